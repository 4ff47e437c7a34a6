"""Backpressure (issue 17 item 9): the replica admits exactly ``max_ongoing_requests``,
queues exactly ``max_queued_requests`` and answers anything beyond at once with an
OpenAI-style JSON 429 and ``Retry-After``; no admitted or queued request is lost, and one
whose client leaves while queued gives its place back and is counted.

The admission object is tested directly; then the live app on the session Ray cluster
(loopback, bounded): the ``small`` model, so that a 480-token stream holds its place for
seconds while the test looks (the checks are of order and counts, not of timing).
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from metrics import names
from serving.app.admission import Admission, Overloaded

# ---- the admission object ----------------------------------------------------------------


def test_limit_and_queue_are_exact_and_the_queue_is_fifo() -> None:
    async def main() -> None:
        adm = Admission(limit=2, queue=3)
        held = [await adm.acquire(), await adm.acquire()]
        order: list[int] = []

        async def wait(i: int) -> None:
            ticket = await adm.acquire()
            order.append(i)
            held.append(ticket)

        waiters = [asyncio.create_task(wait(i)) for i in range(3)]
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (2, 3)
        with pytest.raises(Overloaded, match="limit of 2 requests with 3 queued") as e:
            await adm.acquire()  # the sixth: refused at once, nothing changes
        assert 1 <= e.value.retry_after_s <= 60
        assert (adm.running, adm.waiting) == (2, 3)
        for _ in range(3):
            held.pop(0).release()
            await asyncio.sleep(0)
            assert adm.running == 2
        await asyncio.gather(*waiters)
        assert order == [0, 1, 2] and adm.waiting == 0
        for ticket in held:
            ticket.release()
            ticket.release()  # a second release is a no-op
        assert adm.running == 0

    asyncio.run(main())


def test_a_waiter_that_leaves_gives_its_position_back() -> None:
    async def main() -> None:
        adm = Admission(limit=1, queue=1)
        first = await adm.acquire()
        leaver = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await adm.acquire()
        leaver.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaver
        assert (adm.running, adm.waiting) == (1, 0)
        stayer = asyncio.create_task(adm.acquire())  # the freed position is usable
        await asyncio.sleep(0)
        assert adm.waiting == 1
        first.release()
        (await stayer).release()
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


def test_a_waiter_cancelled_as_it_is_admitted_gives_the_place_back() -> None:
    async def main() -> None:
        adm = Admission(limit=1, queue=1)
        first = await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        first.release()  # admits the waiter (counted running) before it runs...
        waiter.cancel()  # ...and it is cancelled before it could take its ticket
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


def test_raising_the_limit_admits_waiters_and_a_lost_ticket_is_released() -> None:
    async def main() -> None:
        adm = Admission(limit=1, queue=4)
        first = await adm.acquire()
        waiters = [asyncio.create_task(adm.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        adm.set_limits(limit=3, queue=4)
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting) == (3, 1)
        del first  # never released: the place comes back when the ticket is collected
        gc.collect()
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting) == (3, 0)
        for w in waiters:
            (await w).release()
        assert adm.running == 0

    asyncio.run(main())


def test_time_queued_before_the_engine_counts_in_ttft_and_queue_wait() -> None:
    """The server hands the engine the request's arrival (its body read), so the wait
    in the admission queue is in the replica's TTFT and queue-wait histograms."""
    from serving.engine.async_engine import AsyncEngine
    from serving.model.config import ModelConfig

    engine = AsyncEngine(
        model_config=ModelConfig.from_name("tiny"), max_slots=1, max_batch_size=1, seed=0
    )
    timings = []
    engine.on_finish = timings.append
    engine.start()

    async def main() -> None:
        arrival = engine.engine.clock() - 100.0  # as if queued for 100 s
        async for _ in engine.generate_chunks([1, 2, 3], max_tokens=2, arrival_s=arrival):
            pass

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    (t,) = timings
    assert t.ttft_s >= 100.0 and t.queue_wait_s >= 100.0


# ---- the live app ------------------------------------------------------------------------

