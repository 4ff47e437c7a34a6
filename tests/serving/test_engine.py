"""The engine: exactness against recomputation, live batch limit, abort, timings, async."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

import serving.engine.executor as executor_mod
from serving.engine.async_engine import AsyncEngine
from serving.engine.engine import Engine
from serving.model.config import ModelConfig

TINY32 = ModelConfig.from_name("tiny", dtype="float32")


def make_engine(**kw) -> Engine:
    args = {
        "model_config": TINY32,
        "max_slots": 4,
        "max_batch_size": 3,
        "max_len": 48,
        "prefill_chunk": 5,
        "num_threads": 1,
    } | kw
    return Engine(**args)


@torch.inference_mode()
def greedy_reference(eng: Engine, prompt: list[int], n: int) -> list[int]:
    """Full recomputation without a cache, one token at a time."""
    seq = list(prompt)
    for _ in range(n):
        t = torch.tensor([seq])
        logits = eng.model(t, torch.arange(len(seq))[None])  # no slots: no cache
        seq.append(int(logits[0].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("dense_span", [executor_mod.DENSE_SPAN, 0.0])  # view path; gather path
def test_batched_cached_greedy_equals_full_recompute(monkeypatch, dense_span) -> None:
    monkeypatch.setattr(executor_mod, "DENSE_SPAN", dense_span)
    eng = make_engine()
    g = torch.Generator().manual_seed(11)
    # (join at step, prompt length, max_tokens): different lengths, joining at
    # different steps, more than the batch limit, prompts longer than a chunk.
    plan = [(0, 3, 9), (0, 12, 4), (1, 7, 12), (3, 1, 6), (4, 9, 8), (6, 17, 5), (9, 2, 7)]
    prompts = {
        f"r{i}": torch.randint(0, 512, (n,), generator=g).tolist()
        for i, (_, n, _) in enumerate(plan)
    }
    outputs: dict[str, list[int]] = {}
    batches = []
    for step in itertools.count():
        for i, (at, _, mt) in enumerate(plan):
            if at == step:
                eng.add_request(prompts[f"r{i}"], max_tokens=mt, request_id=f"r{i}")
        if step > max(p[0] for p in plan) and not eng.has_work:
            break
        out = eng.step()
        batches.append(out.plan.decode_batch)
        for f in out.finished:
            outputs[f.request_id] = list(f.output_ids)
        assert step < 200
    assert max(batches) == 3  # requests really ran batched
    assert len(outputs) == len(plan)
    for i, (_, _, mt) in enumerate(plan):
        rid = f"r{i}"
        assert outputs[rid] == greedy_reference(eng, prompts[rid], mt), rid


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "needle"),
    [
        ([], 4, "prompt: must not be empty"),
        ([1, 2], -1, "max_tokens=-1"),
        ([1, 2], 2.5, "max_tokens=2.5"),
        ([1, 2], "4", "max_tokens='4'"),
        ([1, 2], None, "max_tokens=None"),
        ([1] * 40, 9, "exceeds the context length 48"),
        ([1, 512], 4, "prompt token 512"),
        ([1, -3], 4, "prompt token -3"),
        ([1, "a"], 4, "prompt token 'a'"),
    ],
)
def test_bad_input_is_refused_and_harms_nothing(prompt, max_tokens, needle) -> None:
    eng = make_engine()
    eng.add_request([5, 6, 7], max_tokens=3, request_id="ok")
    eng.step()
    with pytest.raises(ValueError, match=needle):
        eng.add_request(prompt, max_tokens=max_tokens)
    with pytest.raises(ValueError, match=needle):
        eng.validate(prompt, max_tokens)
    s = eng.stats()
    assert (s.running, s.waiting) == (1, 0)
    done = eng.run_until_idle()
    assert [f.request_id for f in done] == ["ok"] and len(done[0].output_ids) == 3


def test_bad_temperature_refused() -> None:
    with pytest.raises(ValueError, match="temperature=-1"):
        make_engine().add_request([1], max_tokens=1, temperature=-1)


def test_abort_frees_slot_at_once() -> None:
    eng = make_engine(max_slots=2, max_batch_size=2)
    eng.add_request([1, 2], max_tokens=20, request_id="a")
    eng.add_request([3, 4], max_tokens=20, request_id="b")
    eng.add_request([5], max_tokens=2, request_id="c")
    eng.step()
    assert eng.stats().kv_usage == 1.0 and eng.stats().waiting == 1
    assert eng.abort("a") is True
    assert eng.stats().kv_usage == 0.5  # before any further step
    out = eng.step()
    assert [c.request_id for c in out.plan.prefill] == ["c"]
    assert "a" not in out.tokens


def test_shrinking_batch_keeps_in_flight_requests() -> None:
    eng = make_engine(max_slots=4, max_batch_size=4, prefill_chunk=64)
    for i in range(4):
        eng.add_request([i + 1, 2, 3], max_tokens=6, request_id=f"r{i}")
    eng.step()
    eng.set_max_batch_size(1)
    eng.add_request([9, 9], max_tokens=2, request_id="late")
    out = eng.step()
    assert out.plan.decode_batch == 4 and eng.stats().waiting == 1
    done = {f.request_id: len(f.output_ids) for f in eng.run_until_idle()}
    assert done == {"r0": 6, "r1": 6, "r2": 6, "r3": 6, "late": 2}
    with pytest.raises(ValueError, match="max_batch_size=9"):
        eng.set_max_batch_size(9)


def test_timings_from_the_clock() -> None:
    ticks = itertools.count()
    eng = make_engine(clock=lambda: float(next(ticks)))
    eng.add_request([1, 2, 3], max_tokens=4, request_id="a")  # arrival: tick 0
    (f,) = eng.run_until_idle()
    t = f.timing
    # step k reads the clock at schedule (2k+1) and at update (2k+2)
    assert (t.arrival_s, t.admitted_s, t.first_token_s, t.last_token_s) == (0, 1, 2, 8)
    assert t.ttft_s == 2 and t.queue_wait_s == 1 and t.tpot_s == pytest.approx(6 / 3)
    assert (t.prompt_tokens, t.generated_tokens) == (3, 4)


def test_temperature_sampling_is_seeded() -> None:
    def run(seed):
        return make_engine(seed=seed).generate([1, 2, 3], max_tokens=12, temperature=1.5)

    assert run(3) == run(3)
    greedy = make_engine().generate([1, 2, 3], max_tokens=12)
    assert run(3) != greedy


def test_engine_loads_a_checkpoint(tmp_path) -> None:
    from serving.model.checkpoint import save_checkpoint

    src = make_engine(seed=5)
    save_checkpoint(src.model, tmp_path / "ckpt")
    eng = Engine(checkpoint=str(tmp_path / "ckpt"), max_slots=2, max_batch_size=2, max_len=48)
    assert eng.config.n_layers == TINY32.n_layers
    assert eng.generate([4, 5, 6], max_tokens=5) == src.generate([4, 5, 6], max_tokens=5)


def test_engine_needs_a_model() -> None:
    with pytest.raises(ValueError, match="model_config, checkpoint or model"):
        Engine(max_slots=1, max_batch_size=1)


def test_cuda_refused_when_absent() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ValueError, match="device='cuda'"):
        make_engine(device="cuda")


@pytest.mark.gpu
def test_same_path_on_cuda() -> None:
    cpu = make_engine(seed=2)
    gpu = make_engine(seed=2, device="cuda")
    assert gpu.generate([1, 2, 3], max_tokens=6) == cpu.generate([1, 2, 3], max_tokens=6)


# ---- AsyncEngine ---------------------------------------------------------------


@pytest.fixture
def async_engine():
    eng = AsyncEngine(make_engine(max_slots=3, max_batch_size=3))
    finished = []
    eng.on_finish = finished.append
    eng.start()
    yield eng, finished
    eng.stop()


def test_async_streams_the_same_tokens(async_engine) -> None:
    aeng, finished = async_engine
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13, 14]]

    async def collect(p):
        return [t async for t in aeng.generate(p, max_tokens=6)]

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    outs = asyncio.run(main())
    for p, out in zip(prompts, outs, strict=True):
        assert out == greedy_reference(aeng.engine, p, 6)
    assert sorted(t.generated_tokens for t in finished) == [6, 6, 6]
    assert all(t.ttft_s >= t.queue_wait_s >= 0 for t in finished)


def test_async_consumer_that_stops_frees_its_slot(async_engine) -> None:
    aeng, finished = async_engine

    async def main():
        gen = aeng.generate([1, 2, 3], max_tokens=40, request_id="quitter")
        got = [await gen.__anext__() for _ in range(2)]
        assert aeng.engine.stats().running == 1
        await gen.aclose()  # what a disconnecting HTTP client triggers
        return got

    assert len(asyncio.run(main())) == 2
    s = aeng.stats()
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)  # freed without another step
    assert finished == []  # aborted requests are not reported as finished


def test_async_cancelled_task_aborts(async_engine) -> None:
    aeng, _ = async_engine

    async def consume():
        async for _ in aeng.generate([4, 5], max_tokens=40):
            await asyncio.sleep(0)

    async def main():
        task = asyncio.create_task(consume())
        while aeng.engine.stats().running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert aeng.stats().running == 0


def test_async_validation_error_before_any_token(async_engine) -> None:
    aeng, _ = async_engine
    with pytest.raises(ValueError, match="max_tokens=-2"):
        aeng.validate([1, 2], -2)

    async def main():
        return [t async for t in aeng.generate([], max_tokens=3)]

    with pytest.raises(ValueError, match="must not be empty"):
        asyncio.run(main())
    assert aeng.stats().running == 0


def test_async_many_streams_with_cancellations_leak_nothing(async_engine) -> None:
    aeng, finished = async_engine
    n = 12

    async def one(i):
        got = []
        # A client that leaves after 2 tokens asks for 40, so its request cannot finish
        # in the moment between its second token and its cancellation (with 3 it could,
        # on a fast step, and then counted as finished).
        leaves = i % 3 == 0
        async for t in aeng.generate([i + 1, 2], max_tokens=40 if leaves else 3 + i % 4):
            got.append(t)
            if i % 3 == 0 and len(got) == 2:
                break  # a client that leaves early
        return got

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        assert len(out) == (2 if i % 3 == 0 else 3 + i % 4)
    s = aeng.stats()
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)
    assert len(finished) == n - len(range(0, n, 3))


def test_async_chunks_hand_over_a_backlog_at_once(async_engine) -> None:
    aeng, finished = async_engine
    prompt = [3, 1, 4]

    async def main():
        gen = aeng.generate_chunks(prompt, max_tokens=8)
        first = await gen.__anext__()  # the request is queued on the first pull
        while not finished:  # the engine runs on while this consumer is away
            await asyncio.sleep(0.005)
        rest = [c async for c in gen]
        return first, rest

    first, rest = asyncio.run(main())
    assert len(rest) == 1  # everything sampled meanwhile came as one chunk
    assert first + rest[0] == greedy_reference(aeng.engine, prompt, 8)
    assert finished[0].generated_tokens == 8  # the engine's timings saw every token


def test_async_wakes_each_loop_once_per_step_not_once_per_token(async_engine) -> None:
    aeng, _ = async_engine
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11]]
    calls = [0]

    async def collect(p):
        return [t async for t in aeng.generate(p, max_tokens=10)]

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(*a, **kw):
            calls[0] += 1
            return real(*a, **kw)

        loop.call_soon_threadsafe = counting
        steps0 = aeng.stats().steps
        outs = await asyncio.gather(*(collect(p) for p in prompts))
        return outs, aeng.stats().steps - steps0

    outs, steps = asyncio.run(main())
    tokens = sum(map(len, outs))
    assert tokens == 30
    assert calls[0] <= steps  # one hand-over per step (tokens and stream ends together)
    assert calls[0] < tokens
