"""The load generator against a small in-process SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from controller.load.generator import run_load
from controller.load.spec import (
    LoadSpec,
    TraceItem,
    completions_url,
    load_trace,
    saturating_spec,
    synth_prompt,
)
from serving.sim.workload import LengthDist


@dataclass
class FakeOpenAI:
    """A minimal OpenAI-style streaming server: one SSE chunk per token."""

    first_delay_s: float = 0.02
    token_delay_s: float = 0.005
    admission: int | None = None  # beyond this many in flight: `reject_status`
    reject_status: int = 503
    redirect: bool = False
    usage_every: int = 0  # > 0: one chunk per this many tokens, then a usage chunk
    hits: list[tuple[str, str, dict]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {
                k.strip().lower(): v.strip()
                for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            req = json.loads(body) if body else {}
            self.hits.append((method, path, req))
            if self.redirect:
                writer.write(
                    b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\n"
                    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
                return
            if self.admission is not None and self.in_flight >= self.admission:
                msg = b'{"error": "busy"}'
                writer.write(
                    f"HTTP/1.1 {self.reject_status} Busy\r\nContent-Length: {len(msg)}\r\n"
                    "Connection: close\r\n\r\n".encode()
                    + msg
                )
                return
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Connection: close\r\n\r\n"
                )
                await writer.drain()
                await asyncio.sleep(self.first_delay_s)
                n = int(req["max_tokens"])
                every = self.usage_every or 1
                for i in range(0, n, every):
                    if i:
                        await asyncio.sleep(self.token_delay_s)
                    chunk = {"choices": [{"text": "x" * min(every, n - i), "index": 0}]}
                    writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    await writer.drain()
                if self.usage_every:
                    usage = {"choices": [], "usage": {"completion_tokens": n}}
                    writer.write(f"data: {json.dumps(usage)}\n\n".encode())
                writer.write(b"data: [DONE]\n\n")
                await writer.drain()
            finally:
                self.in_flight -= 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def serving(fake: FakeOpenAI) -> AsyncIterator[str]:
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{fake.port}/v1/completions"
    finally:
        server.close()


def test_closed_loop_sends_exactly_the_count_and_measures_each_stream() -> None:
    fake = FakeOpenAI(first_delay_s=0.03, token_delay_s=0.01)

    async def go():
        async with serving(fake) as url:
            spec = LoadSpec(
                url=url,
                concurrency=4,
                max_requests=12,
                duration_s=60,
                output_tokens=LengthDist(mean=5),
                prompt_tokens=LengthDist(mean=10),
            )
            return await run_load(spec)

    res = asyncio.run(go())
    assert len(res.records) == 12 and res.completed == 12
    assert res.rejected == 0 and res.errors == 0 and res.cancelled == 0
    assert 2 <= fake.max_in_flight <= 4  # never more than the concurrency
    assert all(path == "/v1/completions" and m == "POST" for m, path, _ in fake.hits)
    for _, _, body in fake.hits:
        assert body["stream"] is True and body["max_tokens"] == 5 and len(body["prompt"]) == 10
        assert "model" not in body  # left to the server unless given
    for r in res.records:
        assert r.output_tokens == 5
        assert r.ttft_s >= 0.03 - 1e-3  # the server waited that long before the first token
        assert r.tpot_s >= 0.01 - 1e-3
    assert res.generated_tokens == 60


@pytest.mark.parametrize("status", [503, 429])
def test_backpressure_is_counted_as_rejection_not_error(status: int) -> None:
    fake = FakeOpenAI(admission=1, reject_status=status, first_delay_s=0.05)

    async def go():
        async with serving(fake) as url:
            return await run_load(LoadSpec(url=url, concurrency=4, max_requests=16, duration_s=60))

    res = asyncio.run(go())
    assert len(res.records) == 16
    assert res.rejected > 0 and res.completed > 0 and res.errors == 0
    assert res.completed + res.rejected == 16
    assert res.status_counts[status] == res.rejected
    assert fake.max_in_flight == 1


def test_open_loop_is_bounded_by_count_and_in_flight_cap() -> None:
    fake = FakeOpenAI(first_delay_s=0.01, token_delay_s=0.001)

    async def go():
        async with serving(fake) as url:
            spec = LoadSpec(
                url=url, mode="open", rate_rps=200.0, concurrency=50, max_requests=20, duration_s=30
            )
            return await run_load(spec)

    res = asyncio.run(go())
    assert len(fake.hits) == 20
    assert len(res.records) + res.dropped + res.cancelled == 20
    assert res.completed == len(res.records)


def test_duration_bounds_the_run_and_cancels_in_flight() -> None:
    fake = FakeOpenAI(first_delay_s=0.01, token_delay_s=0.5)  # each stream takes ~16 s

    async def go():
        async with serving(fake) as url:
            t = time.monotonic()
            res = await run_load(LoadSpec(url=url, concurrency=3, max_requests=100, duration_s=0.5))
            return res, time.monotonic() - t

    res, wall = asyncio.run(go())
    assert res.records == () and res.cancelled == 3
    assert wall < 10  # far below one stream's 16 s: the deadline cut it


def test_trace_replays_prompts_and_lengths(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 3, "arrival_s": 0.0},
        {"prompt_tokens": 7, "output_tokens": 2, "arrival_s": 0.01},
        {"prompt": "third", "max_tokens": 4, "arrival_s": 0.02},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path)
    fake = FakeOpenAI(first_delay_s=0.001, token_delay_s=0.001)

    async def go():
        async with serving(fake) as url:
            spec = LoadSpec(url=url, mode="trace", trace=trace, max_requests=3, duration_s=30)
            return await run_load(spec)

    res = asyncio.run(go())
    sent = sorted((b["max_tokens"], len(b["prompt"])) for _, _, b in fake.hits)
    assert sent == [(2, 7), (3, 11), (4, 5)]
    assert sorted(r.output_tokens for r in res.records) == [2, 3, 4]


def test_bad_trace_names_the_line(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 2}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_trace(path)


def test_redirects_are_not_followed() -> None:
    fake = FakeOpenAI(redirect=True)

    async def go():
        async with serving(fake) as url:
            return await run_load(LoadSpec(url=url, concurrency=1, max_requests=2, duration_s=30))

    res = asyncio.run(go())
    assert [p for _, p, _ in fake.hits] == ["/v1/completions"] * 2
    assert res.errors == 2 and res.status_counts == {307: 2}


def test_unreachable_server_gives_errors_not_a_crash() -> None:
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        url = f"http://127.0.0.1:{port}/v1/completions"
        return await run_load(LoadSpec(url=url, concurrency=2, max_requests=4, duration_s=10))

    res = asyncio.run(go())
    assert res.errors == 4 and res.completed == 0
    assert all(r.status == 0 and "ConnectError" in r.error for r in res.records)


def test_between_keeps_requests_finished_in_the_window() -> None:
    fake = FakeOpenAI(first_delay_s=0.01, token_delay_s=0.001)

    async def go():
        async with serving(fake) as url:
            return await run_load(LoadSpec(url=url, concurrency=2, max_requests=10, duration_s=30))

    res = asyncio.run(go())
    mid = sorted(r.done_s for r in res.records)[4]
    part = res.between(res.start_s, mid)
    assert len(part.records) == 5 and all(r.done_s <= mid for r in part.records)


@pytest.mark.parametrize(
    ("spec", "kind", "lo", "hi"),
    [
        ("16", "fixed", 16, 16),
        ("uniform:4-9", "uniform", 4, 9),
        ("lognormal:32,0.6", "lognormal", 1, 256),
    ],
)
def test_length_distributions_sample_within_bounds(spec, kind, lo, hi) -> None:
    d = LengthDist.parse(spec)
    assert d.kind == kind
    rng = random.Random(1)
    xs = [d.sample_one(rng) for _ in range(2000)]
    assert lo <= min(xs) and max(xs) <= hi
    assert [d.sample_one(random.Random(5)) for _ in range(3)] == [
        d.sample_one(random.Random(5)) for _ in range(3)
    ]
    if kind == "lognormal":
        assert 26 < sum(xs) / len(xs) < 38  # mean close to 32
        assert len(set(xs)) > 10


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"url": "ftp://x/v1/completions"}, "url="),
        ({"concurrency": 0}, "concurrency=0"),
        ({"mode": "open"}, "rate_rps=None"),
        ({"mode": "burst"}, "mode='burst'"),
        ({"duration_s": 0.0}, "duration_s=0.0"),
        ({"max_requests": 0}, "max_requests=0"),
        ({"mode": "trace"}, "trace"),
    ],
)
def test_spec_validation_names_the_bad_value(kw, match) -> None:
    args = {"url": "http://127.0.0.1:1/v1/completions", **kw}
    with pytest.raises(ValueError, match=match):
        LoadSpec(**args)


def test_length_parse_errors_and_helpers() -> None:
    with pytest.raises(ValueError, match="uniform:LO-HI"):
        LengthDist.parse("uniform:abc")
    with pytest.raises(ValueError, match="kind"):
        LengthDist.parse("zipf:3")
    assert len(synth_prompt(37, random.Random(0))) == 37
    assert completions_url("http://h:1/") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/completions") == "http://h:1/v1/completions"
    s = saturating_spec("http://h:1/v1/completions", max_concurrency=6, duration_s=3.0)
    assert s.mode == "closed" and s.concurrency == 6
    with pytest.raises(ValueError, match="max_tokens"):
        TraceItem(max_tokens=0, prompt="x")


def test_stop_event_ends_the_run_and_on_record_sees_each_request() -> None:
    fake = FakeOpenAI(first_delay_s=0.005, token_delay_s=0.002)
    seen: list = []

    async def go():
        async with serving(fake) as url:
            stop = asyncio.Event()
            spec = LoadSpec(url=url, concurrency=2, max_requests=100_000, duration_s=120)
            task = asyncio.create_task(run_load(spec, stop=stop, on_record=seen.append))
            while len(seen) < 10:
                await asyncio.sleep(0.01)
            stop.set()
            return await task

    res = asyncio.run(go())
    assert len(res.records) >= 10 and len(res.records) < 100_000
    assert len(seen) == len(res.records)
    assert res.cancelled <= 2


def test_client_observation_from_records() -> None:
    from controller.load.result import LoadResult, RequestRecord, client_observation
    from metrics.observation import Slo, Verdict

    recs = []
    for i in range(400):
        ttft = 0.1 if i < 396 else 2.0  # 4 of 400 over a 1 s TTFT SLO: p99 violated? no: 1%
        recs.append(
            RequestRecord(
                sent_s=100.0 + i * 0.01,
                done_s=101.0 + i * 0.01,
                first_token_s=100.0 + i * 0.01 + ttft,
                last_token_s=100.0 + i * 0.01 + ttft + 0.02 * 9,
                prompt_tokens=8,
                max_tokens=10,
                output_tokens=10,
                status=200,
            )
        )
    recs.append(
        RequestRecord(
            sent_s=1, done_s=1.1, first_token_s=None, last_token_s=None,
            prompt_tokens=8, max_tokens=10, output_tokens=0, status=503, error="HTTP 503",
        )
    )  # fmt: skip
    res = LoadResult(start_s=100.0, end_s=110.0, records=tuple(recs))
    obs = client_observation(res, Slo(ttft_p99_s=1.0, tpot_p99_s=0.05))
    assert obs.completed == 400 and obs.rejected == 1 and obs.slo_met == 396
    assert obs.generated_tokens == 4000 and obs.tokens_per_s == 400.0
    assert obs.tpot.p99 == pytest.approx(0.02)
    assert obs.ttft.p99 == pytest.approx(0.1)  # nearest rank: 396th of 400 is 0.1
    assert obs.tpot_verdict.verdict is Verdict.MET and obs.tpot_verdict.samples == 400
    assert obs.ttft_verdict.verdict is not Verdict.MET  # 4 over the threshold: not proven
    assert obs.source == "client"


def test_usage_chunk_gives_the_token_count() -> None:
    fake = FakeOpenAI(first_delay_s=0.001, token_delay_s=0.001, usage_every=3)

    async def go():
        async with serving(fake) as url:
            spec = LoadSpec(
                url=url, concurrency=1, max_requests=2, duration_s=30,
                output_tokens=LengthDist(mean=7),
            )  # fmt: skip
            return await run_load(spec)

    res = asyncio.run(go())
    assert [r.output_tokens for r in res.records] == [7, 7]  # 3 text chunks, usage says 7
    assert fake.hits[0][2]["stream_options"] == {"include_usage": True}
