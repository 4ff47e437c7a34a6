"""OpenAI-compatible completion schemas: request parsing, response bodies, SSE framing.

Pure functions and frozen dataclasses, no Ray and no torch: the Ray Serve app
(serving/app/server.py) calls them, tests call them directly.

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
    """The JSON error object OpenAI clients parse (``error.message`` and friends). Text
    echoed from the client is made encodable (a lone surrogate becomes ``\\ud800``), so
    the error itself can always be sent as UTF-8."""
    msg, par = _utf8(message), None if param is None else _utf8(param)
    return {"error": {"message": msg, "type": type, "param": par, "code": code}}


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
                f"max_tokens={_short(self.max_tokens)}: must be a positive integer",
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
                f"temperature={_short(t)}: must be a number in [0, {MAX_TEMPERATURE}]",
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
            f"unknown field(s) {', '.join(map(_short, unknown[:5]))}; "
            f"allowed: {', '.join(sorted(ALLOWED_FIELDS))}",
            param=unknown[0][:60],
        )
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(
            f"model {_short(model)} is not served here; this server serves {served_model!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    if "prompt" not in body:
        raise ApiError("prompt is required", param="prompt")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(f"n={_short(n)}: only n=1 is supported", param="n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(f"stream={_short(stream)}: must be true or false", param="stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:  # as OpenAI: the options of a stream need a stream
            raise ApiError(
                "stream_options is only allowed with stream: true", param="stream_options"
            )
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise ApiError(
                f"stream_options={_short(opts)}: only {{'include_usage': bool}} is supported",
                param="stream_options",
            )
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise ApiError(
                f"stream_options.include_usage={_short(include_usage)}: must be true or false",
                param="stream_options.include_usage",
            )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"user={_short(user)}: must be a string", param="user")
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
    """Text, token ids, or a batch of one of either (``["text"]``, ``[[ids]]``)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return _text(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return tuple(prompt)
    raise ApiError(
        "prompt must be a string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def _text(prompt: str) -> str:
    """The prompt, if it is Unicode text: JSON's ``\\ud800`` escapes can smuggle in a lone
    surrogate, which no UTF-8 tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            f"prompt: not valid Unicode text (a lone surrogate {prompt[e.start]!r} at "
            f"character {e.start})",
            param="prompt",
        ) from None
    return prompt


def _short(value: object, limit: int = 60) -> str:
    """``repr`` of a client's value, cut to ``limit`` characters for an error message."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def parse_json_body(raw: bytes) -> object:
    """Decode a request body as JSON; every way it can fail is an :class:`ApiError` (400).

    Bytes that are not UTF-8, malformed JSON, ``NaN``/``Infinity`` literals (not JSON),
    numbers Python will not convert, and nesting deeper than the parser's recursion
    limit each get a message, never an exception a server would turn into a 500."""

    def no_constants(name: str) -> object:
        raise ValueError(f"{name} is not a JSON value")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"request body is not UTF-8 (byte {e.start}): send JSON text") from None
    try:
        return json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise ApiError("request body is nested too deeply to be a completion request") from None
    except ValueError as e:  # JSONDecodeError, int conversion limits, parse_constant
        raise ApiError(f"request body is not valid JSON: {_short(str(e), 200)}") from None


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
    Each push decodes only a short window (the ids since the text last came out
    clean, plus the ones before them for context, as vLLM's incremental
    detokenizer does), so a long output costs O(1) per token, not O(length).
    """

    decode: Callable[[Sequence[int]], str]
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # window start: ids before it are out and do not change the text
    read: int = 0  # ids before it are out (as text)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def push_many(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        done = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if not final and text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]


@dataclass(frozen=True, kw_only=True)
class ChunkEncoder:
    """SSE events of one streamed completion, byte for byte what :func:`sse_event` of
    :func:`completion_body` gives, with only the text JSON-encoded per event."""

    completion_id: str
    model: str
    created: int
    _head: bytes = field(init=False, repr=False)
    _tail: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        marker = "\x00"  # the text is the last string of the body: split at its JSON
        body = completion_body(
            completion_id=self.completion_id,
            model=self.model,
            text=marker,
            finish=None,
            created=self.created,
        )
        head, tail = sse_event(body).decode().rsplit(json.dumps(marker), 1)
        object.__setattr__(self, "_head", head.encode())
        object.__setattr__(self, "_tail", tail.encode())

    def text(self, text: str) -> bytes:
        """One chunk carrying ``text`` with no finish reason."""
        return self._head + json.dumps(text).encode() + self._tail

    def final(self, text: str, finish: str) -> bytes:
        return sse_event(
            completion_body(
                completion_id=self.completion_id,
                model=self.model,
                text=text,
                finish=finish,
                created=self.created,
            )
        )


async def sse_completion_stream(
    chunks: AsyncIterator[Sequence[int]],
    *,
    decode: Callable[[Sequence[int]], str],
    completion_id: str,
    model: str,
    max_tokens: int,
    prompt_tokens: int,
    include_usage: bool = False,
    interval_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    on_incomplete: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion, from the engine's token chunks.

    ``chunks`` yields lists of token ids, each everything the engine had sampled
    for the request when the handler got to run (``AsyncEngine.generate_chunks``):
    all of them go out in one event, so a handler that falls behind catches up
    with one event instead of one per token. The first text goes out at once;
    after it, text is sent when ``interval_s`` has passed since the last event
    (a chunk arriving later than that goes out at once, so a step slower than the
    interval is never delayed). The end is one write: the last text with its
    finish reason, the usage chunk if asked for, and ``[DONE]``.

    ``on_incomplete`` is called when a chunk's tokens end inside a character, so
    no text could go out: the server uses it to have the engine hand the next
    token over at once instead of after its stream interval.
    """
    enc = ChunkEncoder(completion_id=completion_id, model=model, created=int(time.time()))
    decoder = IncrementalDecoder(decode=decode)
    n = 0
    pending = ""
    sent_any = False
    last = clock()
    async for chunk in chunks:
        n += len(chunk)
        delta = decoder.push_many(chunk)
        if not delta and chunk and on_incomplete is not None:
            on_incomplete()
        pending += delta
        if pending and (not sent_any or clock() - last >= interval_s):
            yield enc.text(pending)
            pending, sent_any, last = "", True, clock()
    tail = enc.final(pending + decoder.flush(), finish_reason(n, max_tokens))
    if include_usage:
        tail += sse_event(
            usage_chunk(
                completion_id=completion_id,
                model=model,
                created=enc.created,
                usage_=usage(prompt_tokens, n),
            )
        )
    yield tail + SSE_DONE
