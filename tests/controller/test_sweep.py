"""The curve sweep after the search: which batches, stored apart from the search's trials,
rebuilt by export, and never the operating point."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from controller.report.records import TrialRecord
from controller.sim.scenarios import SCENARIOS
from controller.sweep import SWEEP_MAX_WINDOW_S, SWEEP_MIN_REQUESTS, sweep_knobs, sweep_plan
from controller.targets import WindowPlan
from controller.tune_simulated import tune_simulated
from controller.tune_study import report_from_study
from search.space import Knobs, SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)
SPACE = SearchSpace(batch_min=1, batch_max=100, headroom_max=2.0)


def rec(n: int, b: int, c: int, feasible: bool) -> TrialRecord:
    return TrialRecord(
        number=n, max_batch_size=b, max_concurrency=c, tokens_per_s=100.0, goodput_rps=1.0,
        throughput_rps=1.0, completed=100, rejected=0, p50_ttft_ms=1.0, p99_ttft_ms=2.0,
        p50_tpot_ms=1.0, p99_tpot_ms=2.0, ttft_verdict="met", tpot_verdict="met",
        ttft_samples=100, tpot_samples=100, feasible=feasible, window_s=10.0,
    )  # fmt: skip


def test_batches_are_log_spaced_to_the_largest_met_then_past_it() -> None:
    trials = [rec(0, 16, 32, True), rec(1, 40, 40, True), rec(2, 60, 60, False)]
    knobs, why = sweep_knobs(trials, 6, SPACE)
    assert why == ""
    assert [k.max_batch_size for k in knobs] == [1, 3, 12, 40, 52, 68]
    assert all(k.max_concurrency == k.max_batch_size for k in knobs)
    # few points: one past the cut; capped by the search space
    assert [k.max_batch_size for k in sweep_knobs(trials, 3, SPACE)[0]] == [1, 40, 52]
    small = SearchSpace(batch_min=1, batch_max=45, headroom_max=2.0)
    assert [k.max_batch_size for k in sweep_knobs(trials, 6, small)[0]][-1] == 45
    # the batch that ran: a concurrency below the batch limit bounds it
    assert sweep_knobs([rec(0, 64, 8, True)], 2, SPACE)[0][-1] == Knobs(
        max_batch_size=11, max_concurrency=11
    )


def test_nothing_within_the_slo_means_no_sweep() -> None:
    knobs, why = sweep_knobs([rec(0, 8, 8, False)], 6, SPACE)
    assert knobs == [] and "no batch the search measured met the SLO" in why
    assert sweep_knobs([rec(0, 8, 8, True)], 0, SPACE) == ([], "")
    with pytest.raises(ValueError, match="curve points=-1"):
        sweep_knobs([], -1, SPACE)


def test_sweep_windows_are_fixed_size() -> None:
    p = sweep_plan(WindowPlan(warmup_s=2.0, window_s=2.0, max_window_s=900.0, sequential=True))
    assert not p.sequential and p.warmup_s == 2.0
    assert p.min_requests == SWEEP_MIN_REQUESTS and p.max_window_s == SWEEP_MAX_WINDOW_S


def test_a_run_with_a_sweep_keeps_it_apart_and_export_rebuilds_it(tmp_path: Path) -> None:
    sc = SCENARIOS["h100x4-70b"]
    out = tune_simulated(sc, seed=3, out_dir=tmp_path / "run", max_trials=12, curve_points=5)
    report = out.report
    sweep = [t for t in report.trials if t.role == "sweep"]
    searched = report.searched
    assert len(sweep) == 5 and len(searched) <= 12 and sweep[0].max_batch_size == 1
    assert min(t.number for t in sweep) > max(t.number for t in searched)
    assert "5 windows at B=1" in report.meta["curve_sweep"]
    # the operating point is the search's, whatever the sweep measured
    without = report.with_trials(searched)
    assert report.chosen == without.chosen and report.chosen.role == "search"
    # a sweep window made to look best still does not move it
    fake = [replace(t, goodput_rps=1e6) if t.role == "sweep" else t for t in report.trials]
    assert report.with_trials(fake).chosen == report.chosen
    rebuilt = report_from_study(str(tmp_path / "run" / "study.journal"))
    assert [(t.role, t.number) for t in rebuilt.trials] == [
        (t.role, t.number) for t in report.trials
    ]
    assert all(
        t.evidence and t.evidence["tpot_hist"] for t in rebuilt.trials if t.completed
    ) and not math.isnan(rebuilt.trials[-1].tokens_per_s)


def test_a_fault_during_the_sweep_ends_the_sweep_not_the_run(tmp_path: Path) -> None:
    """The search has found its point; a target whose metrics fail at the third sweep
    window leaves two sweep windows, the search's result and a note: the run is not
    aborted (a failed sweep never fails the canary gate)."""
    from controller.report.curve import CurveReport
    from controller.sim.target import SimTarget
    from controller.target_errors import TargetUnavailable
    from controller.tune import TuneLimits, run_tune
    from controller.tune_simulated import SimulatedDeployment
    from search.stop_rule import StopRule
    from search.tuner import Tuner

    class FailsInTheSweep(SimulatedDeployment):
        swept = 0  # sweep windows measured

        def measure(self, knobs: Knobs):
            if self.swept or knobs == Knobs(max_batch_size=1, max_concurrency=1):
                self.swept += 1  # the sweep begins at B=1; the search never goes there
                if self.swept == 3:
                    raise TargetUnavailable("metrics endpoint down")
            return super().measure(knobs)

    sc = SCENARIOS["h100x4-70b"]
    sim = SimTarget(sc, seed=3)
    tuner = Tuner(
        space=sim.space,
        slo=sim.slo,
        storage=str(tmp_path / "study.journal"),
        study_name="sweep-fault",
        seed_knobs=sim.seed_knobs(),
        model_tpot_s=sim.model_tpot_s,
        seed=3,
        stop_rule=StopRule(max_trials=12),
    )
    limits = TuneLimits(
        max_trials=12, time_budget_s=1e9, retry_wait_s=0.0, retries=0, curve_points=5
    )
    out = run_tune(
        target=FailsInTheSweep(sim),
        tuner=tuner,
        base=CurveReport(slo=sim.slo, trials=()),
        limits=limits,
        out_dir=tmp_path / "run",
        sleep=lambda s: None,
    )
    assert not out.aborted and out.report.chosen is not None
    assert out.report.chosen.role == "search"
    assert [t.max_batch_size for t in out.report.trials if t.role == "sweep"][0] == 1
    assert sum(t.role == "sweep" for t in out.report.trials) == 2
    note = out.report.meta["curve_sweep"]
    assert note.startswith("stopped after 2 of 5 windows") and "metrics endpoint down" in note
