"""One streamed request: its JSON body, and what the client saw of its SSE answer.

Two wire formats, as OpenAI defines them and vLLM, SGLang and Ray Serve LLM serve them:

- ``completions`` (``POST /v1/completions``): ``prompt`` is text or a list of token ids;
  each event's ``choices[0].text`` carries text;
- ``chat`` (``POST /v1/chat/completions``): ``messages=[{"role": "user", "content": ...}]``;
  each event's ``choices[0].delta.content`` (or ``reasoning_content``, a reasoning model's
  thoughts, which are tokens all the same) carries text; the first event often carries
  only ``{"role": "assistant"}``.

Both ask ``stream_options.include_usage``: the last event then has ``usage`` with the
server's own ``prompt_tokens`` and ``completion_tokens``, and no choices. The output
length recorded is ``completion_tokens`` when the server sent it, else the number of
events that carried text (a lower bound: a server may pack several tokens in one event).

Times (client clock, unix seconds): the first token is the first event carrying text,
the last token the last event with a choice (a final event with only a finish reason
closes the stream right after the last token); TTFT and TPOT follow from them and the
token count (:class:`~controller.load.result.RequestRecord`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from controller.load.prompts import Prompt
from controller.load.result import RequestRecord
from controller.load.spec import LoadSpec


def request_body(spec: LoadSpec, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    value = prompt.value
    body: dict[str, Any] = {}
    if spec.endpoint == "chat":
        assert isinstance(value, str)  # LoadSpec allows only text prompts with chat
        body["messages"] = [{"role": "user", "content": value}]
    else:
        body["prompt"] = value if isinstance(value, str) else list(value)
    # max_tokens, not the newer max_completion_tokens: every server named above takes it
    body["max_tokens"] = max_tokens
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    body["temperature"] = 0.0
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.model is not None:
        body["model"] = spec.model
    return body


def _text_of(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_one(
    client: httpx.AsyncClient, spec: LoadSpec, prompt: Prompt, max_tokens: int
) -> RequestRecord:
    """POST one request to ``spec.url`` and read its stream to the end (or to an error)."""
    body = request_body(spec, prompt, max_tokens)
    chat = spec.endpoint == "chat"
    sent = time.time()
    first: float | None = None
    first_choice: float | None = None  # a stream whose text is all empty is timed by this
    last: float | None = None
    events = 0  # events that carried text
    usage_out: int | None = None
    usage_prompt: int | None = None
    status = 0
    error = ""
    try:
        async with client.stream("POST", spec.url, json=body) as resp:
            status = resp.status_code
            if status != 200:
                detail = (await resp.aread())[:200].decode("utf-8", "replace")
                error = f"HTTP {status}: {detail}"
            else:
                done = False
                async for line in resp.aiter_lines():
                    # read on past [DONE] to the body's end: a response read to its end
                    # hands its connection back to the pool, one cut short closes it
                    if done or not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    now = time.time()
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        error = f"malformed SSE data: {data[:80]!r}"
                        break
                    if not isinstance(chunk, dict):
                        error = f"malformed SSE data: {data[:80]!r}"
                        break
                    if chunk.get("error"):
                        error = f"server error in stream: {chunk['error']}"
                        break
                    usage = chunk.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        usage_out = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        usage_prompt = int(usage["prompt_tokens"])
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue
                    if first_choice is None:
                        first_choice = now
                    if _text_of(choices[0], chat):
                        events += 1
                        if first is None:
                            first = now
                    if first is not None:
                        last = now
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if first is None and first_choice is not None:
        first, last = first_choice, last or first_choice
    from_usage = usage_out is not None and usage_out > 0
    return RequestRecord(
        sent_s=sent,
        done_s=time.time(),
        first_token_s=first,
        last_token_s=last,
        prompt_tokens=prompt.tokens,
        max_tokens=max_tokens,
        output_tokens=usage_out if from_usage else events,  # type: ignore[arg-type]
        status=status,
        error=error,
        output_from_usage=from_usage,
        server_prompt_tokens=usage_prompt,
    )
