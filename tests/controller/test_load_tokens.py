"""The load generator against a server, in the served model's tokens: prompts sized with
a tokenizer.json, token-id prompts, the chat endpoint, ignore_eos and usage counts,
kept-alive connections.

The server is an aiohttp app on 127.0.0.1 that records every body, counts prompts with
the same tokenizer (trained in the test, no downloads), and streams canned SSE in the
completions or the chat format.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer

from controller.load.generator import run_load
from controller.load.spec import LoadSpec, TraceItem, completions_url
from serving.sim.workload import LengthDist

CHAT_TEMPLATE_TOKENS = 5  # what the stand-in server's "chat template" adds to a message


@dataclass
class StandIn:
    """An OpenAI-style streaming server: completions and chat, usage, EOS, keep-alive."""

    tokenizer: str | None = None
    tokens_per_event: int = 1
    send_usage: bool = True  # honour stream_options.include_usage
    eos_after: int | None = None  # without ignore_eos, stop after this many tokens
    first_delay_s: float = 0.0
    role_delay_s: float = 0.0  # chat: between the role-only event and the first content
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    peers: set[Any] = field(default_factory=set)
    prompt_counts: list[int] = field(default_factory=list)

    def count_prompt(self, body: dict[str, Any]) -> int:
        tok = Tokenizer.from_file(self.tokenizer) if self.tokenizer else None
        if "messages" in body:
            text = body["messages"][-1]["content"]
            n = len(tok.encode(text, add_special_tokens=False).ids) if tok else len(text)
            return n + CHAT_TEMPLATE_TOKENS
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return len(prompt)
        return len(tok.encode(prompt).ids) if tok else len(prompt)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append((request.path, body))
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        chat = request.path.endswith("/chat/completions")
        n_prompt = self.count_prompt(body)
        self.prompt_counts.append(n_prompt)
        n = int(body["max_tokens"])
        if self.eos_after is not None and not body.get("ignore_eos"):
            n = min(n, self.eos_after)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            if chat:
                delta = {"content": text} if text else {}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        kind = "chat.completion.chunk" if chat else "text_completion"
        await asyncio.sleep(self.first_delay_s)
        if chat:  # vLLM's first chat event: the role, no content
            await event({"object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(self.role_delay_s)
        for i in range(0, n, self.tokens_per_event):
            k = min(self.tokens_per_event, n - i)
            await event({"object": kind, "choices": [choice("ab" * k)]})
        await event({"object": kind, "choices": [choice("", "length")]})
        if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n}
            await event({"object": kind, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serving(srv: StandIn) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", srv.handle)
    app.router.add_post("/v1/chat/completions", srv.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def _run(srv: StandIn, **kw: Any):
    async def go():
        async with serving(srv) as base:
            endpoint = kw.get("endpoint", "completions")
            spec = LoadSpec(url=completions_url(base, endpoint), duration_s=60, **kw)
            return await run_load(spec)

    return asyncio.run(go())


def test_completions_text_prompts_count_as_the_server_counts(bpe) -> None:
    srv = StandIn(tokenizer=bpe)
    res = _run(
        srv,
        tokenizer=bpe,
        concurrency=2,
        max_requests=8,
        prompt_tokens=LengthDist(kind="uniform", mean=20, lo=5, hi=40),
        output_tokens=LengthDist(mean=4),
    )
    assert res.completed == 8 and res.errors == 0
    assert all(isinstance(b["prompt"], str) and "ignore_eos" not in b for _, b in srv.bodies)
    assert sorted(r.prompt_tokens for r in res.records) == sorted(srv.prompt_counts)
    assert len({r.prompt_tokens for r in res.records}) > 1  # the lengths were sampled
    for r in res.records:
        assert r.server_prompt_tokens == r.prompt_tokens and 5 <= r.prompt_tokens <= 40
        assert r.output_from_usage and r.output_tokens == 4 and not r.length_mismatch
    assert res.spec is not None and res.spec.tokenizer == bpe
    assert res.between(res.start_s, res.end_s).spec is res.spec


def test_token_id_prompts_go_as_lists_of_ints(bpe) -> None:
    srv = StandIn(tokenizer=bpe)
    res = _run(
        srv,
        tokenizer=bpe,
        prompt_format="token_ids",
        concurrency=1,
        max_requests=4,
        prompt_tokens=LengthDist(mean=17),
        output_tokens=LengthDist(mean=2),
    )
    assert res.completed == 4
    for _, body in srv.bodies:
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 17
        assert all(type(i) is int for i in body["prompt"])
    assert [r.prompt_tokens for r in res.records] == [17] * 4 == srv.prompt_counts


def test_chat_sends_messages_and_times_the_first_content(bpe) -> None:
    srv = StandIn(tokenizer=bpe, role_delay_s=0.05)
    res = _run(
        srv,
        endpoint="chat",
        tokenizer=bpe,
        concurrency=2,
        max_requests=4,
        prompt_tokens=LengthDist(mean=12),
        output_tokens=LengthDist(mean=6),
        model="m",
    )
    assert res.completed == 4 and res.errors == 0
    for path, body in srv.bodies:
        assert path == "/v1/chat/completions" and "prompt" not in body
        assert body["messages"][0]["role"] == "user" and body["model"] == "m"
        assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 6
    for r in res.records:
        assert r.prompt_tokens == 12  # the content's tokens; the template's are the server's
        assert r.server_prompt_tokens == 12 + CHAT_TEMPLATE_TOKENS
        assert r.output_tokens == 6 and r.output_from_usage
        assert r.ttft_s >= 0.05 - 1e-3  # the role-only event is not a token
        assert r.tpot_s >= 0


def test_chat_without_usage_counts_content_events() -> None:
    srv = StandIn(send_usage=False)
    res = _run(
        srv, endpoint="chat", concurrency=1, max_requests=2, output_tokens=LengthDist(mean=5)
    )
    # 5 content events; neither the role event nor the empty finish event is a token
    assert [(r.output_tokens, r.output_from_usage) for r in res.records] == [(5, False)] * 2
    assert [r.server_prompt_tokens for r in res.records] == [None, None]


def test_ignore_eos_is_sent_and_short_outputs_are_flagged() -> None:
    srv = StandIn(eos_after=3)
    res = _run(srv, concurrency=2, max_requests=4, output_tokens=LengthDist(mean=8))
    assert all("ignore_eos" not in b for _, b in srv.bodies)
    assert [r.output_tokens for r in res.records] == [3] * 4
    assert all(r.length_mismatch for r in res.records) and res.length_mismatches == 4

    srv = StandIn(eos_after=3)
    res = _run(
        srv, ignore_eos=True, concurrency=2, max_requests=4, output_tokens=LengthDist(mean=8)
    )
    assert all(b["ignore_eos"] is True for _, b in srv.bodies)
    assert [r.output_tokens for r in res.records] == [8] * 4 and res.length_mismatches == 0


def test_packed_events_count_from_usage_else_as_events() -> None:
    with_usage = _run(
        StandIn(tokens_per_event=3), concurrency=1, max_requests=2,
        output_tokens=LengthDist(mean=7),
    )  # fmt: skip
    assert [r.output_tokens for r in with_usage.records] == [7, 7]
    without = _run(
        StandIn(tokens_per_event=3, send_usage=False), concurrency=1, max_requests=2,
        output_tokens=LengthDist(mean=7),
    )  # fmt: skip
    assert [r.output_tokens for r in without.records] == [3, 3]  # 3 events: a lower bound
    assert without.length_mismatches == 2


def test_connections_are_kept_alive_and_reused() -> None:
    srv = StandIn()
    res = _run(srv, concurrency=3, max_requests=30, output_tokens=LengthDist(mean=2))
    assert res.completed == 30
    assert 1 <= len(srv.peers) <= 3  # one connection per worker, not one per request


def test_open_loop_and_trace_with_a_tokenizer(bpe, tmp_path) -> None:
    tok = Tokenizer.from_file(bpe)
    trace = (
        TraceItem(max_tokens=2, prompt="the lazy dog", arrival_s=0.0),
        TraceItem(max_tokens=3, prompt_tokens=9, arrival_s=0.01),
    )
    srv = StandIn(tokenizer=bpe)
    res = _run(srv, mode="trace", trace=trace, tokenizer=bpe, max_requests=2)
    assert sorted(r.prompt_tokens for r in res.records) == sorted(
        [len(tok.encode("the lazy dog").ids), 9]
    )
    srv = StandIn(tokenizer=bpe)
    res = _run(srv, mode="open", rate_rps=100.0, concurrency=8, max_requests=10, tokenizer=bpe)
    assert len(res.records) + res.dropped + res.cancelled == 10
    assert all(r.prompt_tokens == r.server_prompt_tokens for r in res.records)


def test_wordlevel_tokenizer_end_to_end(wordlevel) -> None:
    srv = StandIn(tokenizer=wordlevel)
    res = _run(
        srv, tokenizer=wordlevel, concurrency=1, max_requests=3, prompt_tokens=LengthDist(mean=25)
    )
    assert [r.prompt_tokens for r in res.records] == [25] * 3 == srv.prompt_counts
