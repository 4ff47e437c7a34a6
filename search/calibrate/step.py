"""The engine's own decode code at a model's shapes, timed for :mod:`search.calibrate.device`.

Hand-kept mirrors of the serving model drift from it, and time in a tight loop
what a real step pays on cold caches. This module builds the serving model itself
(:meth:`serving.model.transformer.Transformer.for_timing`: real-size random weights, prepacked
as the engine prepacks them) with as many decoder layers as the working-set cap
allows, and times parts of a decode step with the engine's own code:

- :func:`measure_step_in_stream`: everything a step does outside its decoder
  layers, as the executor runs it (serving/engine/executor.py ``decode_inputs``: the
  per-step host work of building the token, position and slot tensors; the
  embedding and the step context: rotary factors, cache rows, mask; the final
  norm, the lm_head, fp32 logits; ``draw``: greedy sampling and the tokens back
  to Python), each call after a read of a buffer twice the last-level cache, as a
  real step reaches its epilogue after streaming the last layer's weights;
- the decoder layers themselves (:mod:`search.calibrate.layer` runs the model's own
  ``Block.forward`` on this model);
- :func:`measure_whole_step`: the whole step, where the timing model is the whole model,
  which the prediction is made to add up to at the calibrated batches.

The calibration decomposes the parts against the rates it measured (weight bytes per
second, KV bytes per second), so the profile predicts other batches, contexts and layer
counts from per-layer and per-step parts.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Sequence

import torch

from search.calibrate.shapes import (
    MAX_WORKING_SET_BYTES,
    TORCH_DTYPES,
    _layers_within,
    _linear_shapes,
    best_time,
    filled,
    sync,
)
from search.roofline.models import ModelSpec
from serving.engine.executor import decode_inputs, draw
from serving.model.config import ModelConfig
from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry

logger = logging.getLogger(__name__)

SERVING_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
EVICT_BYTES = 64 << 20  # read before each timed call: more than any CPU's last-level cache here


def timing_layers(model: ModelSpec, dtype: str) -> int:
    """Decoder layers the timing model holds: all, or as many as fit the working-set cap."""
    bpe = TORCH_DTYPES[dtype].itemsize
    per_layer = sum(o * i for o, i in _linear_shapes(model, bpe)[:4]) * bpe
    return _layers_within(per_layer, model.layers)


def head_fits(model: ModelSpec, dtype: str) -> bool:
    """Whether the embedding and lm_head fit the working-set cap (a big vocabulary of a
    big model does not: its step part is then left to the hot-timed pieces)."""
    return 2 * model.vocab * model.hidden * TORCH_DTYPES[dtype].itemsize <= MAX_WORKING_SET_BYTES


def timing_model(dev: torch.device, dtype: str, model: ModelSpec, context: int) -> Transformer:
    """The serving model at ``model``'s shapes with :func:`timing_layers` layers,
    prepacked and with the C decode-attention kernel where the engine uses them (CPU bf16)."""
    cfg = ModelConfig(
        name=f"timing-{model.name}",
        vocab_size=model.vocab,
        d_model=model.hidden,
        n_layers=timing_layers(model, dtype),
        n_heads=model.heads,
        n_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        intermediate_size=model.intermediate,
        max_position=max(2048, context),
        dtype=SERVING_DTYPES[dtype],
    )
    t = Transformer.for_timing(cfg, device=dev)
    t.use_cpu_kernels()  # first, as the engine does (serving/engine/engine.py)
    t.prepack()
    return t


def best_time_cold(
    fn: Callable[[], object],
    evict: Callable[[], object],
    dev: torch.device,
    reps: int,
    budget_s: float = 0.0,
) -> float:
    """Fastest call of ``fn`` after one warm-up, each call preceded by an untimed
    ``evict()``: at least ``reps`` calls, more (up to 50) while the timed calls took
    less than ``budget_s`` (as :func:`search.calibrate.shapes.best_time`)."""
    fn()
    best, spent, n = math.inf, 0.0, 0
    while n < reps or (spent < budget_s and n < 50):
        evict()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def measure_step_in_stream(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
    *,
    timing: Transformer | None = None,
) -> dict[int, float]:
    """batch -> seconds a decode step spends outside its decoder layers, lm_head included,
    run by the engine's own code on cold caches (see the module docstring). Empty when
    the embedding and lm_head do not fit the working-set cap."""
    if not head_fits(model, dtype):
        return {}
    t = timing or timing_model(dev, dtype, model, context)
    evict_buf = filled((EVICT_BYTES // 4,), dev, torch.float32)  # [N]
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict[int, float] = {}
    for b in batches:
        t.allocate_cache(b, context)
        entries = [
            DecodeEntry(request_id=f"r{i}", slot=i, position=context - 1, token=i % model.vocab)
            for i in range(b)
        ]
        step = _step_outside_layers(t, entries, context, dev, gen)
        out[b] = best_time_cold(step, evict_buf.sum, dev, reps, budget_s)
        logger.info("%s step outside the layers at B=%d: %.2f ms", dtype, b, out[b] * 1e3)
    t.allocate_cache(1, 1)  # drop the last batch's cache
    return out


def measure_whole_step(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
    *,
    timing: Transformer,
) -> dict[int, float]:
    """batch -> seconds of a whole decode step run by the engine's code (the host work, the
    model's forward over all its layers, sampling), each call after a read that evicts
    the caches. The layers and the step outside them are timed apart too
    (:mod:`search.calibrate.layer`, :func:`measure_step_in_stream`); a whole step differs
    from the two added up (~1 ms longer at B=1 on an AVX2 VM), and the calibration moves
    the step overhead by the difference so its prediction adds up to the whole step.
    Empty unless ``timing`` holds all of the model's layers and its embedding and lm_head
    fit the working-set cap."""
    if len(timing.model.layers) != model.layers or not head_fits(model, dtype):
        return {}
    t = timing
    evict_buf = filled((EVICT_BYTES // 4,), dev, torch.float32)  # [N]
    gen = torch.Generator(device=dev).manual_seed(0)
    by_slot = operator.attrgetter("slot")
    out: dict[int, float] = {}
    for b in batches:
        t.allocate_cache(b, context)
        for c in t.caches():  # [2, S, Hkv, L, D]
            c.fill_(0.5)  # every page written: untouched pages read as one shared zero page
        entries = [
            DecodeEntry(request_id=f"r{i}", slot=i, position=context - 1, token=i % model.vocab)
            for i in range(b)
        ]
        rows = [e.request_id for e in entries]
        temps = dict.fromkeys(rows, 0.0)

        def step(entries: list[DecodeEntry] = entries, rows: list = rows, temps: dict = temps):
            ordered = sorted(entries, key=by_slot)
            tokens, pos, slots, start, _ = decode_inputs(ordered, context, dev)
            draw(rows, t(tokens, pos, slots, slot_start=start), temps, gen)  # logits [B, V]

        out[b] = best_time_cold(step, evict_buf.sum, dev, reps, budget_s)
        logger.info("%s whole decode step at B=%d: %.2f ms", dtype, b, out[b] * 1e3)
    t.allocate_cache(1, 1)  # drop the last batch's cache
    return out


def _step_outside_layers(
    t: Transformer,
    entries: list[DecodeEntry],
    context: int,
    dev: torch.device,
    gen: torch.Generator,
) -> Callable[[], None]:
    """One decode step of ``entries`` without its decoder layers, by the engine's code."""
    b = len(entries)
    rows = [e.request_id for e in entries]
    temps = dict.fromkeys(rows, 0.0)
    last = torch.randn(b, 1, t.config.d_model, device=dev).to(t.lm_head.weight.dtype)  # [B, 1, d]
    by_slot = operator.attrgetter("slot")

    def step() -> None:
        ordered = sorted(entries, key=by_slot)
        tokens, pos, slots, start, _ = decode_inputs(ordered, context, dev)
        t.prologue(tokens, pos, slots, slot_start=start)  # ([B, 1, d], the step context)
        # ... the decoder layers (search/calibrate/layer.py) run here, giving ``last`` ...
        draw(rows, t.logits(last), temps, gen)  # logits [B, V] fp32

    return step


def measure_weight_rate_on(
    timing: Transformer,
    model: ModelSpec,
    dtype: str,
    batches: Sequence[int],
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> weight bytes/s the timing model's own linears consume, each run in turn
    (every layer's four, then the lm_head where :func:`head_fits`) with inputs
    ``[B, 1, in]``: :func:`search.calibrate.shapes.measure_weight_rate` on the weights the
    other timings use, prepacked or not as the engine runs them, drawn once."""
    dev = timing.lm_head.weight.device
    dt = timing.lm_head.weight.dtype
    lins = [
        lin
        for layer in timing.model.layers
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    if head_fits(model, dtype):
        lins.append(timing.lm_head)
    total = sum(lin.weight.numel() for lin in lins) * dt.itemsize
    out: dict[int, float] = {}
    for b in batches:
        xs = {i: torch.randn(b, 1, i, device=dev).to(dt) for i in {n.in_features for n in lins}}

        def run(xs: dict[int, torch.Tensor] = xs) -> None:
            for lin in lins:
                lin.forward(xs[lin.in_features])  # [B, 1, out]

        out[b] = total / best_time(run, dev, reps, budget_s)
        logger.info("%s weight rate at B=%d: %.2f GB/s", dtype, b, out[b] / 1e9)
    return out
