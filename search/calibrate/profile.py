"""The decode profile a calibration's measurements add up to (:mod:`search.calibrate.device`
measures; this turns its tables into the :class:`DecodeProfile` the roofline reads).

The rates are smoothed so a larger batch is never predicted faster; where whole layers
and whole steps were timed, the weight rate and the overheads are set so the prediction
adds up to them at those batches (the parts timed apart, each the best of its own tries,
sum differently from the whole).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from search.calibrate.layer import layer_residual
from search.calibrate.shapes import _linear_shapes
from search.roofline.hardware import BYTES_PER_ELEM
from search.roofline.models import ModelSpec
from search.roofline.profile import DecodeProfile


def monotone_rates(
    table: dict[int, float], work: Callable[[int], float] | None
) -> dict[int, float]:
    """Make the time of a point never fall as the batch grows (more work is never
    faster): a time above a later one was disturbed, so it takes the later one.

    ``table``: batch -> rate of ``work(batch)`` units per second, or (``work`` None)
    batch -> seconds.
    """
    keys = sorted(table)
    times = {b: (table[b] if work is None else work(b) / table[b]) for b in keys}
    for lo, hi in zip(reversed(keys[:-1]), reversed(keys[1:]), strict=True):
        times[lo] = min(times[lo], times[hi])
    return {b: (times[b] if work is None else work(b) / times[b]) for b in keys}


def _layer_bytes(model: ModelSpec, dtype: str, context: int) -> tuple[int, int]:
    """(weight bytes of one decoder layer's linears, KV bytes one sequence's attention
    reads in one layer at ``context``): what the roofline divides by the rates."""
    m, bpe = model, BYTES_PER_ELEM[dtype]
    weights = sum(o * i for o, i in _linear_shapes(m, bpe)[:4]) * bpe
    return weights, 2 * m.kv_heads * m.head_dim * context * bpe


def _head_bytes(model: ModelSpec, dtype: str) -> int:
    """Bytes of the lm_head's weight: what the roofline divides by the weight rate."""
    return model.embedding_params * BYTES_PER_ELEM[dtype]


def _profile_step_s(
    prof: DecodeProfile, model: ModelSpec, lw: int, lkv: int, head_bytes: int, b: int
) -> float:
    """The step time a profile predicts at batch ``b`` (tp=1, the calibrated context), added
    up as search/roofline/curve.py adds it: the layers' linears, attention and overhead, the
    lm_head, the step overhead."""
    layer = lw / prof.weight_rate_at(b) + b * lkv / prof.kv_rate_at(b) + prof.layer_overhead_at(b)
    return model.layers * layer + head_bytes / prof.weight_rate_at(b) + prof.step_overhead_at(b)


def assemble_profile(
    model: ModelSpec,
    dtype: str,
    context: int,
    wr: dict[int, float],
    kr: dict[int, float],
    ov: dict[int, float],
    so: dict[int, float],
    layer_full: Mapping[int, float],
    step_stream: Mapping[int, float],
    whole: Mapping[int, float],
) -> tuple[DecodeProfile, dict[str, dict[int, float]]]:
    """The profile of one dtype from the best of each measured table (batch -> value):
    ``wr`` weight bytes/s of the linears one by one, ``kr`` KV bytes/s of attention, ``ov``
    and ``so`` a layer's and a step's pieces outside them timed hot, ``layer_full`` whole
    layers, ``step_stream`` the step outside the layers, ``whole`` whole steps (empty where
    not timed). Returns (the profile, the raw tables for the calibration's record)."""
    rates = DecodeProfile(
        weight_rate=monotone_rates(wr, lambda b: 1.0), kv_rate=monotone_rates(kr, float)
    )
    lw, lkv = _layer_bytes(model, dtype, context)
    # A layer that runs faster whole than its linears called one by one plus its
    # attention and the hot overhead (the whole-layer C call at the GEMV's batches:
    # one thread team, no return to Python between its four linears) streams its
    # weights faster than the linears timed alone: there the profile takes the
    # weight rate the whole layer implies, so the prediction adds up to it.
    fused = dict(wr)
    for b, full in layer_full.items():
        spare = full - b * lkv / rates.kv_rate_at(b) - ov.get(b, 0.0)
        if spare > 0 and lw / spare > rates.weight_rate_at(b):
            fused[b] = lw / spare
    if fused != wr:
        rates = DecodeProfile(
            weight_rate=monotone_rates(fused, lambda b: 1.0), kv_rate=rates.kv_rate
        )
    # A layer's overhead as a real step pays it (cold caches between the
    # linears): the whole mirrored layer beyond its linears and attention as
    # the profile's own rates time them, so the prediction at these batches
    # adds up to the layer measured whole (residuals against the pieces
    # timed alone, each the best of its own tries, summed too low). Never
    # below the pieces timed hot.
    rs = {
        b: layer_residual(full, lw / rates.weight_rate_at(b), b * lkv / rates.kv_rate_at(b))
        for b, full in layer_full.items()
    }
    # The same for the step outside the layers (the engine's host work, embedding,
    # step context, final norm, lm_head, logits, sampling: search/calibrate/step.py):
    # what it takes beyond the lm_head's weight bytes at the profile's rate.
    hw_bytes = _head_bytes(model, dtype)
    srs = {
        b: max(0.0, full - hw_bytes / rates.weight_rate_at(b)) for b, full in step_stream.items()
    }
    raw: dict[str, dict[int, float]] = {
        "weight_rate": wr,
        "weight_rate_whole_layer": {b: r for b, r in fused.items() if r != wr.get(b)},
        "kv_rate": kr,
        "layer_s": ov,
        "step_s": so,
        "layer_residual_s": rs,
        "layer_full_s": dict(layer_full),
        "step_residual_s": srs,
        "step_full_s": dict(step_stream),
    }
    ov = {b: max(ov[b], rs.get(b, 0.0)) for b in ov}
    so = {b: max(so[b], srs.get(b, 0.0)) for b in so}
    prof = DecodeProfile(
        weight_rate=rates.weight_rate,
        kv_rate=rates.kv_rate,
        layer_overhead_s=monotone_rates(ov, None),
        step_overhead_s=monotone_rates(so, None),
    )
    # A whole step, where it was timed, is what the prediction adds up to there: its
    # layers and the step outside them timed apart, each the best of its own
    # tries, summed ~1 ms low at B=1 on an AVX2 VM, and the difference either way
    # moves the step overhead (never below the step's pieces timed hot).
    beyond = {
        b: full - _profile_step_s(prof, model, lw, lkv, hw_bytes, b) for b, full in whole.items()
    }
    raw["step_whole_s"] = dict(whole)
    raw["step_beyond_s"] = beyond
    if beyond:
        hot = raw["step_s"]
        so = {b: max(hot[b], prof.step_overhead_at(b) + beyond.get(b, 0.0)) for b in so}
        prof = dataclasses.replace(prof, step_overhead_s=monotone_rates(so, None))
    return prof, raw
