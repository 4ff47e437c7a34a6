"""OpenAI-compatible completion schemas: request parsing, response bodies, SSE framing.

Pure functions and frozen dataclasses, no Ray and no torch: the Ray Serve app
(serving/app.py) calls them, tests call them directly.

Only the fields this server honours are accepted; any other field is a 400 that
names it (an accepted-but-ignored ``top_p`` or ``stop`` would be a silent lie).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Fields of POST /v1/completions this server honours.
ALLOWED_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "n", "user"}
)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; pass 0 for greedy decoding
MAX_TEMPERATURE = 2.0

SSE_DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


class ApiError(ValueError):
    """A request the server refuses; becomes an OpenAI-style JSON error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(
    message: str,
    *,
    param: str | None = None,
    type: str = "invalid_request_error",
    code: str | None = None,
) -> dict[str, Any]:
    """The JSON error object OpenAI clients parse (``error.message`` and friends)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body.

    ``prompt`` is either text (to be tokenized by the server) or token ids.
    """

    model: str
    prompt: str | tuple[int, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    user: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ApiError("prompt is empty: give at least one character", param="prompt")
        elif not self.prompt:
            raise ApiError("prompt is an empty token list: give at least one id", param="prompt")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ApiError(
                f"max_tokens={self.max_tokens!r}: must be a positive integer",
                param="max_tokens",
            )
        if self.max_tokens < 1:
            raise ApiError(
                f"max_tokens={self.max_tokens!r}: must be a positive integer (>= 1)",
                param="max_tokens",
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ApiError(
                f"temperature={t!r}: must be a number in [0, {MAX_TEMPERATURE}]",
                param="temperature",
            )
        if not 0.0 <= t <= MAX_TEMPERATURE:
            raise ApiError(
                f"temperature={t!r}: must be in [0, {MAX_TEMPERATURE}]", param="temperature"
            )


def parse_completion_request(body: object, *, served_model: str) -> CompletionRequest:
    """Validate a decoded JSON body; raise :class:`ApiError` naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - ALLOWED_FIELDS)
    if unknown:
        raise ApiError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(ALLOWED_FIELDS))}",
            param=unknown[0],
        )
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(
            f"model {model!r} is not served here; this server serves {served_model!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    if "prompt" not in body:
        raise ApiError("prompt is required", param="prompt")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(f"n={n!r}: only n=1 is supported", param="n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(f"stream={stream!r}: must be true or false", param="stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise ApiError(
                f"stream_options={opts!r}: only {{'include_usage': bool}} is supported",
                param="stream_options",
            )
        include_usage = bool(opts.get("include_usage", False))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"user={user!r}: must be a string", param="user")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    temperature = body.get("temperature", DEFAULT_TEMPERATURE)
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    return CompletionRequest(
        model=str(model),
        prompt=_parse_prompt(body["prompt"]),
        max_tokens=max_tokens,
        temperature=temperature,
        stream=stream,
        include_usage=include_usage,
        user=user,
    )


def _parse_prompt(prompt: object) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]  # a batch of one prompt
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tuple(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], list):
            return _parse_prompt(prompt[0])
    raise ApiError(
        "prompt must be a string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def new_completion_id() -> str:
    return "cmpl-" + uuid.uuid4().hex


def finish_reason(generated: int, max_tokens: int) -> str:
    """``length`` when the token budget ran out, ``stop`` when the model ended first."""
    return "length" if generated >= max_tokens else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    *,
    completion_id: str,
    model: str,
    text: str,
    finish: str | None,
    created: int | None = None,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object: the whole answer, or one streamed chunk."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(
    *, completion_id: str, model: str, created: int, usage_: dict[str, int]
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def models_body(model: str, *, created: int, owned_by: str = "slotune") -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": owned_by}],
    }


def sse_event(obj: object) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(kw_only=True)
class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting characters.

    A byte-level tokenizer can end a step in the middle of a UTF-8 sequence; the
    decoded tail is then U+FFFD, so the delta is held back until it completes.
    """

    decode: Callable[[Sequence[int]], str]
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already returned

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta

    def flush(self) -> str:
        text = self.decode(self.ids)
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta


async def sse_completion_stream(
    tokens: AsyncIterator[int],
    *,
    decode: Callable[[Sequence[int]], str],
    completion_id: str,
    model: str,
    max_tokens: int,
    prompt_tokens: int,
    include_usage: bool = False,
    interval_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion, from the engine's token stream.

    The first text goes out at once; after it, text is sent when ``interval_s``
    has passed since the last event (a token arriving later than that goes out
    at once, so a step slower than the interval is never delayed). Coalescing
    bounds the per-event cost of the transport at small step times. The end is
    one write: the last text with its finish reason, the usage chunk if asked
    for, and ``[DONE]``.
    """
    created = int(time.time())
    decoder = IncrementalDecoder(decode=decode)
    n = 0
    pending = ""
    sent_any = False
    last = clock()
    async for tok in tokens:
        n += 1
        pending += decoder.push(tok)
        if pending and (not sent_any or clock() - last >= interval_s):
            yield sse_event(
                completion_body(
                    completion_id=completion_id,
                    model=model,
                    text=pending,
                    finish=None,
                    created=created,
                )
            )
            pending, sent_any, last = "", True, clock()
    tail = sse_event(
        completion_body(
            completion_id=completion_id,
            model=model,
            text=pending + decoder.flush(),
            finish=finish_reason(n, max_tokens),
            created=created,
        )
    )
    if include_usage:
        tail += sse_event(
            usage_chunk(
                completion_id=completion_id,
                model=model,
                created=created,
                usage_=usage(prompt_tokens, n),
            )
        )
    yield tail + SSE_DONE
