"""The staged search: a restart-costly batch limit moved rarely, a fixed one never."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import optuna
import pytest

from metrics.observation import Observation
from search.guide import Guide
from search.space import Knobs
from search.stage_sampler import StageSampler
from search.stages import KnobCosts, change_summary, next_cap, realize, stage_state
from search.stop_rule import PointSummary, StopRule
from search.tuner import Tuner, make_sampler
from tests.search.sim_objective import SLO, SPACE, model_tpot, noisy_window

optuna.logging.set_verbosity(optuna.logging.WARNING)
RESTART_S = 45.0  # what the simulated deployment takes to restart with a new batch limit


class Engine:
    """A deployment driven by what the loop applies: an engine batch limit ``cap`` and a
    closed loop of ``concurrency`` requests. It runs min(cap, concurrency) sequences a
    step and queues the rest: TPOT grows with the running batch, TTFT with it and with
    the queue; noisy windows with the verdicts a real window gives."""

    def __init__(self, seed: int = 0, noise: float = 0.02) -> None:
        self.rng = np.random.default_rng(seed)
        self.noise = noise
        self.cap: int | None = None
        self.restarts = 0

    def restart(self, cap: int) -> float:
        self.cap = cap
        self.restarts += 1
        return RESTART_S

    @staticmethod
    def true(cap: int, concurrency: int) -> tuple[float, float, float]:
        b = min(cap, concurrency)
        tpot = 0.002 + 2 * model_tpot(b)
        ttft = 0.05 + 0.004 * b + 3.0 * (concurrency / b - 1.0)
        return tpot, ttft, b / (tpot * 100)

    def window(self, concurrency: int) -> Observation:
        assert self.cap is not None
        return noisy_window(*self.true(self.cap, concurrency), rng=self.rng, noise=self.noise)


def best_feasible_goodput() -> float:
    """The simulated curve's best goodput within the SLO (any batch, any admission)."""
    best = 0.0
    for b in range(1, SPACE.batch_max + 1):
        for c in range(b, 4 * b + 1):
            tpot, ttft, g = Engine.true(b, c)
            if tpot <= 0.98 * SLO.tpot_p99_s and ttft <= 0.98 * SLO.ttft_p99_s:
                best = max(best, g)
    return best


def run(tuner: Tuner, engine: Engine, *, applies_cap: bool = True) -> None:
    """The loop the controller runs: restart only when the proposal says the batch limit
    changes, then set the admission limit live, measure, report the restart's seconds."""
    while not tuner.should_stop():
        p = tuner.proposal()
        cost = 0.0
        if applies_cap:
            assert p.batch_cap is not None
            assert p.batch_change == (p.batch_cap != engine.cap)
            if p.batch_change:
                cost = engine.restart(p.batch_cap)
        else:
            assert p.batch_cap is None and not p.batch_change
        c = p.knobs.max_concurrency
        # The proposal names the operating point the engine will run (search.stages.realize).
        assert engine.cap is not None and p.knobs == realize(c, engine.cap)
        tuner.report(p.knobs, engine.window(c), change_cost_s=cost)


@pytest.mark.parametrize(
    ("seed_batch", "most_changes"),
    [(70, 1), (8, 3)],  # seed above the optimum (the roofline is optimistic), and below
)
def test_restart_costly_batch_changes_rarely_and_finds_the_curve_top(
    seed_batch: int, most_changes: int
) -> None:
    top = best_feasible_goodput()
    costs = KnobCosts(batch="restart", max_batch_changes=3)
    for seed in range(2):
        engine = Engine(seed=seed)
        tuner = Tuner(
            space=SPACE,
            slo=SLO,
            study_name=f"r{seed_batch}-{seed}",
            seed_knobs=[Knobs(max_batch_size=seed_batch, max_concurrency=seed_batch)],
            model_tpot_s=model_tpot,
            seed=seed,
            costs=costs,
        )
        run(tuner, engine)
        trials = tuner.trials()
        summary = tuner.change_summary()
        moves = engine.restarts - 1  # the first restart sets the seed's cap
        assert moves <= most_changes <= costs.max_batch_changes, summary
        assert summary.batch_changes == engine.restarts
        assert summary.change_cost_s == pytest.approx(RESTART_S * engine.restarts)
        assert len(summary.caps) == engine.restarts and summary.caps[0] == seed_batch
        assert sum(summary.trials_per_cap) == len(trials) <= StopRule().max_trials
        assert sum(t.change_cost_s for t in trials) == pytest.approx(summary.change_cost_s)
        best = tuner.best()
        assert best is not None, tuner.stop_reason()
        knobs = best[0]
        # The chosen point, run as it will be deployed (batch limit = its batch).
        tpot, ttft, g = Engine.true(knobs.max_batch_size, knobs.max_concurrency)
        assert tpot <= SLO.tpot_p99_s and ttft <= SLO.ttft_p99_s
        assert g >= 0.9 * top, (knobs, g, top, summary)


