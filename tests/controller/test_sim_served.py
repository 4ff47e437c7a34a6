"""The local scenario: the served-step model folded into the simulator's efficiency."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from controller.sim.scenarios import VM_EPYC_CPU
from controller.sim.served import (
    LocalDeployment,
    decode_step_s,
    fit_efficiency,
    fit_to_served,
    local_scenario,
    served_noise_cv,
)
from search.calibrate.served import ServedModel, ServedPoint
from search.roofline.curve import Roofline
from search.roofline.models import resolve_model
from serving.sim.workload import ClosedLoop


def _served(**point_kw: float) -> ServedModel:
    pts = [
        ServedPoint(batch=1, tpot_p50_s=0.015, tpot_p99_s=0.025, **point_kw),
        ServedPoint(batch=4, tpot_p50_s=0.030, tpot_p99_s=0.050, **point_kw),
        ServedPoint(batch=16, tpot_p50_s=0.090, tpot_p99_s=0.150, **point_kw),
    ]
    return ServedModel.fit(
        pts, model="slotune-small", device="cpu-x", threads=1, prompt_tokens=16, output_tokens=8
    )


def _roof() -> Roofline:
    return Roofline(model=resolve_model("slotune-small"), hardware=VM_EPYC_CPU, context=20)


def _hw(tmp_path: Path) -> Path:
    """A calibration JSON of a 2-core CPU's peaks (the local scenario's kind of device)."""
    hw = tmp_path / "hw.json"
    VM_EPYC_CPU.to_json(hw)
    return hw


def test_the_efficiency_puts_a_decode_step_on_the_wanted_points() -> None:
    roof = _roof()
    want = {1: 0.015, 4: 0.030, 16: 0.090}
    eff = fit_efficiency(want, roof)
    for b, w in want.items():
        assert decode_step_s(eff, roof, b) == pytest.approx(w, rel=0.25)
    # pinned exactly at the smallest batch and at the reference batch
    assert decode_step_s(eff, roof, 1) == pytest.approx(0.015, rel=1e-6)
    assert decode_step_s(eff, roof, eff.ref_batch) == pytest.approx(want[eff.ref_batch], rel=1e-6)


def test_a_step_a_little_under_the_peak_runs_at_the_peak_far_under_is_refused() -> None:
    roof = _roof()
    peak1 = roof.step_time_s(1)
    eff = fit_efficiency({1: peak1 * 0.9, 4: 0.03}, roof)
    assert eff.at_batch_1 == 1.0
    with pytest.raises(ValueError, match="no efficiency"):
        fit_efficiency({1: 1e-7, 4: 2e-7}, roof)


def test_the_first_noise_guess_spreads_p99_over_p50_as_measured() -> None:
    cv = served_noise_cv(_served())
    assert 0.02 <= cv < 1


def test_the_local_scenario_carries_the_canary_defaults(tmp_path) -> None:
    hw = _hw(tmp_path)
    sc = local_scenario(LocalDeployment(served=_served(), hardware_path=hw))
    assert sc.workload.prompt.mean == 16 and sc.workload.output.mean == 8
    assert sc.slo.tpot_p99_s == pytest.approx(0.1) and sc.headroom_max == 2.0
    assert sc.efficiency == sc.calibrated_efficiency
    # the canary's closed loop; no request rate measured: no serving path is fitted
    assert sc.workload.closed == ClosedLoop(gap_s=0.0, path_s=0.0)
    assert "simulated at the measured batches" in sc.description
    with pytest.raises(ValueError, match="max_batch"):
        LocalDeployment(served=_served(), hardware_path=hw, max_batch=0)


def _measured_by_the_simulator(hw: Path) -> tuple[ServedModel, ClosedLoop]:
    """A served calibration taken on a simulated deployment whose decode step, noise and
    serving path are known (the truth the fit must find again), under the canary's closed
    loop, and that path."""
    from controller.sim.scenarios import Efficiency
    from controller.sim.target import SimTarget
    from search.space import Knobs

    path = ClosedLoop(gap_s=0.02, path_s=0.04)  # the path lets 25 req/s through at most
    base = local_scenario(LocalDeployment(served=_served(), hardware_path=hw))
    true = replace(
        base,
        efficiency=Efficiency(at_batch_1=0.5, at_ref_batch=0.2, ref_batch=16, overhead_s=0.004),
        calibrated_efficiency=None,
        step_noise_cv=0.3,
        window_noise_cv=0.0,
        workload=replace(base.workload, closed=path),
    )
    t = SimTarget(true)
    pts = []
    for b in (1, 4, 10, 16):
        r = t.run(Knobs(max_batch_size=b, max_concurrency=b), seed=11, whole=True)
        o = r.observation
        pts.append(
            ServedPoint(
                batch=b,
                tpot_p50_s=o.tpot.p50,
                tpot_p99_s=o.tpot.p99,
                ttft_p99_s=o.ttft.p99,
                tokens_per_s=o.tokens_per_s,
            )
        )
    served = ServedModel.fit(
        pts, model="slotune-small", device="cpu-x", threads=1, prompt_tokens=16, output_tokens=8
    )
    return served, path


def test_the_fit_finds_a_simulated_deployment_again(tmp_path) -> None:
    hw = _hw(tmp_path)
    served, path = _measured_by_the_simulator(hw)
    base = local_scenario(LocalDeployment(served=_served(), hardware_path=hw))
    fit = fit_to_served(served, base)
    for b, (r50, r99, rr, _) in fit.ratios.items():
        assert r50 == pytest.approx(1, abs=0.15), (b, fit.describe())
        assert r99 == pytest.approx(1, abs=0.35), (b, fit.describe())
        assert rr == pytest.approx(1, abs=0.2), (b, fit.describe())
    assert fit.closed.path_s == pytest.approx(path.path_s, rel=0.25), fit.describe()
    # the path's queue is in the TTFT, as measured: not fitted, found again
    assert fit.ratios[16][3] == pytest.approx(1, abs=0.35), fit.describe()


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
