"""Load generator: streaming requests against an OpenAI-compatible server.

Drives any such server (the built-in Ray Serve app, vLLM, SGLang, Ray Serve LLM, ...)
at ``/v1/completions`` or ``/v1/chat/completions`` with one of:

- closed loop: ``concurrency`` workers, each sending the next request as soon as
  its previous one ends (saturating: every admission slot stays occupied);
- open loop: Poisson arrivals at ``rate_rps`` (in-flight capped, excess counted);
- trace: arrivals at the ``arrival_s`` offsets of a JSONL trace.

Every run is bounded by a request count and a wall-clock duration; in-flight
requests still running at the deadline are cancelled (which frees their KV slot
on a server that aborts on disconnect) and counted as ``cancelled``. It only
ever sends ``POST`` to the one URL it was given, never follows redirects and
ignores proxy settings from the environment. Connections are kept alive and reused
(a pool as large as the concurrency), as a production client's would be, so each
request does not pay a TCP handshake.

Per request it records the client-side times (send, first token, last token),
the prompt and output token counts and the HTTP status; 429 and 503 are counted as
rejections (backpressure), anything else non-200 as errors.

Request shapes and bounds live in :mod:`controller.load.spec`, prompts in
:mod:`controller.load.prompts`, one request's body and stream in
:mod:`controller.load.request`, the records and the client-side Observation in
:mod:`controller.load.result`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from controller.load.prompts import Prompt, PromptMaker
from controller.load.request import send_one
from controller.load.result import LoadResult, RequestRecord
from controller.load.spec import LoadSpec

log = logging.getLogger(__name__)


class _Plan:
    """Produces the (prompt, max_tokens, arrival offset) of request i, deterministically."""

    def __init__(self, spec: LoadSpec, prompts: PromptMaker) -> None:
        self.spec = spec
        self.prompts = prompts
        self.rng = random.Random(spec.seed)
        self.next_arrival = 0.0

    def request(self, i: int) -> tuple[Prompt, int]:
        spec = self.spec
        if spec.trace:
            item = spec.trace[i % len(spec.trace)]
            if item.prompt is not None:
                return self.prompts.from_text(item.prompt), item.max_tokens
            return self.prompts.make(int(item.prompt_tokens or 1), self.rng), item.max_tokens
        n = spec.prompt_tokens.sample_one(self.rng)
        return self.prompts.make(n, self.rng), spec.output_tokens.sample_one(self.rng)

    def arrival(self, i: int) -> float:
        spec = self.spec
        if spec.mode == "trace":
            assert spec.trace is not None
            period = len(spec.trace)
            item = spec.trace[i % period]
            if item.arrival_s is not None:
                last = spec.trace[-1].arrival_s or 0.0
                return (i // period) * (last + 1e-3) + item.arrival_s
            return 0.0
        self.next_arrival += self.rng.expovariate(spec.rate_rps or 1.0)
        return self.next_arrival


async def run_load(
    spec: LoadSpec,
    *,
    client: httpx.AsyncClient | None = None,
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> LoadResult:
    """Offer the load ``spec`` describes; returns when the count or the duration is spent,
    or as soon as ``stop`` is set (in-flight requests are then cancelled). ``on_record`` is
    called with each finished request as it finishes."""
    # the tokenizer's vocabulary scan can take a moment: off the event loop
    plan = _Plan(spec, await asyncio.to_thread(PromptMaker, spec))
    own = client is None
    if client is None:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(spec.request_timeout_s, connect=5.0),
            # one kept-alive connection per worker (closed loop) or in-flight slot (open);
            # a little headroom so that a connection still closing never queues a request
            limits=httpx.Limits(
                max_connections=spec.concurrency + 4,
                max_keepalive_connections=spec.concurrency,
            ),
            follow_redirects=False,
            trust_env=False,
        )
    records: list[RequestRecord] = []
    issued = 0
    dropped = 0
    in_flight: set[asyncio.Task[RequestRecord]] = set()
    start = time.time()
    t0 = time.monotonic()
    deadline = t0 + spec.duration_s

    def take() -> int | None:
        nonlocal issued
        if issued >= spec.max_requests or time.monotonic() >= deadline:
            return None
        if stop is not None and stop.is_set():
            return None
        issued += 1
        return issued - 1

    async def worker() -> None:
        while (i := take()) is not None:
            prompt, max_tokens = plan.request(i)
            rec = await send_one(client, spec, prompt, max_tokens)
            records.append(rec)
            if on_record is not None:
                on_record(rec)

    async def arrivals() -> None:
        nonlocal dropped
        while (i := take()) is not None:
            delay = t0 + plan.arrival(i) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() >= deadline:
                return
            if len(in_flight) >= spec.concurrency:
                dropped += 1
                continue
            prompt, max_tokens = plan.request(i)
            task = asyncio.create_task(send_one(client, spec, prompt, max_tokens))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            task.add_done_callback(lambda t: _collect(t, records, on_record))

    if spec.mode == "closed":
        tasks = [asyncio.create_task(worker()) for _ in range(spec.concurrency)]
    else:
        tasks = [asyncio.create_task(arrivals())]
    waits: set[asyncio.Future[Any]] = set(tasks)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        done, pending = await _wait_all_or(waits, stopper, deadline)
        if spec.mode != "closed" and in_flight and not pending:
            # All arrivals sent: wait for the stragglers until the deadline (or the stop).
            await _wait_all_or(set(in_flight), stopper, deadline)
        cancelled = sum(not t.done() for t in pending) if spec.mode == "closed" else 0
        cancelled += sum(not t.done() for t in in_flight)
        for t in [*pending, *in_flight]:
            t.cancel()
        await asyncio.gather(*pending, *in_flight, return_exceptions=True)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        if stopper is not None:
            stopper.cancel()
        if own:
            await client.aclose()
    result = LoadResult(
        start_s=start,
        end_s=time.time(),
        records=tuple(sorted(records, key=lambda r: r.sent_s)),
        cancelled=cancelled,
        dropped=dropped,
        spec=spec,
    )
    if result.length_mismatches:
        log.warning(
            "load: %d of %d completed requests got an output length other than max_tokens "
            "(ignore_eos=%s; counts from usage: %d of them)",
            result.length_mismatches,
            result.completed,
            spec.ignore_eos,
            sum(r.output_from_usage for r in result.records if r.length_mismatch),
        )
    log.info(
        "load %s: %d sent, %d ok, %d rejected, %d errors, %d cancelled, %d dropped in %.1f s",
        spec.mode,
        issued,
        result.completed,
        result.rejected,
        result.errors,
        result.cancelled,
        result.dropped,
        result.end_s - result.start_s,
    )
    return result


async def _wait_all_or(
    tasks: set[asyncio.Future[Any]], stopper: asyncio.Future[Any] | None, deadline: float
) -> tuple[set[asyncio.Future[Any]], set[asyncio.Future[Any]]]:
    """Wait until every task is done, the deadline passes or the stopper fires."""
    pending = set(tasks)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0 or (stopper is not None and stopper.done()):
            break
        watch = pending | ({stopper} if stopper is not None else set())
        await asyncio.wait(watch, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        pending = {t for t in pending if not t.done()}
    return set(tasks) - pending, pending


def _collect(
    task: asyncio.Task[RequestRecord],
    records: list[RequestRecord],
    on_record: Callable[[RequestRecord], None] | None,
) -> None:
    if not task.cancelled() and task.exception() is None:
        records.append(task.result())
        if on_record is not None:
            on_record(task.result())


def run_load_sync(spec: LoadSpec) -> LoadResult:
    """:func:`run_load` from synchronous code (its own event loop)."""
    return asyncio.run(run_load(spec))
