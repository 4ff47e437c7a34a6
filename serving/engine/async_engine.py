"""The asyncio face of the engine: :class:`AsyncEngine` steps it in a thread and streams tokens.

The engine thread runs ``Engine.step`` back to back while there is work. After each
step it hands every sampled token (and every end of stream) to the consumers' event
loops with ONE ``call_soon_threadsafe`` per loop, however many requests that loop
serves (a per-token wake-up costs a self-pipe write each). A consumer takes everything
handed to it so far at once (``generate_chunks``), so one that falls behind catches up
in one go instead of one event per token.

A consumer may also ask the engine thread to hold its tokens back
(``generate_chunks(flush_interval_s=...)``): its first token is handed over at once,
then at most one hand-over per interval, and the end at once with everything still
held. Held tokens cost nothing on the consumer's side (its loop is not woken). A token
is held less than the interval after the step that sampled it, plus the rest of the
step that crosses the interval. With ``events_per_s`` (a budget for the whole engine)
each stream's interval is min(its ``flush_interval_s``, paced streams /
``events_per_s``), so the hand-overs of all streams together stay near the budget
(docs/serving.md "Streaming pace").

Server-side latency metrics do not come from here: the scheduler records arrival,
first and last token times and ``on_finish`` hands them over from the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from serving.engine.engine import Engine, EngineStats
from serving.scheduler.plan import RequestTiming

logger = logging.getLogger(__name__)


_DONE = object()


class _Stream:
    """One consumer's inbox: items the engine thread handed over, and the waiter.

    ``items`` and ``waiter`` are touched only on the consumer's event loop (the
    engine thread hands items over with one ``call_soon_threadsafe`` per loop per
    step); ``held`` and ``flush_at`` only on the engine thread.
    """

    __slots__ = ("flush_at", "held", "interval_s", "items", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.0) -> None:
        self.loop = loop
        self.items: list[object] = []  # token ids, then _DONE or an exception
        self.waiter: asyncio.Future[None] | None = None
        self.interval_s = interval_s
        self.held: list[object] = []  # tokens the engine thread has not handed over yet
        self.flush_at = -math.inf  # engine clock: hand over at the first step from then

    def put(self, items: list[object]) -> None:
        self.items += items
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list[object]:
        """Everything handed over so far (waits for at least one item)."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def _put_all(batch: list[tuple[_Stream, list[object]]]) -> None:
    for stream, items in batch:
        stream.put(items)


