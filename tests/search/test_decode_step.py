"""The calibration's timing model is the serving model at the reference model's shapes.

search/calibrate/step.py times the engine's own code (layers, host work, head, sampling)
on a serving ``Transformer`` built from a ``ModelSpec``. No timing assertions: the
figures vary with the machine and its load; these check the shapes, the wiring and
that every figure is measured.
"""

from __future__ import annotations

import math

import torch

from search.calibrate.layer import measure_layer_in_stream
from search.calibrate.shapes import _linear_shapes
from search.calibrate.step import (
    head_fits,
    measure_step_in_stream,
    measure_weight_rate_on,
    timing_layers,
    timing_model,
)
from search.roofline.models import ModelSpec
from serving.model.linear import Linear

TINY = ModelSpec.from_name("slotune-tiny")
CPU = torch.device("cpu")


def test_timing_model_has_the_reference_shapes_and_runs_its_linears_as_the_engine() -> None:
    t = timing_model(CPU, "bf16", TINY, 32)
    ours = [tuple(lin.weight.shape) for lin in t.modules() if isinstance(lin, Linear)]
    assert ours == _linear_shapes(TINY)  # what the roofline divides by the weight rate
    assert t.config.n_layers == timing_layers(TINY, "bf16") == TINY.layers
    assert t.lm_head.weight.dtype == torch.bfloat16
    assert (t.lm_head.packed is not None) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert all(torch.isfinite(p).all() for p in t.parameters())


def test_step_and_layer_timings_measure_every_batch() -> None:
    t = timing_model(CPU, "fp32", TINY, 32)
    steps = measure_step_in_stream(CPU, "fp32", TINY, [1, 4], 32, reps=2, timing=t)
    assert set(steps) == {1, 4} and all(v > 0 and math.isfinite(v) for v in steps.values())
    layers = measure_layer_in_stream(CPU, "fp32", TINY, [1, 4], 32, reps=2, timing=t)
    assert set(layers) == {1, 4}
    for full, lin, attn in layers.values():
        assert full > 0 and lin > 0 and attn > 0
    rates = measure_weight_rate_on(t, TINY, "fp32", [1, 4], reps=2)
    assert set(rates) == {1, 4} and all(r > 0 for r in rates.values())
    assert t.max_slots == 1  # the last batch's cache is dropped


def test_a_head_beyond_the_working_set_is_left_to_the_hot_pieces() -> None:
    big = ModelSpec.from_name("llama-3.1-8b")  # 128k x 4096 embedding and lm_head: 2 GB
    assert head_fits(TINY, "bf16") and not head_fits(big, "bf16")
    assert measure_step_in_stream(CPU, "bf16", big, [1], 32, reps=1) == {}
