"""OpenAI-compatible errors, JSON bodies in and out, and SSE framing.

Pure functions and frozen dataclasses, no Ray and no torch: the Ray Serve app
(serving/app/completions.py) calls them, tests call them directly. Parsing request fields
is serving/app/openai_request.py's, which fields are known serving/app/openai_fields.py's;
the text a client sees, stop ids and stop strings serving/app/text_output.py's. Response
shapes are OpenAI's ``text_completion``, ``chat.completion`` and ``chat.completion.chunk``
(platform.openai.com/docs/api-reference, as vLLM serves them:
vllm/entrypoints/openai/protocol.py ``CompletionStreamResponse``,
``ChatCompletionStreamResponse``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving.app.text_output import TextOutput

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


def text_prompt(text: str, *, param: str = "prompt") -> str:
    """``text``, if it is Unicode text: JSON's ``\\ud800`` escapes can smuggle in a lone
    surrogate, which no UTF-8 tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            f"{param}: not valid Unicode text (a lone surrogate {text[e.start]!r} at "
            f"character {e.start})",
            param=param,
        ) from None
    return text


def short(value: object, limit: int = 60) -> str:
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
        raise ApiError(f"request body is not valid JSON: {short(str(e), 200)}") from None


def new_completion_id(*, chat: bool = False) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


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
    chat: bool = False,
) -> dict[str, Any]:
    """A whole answer: a ``text_completion`` (also each streamed chunk of one), or with
    ``chat`` a ``chat.completion`` whose message is the assistant's."""
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}}
        if chat
        else {"index": 0, "text": text}
    )
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice | {"logprobs": None, "finish_reason": finish}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_chunk_body(
    *,
    completion_id: str,
    model: str,
    created: int,
    text: str,
    finish: str | None,
    role: bool = False,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``: the assistant's role in the first delta (OpenAI's
    stream format), an empty delta with the finish reason when no text is left."""
    delta: dict[str, str] = {"role": "assistant"} if role else {}
    if text or finish is None or role:
        delta["content"] = text
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(
    *, completion_id: str, model: str, created: int, usage_: dict[str, int], chat: bool = False
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
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


@dataclass(frozen=True, kw_only=True)
class ChunkEncoder:
    """SSE events of one streamed completion (``chat``: chat completion), byte for byte
    what :func:`sse_event` of :func:`completion_body` (:func:`chat_chunk_body`) gives. A
    plain text chunk, the common case, JSON-encodes only its text."""

    completion_id: str
    model: str
    created: int
    chat: bool = False
    _head: bytes = field(init=False, repr=False)
    _tail: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        marker = "\x00"  # the text is the last string of the body: split at its JSON
        head, tail = sse_event(self.body(marker, None)).decode().rsplit(json.dumps(marker), 1)
        object.__setattr__(self, "_head", head.encode())
        object.__setattr__(self, "_tail", tail.encode())

    def body(
        self,
        text: str,
        finish: str | None,
        *,
        first: bool = False,
        usage_: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            return chat_chunk_body(
                completion_id=self.completion_id,
                model=self.model,
                created=self.created,
                text=text,
                finish=finish,
                role=first,
                usage_=usage_,
            )
        return completion_body(
            completion_id=self.completion_id,
            model=self.model,
            text=text,
            finish=finish,
            created=self.created,
            usage_=usage_,
        )

    def text(
        self, text: str, *, first: bool = False, usage_: dict[str, int] | None = None
    ) -> bytes:
        """One chunk carrying ``text`` with no finish reason (``first``: the stream's first
        chunk; ``usage_``: the usage so far, for ``continuous_usage_stats``)."""
        if usage_ is None and not (first and self.chat):
            return self._head + json.dumps(text).encode() + self._tail
        return sse_event(self.body(text, None, first=first, usage_=usage_))

    def final(
        self,
        text: str,
        finish: str,
        *,
        first: bool = False,
        usage_: dict[str, int] | None = None,
    ) -> bytes:
        return sse_event(self.body(text, finish, first=first, usage_=usage_))

    def usage(self, usage_: dict[str, int]) -> bytes:
        return sse_event(
            usage_chunk(
                completion_id=self.completion_id,
                model=self.model,
                created=self.created,
                usage_=usage_,
                chat=self.chat,
            )
        )


async def sse_completion_stream(
    chunks: AsyncIterator[Sequence[int]],
    *,
    output: TextOutput,
    completion_id: str,
    model: str,
    max_tokens: int,
    prompt_tokens: int,
    chat: bool = False,
    include_usage: bool = False,
    continuous_usage: bool = False,
    interval_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    on_incomplete: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion, from the engine's token chunks.

    ``chunks`` yields lists of token ids, each everything the engine had sampled
    for the request when the handler got to run (``AsyncEngine.generate_chunks``):
    all of them go out in one event, so a handler that falls behind catches up
    with one event instead of one per token. ``output`` turns them into text and
    decides the end (stop ids, stop strings; serving/app/text_output.py): on a stop
    string the stream stops reading ``chunks`` (the caller then ends the engine
    request). The first text goes out at once; after it, text is sent when
    ``interval_s`` has passed since the last event (a chunk arriving later than that
    goes out at once, so a step slower than the interval is never delayed). The end is
    one write: the last text with its finish reason, the usage chunk if asked for
    (``include_usage``), and ``[DONE]``. With ``continuous_usage`` every chunk carries
    the usage so far (vLLM's ``stream_options.continuous_usage_stats``).

    ``on_incomplete`` is called when a chunk's tokens end inside a character, so
    no text could go out: the server uses it to have the engine hand the next
    token over at once instead of after its stream interval.
    """
    enc = ChunkEncoder(
        completion_id=completion_id, model=model, created=int(time.time()), chat=chat
    )

    def so_far() -> dict[str, int] | None:
        return usage(prompt_tokens, output.tokens) if continuous_usage else None

    pending = ""
    sent_any = False
    last = clock()
    async for chunk in chunks:
        delta = output.push(chunk)
        if output.stopped == "string":
            pending += delta
            break
        if not delta and chunk and on_incomplete is not None:
            on_incomplete()
        pending += delta
        if pending and (not sent_any or clock() - last >= interval_s):
            yield enc.text(pending, first=not sent_any, usage_=so_far())
            pending, sent_any, last = "", True, clock()
    tail, finish = output.finish(max_tokens)
    end = enc.final(pending + tail, finish, first=not sent_any, usage_=so_far())
    if include_usage:
        end += enc.usage(usage(prompt_tokens, output.tokens))
    yield end + SSE_DONE