def test_the_first_cap_is_no_change_when_the_deployment_already_has_it() -> None:
    tuner = Tuner(
        space=SPACE,
        slo=SLO,
        seed_knobs=[Knobs(max_batch_size=40, max_concurrency=80)],
        costs=KnobCosts(batch="restart"),
        applied_batch_cap=40,
    )
    p = tuner.proposal()
    assert p.knobs == Knobs(max_batch_size=40, max_concurrency=40)  # seeds on the batch line
    assert p.batch_cap == 40 and not p.batch_change and p.phase == "seed"
    assert tuner.proposal() == p  # the same until reported


@pytest.mark.parametrize("seeded", [True, False])
def test_fixed_batch_searches_concurrency_alone(seeded: bool) -> None:
    """`none`: the server's batch limit is its own (256 here); only the client's
    concurrency varies, and the recommendation is the best concurrency for both."""
    engine = Engine(seed=3)
    engine.cap = 256
    tuner = Tuner(
        space=SPACE,
        slo=SLO,
        study_name=f"fixed{seeded}",
        seed_knobs=[Knobs(max_batch_size=70, max_concurrency=70)] if seeded else [],
        model_tpot_s=model_tpot if seeded else None,
        seed=1,
        costs=KnobCosts(batch="fixed"),
    )
    run(tuner, engine, applies_cap=False)
    assert all(t.knobs.max_batch_size == t.knobs.max_concurrency for t in tuner.trials())
    assert set(tuner.study.trials[-1].params) == {"max_concurrency"}
    summary = tuner.change_summary()
    assert summary.batch_changes == 0 and summary.caps == () and summary.change_cost_s == 0
    best = tuner.best()
    assert best is not None, tuner.stop_reason()
    tpot, ttft, g = Engine.true(256, best[0].max_concurrency)
    assert tpot <= SLO.tpot_p99_s and ttft <= SLO.ttft_p99_s
    assert g >= 0.9 * best_feasible_goodput()
    assert len(tuner.trials()) <= StopRule().max_trials


def test_a_resumed_staged_search_keeps_its_cap(tmp_path: Path) -> None:
    def make() -> Tuner:
        return Tuner(
            space=SPACE,
            slo=SLO,
            storage=str(tmp_path / "study.journal"),
            seed_knobs=[Knobs(max_batch_size=8, max_concurrency=8)],
            model_tpot_s=model_tpot,
            seed=0,
            costs=KnobCosts(batch="restart", min_stage_trials=2, stage_trials=2),
        )

    engine = Engine()
    a = make()
    caps = []
    for _ in range(6):
        p = a.proposal()
        if p.batch_change:
            engine.restart(p.batch_cap)
        caps.append(p.batch_cap)
        a.report(p.knobs, engine.window(p.knobs.max_concurrency), change_cost_s=1.0)
    assert caps[0] == 8 and max(caps) > 8  # the cap moved up (TPOT slack at 8)
    b = make()
    p = b.proposal()
    assert p.batch_cap == caps[-1] or p.phase == "cap"
    assert b.change_summary() == a.change_summary()


def pt(b: int, *, c: int | None = None, g: float, tpot: float, ok: bool = True) -> PointSummary:
    return PointSummary(
        knobs=Knobs(max_batch_size=b, max_concurrency=c or b),
        measurements=2,
        goodput_rps=g,
        throughput_rps=g,
        feasible=ok,
        ttft_p99_s=0.3,
        tpot_p99_s=tpot,
        ttft_ok=True,
        tpot_ok=tpot <= SLO.tpot_p99_s,
        first_trial=0,
        last_trial=1,
    )


RESTART = KnobCosts(batch="restart")


def cap_after(points: list[PointSummary], cap: int, visited=(), costs=RESTART, guide=None):
    return next_cap(
        points,
        cap=cap,
        visited=visited or (cap,),
        space=SPACE,
        slo=SLO,
        costs=costs,
        rule=StopRule(),
        guide=guide,
    )


