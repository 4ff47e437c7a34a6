"""The roofline's pinned numbers, its shape, and its operating point."""

from __future__ import annotations

import math

import pytest

from search.roofline.curve import DoesNotFit, Roofline
from search.roofline.hardware import CATALOG as HW
from search.roofline.hardware import HardwareSpec
from search.roofline.models import CATALOG as MODELS
from search.roofline.operating_point import analyze, usd_per_million_tokens
from search.roofline.profile import DecodeProfile

H100 = HW["h100-sxm"]
L8B, L70B, L405B = MODELS["llama-3.1-8b"], MODELS["llama-3.1-70b"], MODELS["llama-3.1-405b"]


def test_pinned_kv_bytes_and_ridge() -> None:
    assert Roofline(model=L8B, hardware=H100).kv_bytes_per_token == 131_072
    assert Roofline(model=L70B, hardware=H100, tp=4).kv_bytes_per_token == 327_680
    assert Roofline(model=L8B, hardware=H100).ridge_flops_per_byte == pytest.approx(295.3, abs=0.5)


def test_70b_tp4_single_stream_comes_from_the_formula() -> None:
    """B=1, context 4096, bf16 on 4 x H100 SXM, written out from the datasheet numbers."""
    r = Roofline(model=L70B, hardware=H100, tp=4, context=4096)
    # Bytes one device reads: its quarter of the matmul weights (the input
    # embedding is a lookup) plus its quarter of the 4096-token KV cache.
    matmul_params = 70_553_706_496 - 128_256 * 8192 - (2 * 80 + 1) * 8192
    mem_bytes = matmul_params * 2 / 4 + 4096 * 327_680 / 4
    flops = (2 * matmul_params + 4 * 80 * 64 * 128 * 4096) / 4
    memory_s, compute_s = mem_bytes / 3.35e12, flops / 989.4e12
    # Two ring all-reduces per layer of a 8192-wide bf16 row over NVLink.
    all_reduce_s = 2 * 80 * (8e-6 + 2 * 3 / 4 * 8192 * 2 / 450e9)
    expected = max(memory_s, compute_s) + all_reduce_s
    assert r.step_time_s(1) == pytest.approx(expected, rel=1e-12)
    assert memory_s > compute_s  # single-stream decode is memory-bound
    assert 0.010 < r.step_time_s(1) < 0.013  # ~11.8 ms TPOT, ~85 tokens/s
    single_device = Roofline(model=L70B, hardware=H100, tp=1, context=4096)
    assert r.step_time_s(1) < single_device.step_time_s(1) / 3  # TP shortens the read


def test_step_time_grows_and_throughput_grows_with_batch() -> None:
    r = Roofline(model=L8B, hardware=H100, context=2048)
    pts = r.curve(300)
    tpot = [p.tpot_s for p in pts]
    tps = [p.tokens_per_s for p in pts]
    assert all(b > a for a, b in zip(tpot, tpot[1:], strict=False))
    assert all(b > a for a, b in zip(tps, tps[1:], strict=False))
    assert [p.batch for p in pts] == list(range(1, 301))
    assert pts[0].tokens_per_s == pytest.approx(1 / pts[0].tpot_s)


def test_knee_sits_at_the_ridge_when_kv_is_negligible() -> None:
    # With 2 bytes per weight and 2 FLOPs per weight per token, the batch at
    # which compute catches up with the weight read is the ridge itself.
    r = Roofline(model=L8B, hardware=H100, context=1)
    assert r.knee_bound == "compute"
    assert r.knee_batch == pytest.approx(r.ridge_flops_per_byte, rel=0.01)
    assert r.bound_at(r.knee_batch - 2) == "memory"
    assert r.bound_at(r.knee_batch + 2) == "compute"


def test_kv_bytes_pull_the_knee_in() -> None:
    short = Roofline(model=L8B, hardware=H100, context=64)
    long = Roofline(model=L8B, hardware=H100, context=4096)
    assert long.knee_bound == "kv" and long.compute_crossover_batch is None
    # At the knee the KV cache read per step matches the weight read.
    w = long.weight_bytes_read_per_device
    assert long.knee_batch == math.ceil(w / (4096 * 131_072))
    assert long.knee_batch < short.knee_batch < short.ridge_flops_per_byte * 1.2
    # With KV bytes the compute crossover moves out past the plain ridge.
    assert short.compute_crossover_batch > Roofline(model=L8B, hardware=H100, context=1).knee_batch


