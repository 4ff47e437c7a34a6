"""Whole decode layers, timed as serving runs them, for :mod:`search.calibrate.device`.

The pieces of :mod:`search.calibrate.shapes` are timed alone, each in a tight loop
whose small tensors and PyTorch's own dispatch state stay hot in the core's
caches. In a real step the linears stream megabytes of weights between those
small ops and evict all of it, so each small op costs more (measured at B=1,
one thread: a ``small`` forward spent ~3x more CPU outside its linears than the
pieces summed). :func:`measure_layer_in_stream` runs the serving model's own
decoder layers (``Block.forward`` of :func:`search.calibrate.step.timing_model`:
real-size prepacked weights, a filled KV cache, the step context the model
builds; no hand-kept mirror to drift from it), and times the linears alone and
the attention core alone on the same tensors; what the whole layer takes beyond
the two (:func:`layer_residual`) is the per-layer overhead as it really occurs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from search.calibrate.shapes import attention_timer, best_time
from search.calibrate.step import timing_model
from search.roofline.models import ModelSpec
from serving.model.transformer import Transformer

logger = logging.getLogger(__name__)


def measure_layer_in_stream(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
    *,
    timing: Transformer | None = None,
) -> dict[int, tuple[float, float, float]]:
    """batch -> seconds per layer of (the full decode layer, its linears alone, its
    attention core alone), on the same tensors, in the same call. Keep the best of
    each over repeated calls, then take :func:`layer_residual`.

    ``timing``: the serving model to run (:func:`search.calibrate.step.timing_model`;
    built here when None): its own ``Block.forward`` over all its layers, each with a
    filled KV cache of ``batch`` slots, one query token per slot at ``context - 1``."""
    t = timing or timing_model(dev, dtype, model, context)
    out: dict[int, tuple[float, float, float]] = {}
    for b in batches:
        out[b] = _in_stream_at(t, b, dev, model, context, reps, budget_s)
    t.allocate_cache(1, 1)  # drop the last batch's cache
    return out


def layer_residual(full_s: float, linears_s: float, attention_s: float) -> float:
    """Seconds a layer takes beyond its linears and attention (never below 0)."""
    return max(0.0, full_s - linears_s - attention_s)


def _in_stream_at(
    t: Transformer,
    b: int,
    dev: torch.device,
    m: ModelSpec,
    context: int,
    reps: int,
    budget_s: float,
) -> tuple[float, float, float]:
    """Seconds per layer (full, linears, attention) at batch ``b``."""
    dt = t.lm_head.weight.dtype
    layers = list(t.model.layers)
    n = len(layers)
    t.allocate_cache(b, context)
    for c in t.caches():  # [2, S, Hkv, L, D]
        c.fill_(0.5)  # every page written: untouched pages read as one shared zero page
    tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)  # [B, 1]
    pos = torch.full((b, 1), context - 1, dtype=torch.long, device=dev)  # [B, 1]
    slots = torch.arange(b, device=dev)  # [B]
    x0, ctx = t.prologue(tokens, pos, slots, slot_start=0)  # [B, 1, d], the step context
    x0 = torch.randn(x0.shape, device=dev).to(dt)  # [B, 1, d]
    linears = [
        (lin, torch.randn(b, 1, lin.in_features, device=dev).to(dt))  # [B, 1, in]
        for layer in layers
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    attend = attention_timer(dev, dt, m, b, context)  # as the engine runs it here

    def full() -> None:  # Transformer.forward's loop over its layers
        x = x0
        for layer in layers:
            x = layer.forward(x, ctx)

    def linears_only() -> None:
        for lin, x in linears:
            lin.forward(x)

    def attention_only() -> None:
        for layer in layers:
            attend(layer.self_attn.kv_cache.narrow(1, 0, b))

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
