"""Timing at the shapes one decode step runs, for :mod:`search.calibrate`.

Each function mirrors a part of serving/model.py's decode step (keep them in
step with it): the model's linears, decode attention over the KV cache, the
rest of a layer, the rest of a step. Figures are the fastest of several runs
(:func:`best_time`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from search.hardware import BYTES_PER_ELEM
from search.models import ModelSpec

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_time(
    fn: Callable[[], object], dev: torch.device, reps: int, budget_s: float = 0.0
) -> float:
    """Fastest timed call of ``fn`` after one warm-up call: at least ``reps`` calls, and
    more (up to 50) while the calls so far took less than ``budget_s``.

    The minimum, not the median: other work on a shared machine only ever adds
    time, so the fastest run is the device's own figure, and more tries within a
    time budget give a quiet moment more chances (compare it with the fastest
    measured step, too).
    """
    fn()
    sync(dev)
    best, spent, n = math.inf, 0.0, 0
    while n < reps or (spent < budget_s and n < 50):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


# Working sets larger than any cache, smaller than memory: a big model is timed on
# as many of its layers as fit in this (rates are per byte, so they carry over).
MAX_WORKING_SET_BYTES = 1 << 30


def _layers_within(per_layer_bytes: int, layers: int) -> int:
    return max(1, min(layers, MAX_WORKING_SET_BYTES // max(1, per_layer_bytes)))


def _linear_shapes(model: ModelSpec, bytes_per_elem: int = 2) -> list[tuple[int, int]]:
    """(out, in) of every linear one decode step runs, in order, lm_head last (of a model
    too big for :data:`MAX_WORKING_SET_BYTES`: the layers that fit, and the lm_head if
    it fits too)."""
    m = model
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    layer = [
        (q, m.hidden),
        (kv, m.hidden),
        (kv, m.hidden),
        (m.hidden, q),
        (m.intermediate, m.hidden),
        (m.intermediate, m.hidden),
        (m.hidden, m.intermediate),
    ]
    per_layer = sum(o * i for o, i in layer) * bytes_per_elem
    n = _layers_within(per_layer, m.layers)
    head = [(m.vocab, m.hidden)]
    if n < m.layers and (n * per_layer + m.vocab * m.hidden * bytes_per_elem) > (
        MAX_WORKING_SET_BYTES
    ):
        head = []
    return layer * n + head


def measure_weight_rate(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> weight bytes/s that the model's linears consume at that batch."""
    dt = TORCH_DTYPES[dtype]
    shapes = _linear_shapes(model, BYTES_PER_ELEM[dtype])
    weights = [torch.empty(o, i, device=dev, dtype=dt).normal_(0, 0.02) for o, i in shapes]
    total = sum(w.numel() for w in weights) * BYTES_PER_ELEM[dtype]
    out: dict[int, float] = {}
    for b in batches:
        xs = {i: torch.randn(b, i, device=dev).to(dt) for i in {i for _, i in shapes}}  # [B, in]

        def run(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)  # [B, out]

        out[b] = total / best_time(run, dev, reps, budget_s)
        logger.info("%s weight rate at B=%d: %.2f GB/s", dtype, b, out[b] / 1e9)
    return out