def test_kv_capacity_caps_the_batch() -> None:
    r = Roofline(model=L70B, hardware=H100, tp=4, context=4096)
    free = 0.9 * 80e9 - 70_553_706_496 * 2 / 4
    assert r.max_batch_memory == int(free // (327_680 / 4 * 4096)) == 109
    assert Roofline(model=L70B, hardware=H100, tp=4, context=8192).max_batch_memory == 54


def test_kv_heads_replicate_past_tp_equal_kv_heads() -> None:
    r8 = Roofline(model=L405B, hardware=HW["h200"], tp=8)
    r16 = Roofline(model=L405B, hardware=HW["h200"], tp=16)
    assert r8.kv_bytes_per_token_per_device == 516_096 / 8
    assert r16.kv_bytes_per_token_per_device == 516_096 / 8  # one KV head per device, replicated


def test_operating_point_is_the_largest_batch_meeting_the_slo() -> None:
    r = Roofline(model=L8B, hardware=H100, context=4096)
    a = analyze(r, slo_tpot_s=0.02, usd_per_hour=2.5)
    op = a.operating_point
    assert op is not None and op.limited_by == "slo"
    assert op.tpot_s <= 0.02 < r.step_time_s(op.batch + 1)
    assert op.tokens_per_s == pytest.approx(op.batch / op.tpot_s)
    assert op.usd_per_million_tokens == pytest.approx(2.5 / (op.tokens_per_s * 3600) * 1e6)


def test_operating_point_limited_by_memory_and_cost_counts_devices() -> None:
    a = analyze(Roofline(model=L70B, hardware=H100, tp=4), slo_tpot_s=0.05, usd_per_hour=2.5)
    op = a.operating_point
    assert op is not None and op.batch == 109 and op.limited_by == "memory"
    assert op.usd_per_million_tokens == pytest.approx(
        usd_per_million_tokens(2.5, 4, op.tokens_per_s)
    )
    assert usd_per_million_tokens(3.6, 1, 1000.0) == pytest.approx(1.0)


def test_no_batch_meets_a_tight_slo() -> None:
    a = analyze(Roofline(model=L70B, hardware=H100, tp=4), slo_tpot_s=0.005)
    assert a.operating_point is None
    assert "even B=1" in " ".join(a.explain())


def test_to_dict_has_the_issues_keys() -> None:
    d = analyze(
        Roofline(model=L70B, hardware=H100, tp=4), slo_tpot_s=0.05, usd_per_hour=2.5
    ).to_dict()
    for key in (
        "ridge_flops_per_byte",
        "kv_bytes_per_token",
        "knee_batch",
        "max_batch_memory",
        "operating_point",
        "curve",
    ):
        assert key in d
    assert {"batch", "tpot_ms", "tokens_per_s", "usd_per_million_tokens"} <= set(
        d["operating_point"]
    )
    assert {"batch", "tpot_ms", "tokens_per_s", "bound"} <= set(d["curve"][0])
    assert len(d["curve"]) == 109 and d["curve"][-1]["batch"] == 109


@pytest.mark.parametrize("slo", [0, -1.0, math.nan, math.inf])
def test_bad_slo_is_rejected(slo: float) -> None:
    with pytest.raises(ValueError, match="slo_tpot_s"):
        analyze(Roofline(model=L8B, hardware=H100), slo_tpot_s=slo)


def test_bad_settings_name_the_value_and_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="tp=3.*allowed: 1, 2, 4, 8"):
        Roofline(model=L8B, hardware=H100, tp=3)
    with pytest.raises(ValueError, match="dtype='fp8'.*allowed"):
        Roofline(model=L8B, hardware=HW["a100-80gb"], dtype="fp8")
    with pytest.raises(ValueError, match="context=0"):
        Roofline(model=L8B, hardware=H100, context=0)
    lonely = HardwareSpec(
        name="box", peak_flops={"bf16": 1e12}, mem_bandwidth=1e10, mem_capacity=1e10
    )
    with pytest.raises(ValueError, match="tp=2.*no interconnect"):
        Roofline(model=L8B, hardware=lonely, tp=2)


