"""The local scenario: the served-step model folded into the simulator's efficiency."""

from __future__ import annotations

import pytest

from controller.sim.served import (
    LocalDeployment,
    local_scenario,
    served_efficiency,
    served_noise_cv,
)
from search.calibrate.served import ServedModel, ServedPoint
from search.roofline.curve import Roofline
from search.roofline.hardware import resolve_hardware
from search.roofline.models import resolve_model


def _served() -> ServedModel:
    pts = [
        ServedPoint(batch=1, tpot_p50_s=0.015, tpot_p99_s=0.025),
        ServedPoint(batch=4, tpot_p50_s=0.030, tpot_p99_s=0.050),
        ServedPoint(batch=16, tpot_p50_s=0.090, tpot_p99_s=0.150),
    ]
    return ServedModel.fit(
        pts, model="slotune-small", device="cpu-x", threads=1, prompt_tokens=16, output_tokens=8
    )


def _roof() -> Roofline:
    return Roofline(
        model=resolve_model("slotune-small"),
        hardware=resolve_hardware("h100-sxm"),
        dtype="bf16",
        context=20,
    )


def test_the_efficiency_puts_a_decode_step_on_the_served_p50_line() -> None:
    s, roof = _served(), _roof()
    eff = served_efficiency(s, roof, max_batch=128)
    for b in (1, 4, 16, 128):
        step = eff.overhead_s + roof.step_time_s(b) / eff.factor(b)
        assert step == pytest.approx(s.tpot_p50_s(b), rel=0.5)
    assert eff.factor(1) * 0 + eff.overhead_s < s.tpot_p50_s(1)


def test_a_served_path_faster_than_the_roofline_is_refused() -> None:
    pts = [ServedPoint(batch=b, tpot_p50_s=1e-7, tpot_p99_s=2e-7) for b in (1, 4)]
    fast = ServedModel.fit(
        pts, model="slotune-small", device="cpu-x", threads=1, prompt_tokens=16, output_tokens=8
    )
    with pytest.raises(ValueError, match="no efficiency"):
        served_efficiency(fast, _roof(), max_batch=16)


def test_the_noise_spreads_p99_over_p50_as_measured() -> None:
    cv = served_noise_cv(_served())
    assert 0.02 <= cv < 1


def test_the_local_scenario_carries_the_canary_defaults(tmp_path) -> None:
    hw = tmp_path / "hw.json"
    resolve_hardware("h100-sxm").to_json(hw)
    sc = local_scenario(LocalDeployment(served=_served(), hardware_path=hw))
    assert sc.workload.prompt.mean == 16 and sc.workload.output.mean == 8
    assert sc.slo.tpot_p99_s == pytest.approx(0.1) and sc.headroom_max == 2.0
    assert sc.efficiency == sc.calibrated_efficiency
    with pytest.raises(ValueError, match="max_batch"):
        LocalDeployment(served=_served(), hardware_path=hw, max_batch=0)


def test_the_report_shows_the_predicted_tpot_of_every_trial(tmp_path) -> None:
    import csv
    import math

    from controller.report.curve import CurveReport
    from controller.report.files import write_report
    from controller.report.records import PredictedPoint, TrialRecord
    from metrics.observation import Slo

    def rec(n: int, b: int, pred: float = math.nan) -> TrialRecord:
        return TrialRecord(
            number=n, max_batch_size=b, max_concurrency=b, tokens_per_s=100.0,
            goodput_rps=1.0, throughput_rps=1.0, completed=10, rejected=0,
            p50_ttft_ms=10.0, p99_ttft_ms=20.0, p50_tpot_ms=30.0, p99_tpot_ms=40.0,
            ttft_verdict="met", tpot_verdict="met", ttft_samples=10, tpot_samples=10,
            feasible=True, window_s=10.0, predicted_tpot_s=pred,
        )  # fmt: skip

    curve = tuple(PredictedPoint(batch=b, tpot_s=0.01 * b, tokens_per_s=100.0) for b in (1, 8))
    r = CurveReport(
        slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1),
        trials=(rec(0, 4), rec(1, 2, pred=0.5)),
        model_curve=curve,
    )
    assert r.predicted_tpot_s(r.trials[0]) == pytest.approx(0.04)  # read off the curve
    assert r.predicted_tpot_s(r.trials[1]) == 0.5  # recorded with the trial
    paths = write_report(r, tmp_path)
    rows = list(csv.DictReader(paths["curve.csv"].open()))
    assert [float(x["predicted_p99_tpot_ms"]) for x in rows] == pytest.approx([40.0, 500.0])
    assert "predicted p99 TPOT ms" in paths["report.html"].read_text()
    back = CurveReport.from_dict(r.to_dict())
    assert back.model_curve == curve and back.trials == r.trials