def measure_kv_rate(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> KV-cache bytes/s decode attention reads (all layers, one query token each).

    Mirrors serving/model.py's decode attention (keep the two in step): a cache
    ``[slots, kv_heads, len, head_dim]`` per layer, grouped-query attention as two
    batched matmuls (the g query heads of a group stacked), fp32 scores, a mask,
    softmax. Only the shapes matter here: the values are random.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    g = m.heads // m.kv_heads
    out: dict[int, float] = {}
    for b in batches:
        per_layer = 2 * b * m.kv_heads * context * m.head_dim * BYTES_PER_ELEM[dtype]
        layers = _layers_within(per_layer, m.layers)
        caches = [
            (
                torch.empty(b, m.kv_heads, context, m.head_dim, device=dev, dtype=dt).normal_(),
                torch.empty(b, m.kv_heads, context, m.head_dim, device=dev, dtype=dt).normal_(),
            )
            for _ in range(layers)
        ]  # per layer: [B, Hkv, L, D] x 2, filled (untouched pages would read as zeros)
        q = torch.randn(b, m.kv_heads, g, m.head_dim, device=dev).to(dt)  # [B, Hkv, g, D]
        hidden = torch.zeros(b, 1, 1, context, dtype=torch.bool, device=dev)  # [B, 1, 1, L]

        def run(caches: list = caches, q: torch.Tensor = q, hidden: torch.Tensor = hidden) -> None:
            for k, v in caches:
                scores = (
                    torch.matmul(q, k.transpose(-1, -2)).float() * m.head_dim**-0.5
                )  # [B, Hkv, g, L]
                scores = scores.masked_fill(hidden, float("-inf"))
                probs = torch.softmax(scores, dim=-1).to(dt)  # [B, Hkv, g, L]
                torch.matmul(probs, v)  # [B, Hkv, g, D]

        nbytes = layers * per_layer
        out[b] = nbytes / best_time(run, dev, reps, budget_s)
        logger.info("%s KV rate at B=%d: %.2f GB/s", dtype, b, out[b] / 1e9)
        del caches
    return out


def measure_layer_overhead(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> seconds per decoder layer outside its linears and attention core.

    Runs the rest of serving/model.py's decode block (keep the two in step) at
    the model's shapes: two RMSNorms in fp32, rotary on q and k, the two cache
    writes (``index_put_``), reshapes, SwiGLU's activation, residual adds. At
    these sizes it is dispatch and small-kernel time, the part the bytes miss.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out: dict[int, float] = {}
    layers = 8
    for b in batches:
        x = torch.randn(b, 1, m.hidden, device=dev).to(dt)  # [B, 1, d]
        w = torch.ones(m.hidden, device=dev, dtype=dt)  # [d]
        qf = torch.randn(b, 1, q_dim, device=dev).to(dt)  # [B, 1, H*D]
        kf = torch.randn(b, 1, kv_dim, device=dev).to(dt)  # [B, 1, Hkv*D]
        gate = torch.randn(b, 1, m.intermediate, device=dev).to(dt)  # [B, 1, I]
        cos = torch.randn(b, 1, 1, m.head_dim, device=dev).to(dt)  # [B, 1, 1, D]
        sin = torch.randn(b, 1, 1, m.head_dim, device=dev).to(dt)  # [B, 1, 1, D]
        caches = [
            torch.zeros(b, m.kv_heads, context, m.head_dim, device=dev, dtype=dt) for _ in range(2)
        ]  # [S, Hkv, L, D]
        heads = torch.arange(m.kv_heads, device=dev)
        pos = torch.full((b, 1), 7, device=dev, dtype=torch.long)  # [B, 1]
        index = (torch.arange(b, device=dev)[:, None, None], heads[None, None, :], pos[:, :, None])

        def norm(h: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            hf = h.float()
            hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
            return w * hf.to(h.dtype)

        def rope(t: torch.Tensor, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        def run(
            x: torch.Tensor = x,
            qf: torch.Tensor = qf,
            kf: torch.Tensor = kf,
            gate: torch.Tensor = gate,
            caches: list = caches,
            index: tuple = index,
            b: int = b,
        ) -> None:
            h = x
            for _ in range(layers):
                n = norm(h)
                q = rope(qf.view(b, 1, m.heads, m.head_dim))  # [B, 1, H, D]
                k = rope(kf.view(b, 1, m.kv_heads, m.head_dim))  # [B, 1, Hkv, D]
                caches[0].index_put_(index, k)
                caches[1].index_put_(index, kf.view(b, 1, m.kv_heads, m.head_dim))
                q.transpose(1, 2).reshape(b, m.kv_heads, -1, m.head_dim)
                h = h + n
                n = norm(h)
                h = h + (torch.nn.functional.silu(gate) * gate)[..., : m.hidden]

        out[b] = best_time(run, dev, reps, budget_s) / layers
        logger.info("%s layer overhead at B=%d: %.1f us", dtype, b, out[b] * 1e6)
    return out


def measure_step_overhead(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> seconds per step outside the layers and the lm_head matmul.

    serving/model.py's prologue and epilogue (keep in step): embedding lookup,
    rotary table lookups cast to the dtype, the position mask, the final RMSNorm,
    fp32 logits, and a greedy argmax.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    emb = torch.empty(m.vocab, m.hidden, device=dev, dtype=dt).normal_()  # [V, d]
    table = torch.randn(2048, m.head_dim, device=dev)  # [P, D] fp32
    w = torch.ones(m.hidden, device=dev, dtype=dt)  # [d]
    out: dict[int, float] = {}
    for b in batches:
        tokens = torch.randint(0, m.vocab, (b, 1), device=dev)  # [B, 1]
        pos = torch.full((b, 1), 100, device=dev, dtype=torch.long)  # [B, 1]
        logits = torch.randn(b, m.vocab, device=dev).to(dt)  # [B, V], as the lm_head gives

        def run(
            tokens: torch.Tensor = tokens, pos: torch.Tensor = pos, logits: torch.Tensor = logits
        ) -> None:
            x = F.embedding(tokens, emb)  # [B, 1, d]
            table[pos].to(dt)[:, :, None, :]  # cos [B, 1, 1, D]
            table[pos].to(dt)[:, :, None, :]  # sin
            key_pos = torch.arange(256, device=dev)
            torch.gt(key_pos, pos[:, None, None, :, None])  # [B, 1, 1, 1, L]
            xf = x[:, -1].float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
            w * xf.to(dt)
            logits.float().argmax(dim=-1)  # [B]

        out[b] = best_time(run, dev, reps, budget_s)
        logger.info("%s step overhead at B=%d: %.1f us", dtype, b, out[b] * 1e6)
    return out
