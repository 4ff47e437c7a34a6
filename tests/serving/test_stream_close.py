"""A streamed request's outcome when the stream is closed: before its last event it is an
abort (client_disconnect, with its first token); after it, a completion only (the engine's
finish hook records it), never also an abort. Serve closes the replica's generator when the
client leaves, which can come after the last event was handed over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from metrics import names
from serving.app import openai_api as oa
from serving.app.completions import CompletionHandler, _Job
from serving.app.openai_request import parse_completion_request


class _Engine:
    def __init__(self) -> None:
        self.engine = SimpleNamespace(clock=lambda: 1.0)

    async def generate_chunks(self, prompt_ids, **_kw):
        for tok in (101, 102, 103):
            yield [tok]

    def flush_next(self, _cid: str) -> None:
        pass


def _handler(aborted: list[dict]) -> CompletionHandler:
    h = object.__new__(CompletionHandler)
    h.engine = _Engine()
    h.args = SimpleNamespace(stream_interval_s=0.0, served_name="m")
    h.tokenizer = SimpleNamespace(decode=lambda ids: "".join(chr(97 + i % 26) for i in ids))
    h._serve_delays = {}
    h.metrics = lambda: SimpleNamespace(record_aborted=lambda **kw: aborted.append(kw))
    return h


def _job() -> _Job:
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
    req = parse_completion_request(body, served_model="m")
    return _Job(
        req=req,
        prompt_ids=[1, 2],
        max_tokens=3,
        cid="c1",
        arrival=0.5,
        serve_delay_s=0.0,
        stop_ids=frozenset(),
    )


async def _read_then_close(stop_after_done: bool) -> tuple[list[bytes], list[dict], int]:
    aborted: list[dict] = []
    released = []
    gen = _handler(aborted)._stream(_job(), SimpleNamespace(release=lambda: released.append(1)))
    events = []
    async for event in gen:
        events.append(event)
        if event.endswith(oa.SSE_DONE) if stop_after_done else len(events) == 1:
            break
    await gen.aclose()  # the client is gone: Serve closes the generator where it waits
    return events, aborted, len(released)


def test_a_stream_closed_after_its_last_event_is_not_also_an_abort() -> None:
    events, aborted, released = asyncio.run(_read_then_close(stop_after_done=True))
    assert events[-1].endswith(oa.SSE_DONE)
    assert aborted == [] and released == 1


def test_a_stream_closed_before_its_last_event_is_a_client_disconnect() -> None:
    events, aborted, released = asyncio.run(_read_then_close(stop_after_done=False))
    assert len(events) == 1 and not events[0].endswith(oa.SSE_DONE)
    assert [a["reason"] for a in aborted] == [names.REASON_CLIENT_DISCONNECT]
    assert aborted[0]["ttft_s"] == 0.5 and released == 1
