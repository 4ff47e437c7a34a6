"""The device decode path (serving/engine/device_decode.py) and batched prefill, on the CPU.

CUDA graphs need a GPU: the tests marked ``gpu`` capture them and are skipped here. All
else runs on the CPU, where the path is the same code without the capture: fixed
(batch, window) buckets over slots 0..B-1, SDPA over a cache window with per-row masks,
inputs through :class:`Staging`, prefill chunks of a step in one forward.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine.device_decode import DeviceDecode, Staging, batch_buckets, window_buckets
from serving.engine.engine import Engine
from serving.engine.executor import TorchExecutor
from serving.model.config import ModelConfig
from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry, PrefillChunk

TINY32 = ModelConfig.from_name("tiny", dtype="float32")


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert window_buckets(64) == [64]
    assert window_buckets(512) == [64, 96, 128, 192, 256, 384, 512]
    assert window_buckets(300) == [64, 96, 128, 192, 256, 300]


def _model(max_slots: int = 8, max_len: int = 128) -> Transformer:
    m = Transformer.random(TINY32, seed=3)
    m.allocate_cache(max_slots, max_len)
    return m


def test_shape_covers_the_highest_slot_and_the_longest_request() -> None:
    m = _model()
    dd = DeviceDecode(m, max_slots=8, max_len=128, generator=torch.Generator(),
                      staging=Staging(torch.device("cpu")))  # fmt: skip
    e = [DecodeEntry(request_id="a", slot=0, position=10, token=1),
         DecodeEntry(request_id="b", slot=4, position=70, token=2)]  # fmt: skip
    assert dd.shape_for(e) == (8, 96)
    rows, logits = dd.logits(e)
    assert rows == ["a", None, None, None, "b", None, None, None] and logits.shape == (8, 512)
    with pytest.raises(ValueError, match="cuda_graphs=True: the model is on cpu"):
        DeviceDecode(m, max_slots=8, max_len=128, generator=torch.Generator(),
                     staging=Staging(torch.device("cpu")), cuda_graphs=True)  # fmt: skip


@torch.inference_mode()
def test_window_step_equals_the_full_row_step() -> None:
    """Mixed positions, a hole among the slots: the same logits as the masked full-row
    forward the CPU path runs, and the same K/V written."""
    ref, dev = _model(), _model()
    g = torch.Generator().manual_seed(0)
    for slot, n in ((0, 9), (1, 40), (3, 2)):
        ids = torch.randint(0, 512, (1, n), generator=g)
        for m in (ref, dev):
            m(ids, torch.arange(n)[None], torch.tensor([slot]))
    entries = [DecodeEntry(request_id=f"r{s}", slot=s, position=p, token=7 + s)
               for s, p in ((0, 9), (1, 40), (3, 2))]  # fmt: skip
    want = ref(
        torch.tensor([[e.token] for e in entries]),
        torch.tensor([[e.position] for e in entries]),
        torch.tensor([e.slot for e in entries]),
    )
    dd = DeviceDecode(dev, max_slots=8, max_len=128, generator=torch.Generator(),
                      staging=Staging(torch.device("cpu")))  # fmt: skip
    rows, got = dd.logits(entries)
    torch.testing.assert_close(got[[0, 1, 3]], want, atol=1e-5, rtol=1e-5)
    for a, b in zip(ref.caches(), dev.caches(), strict=True):  # the hole's write is unread
        torch.testing.assert_close(a[:, [0, 1, 3], :, :127], b[:, [0, 1, 3], :, :127])


@torch.inference_mode()
def test_batched_prefill_equals_one_chunk_at_a_time() -> None:
    chunk = PrefillChunk
    chunks = [
        chunk(request_id="a", slot=2, start=0, length=5, last=True, token_ids=(1, 2, 3, 4, 6)),
        chunk(request_id="b", slot=0, start=4, length=3, last=False, token_ids=(9, 8, 7)),
        chunk(request_id="c", slot=5, start=0, length=1, last=True, token_ids=(42,)),
    ]
    one, many = _model(), _model()
    ex = TorchExecutor(model=many, device=torch.device("cpu"), max_len=128, device_decode=True)
    rows, got = ex._prefill(chunks)
    assert rows == ["a", None, "c"]
    for i, c in enumerate(chunks):
        want = one(
            torch.tensor([c.token_ids]),
            torch.arange(c.start, c.start + c.length)[None],
            torch.tensor([c.slot]),
        )[0]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)
    for a, b in zip(one.caches(), many.caches(), strict=True):  # pads write only at max_len-1
        torch.testing.assert_close(a[..., :127, :], b[..., :127, :])


def _engine(**kw) -> Engine:
    args = dict(model_config=TINY32, max_slots=6, max_batch_size=6, max_len=96,
                prefill_chunk=7, num_threads=1, seed=5)  # fmt: skip
    return Engine(**(args | kw))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_on_the_device_path_generates_what_the_cpu_path_does(temperature) -> None:
    """Six concurrent requests of mixed lengths, with a stop id, arriving while others
    decode: token for token the CPU path's output (sampling from the same generator)."""
    outs = []
    for device_decode in (False, True):
        eng = _engine(device_decode=device_decode)
        g = torch.Generator().manual_seed(1)
        ids = {}
        for i, n in enumerate((3, 30, 11, 1, 17, 50)):
            prompt = torch.randint(0, 512, (n,), generator=g).tolist()
            ids[eng.add_request(prompt, max_tokens=12 + i, temperature=temperature,
                                stop_ids=(13,) if i == 2 else ())] = i  # fmt: skip
            if i % 2:
                eng.step()  # later arrivals join running decodes
        done = eng.run_until_idle()
        outs.append({ids[f.request_id]: list(f.output_ids) for f in done})
        assert (eng.executor.device_decode is not None) == device_decode
    assert outs[0] == outs[1] and len(outs[0]) == 6


@pytest.mark.gpu
def test_cuda_graphs_replay_what_eager_runs_with_one_sync_a_step() -> None:
    outs = []
    for graphs in (False, True):
        eng = _engine(device="cuda", cuda_graphs=graphs)
        rids = [eng.add_request(list(range(1, 2 + 7 * i)), max_tokens=20) for i in range(4)]
        eng.step()
        eng.step()  # prompts in; decode steps from here
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning) as seen:
                eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if graphs:
            assert len([w for w in seen if "synchroniz" in str(w.message)]) == 1
        done = {f.request_id: f.output_ids for f in eng.run_until_idle()}
        outs.append([done[r] for r in rids])
        if graphs:
            assert eng.executor.device_decode.graphs_captured >= 1
    assert outs[0] == outs[1]