def test_a_model_that_does_not_fit_says_what_would() -> None:
    with pytest.raises(DoesNotFit, match="811.7 GB.*--tp 16"):
        analyze(Roofline(model=L405B, hardware=H100), slo_tpot_s=0.05)
    with pytest.raises(DoesNotFit, match="context=1000000.*--context <="):
        analyze(Roofline(model=L8B, hardware=H100, context=1_000_000), slo_tpot_s=0.05)


def test_tensor_parallel_adds_all_reduce_time() -> None:
    r1 = Roofline(model=L70B, hardware=HW["h200"], tp=1)
    r2 = Roofline(model=L70B, hardware=HW["h200"], tp=2)
    assert r1.all_reduce_s(8) == 0.0
    assert r2.all_reduce_s(8) == pytest.approx(2 * 80 * (8e-6 + 2 * 1 / 2 * 8 * 8192 * 2 / 450e9))


def test_detailed_step_matches_and_prefill_costs_more() -> None:
    r = Roofline(model=L8B, hardware=H100, context=1000)
    assert r.step_time_detailed_s(decode_batch=8, kv_tokens=8000) == r.step_time_s(8)
    assert r.step_time_detailed_s(decode_batch=0, kv_tokens=0) == 0.0
    plain = r.step_time_detailed_s(decode_batch=8, kv_tokens=8000)
    mixed = r.step_time_detailed_s(decode_batch=8, kv_tokens=8000, prefill_tokens=2048)
    assert mixed > plain
    # A 2048-token prefill is compute-bound: its matmul FLOPs alone take this long.
    assert mixed >= 2 * (L8B.matmul_params - L8B.embedding_params) * 2048 / 989.4e12
    # Mixed lengths: a shorter context reads fewer KV bytes.
    assert r.step_time_detailed_s(decode_batch=8, kv_tokens=4000) < plain
    with pytest.raises(ValueError, match="kv_tokens=-1"):
        r.step_time_detailed_s(decode_batch=1, kv_tokens=-1)


def test_calibrated_device_uses_the_measured_rates() -> None:
    m = MODELS["slotune-small"]
    prof = DecodeProfile(
        weight_rate={1: 10e9, 64: 2e9},
        kv_rate={1: 1e9, 64: 4e9},
        layer_overhead_s={1: 100e-6, 64: 200e-6},
        step_overhead_s={1: 50e-6},
    )
    hw = HardwareSpec(
        name="cpu",
        peak_flops={"bf16": 200e9},
        mem_bandwidth=25e9,
        mem_capacity=24e9,
        decode={"bf16": prof},
    )
    r = Roofline(model=m, hardware=hw, context=256)
    assert r.calibrated
    head = m.embedding_params * 2
    layers = m.weight_bytes_read_per_step() - head
    expected = layers / 10e9 + head / 10e9 + 256 * 12_288 / 1e9 + 12 * 100e-6 + 50e-6
    assert r.step_time_s(1) == pytest.approx(expected)
    expected64 = (layers + head) / 2e9 + 64 * 256 * 12_288 / 4e9 + 12 * 200e-6 + 50e-6
    assert r.step_time_s(64) == pytest.approx(expected64)
    # The ideal roofline on the same peaks is faster: the calibration measures the loss.
    ideal = HardwareSpec(
        name="i", peak_flops={"bf16": 200e9}, mem_bandwidth=25e9, mem_capacity=24e9
    )
    assert Roofline(model=m, hardware=ideal, context=256).step_time_s(1) < r.step_time_s(1)
    peak_only = Roofline(model=m, hardware=hw.without_calibration(), context=256)
    assert not peak_only.calibrated
    assert peak_only.step_time_s(1) == Roofline(model=m, hardware=ideal, context=256).step_time_s(1)
