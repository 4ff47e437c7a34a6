from __future__ import annotations

import math
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from metrics import names
from metrics.exporter import ControllerExporter
from metrics.observation import Observation, SloVerdict, Verdict
from metrics.snapshot import parse_exposition


@dataclass(frozen=True)
class FakeKnobs:
    max_batch_size: int
    max_concurrency: int


def _value(exp: ControllerExporter, name: str, **labels: str) -> float:
    v = exp.registry.get_sample_value(name, labels)
    assert v is not None, (name, labels)
    return v


def test_exports_knobs_trials_goodput_verdicts_rollbacks() -> None:
    exp = ControllerExporter(registry=CollectorRegistry())
    assert math.isnan(_value(exp, names.CONTROLLER_BEST_GOODPUT_RPS))
    assert _value(exp, names.CONTROLLER_SLO_VERDICT, slo="ttft", verdict="insufficient") == 1
    exp.set_knobs(FakeKnobs(max_batch_size=32, max_concurrency=48))
    exp.set_knobs({"max_batch_size": 64})
    exp.trial_done()
    exp.trial_done()
    exp.set_best_goodput(12.5)
    exp.rollback()
    v_met = SloVerdict(
        verdict=Verdict.MET, threshold_s=1.0, estimate_s=0.4, samples=500, confidence=0.95
    )
    v_bad = SloVerdict(
        verdict=Verdict.VIOLATED, threshold_s=0.1, estimate_s=0.3, samples=500, confidence=0.95
    )
    exp.observe(
        Observation(
            start_s=0, end_s=10, completed=100, slo_met=80, ttft_verdict=v_met, tpot_verdict=v_bad
        )
    )
    assert _value(exp, names.CONTROLLER_KNOB, knob="max_batch_size") == 64
    assert _value(exp, names.CONTROLLER_KNOB, knob="max_concurrency") == 48
    assert _value(exp, names.CONTROLLER_TRIALS_TOTAL) == 2
    assert _value(exp, names.CONTROLLER_BEST_GOODPUT_RPS) == 12.5
    assert _value(exp, names.CONTROLLER_GOODPUT_RPS) == 8.0
    assert _value(exp, names.CONTROLLER_ROLLBACKS_TOTAL) == 1
    assert _value(exp, names.CONTROLLER_SLO_VERDICT, slo="ttft", verdict="met") == 1
    assert _value(exp, names.CONTROLLER_SLO_VERDICT, slo="ttft", verdict="insufficient") == 0
    assert _value(exp, names.CONTROLLER_SLO_VERDICT, slo="tpot", verdict="violated") == 1
    assert _value(exp, names.CONTROLLER_QUANTILE_SECONDS, slo="tpot") == 0.3
    assert _value(exp, names.CONTROLLER_STALE) == 0
    assert math.isnan(_value(exp, names.CONTROLLER_TPOT_BAND, edge="tighten"))  # none yet
    assert math.isnan(_value(exp, names.CONTROLLER_TPOT_SPREAD))
    exp.set_tpot_band(0.86, 0.81, 0.1)
    assert _value(exp, names.CONTROLLER_TPOT_BAND, edge="tighten") == 0.86
    assert _value(exp, names.CONTROLLER_TPOT_BAND, edge="loosen") == 0.81
    assert _value(exp, names.CONTROLLER_TPOT_SPREAD) == 0.1


def test_rejects_non_numeric_knobs() -> None:
    exp = ControllerExporter()
    with pytest.raises(ValueError, match="mode"):
        exp.set_knobs({"mode": "fast"})


def test_serves_on_loopback_and_two_exporters_do_not_collide() -> None:
    a, b = ControllerExporter(), ControllerExporter()
    port = a.serve(0)
    try:
        a.trial_done()
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert r.status_code == 200
        snap = parse_exposition(r.text, time_s=0)
        assert snap.series(names.CONTROLLER_TRIALS_TOTAL, {}) == {frozenset(): 1.0}
        assert b.text().count(names.CONTROLLER_TRIALS_TOTAL) >= 1
        with pytest.raises(RuntimeError, match="already"):
            a.serve(0)
    finally:
        a.close()
