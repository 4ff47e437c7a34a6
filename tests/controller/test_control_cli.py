"""``slotune control`` from its command line: a real Prometheus scraping a stand-in exporter
whose p99 TPOT is over the SLO; a dry run recommends tightening from PromQL windows, audits
each tick and changes nothing; ``--ack`` clears a latch and, with a controller running,
leaves its acknowledgement for the next tick."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import start_http_server

from controller.cli.main import main
from controller.control.decide import State
from controller.control.loop import ack_path
from controller.control.store import Lease, load_state, save_state
from metrics.observation import Slo
from search.space import Knobs
from tests.fixtures.prometheus_server import PrometheusServer
from tests.metrics.emit import Emitter

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
LABELS = {"application": "llm", "deployment": "LLM", "replica": "r1"}
K16 = Knobs(max_batch_size=16, max_concurrency=16)


def _run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.prometheus
@pytest.mark.slow
def test_a_dry_run_reads_prometheus_and_recommends_without_acting(
    prometheus_server: PrometheusServer, tmp_path: Path
) -> None:
    em = Emitter(slo=SLO, prefix="ray_")
    em.touch(**LABELS)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=em.registry)
    stop = threading.Event()

    def traffic() -> None:  # ~100 requests a second, p99 TPOT ~150 ms (SLO 100 ms)
        i = 0
        while not stop.is_set() and i < 6000:
            em.record(0.2, 0.15 if i % 20 == 0 else 0.05, 8, **LABELS)
            i += 1
            time.sleep(0.01)

    t = threading.Thread(target=traffic, daemon=True)
    try:
        with prometheus_server.scraping("control-cli", f"127.0.0.1:{server.server_port}"):
            t.start()
            state = tmp_path / "state.json"
            save_state(State(knobs=K16), state)
            code = _run(
                [
                    "control", "--app", "llm", "--actuator", "none", "--dry-run",
                    "--prometheus-url", prometheus_server.url, "--metrics-prefix", "ray_",
                    "--metrics-profile", "slotune", "--max-batch", "32", "--state", str(state),
                    "--interval", "5", "--max-ticks", "3", "--min-requests", "50", "--quiet",
                ]
            )  # fmt: skip
    finally:
        stop.set()
        t.join(timeout=10)
        server.shutdown()
        server.server_close()
    assert code == 0
    rows = [json.loads(x) for x in state.with_suffix(".audit.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    judged = [r for r in rows if r["outcome"] != "inconclusive"]
    assert judged, [r["reason"] for r in rows]
    for r in judged:
        assert (r["outcome"], r["action"]) == ("violated", "tighten"), r["reason"]
        # p99 TPOT ~1.5x the SLO: cut by x0.9 at least and by the 25% bound at most
        b = r["to"]["max_batch_size"]
        assert 12 <= b <= 14 and r["to"]["max_concurrency"] == b
        assert r["observation"]["tpot"]["verdict"] == "violated"
        assert r["observation"]["completed"] >= 50
        assert r["dry_run"] and not r["applied"]
    assert load_state(state).knobs == K16  # a dry run changes nothing


def test_ack_clears_the_latch_or_leaves_it_for_a_running_controller(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    save_state(State(knobs=K16, degraded="SLO burn: ..."), state)
    argv = ["control", "--app", "llm", "--actuator", "none", "--ack", "--state", str(state)]
    assert _run(argv) == 0
    assert load_state(state).degraded == ""
    save_state(State(knobs=K16, degraded="SLO burn: ..."), state)
    with Lease(state):  # a controller holds it
        assert _run(argv) == 0
    assert ack_path(state).exists() and load_state(state).degraded


def test_the_policy_flags_reach_the_policy() -> None:
    from controller.cli.control import _policy

    p = _policy(SLO, None, 24, 0.9, 0.8, 120.0, 50, 0.99)
    assert (p.batch_max, p.tighten_at, p.loosen_below) == (24, 0.9, 0.8)
    assert (p.stabilization_s, p.min_requests, p.attainment) == (120.0, 50, 0.99)
    assert _policy(SLO, None, 24, None, None, None, None).attainment == 0.95  # the default
