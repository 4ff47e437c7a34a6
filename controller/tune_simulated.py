"""The canary loop (``controller.tune.run_tune``) on a simulated fleet: the whole run, its
export included, without a deployment. What ``slotune compare`` is proven on (a run of a
version and a rerun, or a slower version), and what a user tries it on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from controller.report.curve import CurveReport
from controller.report.records import PredictedPoint
from controller.sim.scenarios import Efficiency, Scenario
from controller.sim.target import SimTarget
from controller.targets import Measurement
from controller.tune import TuneLimits, TuneOutcome, run_tune
from search.space import Knobs
from search.stop_rule import StopRule
from search.tuner import Tuner


class SimulatedDeployment:
    """A :class:`controller.targets.Target` whose windows the simulator measures."""

    def __init__(self, sim: SimTarget) -> None:
        self.sim = sim
        self._knobs: Knobs | None = None

    def current_knobs(self) -> Knobs | None:
        return self._knobs

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> None:
        self._knobs = knobs

    def measure(self, knobs: Knobs) -> Measurement:
        return Measurement(observation=self.sim.measure(knobs))

    def describe(self) -> dict[str, Any]:
        return {**self.sim.describe(), "app": f"simulated {self.sim.scenario.name}"}


def slowed(scenario: Scenario, factor: float) -> Scenario:
    """``scenario`` on a version whose every step takes ``factor`` times as long."""
    if not factor > 0:
        raise ValueError(f"factor={factor!r}: must be > 0")

    def slow(e: Efficiency | None) -> Efficiency | None:
        if e is None:
            return None
        return replace(
            e,
            at_batch_1=e.at_batch_1 / factor,
            at_ref_batch=e.at_ref_batch / factor,
            overhead_s=e.overhead_s * factor,
        )

    return replace(
        scenario,
        name=f"{scenario.name}-x{factor:g}",
        efficiency=slow(scenario.efficiency),
        calibrated_efficiency=slow(scenario.calibrated_efficiency),
    )


def tune_simulated(
    scenario: Scenario,
    *,
    seed: int,
    out_dir: Path,
    max_trials: int = 20,
    usd_per_hour: float | None = None,
    curve_points: int = 0,
) -> TuneOutcome:
    """One canary run on ``scenario``'s simulated fleet (the roofline-seeded tuner, its
    study in ``out_dir``), exported into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sim = SimTarget(scenario, seed=seed)
    tuner = Tuner(
        space=sim.space,
        slo=sim.slo,
        storage=str(out_dir / "study.journal"),
        study_name=scenario.name,
        seed_knobs=sim.seed_knobs(),
        model_tpot_s=sim.model_tpot_s,
        seed=seed,
        stop_rule=StopRule(max_trials=max_trials),
    )
    return run_simulated(
        sim,
        tuner,
        out_dir=out_dir,
        max_trials=max_trials,
        usd_per_hour=usd_per_hour,
        curve_points=curve_points,
    )


def run_simulated(
    sim: SimTarget,
    tuner: Tuner,
    *,
    out_dir: Path,
    max_trials: int,
    usd_per_hour: float | None = None,
    curve_points: int = 0,
) -> TuneOutcome:
    """The canary loop with ``tuner`` on the simulated fleet ``sim``, exported into
    ``out_dir`` (``slotune simulate --out``)."""
    scenario = sim.scenario
    curve = sim.analysis.curve
    base = CurveReport(
        slo=sim.slo,
        trials=(),
        predicted=tuple(PredictedPoint.of(p) for p in curve),
        model=scenario.model,
        hardware=sim.hardware.name,
        usd_per_hour=usd_per_hour,
        knee_batch=sim.analysis.knee_batch,
        predicted_batch=sim.seed_batch,
        meta={"target": f"simulated {scenario.name}", "seed": sim.seed},
    )
    limits = TuneLimits(
        max_trials=max_trials, time_budget_s=1e9, retry_wait_s=0.0, curve_points=curve_points
    )
    return run_tune(
        target=SimulatedDeployment(sim),
        tuner=tuner,
        base=base,
        limits=limits,
        out_dir=out_dir,
        sleep=lambda s: None,
    )