def test_next_cap_rules() -> None:
    # Best at the cap with TPOT slack: up by 1.5x without a guide.
    assert cap_after([pt(20, g=5.0, tpot=0.03)], 20)[0] == 30
    # With the guide, its largest batch within the SLO, bounded to 1.5..2x the cap.
    guide = Guide(model_tpot_s=model_tpot, space=SPACE, slo=SLO)
    up = cap_after([pt(10, g=5.0, tpot=0.02)], 10, guide=guide)[0]
    assert 15 <= up <= 20
    # At the cap but TPOT near the SLO: the cap is right, stay.
    assert cap_after([pt(20, g=5.0, tpot=0.048)], 20) is None
    # Something above the cap was measured already: its curve is known, stay.
    above = pt(30, g=1.0, tpot=0.06, ok=False)
    assert cap_after([pt(20, g=5.0, tpot=0.03), above], 20) is None
    # Best below the cap (TPOT-limited there): down to its batch once, then no more.
    pts = [pt(12, g=5.0, tpot=0.045), pt(16, g=1.0, tpot=0.06, ok=False)]
    assert cap_after(pts, 40)[0] == 12
    assert cap_after(pts, 40, visited=(40, 12)) is None
    assert cap_after(pts, 40, costs=KnobCosts(batch="restart", settle=False)) is None
    # Nothing feasible: every batch under the cap was reachable live, no move helps.
    assert cap_after([pt(4, g=0.0, tpot=0.06, ok=False)], 40) is None
    # Live or fixed batches never move.
    assert cap_after([pt(20, g=5.0, tpot=0.03)], 20, costs=KnobCosts(batch="fixed")) is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch": "sometimes"}, "batch='sometimes'"),
        ({"max_batch_changes": -1}, "max_batch_changes=-1"),
        ({"stage_trials": 2, "min_stage_trials": 3}, "min_stage_trials=3"),
        ({"slack": 0.0}, "slack=0.0"),
        ({"up_min": 1.0}, "up_min=1.0"),
        ({"up_min": 3.0, "up_max": 2.0}, "up_min=3.0"),
    ],
)
def test_knob_costs_validation_names_the_value(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KnobCosts(**kw)


def test_stage_state_and_summary_from_stored_attributes() -> None:
    attrs = [
        {"stage": 0, "batch_cap": 64, "batch_change": True, "change_cost_s": 40.0},
        {"stage": 0, "batch_cap": 64, "batch_change": False},
        {"stage": 1, "batch_cap": 20, "batch_change": True, "change_cost_s": 35.5},
    ]
    st = stage_state([(a, True) for a in attrs[:2]] + [(attrs[2], False)], first=64)
    assert (st.stage, st.cap, st.in_stage, st.visited, st.last_cap) == (1, 20, 0, (64, 20), 20)
    s = change_summary(attrs, mode="restart")
    assert (s.batch_changes, s.change_cost_s, s.caps, s.trials_per_cap) == (
        2,
        75.5,
        (64, 20),
        (2, 1),
    )
    assert stage_state([], first=64).cap == 64
    # Live trials store no cap: a change is a new batch between consecutive trials.
    live = [{"max_batch_size": b} for b in (8, 8, 16, 8)]
    assert change_summary(live, mode="live").batch_changes == 2


def test_stage_sampler_keeps_samples_in_the_stage() -> None:
    sampler = StageSampler(optuna.samplers.RandomSampler(seed=0), "c")
    study = optuna.create_study(sampler=sampler)
    dist = optuna.distributions.IntDistribution(1, 1024, log=True)
    sampler.narrow(3, 12)
    vals = [study.ask({"c": dist}).params["c"] for _ in range(30)]
    assert all(3 <= v <= 12 for v in vals) and len(set(vals)) > 3
    sampler.narrow(7, 7)
    assert study.ask({"c": dist}).params["c"] == 7
    with pytest.raises(ValueError, match="bounds=\\(0, 3\\)"):
        sampler.narrow(0, 3)
    assert math.isfinite(dist.high)


def _gp_study() -> tuple[optuna.Study, StageSampler, dict]:
    gp = make_sampler("gp", seed=0, n_startup_trials=4)
    sampler = StageSampler(gp, "c")
    study = optuna.create_study(direction="maximize", sampler=sampler)
    dists = {
        "c": optuna.distributions.IntDistribution(1, 400, log=True),
        "h": optuna.distributions.IntDistribution(1, 4),
    }
    for c in (300, 200, 150, 5, 8, 12, 250):  # the best trial at c=300
        study.enqueue_trial({"c": c, "h": 1})
        t = study.ask(dists)
        t.set_constraint("tpot", -1.0)  # every one within the SLO
        study.tell(t, c / 10.0)
    return study, sampler, dists


def test_stage_sampler_under_gp_with_the_best_trial_outside_the_stage() -> None:
    # Optuna 5.1's GPSampler starts its acquisition search at the best trial's parameters,
    # and failed an assertion when the stage's bounds lay under them (a cap moved down).
    study, sampler, dists = _gp_study()
    sampler.narrow(2, 40)
    for _ in range(3):
        t = study.ask(dists)
        assert 2 <= t.params["c"] <= 40
        t.set_constraint("tpot", -0.5)
        study.tell(t, 1.0)


def test_stage_sampler_under_gp_from_one_value_back_to_a_range() -> None:
    # A stage of one admission value, then a wider one: GPSampler's constraint model,
    # cached from the trial before, failed when the relative space lost that dimension.
    study, sampler, dists = _gp_study()
    for bounds in ((7, 7), (2, 300), (7, 7), (5, 50)):
        sampler.narrow(*bounds)
        t = study.ask(dists)
        assert bounds[0] <= t.params["c"] <= bounds[1]
        t.set_constraint("tpot", -0.5)
        study.tell(t, 1.0)
