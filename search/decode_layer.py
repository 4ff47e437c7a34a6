"""A whole decode layer, timed the way serving runs it, for :mod:`search.calibrate`.

The pieces of :mod:`search.decode_shapes` are timed alone, each in a tight loop
whose small tensors and PyTorch's own dispatch state stay hot in the core's
caches. In a real step the linears stream megabytes of weights between those
small ops and evict all of it, so each small op costs more (measured at B=1,
one thread: a ``small`` forward spent ~3x more CPU outside its linears than the
pieces summed). :func:`measure_layer_in_stream` runs the layer end to end (the
same ops in the same order as serving/model.py's decode block: keep the two in
step) on real-size, prepacked weights and a filled KV cache, and times the
linears alone and the attention core alone on the same tensors; what the whole
layer takes beyond the two (:func:`layer_residual`) is the per-layer overhead
as it really occurs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from search.decode_shapes import (
    BYTES_PER_ELEM,
    TORCH_DTYPES,
    _layers_within,
    _linear_shapes,
    best_time,
    can_prepack,
    decode_attention,
    filled,
)
from search.models import ModelSpec

logger = logging.getLogger(__name__)


def measure_layer_in_stream(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, tuple[float, float, float]]:
    """batch -> seconds per layer of (the full decode layer, its linears alone, its
    attention core alone), on the same tensors, in the same call. Keep the best of
    each over repeated calls, then take :func:`layer_residual`."""
    dt = TORCH_DTYPES[dtype]
    m = model
    shapes = _linear_shapes(m, BYTES_PER_ELEM[dtype])[:4]  # qkv, o, gate_up, down
    packed = can_prepack(dev, dt)

    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1) if packed else w

    def linear(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T`` (+ ``res``, fused as serving/fused_linear.py's ``add_forward``)."""
        if packed:
            if res is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, res, w, None, "add")
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        if res is not None:
            return torch.addmm(res.flatten(0, -2), x.flatten(0, -2), w.t()).view(res.shape)
        return F.linear(x, w)

    out: dict[int, tuple[float, float, float]] = {}
    for b in batches:
        out[b] = _in_stream_at(b, dev, dt, m, context, reps, budget_s, shapes, pack, linear)
    return out


def layer_residual(full_s: float, linears_s: float, attention_s: float) -> float:
    """Seconds a layer takes beyond its linears and attention (never below 0)."""
    return max(0.0, full_s - linears_s - attention_s)


def _in_stream_at(
    b: int,
    dev: torch.device,
    dt: torch.dtype,
    m: ModelSpec,
    context: int,
    reps: int,
    budget_s: float,
    shapes: list[tuple[int, int]],
    pack: Callable[[torch.Tensor], torch.Tensor],
    linear: Callable[..., torch.Tensor],
) -> tuple[float, float, float]:
    """Seconds per layer (full, linears, attention) at batch ``b``."""
    h, hkv, d, hid = m.heads, m.kv_heads, m.head_dim, m.hidden
    g = h // hkv
    bpe = dt.itemsize
    per_layer_w = sum(o * i for o, i in shapes) * bpe
    per_layer_kv = 2 * b * hkv * context * d * bpe
    n = min(_layers_within(per_layer_w, m.layers), _layers_within(per_layer_kv, m.layers))
    weights = [
        [pack(torch.empty(o, i, device=dev, dtype=dt).normal_(0, 0.02)) for o, i in shapes]
        for _ in range(n)
    ]
    caches = [filled((2, b, hkv, context, d), dev, dt) for _ in range(n)]  # [2, S, Hkv, L, D]
    norm_w = torch.ones(hid, device=dev, dtype=dt)  # [d]
    x0 = torch.randn(b, 1, hid, device=dev).to(dt)  # [B, 1, d]
    cos = torch.randn(b, 1, 1, d, device=dev).to(dt)  # [B, 1, 1, D]
    sin = torch.randn(b, 1, 1, d, device=dev).to(dt)  # [B, 1, 1, D]
    mask = torch.zeros(b * hkv, g, context, device=dev, dtype=dt)  # [B*Hkv, g, L]
    j = torch.arange(2, device=dev)[:, None]  # [2, 1]
    heads = torch.arange(hkv, device=dev)[None, :]  # [1, Hkv]
    slots = torch.arange(b, device=dev)  # [B]
    rows = (slots * hkv * context)[:, None, None, None] + (j * b * hkv + heads) * context
    rows = (rows + context - 1).flatten(2)  # [B, 1, 2*Hkv]: write at the last position
    x_in = {i: torch.randn(b, 1, i, device=dev).to(dt) for _, i in shapes}  # [B, 1, in]
    q0 = torch.randn(b * hkv, g, d, device=dev).to(dt)  # [B*Hkv, g, D]

    def attention(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return decode_attention(q, cache.narrow(1, 0, b), mask)  # [B*Hkv, g, D]

    def full(weights: list = weights, caches: list = caches) -> None:
        res = x0
        for (w_qkv, w_o, w_gu, w_down), cache in zip(weights, caches, strict=True):
            nx = torch.rms_norm(res, (hid,), norm_w, 1e-5)
            qkv = linear(nx, w_qkv).view(b, 1, h + 2 * hkv, d)  # [B, 1, H+2Hkv, D]
            qk = qkv.narrow(2, 0, h + hkv)
            x1, x2 = qk.chunk(2, dim=-1)
            torch.addcmul(qk * cos, torch.cat((x2, x1), dim=-1), sin, out=qk)
            q = qkv.narrow(2, 0, h)  # [B, 1, H, D]
            cache.view(-1, d).index_put_((rows,), qkv.narrow(2, h, 2 * hkv))
            o = attention(q.transpose(1, 2).reshape(b * hkv, g, d), cache)
            o = o.view(b, h, 1, d).transpose(1, 2).reshape(b, 1, h * d)  # [B, 1, H*D]
            res = linear(o, w_o, res)
            nx = torch.rms_norm(res, (hid,), norm_w, 1e-5)
            gate, up = linear(nx, w_gu).chunk(2, dim=-1)  # [B, 1, I] each
            res = linear(F.silu(gate) * up, w_down, res)

    def linears_only(weights: list = weights) -> None:
        for layer in weights:
            for (_, i), w in zip(shapes, layer, strict=True):
                linear(x_in[i], w)

    def attention_only(caches: list = caches) -> None:
        for cache in caches:
            attention(q0, cache)

    t_full = best_time(full, dev, reps, budget_s)
    t_lin = best_time(linears_only, dev, reps, budget_s)
    t_attn = best_time(attention_only, dev, reps, budget_s)
    resid = layer_residual(t_full, t_lin, t_attn) / n
    logger.info(
        "%s layer in stream at B=%d: full %.2f ms, linears %.2f, attention %.2f: "
        "%.1f us a layer beyond them",
        dt,
        b,
        t_full * 1e3,
        t_lin * 1e3,
        t_attn * 1e3,
        resid * 1e6,
    )
    return t_full / n, t_lin / n, t_attn / n