class AsyncEngine:
    """Runs :meth:`Engine.step` in a background thread; safe to use from asyncio.

    ``generate_chunks`` yields, each time its consumer gets to run, every token
    id sampled for the request since the last yield (one or more: a consumer
    that falls behind gets them together, nothing is held back); ``generate``
    yields them one by one. After a step the engine thread wakes each consumer
    event loop once (one ``call_soon_threadsafe`` for all its requests), not
    once per token. When the consumer stops early (``aclose``, cancellation, a
    dropped client) the request is aborted and its KV slot freed before the
    next step. ``on_finish(RequestTiming)`` is called from the engine thread for
    every request that finishes normally (aborted requests are not reported),
    before its stream ends; the timings are the engine's, not the stream's. The
    finish reason is ``length`` when ``max_tokens`` tokens came back, ``stop``
    otherwise. ``pace_clock`` (seconds, monotonic) paces ``flush_interval_s`` only (a
    ``clock`` keyword goes to the :class:`Engine`, for its request timestamps);
    ``events_per_s`` (None: no budget) shortens the intervals of paced streams while
    few share the engine (see the module docstring).
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        pace_clock: Callable[[], float] = time.monotonic,
        events_per_s: float | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if events_per_s is not None and not (0 < events_per_s < math.inf):
            raise ValueError(f"events_per_s={events_per_s!r}: must be a positive number or None")
        self.engine = engine if engine is not None else Engine(**engine_kwargs)
        self.pace_clock = pace_clock
        self.events_per_s = events_per_s
        self.tokenizer = self.engine.tokenizer
        self.on_finish: Callable[[RequestTiming], None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="slotune-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._deliver([(rid, RuntimeError("the engine stopped")) for rid in list(self._streams)])

    @property
    def native_thread_id(self) -> int | None:
        """The engine thread's OS thread id (None before ``start``)."""
        return None if self._thread is None else self._thread.native_id

    def validate(self, prompt_ids: list[int], max_tokens: object) -> None:
        self.engine.validate(prompt_ids, max_tokens)

    def set_max_batch_size(self, max_batch_size: int) -> None:
        self.engine.set_max_batch_size(max_batch_size)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def flush_next(self, request_id: str) -> None:
        """Have the engine thread hand this stream's next token over at once, whatever
        its interval (a consumer whose tokens ended inside a character asks for it).
        Called on the consumer's loop; a race with the step that is ending only
        delays it to the stream's interval."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.flush_at = -math.inf

    def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends (without error) and its slot is freed. Callable
        from any thread: what the engine thread still held for it is dropped with the
        request (``held`` is the engine thread's alone)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._hand_over({stream.loop: [(stream, [_DONE])]})
        return self.engine.abort(request_id)

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        request_id: str | None = None,
        stop_ids: Sequence[int] = (),
    ) -> AsyncIterator[int]:
        """Token ids one by one (see :meth:`generate_chunks`)."""
        chunks = self.generate_chunks(
            prompt_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            request_id=request_id,
            stop_ids=stop_ids,
        )
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                for tok in chunk:
                    yield tok

    async def generate_chunks(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        request_id: str | None = None,
        stop_ids: Sequence[int] = (),
        flush_interval_s: float = 0.0,
        arrival_s: float | None = None,
        min_tokens: int = 0,
    ) -> AsyncIterator[list[int]]:
        """Lists of token ids: all that were handed over since the consumer last ran.

        ``arrival_s`` (the engine's clock; None: now) is when the request arrived, for its
        TTFT and queue wait: a server that queued it before handing it over passes it.
        ``stop_ids`` end the request, and cannot be sampled before ``min_tokens`` tokens
        (``Engine.add_request``).

        ``flush_interval_s`` > 0: the engine thread hands the first token over at
        once, then holds tokens back until ``flush_interval_s`` has passed since the
        last hand-over (checked after each step), and hands over the end at once with
        everything held. ``math.inf``: the first token, then the rest at the end.
        """
        if not (flush_interval_s >= 0):  # also refuses NaN
            raise ValueError(f"flush_interval_s={flush_interval_s!r}: must be >= 0 seconds")
        rid = request_id if request_id is not None else f"areq-{next(self._ids)}"
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("AsyncEngine is not running: call start() first")
        stream = _Stream(asyncio.get_running_loop(), flush_interval_s)
        self._streams[rid] = stream
        done = False
        try:
            self.engine.add_request(
                prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                request_id=rid,
                stop_ids=stop_ids,
                arrival_s=arrival_s,
                min_tokens=min_tokens,
            )
            self._wake.set()
            while not done:
                tokens: list[int] = []
                end: object = None
                for item in await stream.take():
                    if item is _DONE or isinstance(item, BaseException):
                        end = item
                        break
                    tokens.append(item)  # type: ignore[arg-type]
                done = end is not None
                if tokens:
                    yield tokens
                if isinstance(end, BaseException):
                    raise end
        finally:
            self._streams.pop(rid, None)
            if not done:
                self.engine.abort(rid)

    # ---- the engine thread ---------------------------------------------------------------
    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Hand items (a token id, ``_DONE`` or an exception) to their streams at once,
        with whatever the stream held: one ``call_soon_threadsafe`` per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, list[object]]]] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                out, stream.held = stream.held, []
                out.append(item)
                by_loop.setdefault(stream.loop, []).append((stream, out))
        self._hand_over(by_loop)

    def _hand_over(
        self, by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, list[object]]]]
    ) -> None:
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumers' loop is closed
                for stream, _ in batch:
                    for rid, s in list(self._streams.items()):
                        if s is stream:
                            self._streams.pop(rid, None)
                            self.engine.abort(rid)

    def _deliver_step(self, tokens: dict[str, int], ended: list[str]) -> None:
        """After a step: each stream's new token, held or handed over by its interval;
        the streams in ``ended`` get everything held and ``_DONE``."""
        now = self.pace_clock()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, list[object]]]] = {}
        streams = self._streams
        share = math.inf  # the interval that keeps all paced streams at the budget
        if self.events_per_s is not None:
            paced = sum(
                1 for rid in tokens if (st := streams.get(rid)) and 0 < st.interval_s < math.inf
            )
            share = paced / self.events_per_s
        for rid, tok in tokens.items():
            stream = streams.get(rid)
            if stream is None:
                continue
            stream.held.append(tok)
            if now >= stream.flush_at:
                by_loop.setdefault(stream.loop, []).append((stream, stream.held))
                stream.held = []
                iv = stream.interval_s
                stream.flush_at = now + (min(iv, share) if iv < math.inf else iv)
        for rid in ended:
            stream = streams.get(rid)
            if stream is None:
                continue
            out, stream.held = stream.held, []
            out.append(_DONE)
            by_loop.setdefault(stream.loop, []).append((stream, out))
        self._hand_over(by_loop)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            if not eng.has_work:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                out = eng.step()
            except Exception as e:  # a failed step fails its requests, not the engine
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            if out.plan.is_empty:  # nothing runnable (cannot happen today): do not spin
                self._wake.wait(timeout=0.01)
                self._wake.clear()
            ended: list[str] = []
            for f in out.finished:
                if self.on_finish is not None:  # before the stream ends: metrics first
                    try:
                        self.on_finish(f.timing)
                    except Exception:
                        logger.exception("on_finish failed for %s", f.request_id)
                ended.append(f.request_id)
            self._deliver_step(out.tokens, ended)

    def _fail_all(self, err: Exception) -> None:
        ids = self.engine.abort_all()
        self._deliver([(rid, RuntimeError(f"engine step failed: {err}")) for rid in ids])
