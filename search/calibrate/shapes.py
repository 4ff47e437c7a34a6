"""Timing at the shapes one decode step runs, for :mod:`search.calibrate.device`.

Each function mirrors a part of serving/model/transformer.py's decode step (keep them in
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

from search.roofline.hardware import BYTES_PER_ELEM
from search.roofline.models import ModelSpec
from serving.kernels import cpu_kernels

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


def can_prepack(dev: torch.device, dt: torch.dtype) -> bool:
    """Whether serving's engine prepacks its linears here (keep in step with
    serving/model/transformer.py ``can_prepack``): CPU, bf16, oneDNN with bf16 support."""
    return (
        dev.type == "cpu"
        and dt == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _linear_shapes(model: ModelSpec, bytes_per_elem: int = 2) -> list[tuple[int, int]]:
    """(out, in) of every linear one decode step runs, in order, lm_head last (of a model
    too big for :data:`MAX_WORKING_SET_BYTES`: the layers that fit, and the lm_head if
    it fits too). serving/model/transformer.py fuses q/k/v into one linear and gate/up into one:
    four per layer."""
    m = model
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    layer = [
        (q + 2 * kv, m.hidden),  # qkv_proj
        (m.hidden, q),  # o_proj
        (2 * m.intermediate, m.hidden),  # gate_up_proj
        (m.hidden, m.intermediate),  # down_proj
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
    *,
    prepacked: bool | None = None,
) -> dict[int, float]:
    """batch -> weight bytes/s that the model's linears consume at that batch.

    Runs the kernels the engine runs: oneDNN's ``_linear_pointwise`` on weights
    prepacked with ``_reorder_linear_weight`` where the engine prepacks
    (``prepacked`` None: as :func:`can_prepack` says), ``F.linear`` elsewhere;
    the fused shapes of :func:`_linear_shapes`; inputs ``[B, 1, in]``."""
    dt = TORCH_DTYPES[dtype]
    packed = can_prepack(dev, dt) if prepacked is None else prepacked
    shapes = _linear_shapes(model, BYTES_PER_ELEM[dtype])
    weights = [torch.empty(o, i, device=dev, dtype=dt).normal_(0, 0.02) for o, i in shapes]
    total = sum(w.numel() for w in weights) * BYTES_PER_ELEM[dtype]
    if packed:
        weights = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]

        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    else:
        linear = F.linear
    out: dict[int, float] = {}
    for b in batches:
        xs = {i: torch.randn(b, 1, i, device=dev).to(dt) for _, i in shapes}  # [B, 1, in]

        def run(xs: dict[int, torch.Tensor] = xs) -> None:
            for (_, i), w in zip(shapes, weights, strict=True):
                linear(xs[i], w)  # [B, 1, out]

        out[b] = total / best_time(run, dev, reps, budget_s)
        logger.info(
            "%s weight rate at B=%d: %.2f GB/s%s",
            dtype,
            b,
            out[b] / 1e9,
            " (prepacked)" if packed else "",
        )
    return out


def decode_attention(
    q: torch.Tensor,  # [B*Hkv, g, D]
    cache: torch.Tensor,  # [2, B, Hkv, L, D]
    mask: torch.Tensor,  # [B*Hkv, g, L], 0 / -inf in the cache dtype
) -> torch.Tensor:
    """serving/model/transformer.py's decode attention core (keep the two in step): contiguous
    ``[B*Hkv, L, D]`` views of K and V, the scores GEMM with the scale as its alpha
    and the mask as its addend, softmax of the bf16 scores (computed in fp32,
    rounded once), the second GEMM. Returns ``[B*Hkv, g, D]``."""
    keys, values = cache.unbind(0)  # [B, Hkv, L, D] each
    length, d = keys.shape[-2], keys.shape[-1]
    keys = keys.reshape(-1, length, d)  # [B*Hkv, L, D] (a view)
    values = values.reshape(-1, length, d)  # [B*Hkv, L, D] (a view)
    scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=d**-0.5)  # [B*Hkv, g, L]
    probs = torch.softmax(scores, dim=-1)  # [B*Hkv, g, L]
    return torch.bmm(probs, values)  # [B*Hkv, g, D]


def attention_timer(
    dev: torch.device, dt: torch.dtype, model: ModelSpec, batch: int, context: int
) -> Callable[[torch.Tensor], object]:
    """``run(cache)``: one layer's decode attention at ``batch`` x ``context`` on a cache
    [2, batch, Hkv, context, D], as the engine runs it here (the C kernel of
    serving/kernels/cpu_kernels.py on CPU bf16, with rotary and the cache write, or
    :func:`decode_attention`), each query at position ``context - 1``."""
    m = model
    g, d = m.heads // m.kv_heads, m.head_dim
    kernels = cpu_kernels.for_model(dev, dt, m.heads, m.kv_heads, d)
    if kernels is not None:
        qkv = torch.randn(batch, m.heads + 2 * m.kv_heads, d, device=dev).to(dt)
        tables = filled((context, d), dev, dt)
        pos = torch.full((batch,), context - 1, dtype=torch.long, device=dev)
        slots = torch.arange(batch, device=dev)
        # ``tables`` stands in for the rotary cos and sin tables (only timing matters)
        return lambda c: kernels.decode_attention(
            qkv, c, tables, tables, pos, slots, m.heads, d**-0.5
        )
    q = torch.randn(batch * m.kv_heads, g, d, device=dev).to(dt)  # [B*Hkv, g, D]
    mask = torch.zeros(batch * m.kv_heads, g, context, device=dev, dtype=dt)  # [B*Hkv, g, L]
    return lambda c: decode_attention(q, c, mask)


def filled(shape: tuple[int, ...], dev: torch.device, dt: torch.dtype) -> torch.Tensor:
    """A tensor with every page written (untouched pages read as one shared zero page
    and hide their traffic). A constant: GEMM and softmax times do not depend on the
    values, and ``fill_`` runs at memory speed where ``normal_`` takes seconds per GB."""
    return torch.empty(shape, device=dev, dtype=dt).fill_(0.5)


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

    Runs serving/model/transformer.py's decode attention as the engine does here
    (:func:`attention_timer`: the C kernel on CPU bf16, else :func:`decode_attention`) over a
    cache ``[2, slots, kv_heads, len, head_dim]`` per layer (K, V). Only the shapes
    matter here: the values are a constant.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    d = m.head_dim
    out: dict[int, float] = {}
    for b in batches:
        per_layer = 2 * b * m.kv_heads * context * d * BYTES_PER_ELEM[dtype]
        layers = _layers_within(per_layer, m.layers)
        caches = [filled((2, b, m.kv_heads, context, d), dev, dt) for _ in range(layers)]
        attend = attention_timer(dev, dt, m, b, context)

        def run(caches: list = caches, attend: Callable = attend) -> None:
            for c in caches:
                attend(c)

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

    Runs the rest of serving/model/transformer.py's decode block (keep the two in step) at
    the model's shapes: two fused RMSNorms, rotary on q and k in place (chunk,
    cat, mul, addcmul), the one cache write (``index_put_`` of K and V), the query
    and output reshapes, SwiGLU's activation (the residual adds are fused into
    o_proj and down_proj). At these sizes it is dispatch and small-kernel time,
    the part the bytes miss.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    h, hkv, d = m.heads, m.kv_heads, m.head_dim
    g, q_dim, kv_dim = h // hkv, h * d, hkv * d
    out: dict[int, float] = {}
    layers = 8
    for b in batches:
        x = torch.randn(b, 1, m.hidden, device=dev).to(dt)  # [B, 1, d]
        w = torch.ones(m.hidden, device=dev, dtype=dt)  # [d]
        qkv = torch.randn(b, 1, q_dim + 2 * kv_dim, device=dev).to(dt)  # [B, 1, (H+2Hkv)*D]
        gate_up = torch.randn(b, 1, 2 * m.intermediate, device=dev).to(dt)  # [B, 1, 2I]
        attn = torch.randn(b * hkv, g, d, device=dev).to(dt)  # [B*Hkv, g, D] from the bmm
        cos = torch.randn(b, 1, 1, d, device=dev).to(dt)  # [B, 1, 1, D]
        sin = torch.randn(b, 1, 1, d, device=dev).to(dt)  # [B, 1, 1, D]
        cache = torch.zeros(2, b, hkv, context, d, device=dev, dtype=dt)  # [2, S, Hkv, L, D]
        rows = torch.arange(b * 2 * hkv, device=dev).view(b, 1, 2 * hkv) * context  # [B, 1, 2Hkv]

        def run(
            x: torch.Tensor = x,
            qkv: torch.Tensor = qkv,
            gate_up: torch.Tensor = gate_up,
            attn: torch.Tensor = attn,
            cache: torch.Tensor = cache,
            rows: torch.Tensor = rows,
            cos: torch.Tensor = cos,
            sin: torch.Tensor = sin,
            w: torch.Tensor = w,
            b: int = b,
        ) -> None:
            for _ in range(layers):
                F.rms_norm(x, (m.hidden,), w, 1e-5)
                qk = qkv[..., : q_dim + kv_dim].unflatten(-1, (h + hkv, d))  # [B, 1, H+Hkv, D]
                x1, x2 = qk.chunk(2, dim=-1)
                swapped = torch.cat((x2, x1), dim=-1)
                torch.addcmul(qk * cos, swapped, sin, out=qk)
                kv = qkv[..., q_dim:].unflatten(-1, (2 * hkv, d))  # [B, 1, 2Hkv, D]
                cache.view(-1, d).index_put_((rows,), kv)
                q = qkv[..., :q_dim].unflatten(-1, (h, d))  # [B, 1, H, D]
                q.transpose(1, 2).reshape(b * hkv, g, d)  # [B*Hkv, g, D]
                attn.view(b, h, 1, d).transpose(1, 2).reshape(b, 1, q_dim)  # [B, 1, H*D]
                F.rms_norm(x, (m.hidden,), w, 1e-5)
                gate, up = gate_up.chunk(2, dim=-1)  # [B, 1, I] each
                F.silu(gate) * up

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
    context: int = 256,
) -> dict[int, float]:
    """batch -> seconds per step outside the layers and the lm_head matmul.

    serving/model/transformer.py's prologue and epilogue and serving/engine/executor.py's decode
    (keep in step): the input tensors, embedding lookup, rotary table lookups,
    the cache rows and the additive mask (in the model dtype, one row per query
    row of the grouped GEMM), the final RMSNorm, fp32 logits, a greedy argmax and
    the tokens back to Python.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    hkv = m.kv_heads
    g = m.heads // hkv
    emb = torch.empty(m.vocab, m.hidden, device=dev, dtype=dt).normal_()  # [V, d]
    cos_t = torch.randn(2048, m.head_dim, device=dev).to(dt)  # [P, D]
    sin_t = torch.randn(2048, m.head_dim, device=dev).to(dt)  # [P, D]
    w = torch.ones(m.hidden, device=dev, dtype=dt)  # [d]
    out: dict[int, float] = {}
    for b in batches:
        token_list = [int(t) for t in torch.randint(0, m.vocab, (b,))]
        pos_list = [context - 1] * b
        logits = torch.randn(b, m.vocab, device=dev).to(dt)  # [B, V], as the lm_head gives

        def run(token_list: list = token_list, pos_list: list = pos_list, logits=logits) -> None:
            tokens = torch.tensor(token_list, device=dev)[:, None]  # [B, 1]
            pos = torch.tensor(pos_list, device=dev)[:, None]  # [B, 1]
            slots = torch.arange(len(token_list), device=dev)  # [B]
            x = F.embedding(tokens, emb)  # [B, 1, d]
            cos_t[pos][:, :, None, :]  # cos [B, 1, 1, D]
            sin_t[pos][:, :, None, :]  # sin
            j = torch.arange(2, device=dev)[:, None]  # [2, 1]
            hh = torch.arange(hkv, device=dev)[None, :]  # [1, Hkv]
            base = slots * (hkv * context)  # [B]
            within = (j * len(token_list) * hkv + hh) * context  # [2, Hkv]
            rows = base[:, None, None, None] + within + pos[:, :, None, None]
            rows.flatten(2)  # [B, 1, 2*Hkv]
            key_pos = torch.arange(context, device=dev)  # [L]
            hidden = key_pos > pos[:, None, None, :, None]  # [B, 1, 1, 1, L]
            mask = torch.zeros(hidden.shape, device=dev, dtype=dt).masked_fill_(hidden, -math.inf)
            mask.expand(-1, hkv, g, -1, -1).reshape(-1, g, context)  # [B*Hkv, g, L]
            F.rms_norm(x[:, -1], (m.hidden,), w, 1e-5)  # [B, d]
            logits.float().argmax(dim=-1).tolist()  # [B]

        out[b] = best_time(run, dev, reps, budget_s)
        logger.info("%s step overhead at B=%d: %.1f us", dtype, b, out[b] * 1e6)
    return out
