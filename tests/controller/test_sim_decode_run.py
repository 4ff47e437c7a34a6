"""The fast path's step times are the scalar step times, bit for bit, in every scenario."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from controller.sim.decode_run import DecodeRunStepTime, decode_only_plan
from controller.sim.scenarios import SCENARIOS, Efficiency
from controller.sim.target import SimTarget
from search.roofline.profile import DecodeProfile
from search.space import Knobs
from serving.sim.simulator import simulate


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_decode_run_equals_the_scalar_step_time(name: str) -> None:
    target = SimTarget(SCENARIOS[name])
    fn = DecodeRunStepTime(target)
    rng = np.random.default_rng(0)
    for batch in sorted({1, 2, 7, target.seed_batch, target.space.batch_max}):
        kv = np.sort(rng.integers(batch, batch * target.scenario.max_len, size=50))  # [50]
        got = fn.decode_run(batch, kv)
        want = [target.step_time(decode_only_plan(batch, int(x))) for x in kv]
        assert got.tolist() == want
    assert fn.fallbacks == 0


def test_a_calibrated_device_takes_the_calibrated_form() -> None:
    target = SimTarget(SCENARIOS["h100-8b"])
    profile = DecodeProfile(
        weight_rate={1: 2.0e12, 16: 1.5e13, 256: 9.0e13},
        kv_rate={1: 1.0e12, 64: 2.5e12},
        layer_overhead_s={1: 2e-6, 128: 5e-6},
        step_overhead_s={1: 1e-4},
    )
    hw = replace(target.roofline.hardware, decode={target.roofline.dtype: profile})
    target.roofline = replace(target.roofline, hardware=hw)
    assert target.roofline.calibrated
    fn = DecodeRunStepTime(target)
    for batch in (1, 3, 40, 300):
        kv = np.arange(batch, batch * 900, 97)  # [m]
        want = [target.step_time(decode_only_plan(batch, int(x))) for x in kv]
        assert fn.decode_run(batch, kv).tolist() == want
    assert fn.fallbacks == 0


def test_a_changed_step_time_falls_back_to_it_and_says_so(caplog) -> None:
    target = SimTarget(SCENARIOS["h100-8b"])
    fn = DecodeRunStepTime(target)
    target.efficiency = Efficiency(at_batch_1=0.9, at_ref_batch=0.9, overhead_s=1e-3)
    target.step_time = lambda plan: 1e-3 * plan.kv_tokens  # no longer the roofline's
    kv = np.arange(10, 20)  # [10]
    with caplog.at_level(logging.WARNING):
        got = fn.decode_run(4, kv)
    assert got.tolist() == [1e-3 * x for x in range(10, 20)]
    assert fn.fallbacks == 1 and "step by step" in caplog.text


@pytest.mark.parametrize("name", ["h100x4-70b", "l4-8b"])
def test_a_window_is_the_same_with_and_without_the_fast_path(name: str) -> None:
    target = SimTarget(SCENARIOS[name])
    cfg = target.sim_config
    runs = DecodeRunStepTime(target)
    for knobs in (
        Knobs(max_batch_size=2, max_concurrency=2),
        Knobs(max_batch_size=8, max_concurrency=16),
    ):
        args = dict(
            max_batch_size=knobs.max_batch_size,
            max_concurrency=knobs.max_concurrency,
            workload=target.workload,
            config=cfg,
            slo=target.slo,
            seed=3,
        )
        assert simulate(**args, step_time=runs) == simulate(**args, step_time=target.step_time)
    assert runs.runs > 10 and runs.fallbacks == 0
