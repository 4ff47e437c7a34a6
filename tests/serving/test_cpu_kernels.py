"""The C decode-attention kernel (serving/kernels/cpu_kernels.py) against the torch path.

Skipped where the kernel cannot be built (no C compiler, not x86-64): the model then
runs the torch path, which the rest of the suite covers.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import serving.kernels.cpu_kernels as ck
from serving.engine.engine import Engine
from serving.model.config import ModelConfig
from serving.model.linear import Linear, widens_bf16
from serving.model.transformer import Transformer

KERNELS = ck.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C kernel cannot be built here")

# head_dim 64 and 32 take the AVX-512 path where the CPU has it; 48 the scalar path.
SHAPES = {
    "small-like": dict(n_heads=12, n_kv_heads=4, head_dim=64, d_model=256),
    "tiny": dict(n_heads=8, n_kv_heads=4, head_dim=32, d_model=256),
    "scalar": dict(n_heads=6, n_kv_heads=2, head_dim=48, d_model=192),
}


def model_of(shape: str) -> Transformer:
    cfg = ModelConfig.from_name("tiny").replace(name=f"k-{shape}", n_layers=2, **SHAPES[shape])
    return Transformer.random(cfg, seed=5)


def decode_both(m: Transformer, positions: list[int], slots: list[int], *, gemv: bool = True):
    """One decode step with the kernels and one with torch ops on identical caches:
    (logits, caches) of each. ``gemv=False``: the linears run torch's way in both (no GEMV,
    no small GEMM), so the attention kernel sees the very same q, k and v as the torch path."""
    gen = torch.Generator().manual_seed(9)
    m.allocate_cache(max(slots) + 2, 64)
    for c in m.caches():
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
    start = [c.clone() for c in m.caches()]
    b = len(slots)
    tokens = torch.randint(0, m.config.vocab_size, (b, 1), generator=gen)
    pos = torch.tensor(positions)[:, None]
    sl = torch.tensor(slots)
    out = []
    for on in (True, False):
        assert m.use_cpu_kernels(on) is on
        if not gemv:  # the linears as torch runs them, in both
            for lin in m.modules():
                if isinstance(lin, Linear):
                    lin.rows8 = lin.cols16 = None
                    lin.w32 = lin.weight.float() if widens_bf16(lin.weight) else None
        for c, s in zip(m.caches(), start, strict=True):
            c.copy_(s)
        with torch.inference_mode():
            logits = m(tokens, pos, sl)
        out.append((logits, [c.clone() for c in m.caches()]))
    return out


@needs_kernels
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_attention_kernel_matches_torch_ops(shape: str) -> None:
    m = model_of(shape)
    # Different positions (0: a single key; 63: the last row), slots out of order.
    (lk, ck_), (lt, ct) = decode_both(m, [0, 17, 63, 5], [3, 0, 1, 4], gemv=False)
    for a, b in zip(ck_, ct, strict=True):
        # The K/V rows written (rotary rounded as torch rounds it) are the same bits.
        assert torch.equal(a, b)
    torch.testing.assert_close(lk, lt, atol=0.05, rtol=0.05)
    assert torch.equal(lk.argmax(-1), lt.argmax(-1))


@needs_kernels
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_step_with_gemv_matches_torch_ops(shape: str) -> None:
    m = model_of(shape)
    assert m.use_cpu_kernels()
    gemvs = [x for x in m.modules() if isinstance(x, Linear) and x.rows8 is not None]
    assert len(gemvs) == (4 * 2 + 1 if KERNELS.gemv_isa else 0)  # 4 a layer, lm_head
    (lk, ck_), (lt, ct) = decode_both(m, [0, 17, 63, 5], [3, 0, 1, 4])
    for a, b in zip(ck_, ct, strict=True):  # fp32 sums in another order: bf16 rounding
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    torch.testing.assert_close(lk, lt, atol=0.05, rtol=0.05)


needs_gemv = pytest.mark.skipif(
    KERNELS is None or KERNELS.gemv_isa is None, reason="the GEMV needs AVX-512 bf16 or AVX2"
)


@needs_gemv
@pytest.mark.parametrize("shape", ["small-like", "tiny"])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_whole_layer_call_gives_the_bits_of_the_layer_op_by_op(
    shape: str, rows: int, monkeypatch
) -> None:
    """Up to KERNELS.gemv_rows rows a decode step runs each layer in one C call; its logits
    and cache writes are the very bits of the same kernels called op by op (the norms,
    GEMVs, attention, SwiGLU and residual adds rounded alike)."""
    m = model_of(shape)
    assert m.use_cpu_kernels() and all(layer.fused for layer in m.model.layers)
    calls = []
    real = KERNELS.decode_layer
    monkeypatch.setattr(KERNELS, "decode_layer", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(m.kernels, "step_fn", None)  # layer by layer (whole: test_cpu_step)
    gen = torch.Generator().manual_seed(rows)
    m.allocate_cache(6, 64)
    for c in m.caches():
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
    start = [c.clone() for c in m.caches()]
    with torch.no_grad():  # a hidden state with large entries: silu's tails, both signs
        m.model.embed_tokens.weight.mul_(8.0)
    tokens = torch.randint(0, m.config.vocab_size, (rows, 1), generator=gen)
    pos = torch.tensor([[63], [0], [17]][:rows])
    slots = torch.tensor([4, 1, 2][:rows])
    out = []
    for fused in (True, False):
        for layer in m.model.layers:
            layer.fused = fused
        for c, s in zip(m.caches(), start, strict=True):
            c.copy_(s)
        with torch.inference_mode():
            out.append((m(tokens, pos, slots), [c.clone() for c in m.caches()]))
    assert len(calls) == (len(m.model.layers) if rows <= KERNELS.gemv_rows else 0)
    # A layer whose GEMV copies were dropped after the fact runs op by op, not on None.
    for layer in m.model.layers:
        layer.fused = True
    m.model.layers[0].self_attn.o_proj.rows8 = None
    with torch.inference_mode():
        m(tokens, pos, slots)
    assert len(calls) == (2 * len(m.model.layers) - 1 if rows <= KERNELS.gemv_rows else 0)
    (lf, cf), (lo, co) = out
    assert torch.equal(lf, lo)
    assert all(torch.equal(a, b) for a, b in zip(cf, co, strict=True))


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_gemv_computes_the_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(40, 96, generator=gen) * 0.1).to(torch.bfloat16)  # O=40, I=96
    x = torch.randn(rows, 1, 96, generator=gen).to(torch.bfloat16)
    res = torch.randn(rows, 1, 40, generator=gen).to(torch.bfloat16)
    packed = KERNELS.pack_rows8(w)
    want = x.float() @ w.float().T  # [rows, 1, 40]
    got = KERNELS.gemv(x, packed, 40)
    assert got.shape == (rows, 1, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    got_res = KERNELS.gemv(x, packed, 40, res)
    torch.testing.assert_close(got_res.float(), want + res.float(), atol=2e-2, rtol=1e-2)
    # A row's bits do not depend on the rows beside it (pairs and lone rows take their
    # sums in the same order): each row alone gives what it gave in the batch.
    for r in range(rows):
        assert torch.equal(KERNELS.gemv(x[r : r + 1], packed, 40), got[r : r + 1])
    # The model's Linear takes it up to KERNELS.gemv_rows rows, oneDNN/torch beyond.
    lin = Linear(96, 40)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.to(torch.bfloat16)
    lin.kernels, lin.rows8 = KERNELS, packed
    torch.testing.assert_close(lin.forward(x).float(), want, atol=1e-2, rtol=1e-2)
    big = torch.randn(KERNELS.gemv_rows + 1, 96, generator=gen).to(torch.bfloat16)
    assert torch.equal(lin.forward(big), torch.nn.functional.linear(big, w))


@pytest.mark.skipif(
    KERNELS is None or not KERNELS.has_gemm, reason="the small GEMM is built on AVX2 only"
)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 13])
def test_small_gemm_computes_the_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(48, 80, generator=gen) * 0.1).to(torch.bfloat16)  # 3 blocks of 16 rows
    x = torch.randn(rows, 1, 80, generator=gen).to(torch.bfloat16)
    res = torch.randn(rows, 1, 48, generator=gen).to(torch.bfloat16)
    packed = KERNELS.pack_cols16(w)
    want = x.float() @ w.float().T  # [rows, 1, 48]
    got = KERNELS.gemm(x, packed, 48)
    assert got.shape == (rows, 1, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    got_res = KERNELS.gemm(x, packed, 48, res)
    torch.testing.assert_close(got_res.float(), want + res.float(), atol=2e-2, rtol=1e-2)
    for r in range(rows):  # each sum runs over the inputs in order, whatever the tile
        assert torch.equal(KERNELS.gemm(x[r : r + 1], packed, 48), got[r : r + 1])
    # A non-contiguous x (a transposed view) reads as its values, not its storage order.
    xt = x.reshape(rows, 80).t().contiguous().t()  # [rows, 80], column-major strides
    assert xt.is_contiguous() == (rows == 1)
    assert torch.equal(KERNELS.gemm(xt, packed, 48), got.reshape(rows, 48))
    # The model's Linear takes it past the GEMV's rows.
    lin = Linear(80, 48)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.to(torch.bfloat16)
    lin.kernels, lin.cols16 = KERNELS, packed
    assert torch.equal(lin.forward(x), got)
    assert torch.equal(lin.add_forward(x, res), got_res)


@needs_kernels
def test_kernel_reads_only_each_sequence_own_positions() -> None:
    m = model_of("small-like")
    assert m.use_cpu_kernels()
    m.allocate_cache(2, 32)
    for c in m.caches():
        c.normal_()
        c[:, :, :, 10:] = float("nan")  # beyond the positions this step reads
    with torch.inference_mode():
        logits = m(torch.tensor([[1], [2]]), torch.tensor([[9], [4]]), torch.tensor([0, 1]))
    assert torch.isfinite(logits).all()


@needs_kernels
def test_engine_with_and_without_kernel_generates_the_same_tokens() -> None:
    cfg = ModelConfig.from_name("tiny")  # bf16
    plan = [(0, 3, 9), (0, 12, 4), (1, 7, 12), (3, 1, 6), (4, 9, 8)]
    runs = []
    for on in (True, False):
        eng = Engine(
            model_config=cfg,
            max_slots=4,
            max_batch_size=3,
            max_len=48,
            prefill_chunk=5,
            num_threads=1,
            cpu_kernels=on,
        )
        assert eng.cpu_kernels is on
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for _, n, _ in plan]
        outputs: dict[str, list[int]] = {}
        for step in itertools.count():
            for i, (at, _, mt) in enumerate(plan):
                if at == step:
                    eng.add_request(prompts[i], max_tokens=mt, request_id=f"r{i}")
            if step > 4 and not eng.has_work:
                break
            for f in eng.step().finished:
                outputs[f.request_id] = list(f.output_ids)
        runs.append(outputs)
    assert len(runs[0]) == len(plan)
    assert runs[0] == runs[1]


def test_switched_off_or_without_compiler_falls_back(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv(ck.ENV_SWITCH, "0")
    ck.load.cache_clear()
    try:
        assert ck.load() is None
        assert not model_of("tiny").use_cpu_kernels()
        monkeypatch.delenv(ck.ENV_SWITCH)
        ck.load.cache_clear()
        monkeypatch.setattr(ck, "_compiler", lambda: None)
        monkeypatch.setenv("SLOTUNE_KERNEL_CACHE", str(tmp_path))
        with caplog.at_level(logging.WARNING, logger="serving.kernels.cpu_kernels"):
            assert ck.load() is None
        assert "no C compiler" in caplog.text
        m = model_of("tiny")
        assert not m.use_cpu_kernels()
        with torch.inference_mode():  # the torch path still serves
            m.allocate_cache(1, 8)
            assert m(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([0])).shape[0] == 1
    finally:
        ck.load.cache_clear()


@needs_kernels
def test_not_used_for_fp32_or_unsupported_heads() -> None:
    cfg = ModelConfig.from_name("tiny", dtype="float32")
    assert not Transformer.random(cfg).use_cpu_kernels()
    assert not KERNELS.supports(n_heads=64, n_kv_heads=2, head_dim=64)  # group of 32


@needs_kernels
def test_build_reuses_the_library_and_reports_compiler_errors(monkeypatch, tmp_path) -> None:
    first = ck.build(tmp_path)
    assert first.exists() and ck.build(tmp_path) == first
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(ck, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="failed"):
        ck.build(tmp_path / "other")
    assert not list((tmp_path / "other").glob("*.so"))  # no half-built library left


@needs_kernels
def test_rms_norm_kernel_gives_torch_bits() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 768, generator=gen).to(torch.bfloat16)
    w = (torch.randn(768, generator=gen) * 0.5 + 1).to(torch.bfloat16)
    got = KERNELS.rms_norm(x, w, 1e-5)
    want = torch.rms_norm(x, (768,), w, 1e-5)
    assert (got != want).sum() <= 2  # the sum of squares in another order: a rare last bit


@needs_kernels
def test_nan_in_the_cache_propagates_like_torch() -> None:
    """A NaN where a sequence reads its cache is NaN in its logits on both paths (the
    kernel must not hide corruption as a uniform attention)."""
    m = model_of("small-like")
    got = []
    for on in (True, False):
        m.use_cpu_kernels(on)
        m.allocate_cache(2, 16)
        for c in m.caches():
            c.normal_(generator=torch.Generator().manual_seed(1))
            c[0, 0, :, 3] = float("nan")  # slot 0's K at position 3; slot 1 is clean
        with torch.inference_mode():
            got.append(m(torch.tensor([[1], [2]]), torch.tensor([[9], [9]]), torch.tensor([0, 1])))
    for logits in got:
        assert torch.isnan(logits[0]).all() and torch.isfinite(logits[1]).all()


@needs_kernels
def test_out_of_range_position_or_slot_is_an_error_not_a_write() -> None:
    m = model_of("small-like")
    assert m.use_cpu_kernels()
    m.allocate_cache(2, 16)
    before = [c.clone() for c in m.caches()]
    for pos, slot in ((16, 0), (3, 2), (-1, 0)):
        with pytest.raises(IndexError, match="outside"), torch.inference_mode():
            m(torch.tensor([[1]]), torch.tensor([[pos]]), torch.tensor([slot]))
    assert all(torch.equal(a, b) for a, b in zip(before, m.caches(), strict=True))


@needs_kernels
def test_moving_the_model_drops_the_kernels() -> None:
    m = model_of("tiny")
    assert m.use_cpu_kernels()
    m.to(torch.float32)
    assert m.kernels is None
    assert all(x.rows8 is None for x in m.modules() if isinstance(x, Linear))
    m.allocate_cache(1, 8)
    with torch.inference_mode():
        assert torch.isfinite(m(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([0]))).all()


@pytest.mark.skipif(
    KERNELS is None or not KERNELS.has_gemm, reason="the small GEMM is built on AVX2 only"
)
def test_linears_the_small_gemm_serves_get_no_fp32_copy(monkeypatch) -> None:
    """The engine turns the kernels on before prepacking: a linear the AVX2 GEMM serves
    never gets prepack's fp32 copy (4 bytes a parameter), whichever order is used."""
    import serving.model.linear as fl

    monkeypatch.setattr(fl, "bf16_matmul_native", lambda: False)
    m = model_of("tiny")
    assert m.use_cpu_kernels()
    m.prepack()
    lins = [x for x in m.modules() if isinstance(x, Linear)]
    assert all(x.cols16 is not None and x.w32 is None for x in lins)
    m.use_cpu_kernels(False)  # back to torch: the fp32 copies return
    assert all(x.cols16 is None and x.w32 is not None for x in lins)
