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
    """On a GPU: graphs (and overlap) give the eager path's tokens, and a decode step makes
    at most one synchronizing call torch's sync debug mode sees (the overlapped step
    waits on an event for the step before it; that wait is not such a call)."""
    import warnings

    outs = []
    for graphs in (False, True):
        eng = _engine(device="cuda", cuda_graphs=graphs, overlap=graphs)
        rids = [eng.add_request(list(range(1, 2 + 7 * i)), max_tokens=20) for i in range(4)]
        done = {}
        for _ in range(3):  # prompts in; decode steps from here
            done |= {f.request_id: f.output_ids for f in eng.step().finished}
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                done |= {f.request_id: f.output_ids for f in eng.step().finished}
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        assert len(syncs) <= 1, [str(w.message) for w in syncs]
        done |= {f.request_id: f.output_ids for f in eng.run_until_idle()}
        outs.append([done[r] for r in rids])
        if graphs:
            assert eng.executor.device_decode.graphs_captured >= 1
    assert outs[0] == outs[1]


def _run(eng: Engine, requests: list[dict]) -> dict[int, tuple[str, list[int], int]]:
    """Add the requests (every other one after a step, joining running decodes) and run
    to the end: index -> (reason, output ids, generated tokens)."""
    ids = {}
    done = []
    streamed: dict[str, list[int]] = {}

    def step() -> None:
        out = eng.step()
        for rid, tok in out.tokens.items():  # never a token after the request's end
            assert rid not in {f.request_id for f in done}, (rid, tok)
            streamed.setdefault(rid, []).append(tok)
        done.extend(out.finished)

    for i, r in enumerate(requests):
        ids[eng.add_request(**r)] = i
        if i % 2:
            step()
    while eng.has_work:
        step()
    assert all(streamed[f.request_id] == list(f.output_ids) for f in done)
    assert eng.stats().generated_tokens == sum(len(f.output_ids) for f in done)
    return {
        ids[f.request_id]: (f.reason, list(f.output_ids), f.timing.generated_tokens) for f in done
    }


def _requests(stops: dict[int, tuple[int, ...]], **extra) -> list[dict]:
    g = torch.Generator().manual_seed(4)
    out = []
    for i, (n, mt) in enumerate(((4, 9), (25, 1), (9, 14), (2, 6), (40, 11), (13, 3))):
        prompt = torch.randint(0, 512, (n,), generator=g).tolist()
        out.append(dict(prompt_ids=prompt, max_tokens=mt, stop_ids=stops.get(i, ())) | extra)
    return out


def test_overlap_finishes_as_the_engine_without_it() -> None:
    """Step N launched before step N-1's tokens are known: stop ids sampled mid-stream,
    as a first token, and as the last token a request may have all end requests exactly
    as the engine that waits for every step (reason, tokens, counts); min_tokens too."""
    plain = _run(_engine(device_decode=True, overlap=False), _requests({}))
    stops = {
        0: (plain[0][1][3],),  # its 4th token: a stop mid-stream
        1: (plain[1][1][0],),  # max_tokens 1 and its only token a stop id
        2: (plain[2][1][0],),  # its first token
        4: (plain[4][1][10],),  # its last allowed token (max_tokens 11)
    }
    for extra in ({}, {"min_tokens": 2}, {"temperature": 0.7}):
        want = _run(_engine(device_decode=True, overlap=False), _requests(stops, **extra))
        eng = _engine(device_decode=True)
        assert eng.overlap
        got = _run(eng, _requests(stops, **extra))
        assert got == want
        if not extra:  # each stops at the first time it samples its stop id
            for i, (stop,) in stops.items():
                at = plain[i][1].index(stop)
                assert want[i] == ("stop", plain[i][1][: at + 1], at + 1)  # the stop id kept


def test_overlap_times_a_token_when_it_reaches_the_host() -> None:
    """A token's time is when its step's draws were waited for, not the earlier update."""
    ticks = iter(range(10_000))
    eng = _engine(device_decode=True, clock=lambda: float(next(ticks)))
    eng.add_request([1, 2, 3], max_tokens=4)
    eng.step()  # launches the prompt's step; its token is not back yet
    (f,) = eng.run_until_idle()
    t = f.timing
    assert t.arrival_s < t.admitted_s < t.first_token_s < t.last_token_s
    assert t.generated_tokens == 4 == len(f.output_ids)