APP = "backpressure"
LIMIT, QUEUE = 2, 3
HOLD = {
    "max_tokens": 480,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture(scope="module")
def base(ray_cluster):
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import delete_app, deploy_app

    deploy_app(
        ServerArgs(model="small", max_slots=4),
        LiveConfig(max_batch_size=LIMIT, max_ongoing_requests=LIMIT),
        name=APP,
        route_prefix=f"/{APP}",
        max_queued_requests=QUEUE,
    )
    yield f"{ray_cluster.http_url}/{APP}"
    delete_app(APP)


def _stats(base: str) -> dict:
    return httpx.get(base + "/stats", timeout=30).json()


def _wait_for(base: str, admitted: int, queued: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = _stats(base)
        if (st["admitted"], st["queued"]) == (admitted, queued):
            return
        assert st["admitted"] <= LIMIT and st["queued"] <= QUEUE, st
        time.sleep(0.05)
    raise AssertionError(f"never {admitted} admitted + {queued} queued; last {st}")


def _counter(metrics_url: str, name: str, reason: str) -> float:
    family = names.counter_samples(name)[0]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(metrics_url, timeout=10).text.splitlines()
        if line.startswith(family + "{")
        and f'{names.LABEL_REASON}="{reason}"' in line
        and f'application="{APP}"' in line
    )


def _wait_counter(metrics_url: str, name: str, reason: str, value: float) -> float:
    deadline = time.monotonic() + 30
    while (got := _counter(metrics_url, name, reason)) < value and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


class Stream(threading.Thread):
    """One streamed completion, read to its end; its status and events kept."""

    def __init__(self, base: str, i: int) -> None:
        super().__init__(daemon=True)
        self.base, self.i = base, i
        self.status: int | None = None
        self.events: list[object] = []

    def run(self) -> None:
        body = {"prompt": f"hold {self.i}", **HOLD}
        with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=300) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    self.events.append(data if data == "[DONE]" else json.loads(data))


def _check_served_in_full(s: Stream) -> None:
    assert s.status == 200 and s.events and s.events[-1] == "[DONE]", (s.i, s.status)
    usage = s.events[-2]["usage"]
    finish = [e["choices"][0]["finish_reason"] for e in s.events[:-2] if e["choices"]]
    assert finish[-1] in ("length", "stop") and all(f is None for f in finish[:-1])
    assert 1 <= usage["completion_tokens"] <= HOLD["max_tokens"]
    assert finish[-1] != "length" or usage["completion_tokens"] == HOLD["max_tokens"]


@pytest.mark.ray
def test_one_past_the_queue_gets_a_json_429_at_once_and_none_is_lost(base: str, ray_cluster):
    rejected0 = _counter(ray_cluster.metrics_url, names.REJECTED_TOTAL, names.REASON_OVERLOADED)
    streams = [Stream(base, i) for i in range(LIMIT + QUEUE)]
    for s in streams:
        s.start()
    _wait_for(base, LIMIT, QUEUE)
    # the sixth, plain and streamed: refused while all five are still held
    extra = httpx.post(
        base + "/v1/completions", json={"prompt": "six", "max_tokens": 4}, timeout=30
    )
    with httpx.stream(
        "POST", base + "/v1/completions", json={"prompt": "seven", **HOLD}, timeout=30
    ) as extra_stream:
        extra_stream.read()
    st = _stats(base)
    assert (st["admitted"], st["queued"]) == (LIMIT, QUEUE), st
    for r in (extra, extra_stream):
        assert r.status_code == 429, (r.status_code, r.text[:300])
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_overloaded", "overloaded")
        assert f"limit of {LIMIT} requests" in err["message"] and f"holds {QUEUE}" in err["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60
    for s in streams:
        s.join(300)
        assert not s.is_alive(), f"stream {s.i} did not end"
        _check_served_in_full(s)
    st = _stats(base)
    assert (st["admitted"], st["queued"]) == (0, 0), st
    got = _wait_counter(
        ray_cluster.metrics_url, names.REJECTED_TOTAL, names.REASON_OVERLOADED, rejected0 + 2
    )
    assert got == rejected0 + 2


@pytest.mark.ray
def test_a_client_that_leaves_the_queue_frees_its_position_and_is_counted(base, ray_cluster):
    metrics_url = ray_cluster.metrics_url
    aborted0 = _counter(metrics_url, names.ABORTED_TOTAL, names.REASON_CLIENT_DISCONNECT)
    running = [Stream(base, i) for i in range(LIMIT)]
    for s in running:
        s.start()
    _wait_for(base, LIMIT, 0)
    url = urlparse(base)
    body = json.dumps({"prompt": "leave", "max_tokens": 4}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(
            f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _wait_for(base, LIMIT, 1)
    # hung up while queued: the position is free again and the request counted aborted
    _wait_for(base, LIMIT, 0)
    later = [Stream(base, 10 + i) for i in range(QUEUE)]  # the whole queue is usable again
    for s in later:
        s.start()
    _wait_for(base, LIMIT, QUEUE)
    for s in running + later:
        s.join(300)
        _check_served_in_full(s)
    got = _wait_counter(
        metrics_url, names.ABORTED_TOTAL, names.REASON_CLIENT_DISCONNECT, aborted0 + 1
    )
    assert got == aborted0 + 1
