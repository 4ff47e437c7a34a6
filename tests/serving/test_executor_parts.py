"""The executor's host work as the functions the calibration times (decode_inputs, draw).

search/calibrate/step.py times ``decode_inputs``, ``Transformer.prologue``/``logits`` and
``draw`` as the engine's per-step work outside the layers; these tests pin that the
executor is exactly those functions around the layers.
"""

from __future__ import annotations

import torch

from serving.engine.executor import TorchExecutor, decode_inputs, draw
from serving.model.config import ModelConfig
from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry, StepPlan


def _model() -> Transformer:
    m = Transformer.random(ModelConfig.from_name("tiny", dtype="float32"), seed=1)
    m.allocate_cache(8, 32)
    return m


def _entries(slots: list[int]) -> list[DecodeEntry]:
    return [
        DecodeEntry(request_id=f"r{s}", slot=s, position=3 + s, token=10 + s) for s in sorted(slots)
    ]


def test_dense_slots_read_as_a_view_with_dummy_rows_dropped() -> None:
    dev = torch.device("cpu")
    tokens, pos, slots, start, keep = decode_inputs(_entries([2, 3, 5]), 32, dev)
    assert start == 2 and slots.tolist() == [2, 3, 4, 5]
    assert tokens[:, 0].tolist() == [12, 13, 0, 15]
    assert pos[:, 0].tolist() == [5, 6, 31, 8]  # the hole writes at max_len - 1
    assert keep is not None and keep.tolist() == [0, 1, 3]
    tokens, pos, slots, start, keep = decode_inputs(_entries([0, 7]), 32, dev)
    assert start is None and keep is None and slots.tolist() == [0, 7]  # sparse: gathered


def test_executor_is_prologue_layers_logits_and_draw() -> None:
    model = _model()
    ex = TorchExecutor(model=model, device=torch.device("cpu"), max_len=32, seed=0)
    entries = _entries([1, 2, 4])
    temps = {"r1": 0.0, "r2": 0.0, "r4": 0.0}
    got = ex.execute(StepPlan(decode=tuple(entries)), temps)

    model2 = _model()  # a fresh cache: the same writes happen again
    tokens, pos, slots, start, keep = decode_inputs(entries, 32, torch.device("cpu"))
    with torch.inference_mode():
        x, ctx = model2.prologue(tokens, pos, slots, slot_start=start)
        for layer in model2.model.layers:
            x = layer.forward(x, ctx)
        logits = model2.logits(x)  # [span, V]
        assert torch.equal(logits, model2(tokens, pos, slots, slot_start=start))
        logits = logits.index_select(0, keep)  # [B, V]
    want = draw(["r1", "r2", "r4"], logits, temps, torch.Generator().manual_seed(0))
    assert got == want
    assert want == {r: int(t) for r, t in zip(want, logits.argmax(-1).tolist(), strict=True)}
