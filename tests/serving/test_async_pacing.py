"""AsyncEngine's stream pacing: the engine thread holds tokens back per stream.

The first token is handed over at once, then at most one hand-over per
``flush_interval_s``, and the end at once with everything held. The clock the
pacing reads is a step counter here (10 ms per step), so the expected hand-overs
are exact whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading

import pytest

from serving.engine.async_engine import _DONE, AsyncEngine, _Stream
from tests.serving.test_engine import greedy_reference, make_engine

STEP_S = 0.01  # what the fake clock advances per engine step


def step_clock():
    """A clock that advances STEP_S each time the engine thread reads it (once a step)."""
    ticks = itertools.count()
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return next(ticks) * STEP_S

    return clock


@pytest.fixture
def paced():
    eng = AsyncEngine(make_engine(max_slots=3, max_batch_size=3), pace_clock=step_clock())
    finished = []
    eng.on_finish = finished.append
    eng.start()
    yield eng, finished
    eng.stop()


def run_counting(coro_fn):
    """Run ``coro_fn()``; also return every hand-over to the loop: per call, a list of
    (stream, items) pairs."""
    handovers: list[list[tuple[object, list[object]]]] = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(fn, batch, *a, **kw):
            handovers.append([(stream, list(items)) for stream, items in batch])
            return real(fn, batch, *a, **kw)

        loop.call_soon_threadsafe = counting
        return await coro_fn()

    return asyncio.run(main()), handovers


def test_first_token_at_once_then_one_hand_over_per_interval_and_end_at_once(paced) -> None:
    aeng, finished = paced
    prompt = [1, 2, 3]

    async def collect():
        gen = aeng.generate_chunks(prompt, max_tokens=8, flush_interval_s=0.025)
        return [c async for c in gen]

    chunks, handovers = run_counting(collect)
    tokens = [t for c in chunks for t in c]
    assert tokens == greedy_reference(aeng.engine, prompt, 8)  # nothing lost or reordered
    sizes = [[len(items) for _, items in call] for call in handovers]
    # Steps 10 ms apart, 25 ms interval: token 1 at once; tokens 2-4 together 30 ms
    # later, 5-7 30 ms after that; token 8 with the end, at once.
    assert sizes == [[1], [3], [3], [2]]
    assert handovers[-1][0][1][-1] is _DONE
    assert finished[0].generated_tokens == 8  # server-side timings saw every token


def test_no_interval_hands_over_every_step(paced) -> None:
    aeng, _ = paced

    async def collect():
        return [c async for c in aeng.generate_chunks([4, 5], max_tokens=5)]

    chunks, handovers = run_counting(collect)
    assert sum(map(len, chunks)) == 5
    sizes = [[len(items) for _, items in call] for call in handovers]
    assert sizes == [[1], [1], [1], [1], [1, 1]]  # the last token, then the end


def test_infinite_interval_wakes_the_consumer_for_the_first_token_and_the_end(paced) -> None:
    aeng, _ = paced
    prompt = [9, 8, 7]

    async def collect():
        gen = aeng.generate_chunks(prompt, max_tokens=10, flush_interval_s=math.inf)
        return [c async for c in gen]

    chunks, handovers = run_counting(collect)
    assert len(handovers) == 2
    assert [t for c in chunks for t in c] == greedy_reference(aeng.engine, prompt, 10)


def test_streams_are_paced_each_on_its_own_interval(paced) -> None:
    aeng, _ = paced

    async def collect(p, interval):
        gen = aeng.generate_chunks(p, max_tokens=6, flush_interval_s=interval)
        return [t async for c in gen for t in c]

    async def both():
        return await asyncio.gather(collect([1, 2], 0.0), collect([3, 4], math.inf))

    (a, b), handovers = run_counting(both)
    assert a == greedy_reference(aeng.engine, [1, 2], 6)
    assert b == greedy_reference(aeng.engine, [3, 4], 6)
    per_stream: dict[int, int] = {}
    for call in handovers:
        for stream, _ in call:
            per_stream[id(stream)] = per_stream.get(id(stream), 0) + 1
    # The unpaced stream: one per token and the end (7); the paced one: first and end.
    assert sorted(per_stream.values()) == [2, 7]


def test_a_consumer_that_leaves_with_tokens_held_frees_its_slot(paced) -> None:
    aeng, finished = paced

    async def main():
        gen = aeng.generate_chunks([1, 2, 3], max_tokens=40, flush_interval_s=math.inf)
        first = await gen.__anext__()
        while aeng.engine.stats().steps < 5:  # the engine holds tokens meanwhile
            await asyncio.sleep(0.005)
        await gen.aclose()  # what a disconnecting HTTP client triggers
        return first

    assert len(asyncio.run(main())) == 1
    s = aeng.stats()
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)
    assert finished == []


@pytest.mark.parametrize("bad", [-0.1, math.nan])
def test_bad_flush_interval_is_refused(paced, bad: float) -> None:
    aeng, _ = paced

    async def main():
        return [c async for c in aeng.generate_chunks([1], max_tokens=2, flush_interval_s=bad)]

    with pytest.raises(ValueError, match="flush_interval_s="):
        asyncio.run(main())
    assert aeng.stats().running == 0


def test_events_budget_lets_a_lone_stream_through() -> None:
    # Budget 100 events/s, steps 10 ms apart, the stream asks for 25 ms at most.
    # Alone: 1 stream / 100 per s = 10 ms < 25 ms: every step's token goes out.
    eng = AsyncEngine(
        make_engine(max_slots=3, max_batch_size=3), pace_clock=step_clock(), events_per_s=100.0
    )
    eng.start()
    try:

        async def lone():
            gen = eng.generate_chunks([1, 2, 3], max_tokens=6, flush_interval_s=0.025)
            return [c async for c in gen]

        _, handovers = run_counting(lone)
        assert [[len(items) for _, items in call] for call in handovers] == [
            [1],
            [1],
            [1],
            [1],
            [1],
            [1, 1],
        ]

    finally:
        eng.stop()


def test_events_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="events_per_s=0"):
        AsyncEngine(make_engine(), events_per_s=0)


def test_events_budget_gives_a_crowd_the_full_interval() -> None:
    # The engine thread's side alone, step by step (no model, no thread): budget 100
    # events/s, every stream asks for 25 ms at most, steps 10 ms apart.
    eng = AsyncEngine(make_engine(), pace_clock=step_clock(), events_per_s=100.0)
    loop = asyncio.new_event_loop()
    calls: list[list[str]] = []
    names: dict[int, str] = {}

    def record(fn, batch):
        calls.append(sorted(names[id(stream)] for stream, _ in batch))

    loop.call_soon_threadsafe = record  # type: ignore[method-assign]
    try:
        for rid in "abc":
            eng._streams[rid] = _Stream(loop, 0.025)
            names[id(eng._streams[rid])] = rid
        sampled = ["a", "a", "abc", "abc", "abc", "abc", "abc"]
        for step, rids in enumerate(sampled):
            eng._deliver_step({rid: step for rid in rids}, [])
            if len(calls) == step:
                calls.append([])  # nothing handed over this step
    finally:
        loop.close()
    assert calls == [
        ["a"],  # alone: 1 / 100 = 10 ms, so it goes out again at the next step
        ["a"],
        ["a", "b", "c"],  # b and c first tokens at once; three paced: 3 / 100 = 30 ms
        [],  # held: the 25 ms interval (less than 30) now applies to all three
        [],
        ["a", "b", "c"],
        [],
    ]
    assert sum(len(s.held) for s in eng._streams.values()) == 3  # step 6's tokens, held


def test_flush_next_hands_the_next_token_over_at_once() -> None:
    # A consumer whose text ended inside a character asks for the next token now:
    # without flush_next the 25 ms interval would hold it for two more steps.
    eng = AsyncEngine(make_engine(), pace_clock=step_clock())
    loop = asyncio.new_event_loop()
    calls: list[list[int]] = []

    def record(fn, batch):
        calls.append([len(items) for _, items in batch])

    loop.call_soon_threadsafe = record  # type: ignore[method-assign]
    try:
        eng._streams["a"] = _Stream(loop, 0.025)
        eng._deliver_step({"a": 1}, [])  # first token: at once
        eng.flush_next("a")
        eng._deliver_step({"a": 2}, [])  # at once again, though 10 ms < 25 ms
        eng._deliver_step({"a": 3}, [])  # held: the interval applies again
        eng.flush_next("gone")  # an unknown (finished) request: nothing happens
    finally:
        loop.close()
    assert calls == [[1], [1]]
    assert eng._streams["a"].held == [3]


def test_abort_from_the_consumers_loop_ends_the_stream_and_frees_the_slot(paced) -> None:
    """``abort`` ends a paced stream at once (what it held is dropped with the request)
    and the engine frees its slot; other streams are untouched."""
    aeng, _ = paced

    async def main():
        gen = aeng.generate_chunks(
            [1, 2, 3], max_tokens=45, request_id="gone", flush_interval_s=math.inf
        )
        first = await gen.__anext__()  # the first token comes at once
        assert aeng.abort("gone") is True
        rest = [c async for c in gen]  # ends without error
        other = [c async for c in aeng.generate_chunks([4, 5], max_tokens=3)]
        return first, rest, other

    first, rest, other = asyncio.run(main())
    assert len(first) == 1 and rest == []
    assert sum(map(len, other)) == 3
    assert aeng.abort("gone") is False  # already gone
    assert aeng.engine.stats().running == 0
