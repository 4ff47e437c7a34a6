"""``slotune control`` while its real Prometheus is down for a minute (issue 20's fault).

A Prometheus of its own (stopped and started again by its PID, same port and TSDB) scrapes
a stand-in exporter whose traffic is calm and queueing at the limit all along: the very
signal on which the controller loosens once it has lasted the stabilization window. The
controller runs from its command line (dry run, so its recommendations are what it would
do). Before the outage the calm is shorter than the window; across the outage every tick
holds with a warning; after it the calm must be measured afresh, so the first loosening
comes a whole stabilization window after data returns, not at once."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import start_http_server

from controller.cli.main import main
from controller.control.decide import State
from controller.control.store import save_state
from metrics.observation import Slo
from search.space import Knobs
from tests.fixtures.prometheus_server import start_prometheus
from tests.metrics.emit import Emitter

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
LABELS = {"application": "llm", "deployment": "LLM", "replica": "r1"}
K16 = Knobs(max_batch_size=16, max_concurrency=16)
INTERVAL_S = 5.0
STABILIZATION_S = 20.0
OUTAGE_S = 60.0
TICKS_BEFORE = 3  # 15 s of calm: short of the stabilization window
TICKS = TICKS_BEFORE + int(OUTAGE_S / INTERVAL_S) + 10


@pytest.mark.prometheus
@pytest.mark.slow
def test_prometheus_down_for_a_minute_holds_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "prom").mkdir()
    prom = start_prometheus(tmp_path / "prom")
    em = Emitter(slo=SLO, prefix="ray_")
    em.touch(**LABELS)
    em.batch(16, 3, **LABELS)  # the batch runs full and requests wait: demand at the limit
    server, _ = start_http_server(0, addr="127.0.0.1", registry=em.registry)
    stop = threading.Event()

    def traffic() -> None:  # ~100 requests a second, well within both SLOs
        i = 0
        while not stop.is_set() and i < 30_000:
            em.record(0.2, 0.03, 8, **LABELS)
            i += 1
            time.sleep(0.01)

    state = tmp_path / "state.json"
    save_state(State(knobs=K16), state)
    audit = state.with_suffix(".audit.jsonl")
    codes: list[int] = []

    def control() -> None:
        argv = [
            "control", "--app", "llm", "--actuator", "none", "--dry-run",
            "--prometheus-url", prom.url, "--metrics-prefix", "ray_",
            "--metrics-profile", "slotune", "--max-batch", "32", "--state", str(state),
            "--interval", f"{INTERVAL_S:g}", "--stabilization", f"{STABILIZATION_S:g}",
            "--max-ticks", str(TICKS), "--min-requests", "50", "--quiet",
        ]  # fmt: skip
        try:
            main(argv)
            codes.append(0)
        except SystemExit as e:
            codes.append(int(e.code or 0))

    def ticks() -> int:
        return len(audit.read_text().splitlines()) if audit.exists() else 0

    t_load = threading.Thread(target=traffic, daemon=True)
    t_ctl = threading.Thread(target=control, daemon=True)
    caplog.set_level(logging.WARNING, logger="controller.control.loop")
    try:
        with prom.scraping("outage", f"127.0.0.1:{server.server_port}"):
            t_load.start()
            t_ctl.start()
            deadline = time.monotonic() + 120
            while ticks() < TICKS_BEFORE and time.monotonic() < deadline:
                time.sleep(0.2)
            assert ticks() >= TICKS_BEFORE, "the controller did not tick"
            prom.stop()
            down_s = time.time()
            time.sleep(OUTAGE_S)
            prom.launch()
            up_s = time.time()
            t_ctl.join(timeout=TICKS * INTERVAL_S + 120)
            assert not t_ctl.is_alive(), "the controller did not stop after --max-ticks"
    finally:
        stop.set()
        t_load.join(timeout=10)
        server.shutdown()
        server.server_close()
        prom.stop()
    assert codes == [0]
    rows = [json.loads(x) for x in audit.read_text().splitlines()]
    assert len(rows) == TICKS
    before = [r for r in rows if r["time_s"] <= down_s]
    during = [r for r in rows if down_s + 1.0 < r["time_s"] <= up_s]
    after = [r for r in rows if r["time_s"] > up_s]
    assert len(before) >= TICKS_BEFORE and len(during) >= 10 and after, [
        (r["time_s"], r["outcome"]) for r in rows
    ]
    # before: calm, but not yet for a whole stabilization window
    assert all(r["action"] == "hold" for r in before), [r["reason"] for r in before]
    assert any(r["outcome"] == "met" for r in before), [r["reason"] for r in before]
    # down: every tick holds, none is a failure, and each says why
    for r in during:
        assert (r["outcome"], r["action"]) == ("inconclusive", "hold"), r["reason"]
        assert "could not be read" in r["reason"] and r["to"] == K16.as_dict()
    warned = [m for m in caplog.messages if "reading the window failed" in m]
    assert len(warned) >= len(during)
    # back: the calm is measured again from the first window judged after the outage
    judged = [r for r in after if r["outcome"] == "met"]
    assert judged, [r["reason"] for r in after]
    first = judged[0]["observation"]["start_s"]
    loosened = [r for r in rows if r["action"] == "loosen"]
    assert loosened, [r["reason"] for r in after]  # recovery: it acts on data again
    for r in loosened:
        assert r["time_s"] > up_s and r["time_s"] - first >= STABILIZATION_S, r["reason"]
        assert r["to"]["max_batch_size"] > K16.max_batch_size
