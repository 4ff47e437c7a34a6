"""Calibration of the local device: a quick run, its JSON, and its use by the roofline.

No timing assertions: the figures vary with the machine and its load; the tests
check that every figure is measured, positive, and wired through.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from search.calibrate.device import calibrate, default_cache_path, measure_bandwidth, pick_device
from search.calibrate.plan import PLANS, CalibrationPlan
from search.calibrate.profile import _layer_bytes, monotone_rates
from search.calibrate.shapes import measure_kv_rate
from search.roofline.curve import Roofline
from search.roofline.hardware import resolve_hardware
from search.roofline.models import ModelSpec

TINY = ModelSpec.from_name("slotune-tiny")


THREADS: dict[str, int] = {}


@pytest.fixture(scope="module")
def quick():  # one quick calibration shared by the tests below (a few seconds)
    THREADS["before"] = torch.get_num_threads()
    THREADS["asked"] = 1 if THREADS["before"] > 1 else 2
    cal = calibrate(
        device="cpu",
        plan=PLANS["quick"],
        model=TINY,
        dtypes=("fp32", "bf16"),
        threads=THREADS["asked"],
    )
    THREADS["after"] = torch.get_num_threads()
    return cal


def test_calibration_runs_at_the_threads_asked_and_restores(quick) -> None:
    assert quick.measured["threads"] == THREADS["asked"]
    assert f"{THREADS['asked']} threads" in quick.spec.source
    assert THREADS["after"] == THREADS["before"]
    with pytest.raises(ValueError, match="threads=0: must be a positive integer"):
        calibrate(device="cpu", plan=PLANS["quick"], model=TINY, threads=0)


def test_quick_calibration_measures_every_figure(quick) -> None:
    spec = quick.spec
    assert set(spec.peak_flops) == {"fp32", "bf16"}
    assert all(math.isfinite(v) and v > 0 for v in spec.peak_flops.values())
    assert spec.mem_bandwidth > 0 and spec.mem_capacity > 1e9
    plan = PLANS["quick"]
    for dt in ("fp32", "bf16"):
        prof = spec.decode[dt]
        # Smoothed for the roofline: a larger batch is never predicted faster.
        times = [1 / prof.weight_rate_at(b) for b in plan.weight_batches]
        assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:], strict=False))
        raw = quick.measured["raw"][dt]
        assert set(raw) == {
            "weight_rate",
            "weight_rate_whole_layer",
            "kv_rate",
            "layer_s",
            "step_s",
            "layer_residual_s",
            "layer_full_s",
            "step_residual_s",
            "step_full_s",
            "step_whole_s",
            "step_beyond_s",
        }
        # A whole step by the engine's code (the tiny model fits: all its layers): the
        # roofline's prediction at the largest batch is that step (the difference from
        # the parts timed apart moved the step overhead), unless the overhead hit its
        # floor (below, the smoothing may lower a batch to a larger one's time).
        assert set(raw["step_whole_s"]) == set(plan.kv_batches)
        roof = Roofline(model=TINY, hardware=spec, dtype=dt, context=plan.context)
        top_whole = raw["step_whole_s"][plan.kv_batches[-1]]
        if prof.step_overhead_s[plan.kv_batches[-1]] > raw["step_s"][plan.kv_batches[-1]]:
            assert roof.step_time_s(plan.kv_batches[-1]) == pytest.approx(top_whole, rel=1e-6)
        else:
            assert roof.step_time_s(plan.kv_batches[-1]) >= top_whole
        # At the measured batches a layer's predicted time adds up to the mirrored
        # layer timed whole (the residual is taken against the profile's own rates).
        lw, lkv = _layer_bytes(TINY, dt, plan.context)
        # Where a layer ran faster whole than its linears one by one plus attention and the
        # hot overhead (the whole-layer C call), the weight rate is the one it implies.
        for b, r in raw["weight_rate_whole_layer"].items():
            assert r > raw["weight_rate"][b]
            implied = lw / r + b * lkv / prof.kv_rate_at(b) + raw["layer_s"][b]
            assert implied == pytest.approx(raw["layer_full_s"][b])
        for b, full in raw["layer_full_s"].items():
            parts = lw / prof.weight_rate_at(b) + b * lkv / prof.kv_rate_at(b)
            assert raw["layer_residual_s"][b] == pytest.approx(max(0.0, full - parts))
        top = plan.kv_batches[-1]  # the largest batch: no smoothing from above
        want = max(raw["layer_s"][top], raw["layer_residual_s"][top])
        assert prof.layer_overhead_s[top] == pytest.approx(want)
        # The step outside the layers, run by the engine's own code (lm_head included),
        # is what the profile adds up to there: the lm_head's bytes at the profile's
        # rate plus the step overhead (never below the hot-timed pieces).
        assert set(raw["step_full_s"]) == set(plan.kv_batches)
        head = TINY.embedding_params * (4 if dt == "fp32" else 2)
        for b, full in raw["step_full_s"].items():
            assert full > 0 and math.isfinite(full)
            assert raw["step_residual_s"][b] == pytest.approx(
                max(0.0, full - head / prof.weight_rate_at(b))
            )
        assert prof.step_overhead_s[top] == pytest.approx(
            max(
                raw["step_s"][top],
                max(raw["step_s"][top], raw["step_residual_s"][top]) + raw["step_beyond_s"][top],
            )
        )
        # The overhead used is never below the hot-timed pieces (smoothed: a batch
        # takes no more than a larger one was measured at).
        ks = plan.kv_batches
        for i, b in enumerate(ks):
            floor = min(raw["layer_s"][k] for k in ks[i:])
            assert prof.layer_overhead_s[b] >= floor * (1 - 1e-9)
        assert tuple(prof.weight_rate) == plan.weight_batches
        assert tuple(prof.kv_rate) == plan.kv_batches
        assert tuple(prof.layer_overhead_s) == plan.kv_batches
        assert tuple(prof.step_overhead_s) == plan.kv_batches
    assert quick.measured["model"] == "slotune-tiny"
    assert "cpu" in spec.source and spec.calibrated


def test_calibrated_json_feeds_the_roofline(quick, tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    quick.spec.to_json(path, extra=quick.measured)
    hw = resolve_hardware(str(path))
    assert hw == quick.spec
    r = Roofline(model=TINY, hardware=hw, context=64)
    assert r.calibrated
    pts = r.curve(64)
    assert all(p.tpot_s > 0 and math.isfinite(p.tpot_s) for p in pts)
    # A calibrated step is never faster than the ideal bounds on the same peaks.
    for b in (1, 8, 64):
        mem_s, comp_s = r.bounds_s(decode_batch=b, kv_tokens=b * 64)
        assert r.step_time_s(b) >= 0.999 * min(mem_s, comp_s)


def test_bandwidth_reads_a_filled_tensor() -> None:
    dev = torch.device("cpu")
    bw = measure_bandwidth(dev, 64 << 20, reps=2)
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s


def test_kv_rate_counts_the_bytes_of_every_layer() -> None:
    # Twice the context is twice the bytes: the rate must stay of the same order,
    # not double (which would mean the bytes were counted but not read).
    # Best of three runs each: one run on a shared machine can be descheduled (a CI run
    # read 1.5 GB/s at 256 beside 17.8 at 512).
    dev = torch.device("cpu")
    small = max(measure_kv_rate(dev, "fp32", TINY, [4], 256, reps=3)[4] for _ in range(3))
    large = max(measure_kv_rate(dev, "fp32", TINY, [4], 512, reps=3)[4] for _ in range(3))
    assert small > 0 and large > 0 and large / small < 10


def test_bad_requests_name_the_value() -> None:
    with pytest.raises(ValueError, match="'tpu'.*allowed: cpu, cuda"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="'fp64'"):
        calibrate(device="cpu", plan=PLANS["quick"], model=TINY, dtypes=("fp64",))
    with pytest.raises(ValueError, match="weight_batches"):
        CalibrationPlan(weight_batches=(4, 2))
    with pytest.raises(ValueError, match="'huge'"):
        CalibrationPlan.from_name("huge")


def test_cache_path_names_host_and_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = default_cache_path(torch.device("cpu"))
    assert p.parent == tmp_path / "slotune"
    assert p.name.startswith("hardware-") and "-cpu-" in p.name and p.suffix == ".json"
    one = default_cache_path(torch.device("cpu"), threads=1)
    assert one.parent == p.parent and one.name == f"{p.stem}-1t.json"
    assert default_cache_path(torch.device("cpu"), threads=2) != one


def test_monotone_rates_let_no_larger_batch_be_faster() -> None:
    # Weight rates: the same bytes at every batch, so time = 1 / rate.
    assert monotone_rates({1: 5.0, 2: 6.0, 4: 8.0, 8: 4.0}, lambda b: 1.0) == {
        1: 8.0,
        2: 8.0,
        4: 8.0,
        8: 4.0,
    }
    # KV rates: bytes grow with the batch; B=8 took longer than B=64 would allow.
    kv = monotone_rates({1: 1.0, 8: 2.0, 64: 30.0}, float)
    assert kv[1] == 1.0 and kv[64] == 30.0 and kv[8] == pytest.approx(8 / (64 / 30))
    # Plain times.
    assert monotone_rates({1: 3e-4, 8: 1e-4, 64: 5e-4}, None) == {1: 1e-4, 8: 1e-4, 64: 5e-4}


@pytest.mark.gpu
def test_quick_calibration_on_cuda() -> None:
    cal = calibrate(device="cuda", plan=PLANS["quick"], model=TINY, dtypes=("bf16",))
    spec = cal.spec
    assert spec.name.startswith("cuda-") and spec.mem_capacity > 1e9
    assert spec.flops("bf16") > 1e12 and spec.mem_bandwidth > 1e11  # any datacenter GPU
    r = Roofline(model=TINY, hardware=spec, context=64)
    assert r.calibrated and r.step_time_s(8) > 0


def test_big_models_are_timed_on_the_layers_that_fit() -> None:
    from search.calibrate.shapes import MAX_WORKING_SET_BYTES, _linear_shapes

    spec = ModelSpec.from_name("slotune-small")
    small = _linear_shapes(spec)
    assert len(small) == 12 * 4 + 1  # every (fused) linear and the lm_head
    assert small[0] == (768 + 2 * 256, 768) and small[2] == (2 * 2048, 768)
    assert sum(o * i for o, i in small) == spec.matmul_params  # every weight, once
    big = _linear_shapes(ModelSpec.from_name("llama-3.1-8b"))
    assert 4 <= len(big) < 32 * 4 and len(big) % 4 == 0
    assert sum(o * i for o, i in big) * 2 <= MAX_WORKING_SET_BYTES


def test_weight_rate_times_prepacked_and_plain_linears() -> None:
    from search.calibrate.shapes import can_prepack, measure_weight_rate

    dev = torch.device("cpu")
    plain = measure_weight_rate(dev, "bf16", TINY, [1, 4], reps=2, prepacked=False)
    assert set(plain) == {1, 4} and all(r > 0 for r in plain.values())
    if not can_prepack(dev, torch.bfloat16):
        pytest.skip("no oneDNN bf16 on this CPU")
    packed = measure_weight_rate(dev, "bf16", TINY, [1, 4], reps=2, prepacked=True)
    assert set(packed) == {1, 4} and all(r > 0 for r in packed.values())
    assert not can_prepack(dev, torch.float32)  # the engine packs bf16 only


def test_layer_in_stream_times_the_whole_layer_and_its_parts() -> None:
    from search.calibrate.layer import layer_residual, measure_layer_in_stream

    got = measure_layer_in_stream(torch.device("cpu"), "bf16", TINY, [1, 4], 32, reps=2)
    assert set(got) == {1, 4}
    for full, lin, attn in got.values():
        assert full > 0 and lin > 0 and attn > 0 and math.isfinite(full)
    assert layer_residual(3.0, 1.0, 0.5) == 1.5
    assert layer_residual(1.0, 1.0, 0.5) == 0.0  # noise never makes it negative


@pytest.mark.parametrize("widen", [False, True])
def test_bf16_matmul_peak_multiplies_as_the_engine_does(monkeypatch, widen: bool) -> None:
    """Without bf16 matmul hardware the engine multiplies bf16 in fp32 (widened copies):
    the calibrated peak times that, not torch's slow bf16 fallback."""
    import search.calibrate.device as cal

    seen = []
    monkeypatch.setattr(cal, "widens_bf16", lambda t: widen)
    monkeypatch.setattr(cal, "best_time", lambda fn, *a: seen.append(fn().dtype) or 0.5)
    assert cal.measure_matmul_peak(torch.device("cpu"), "bf16", 8, 1) == 2.0 * 8**3 / 0.5
    assert seen == [torch.float32 if widen else torch.bfloat16]


def test_after_pass_interleaves_work_outside_the_calibration_time(monkeypatch) -> None:
    """bench/engine.py times its steps between the calibration's passes: the hook runs
    after each pass, and its time is neither the calibration's elapsed time nor counted
    against the plan's max_s."""
    import dataclasses
    import time

    plan = dataclasses.replace(PLANS["quick"], passes=2, max_s=600.0)
    real = time.perf_counter
    jump = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + jump[0])
    calls = []

    def work(dtype: str, i: int) -> None:  # an hour of work, as the clock sees it
        calls.append((dtype, i))
        jump[0] += 3600.0

    cal = calibrate(device="cpu", plan=plan, model=TINY, dtypes=("fp32",), after_pass=work)
    assert calls == [("fp32", 0), ("fp32", 1)]  # counted, the hour would cut pass 2
    assert 0 < cal.elapsed_s < 600