def test_overlap_needs_the_device_path() -> None:
    with pytest.raises(ValueError, match="overlap=True needs the device decode path"):
        _engine(overlap=True)


def test_async_engine_streams_the_overlapped_steps() -> None:
    """The asyncio face over an overlapping engine: the same tokens as the engine without
    overlap, every stream ends, and a consumer that quits mid-stream frees its slot."""
    import asyncio

    from serving.engine.async_engine import AsyncEngine

    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13, 14]]
    ref = _engine(device_decode=True, overlap=False)
    want = [ref.generate(p, max_tokens=7) for p in prompts]
    aeng = AsyncEngine(_engine(device_decode=True))
    finished = []
    aeng.on_finish = finished.append
    aeng.start()
    try:

        async def collect(p):
            return [t async for t in aeng.generate(p, max_tokens=7)]

        async def quitter():
            gen = aeng.generate([5, 6], max_tokens=40, request_id="quitter")
            got = [await gen.__anext__() for _ in range(2)]
            await gen.aclose()
            return got

        async def main():
            return await asyncio.gather(*(collect(p) for p in prompts), quitter())

        outs = asyncio.run(main())
    finally:
        aeng.stop()
    assert outs[:3] == want and len(outs[3]) == 2
    assert sorted(t.generated_tokens for t in finished) == [7, 7, 7]
    s = aeng.stats()
    assert (s.running, s.waiting) == (0, 0)


@pytest.mark.slow
@torch.inference_mode()
def test_flex_attention_reads_each_rows_own_blocks_and_agrees_with_sdpa() -> None:
    """The GPU's attention, compiled on the CPU: each row reads ceil((position + 1) / 128)
    key blocks of its own cache row (a 300-token slot is 3 blocks), and the logits equal
    the SDPA window's."""
    from serving.engine.device_decode import KV_BLOCK

    models = [_model(max_len=300), _model(max_len=300)]
    g = torch.Generator().manual_seed(0)
    for slot, n in ((0, 9), (1, 140), (3, 2)):
        ids = torch.randint(0, 512, (1, n), generator=g)
        for m in models:
            m(ids, torch.arange(n)[None], torch.tensor([slot]))
    entries = [DecodeEntry(request_id=f"r{s}", slot=s, position=p, token=7 + s)
               for s, p in ((0, 9), (1, 140), (3, 2))]  # fmt: skip
    got = {}
    for m, attention in zip(models, ("sdpa", "flex"), strict=True):
        dd = DeviceDecode(m, max_slots=8, max_len=300, generator=torch.Generator(),
                          staging=Staging(torch.device("cpu")), attention=attention)  # fmt: skip
        rows, got[attention] = dd.logits(entries)
    torch.testing.assert_close(got["flex"][[0, 1, 3]], got["sdpa"][[0, 1, 3]])
    (attend,) = dd._attend.values()
    assert attend.kv_num.flatten().tolist() == [1, 2, 1, 1]  # positions 9, 140, (hole: 1), 2
    assert KV_BLOCK == 128


@pytest.mark.slow
def test_engine_with_flex_attention_and_overlap_generates_what_the_cpu_path_does() -> None:
    want = _run(_engine(max_len=256), _requests({}))
    got = _run(_engine(max_len=256, device_decode=True, attention="flex"), _requests({}))
    assert got == want


def test_a_failed_capture_falls_back_to_serving_without_graphs(monkeypatch, caplog) -> None:
    """Where compiling or capturing fails (a GPU, driver or torch this was never run on),
    the replica still serves, on the device path without graphs, and says why."""
    dd = DeviceDecode(_model(), max_slots=8, max_len=128, generator=torch.Generator(),
                      staging=Staging(torch.device("cpu")))  # fmt: skip
    dd.cuda_graphs, dd.attention = True, "flex"  # as on a GPU

    def fail() -> None:
        raise RuntimeError("cannot capture here")

    monkeypatch.setattr(dd, "_capture_all", fail)
    with caplog.at_level("ERROR"):
        assert dd.warm_up() == 0
    assert (dd.cuda_graphs, dd.attention) == (False, "sdpa")
    assert "serving without CUDA graphs" in caplog.text
    rows, logits = dd.logits([DecodeEntry(request_id="a", slot=1, position=5, token=3)])
    assert rows == [None, "a"] and torch.isfinite(logits[1]).all()
