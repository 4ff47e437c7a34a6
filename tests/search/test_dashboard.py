"""The study a tuner writes to its JournalStorage file opens in optuna-dashboard.

Serves optuna-dashboard's WSGI app on 127.0.0.1 (an ephemeral port, one thread, torn
down at the end) and reads the study back through its HTTP API: the study, its trials,
their knobs, verdict and both p99 latencies. Skipped when optuna-dashboard is not installed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import optuna
import pytest

from metrics.observation import Observation, Percentiles, Slo, SloVerdict, Verdict
from search.space import Knobs, SearchSpace
from search.tuner import Tuner, open_storage

dashboard = pytest.importorskip("optuna_dashboard")
optuna.logging.set_verbosity(optuna.logging.WARNING)

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)


def window(k: Knobs) -> Observation:
    tpot = 0.01 + 0.001 * k.max_batch_size
    ttft = 0.1 + 0.01 * k.max_batch_size

    def v(est: float, thr: float) -> SloVerdict:
        verdict = Verdict.MET if est < thr else Verdict.VIOLATED
        return SloVerdict(
            verdict=verdict, threshold_s=thr, estimate_s=est, samples=500, confidence=0.95
        )

    tv, pv = v(ttft, SLO.ttft_p99_s), v(tpot, SLO.tpot_p99_s)
    ok = tv.verdict is Verdict.MET and pv.verdict is Verdict.MET
    n = 10 * k.max_batch_size
    return Observation(
        start_s=0.0,
        end_s=10.0,
        completed=n,
        slo_met=n if ok else 0,
        ttft=Percentiles(p99=ttft),
        tpot=Percentiles(p99=tpot),
        ttft_verdict=tv,
        tpot_verdict=pv,
    )


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "study.journal"
    tuner = Tuner(
        space=SearchSpace(batch_min=1, batch_max=64),
        slo=SLO,
        storage=str(path),
        study_name="dash",
        seed_knobs=[Knobs(max_batch_size=32, max_concurrency=32)],
        seed=0,
    )
    for _ in range(3):
        k = tuner.propose()
        tuner.report(k, window(k))
    app = dashboard.wsgi(open_storage(str(path)))
    server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_dashboard_lists_the_study_and_its_trials(served: str) -> None:
    with httpx.Client(base_url=served, timeout=20.0) as client:
        studies = client.get("/api/studies")
        assert studies.status_code == 200, studies.text
        (study,) = [s for s in studies.json()["study_summaries"] if s["study_name"] == "dash"]
        detail = client.get(f"/api/studies/{study['study_id']}")
    assert detail.status_code == 200, detail.text
    trials = detail.json()["trials"]
    assert len(trials) == 3
    first = trials[0]
    assert first["state"] == "Complete"
    attrs = {a["key"]: a["value"] for a in first["user_attrs"]}
    assert attrs["phase"] == "seed" and attrs["max_batch_size"] == "32"
    # optuna-dashboard 0.21 reads constraints from the pre-Optuna-5 system attribute, not
    # from Trial.set_constraint's named ones: the verdict and both p99s show as user attrs.
    assert attrs["feasible"] == "True"
    assert float(attrs["tpot_p99_s"]) == pytest.approx(0.042)
    assert float(attrs["ttft_p99_s"]) == pytest.approx(0.42)
