"""DecodeRunStepTime's scalar mirror is SimTarget.step_time, bit for bit, and says when not."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest

from controller.sim.decode_run import DecodeRunStepTime, plan_of
from controller.sim.scenarios import SCENARIOS, Efficiency
from controller.sim.target import SimTarget


def _random_plans(target: SimTarget, n: int, seed: int):
    rng = random.Random(seed)
    cap = target.sim_config.max_slots
    chunk = target.sim_config.prefill_chunk
    for _ in range(n):
        b = rng.choice([0, 1, 2, rng.randint(1, cap), cap])
        kv = b * rng.randint(1, target.scenario.max_len - 1) if b else 0
        k = rng.choice([0, 0, 1, 2, 3]) if b else rng.choice([1, 2, 3])
        lengths = tuple(rng.randint(1, max(1, chunk // k)) for _ in range(k))
        yield plan_of(b, kv, lengths)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_mirror_is_the_step_time_on_random_plans(name: str) -> None:
    target = SimTarget(SCENARIOS[name])
    fn = DecodeRunStepTime(target)
    assert fn._scalar is not None  # these scenarios take the mirror
    plans = list(_random_plans(target, 600, seed=len(name)))
    assert [fn(p) for p in plans] == [target.step_time(p) for p in plans]
    assert fn._scalar is not None  # ... and the checks every 512 calls found no difference


def test_a_replaced_efficiency_or_roofline_is_mirrored_afresh() -> None:
    target = SimTarget(SCENARIOS["h100x4-70b"])
    fn = DecodeRunStepTime(target)
    plans = list(_random_plans(target, 50, seed=1))
    target.efficiency = Efficiency(at_batch_1=0.9, at_ref_batch=0.2, overhead_s=7e-3)
    assert [fn(p) for p in plans] == [target.step_time(p) for p in plans]
    target.roofline = replace(target.roofline, tp=2)
    assert [fn(p) for p in plans] == [target.step_time(p) for p in plans]


def test_a_changed_arithmetic_turns_the_mirror_off_and_says_so(caplog, monkeypatch) -> None:
    target = SimTarget(SCENARIOS["l4-8b"])
    real = type(target).step_time
    monkeypatch.setattr(type(target), "step_time", lambda self, plan: 1.5 * real(self, plan))
    with caplog.at_level(logging.WARNING):
        fn = DecodeRunStepTime(target)  # the check at construction finds the difference
    assert fn._scalar is None and "differs" in caplog.text
    plans = list(_random_plans(target, 20, seed=2))
    assert [fn(p) for p in plans] == [target.step_time(p) for p in plans]


def test_a_change_after_construction_is_caught_by_the_periodic_check(caplog) -> None:
    target = SimTarget(SCENARIOS["cpu-small"])
    fn = DecodeRunStepTime(target)
    target.step_time = lambda plan: 1e-3 + 1e-9 * plan.kv_tokens  # type: ignore[method-assign]
    plans = list(_random_plans(target, 1100, seed=3))
    with caplog.at_level(logging.WARNING):
        got = [fn(p) for p in plans]
    assert fn._scalar is None and "differs" in caplog.text
    want = [target.step_time(p) for p in plans]
    assert got[511:] == want[511:]  # from the check at the 512th call on
    assert got[:511] != want[:511]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_step_time_of_the_totals_is_the_step_time(name: str) -> None:
    target = SimTarget(SCENARIOS[name])
    fn = DecodeRunStepTime(target).step_totals()
    assert fn is not None
    plans = list(_random_plans(target, 600, seed=7 + len(name)))
    assert [fn(*p.totals()) for p in plans] == [target.step_time(p) for p in plans]


def test_the_step_time_of_the_totals_checks_itself_too(caplog) -> None:
    target = SimTarget(SCENARIOS["cpu-small"])
    runs = DecodeRunStepTime(target)
    fn = runs.step_totals()
    assert fn is not None
    target.step_time = lambda plan: 1e-3 + 1e-9 * plan.kv_tokens  # type: ignore[method-assign]
    plans = list(_random_plans(target, 1100, seed=3))
    with caplog.at_level(logging.WARNING):
        got = [fn(*p.totals()) for p in plans]
    assert runs._scalar is None and "differs" in caplog.text
    assert got[511:] == [target.step_time(p) for p in plans][511:]
    assert runs.step_totals() is None  # the next window times its plans
