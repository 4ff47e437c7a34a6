"""Parsing ``POST /v1/completions`` and ``POST /v1/chat/completions`` bodies.

Pure functions and frozen dataclasses, no Ray and no torch: the Ray Serve app
(serving/app/completions.py) calls them, tests call them directly. A chat request becomes the
same :class:`CompletionRequest` as a completion, its prompt rendered from the messages
by the model's own chat template where it has one (serving/model/chat_template.py), else
by the plain one (serving/model/tokenizer.py ``render_chat``).

Which fields each endpoint knows, which are accepted at their default only, and what
happens to unknown ones: serving/app/openai_fields.py (docs/serving.md "Client
compatibility"). Honoured here: ``model``, ``prompt`` / ``messages``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``stream``, ``stream_options``
(``include_usage``, ``continuous_usage_stats``), ``n`` (1), ``user``, ``seed`` (with
temperature 0), ``stop``, and vLLM's ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``include_stop_str_in_output``, ``add_generation_prompt``; their names and defaults are
OpenAI's and vLLM's (vllm-project/vllm: vllm/entrypoints/openai/protocol.py,
``CompletionRequest``, ``ChatCompletionRequest``, ``StreamOptions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from serving.app.openai_api import ApiError, short, text_prompt
from serving.app.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from serving.model.chat_template import ChatTemplate
from serving.model.tokenizer import render_chat

DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; pass 0 for greedy decoding
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1 << 18  # a whole vocabulary fits; the body limit bounds it anyway
_INT64 = 2**63  # vLLM's ``seed`` bounds: torch.iinfo(torch.long)


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A validated completion or chat request.

    ``prompt`` is text (to be tokenized by the server) or token ids; a chat request's is
    its messages rendered by the plain chat template. ``max_tokens`` None (chat without a
    limit): as many as the context leaves after the prompt.
    """

    model: str
    prompt: str | tuple[int, ...]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in each
    user: str | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # ids that end the request (EOS is the server's)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # generate past EOS until max_tokens
    min_tokens: int = 0  # no stop id and no stop string before this many tokens
    chat: bool = False  # answer in the chat.completion format
    # whether the tokenizer adds its special tokens (BOS) to a text prompt: not to a
    # prompt from the model's chat template, which writes its own
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ApiError("prompt is empty: give at least one character", param="prompt")
        elif not self.prompt:
            raise ApiError("prompt is an empty token list: give at least one id", param="prompt")
        mt = self.max_tokens
        if mt is not None and (not _is_int(mt) or mt < 1):
            raise ApiError(
                f"max_tokens={short(mt)}: must be a positive integer", param="max_tokens"
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ApiError(
                f"temperature={short(t)}: must be a number in [0, {MAX_TEMPERATURE}]",
                param="temperature",
            )
        if not 0.0 <= t <= MAX_TEMPERATURE:
            raise ApiError(
                f"temperature={t!r}: must be in [0, {MAX_TEMPERATURE}]", param="temperature"
            )
        if mt is not None and self.min_tokens > mt:
            raise ApiError(
                f"min_tokens={self.min_tokens}: must be at most max_tokens={mt}",
                param="min_tokens",
            )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_completion_request(body: object, *, served_model: str) -> CompletionRequest:
    """Validate a decoded ``/v1/completions`` body; raise :class:`ApiError` naming the bad
    field."""
    body = _object(body)
    check_fields(body, COMPLETION_FIELDS)
    model = _model(body, served_model)
    if "prompt" not in body:
        raise ApiError("prompt is required", param="prompt")
    max_tokens = body.get("max_tokens")
    return CompletionRequest(
        model=model,
        prompt=_parse_prompt(body["prompt"]),
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        **_options(body),
    )


def parse_chat_request(
    body: object, *, served_model: str, chat_template: ChatTemplate | None = None
) -> CompletionRequest:
    """Validate a decoded ``/v1/chat/completions`` body (see :func:`parse_completion_request`)
    and render its messages with ``chat_template`` (None: the plain template)."""
    body = _object(body)
    check_fields(body, CHAT_FIELDS)
    model = _model(body, served_model)
    if "messages" not in body:
        raise ApiError("messages is required", param="messages")
    add_prompt = _bool(body, "add_generation_prompt", default=True)
    # OpenAI's max_completion_tokens replaces the deprecated max_tokens (vLLM takes either)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    messages = _messages(body["messages"])
    if chat_template is None:
        text = render_chat(messages, generation_prompt=add_prompt)
    else:
        try:
            text = chat_template.render(messages, add_generation_prompt=add_prompt)
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
    return CompletionRequest(
        model=model,
        prompt=text_prompt(text),
        max_tokens=max_tokens,
        chat=True,
        add_special_tokens=chat_template is None,
        **_options(body),
    )


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _model(body: dict[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(
            f"model {short(model)} is not served here; this server serves {served_model!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    return served_model


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """The fields both endpoints share, validated, as CompletionRequest keywords."""
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(f"n: {short(n)} is not supported (only 1)", param="n")
    stream = _bool(body, "stream", default=False)
    include_usage, continuous = _stream_options(body.get("stream_options"), stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"user={short(user)}: must be a string", param="user")
    temperature = body.get("temperature")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not -_INT64 <= seed < _INT64:
            raise ApiError(f"seed={short(seed)}: must be a 64-bit integer", param="seed")
        if temperature != 0:  # greedy decoding is deterministic: the seed is honoured
            raise ApiError(
                f"seed: {seed} is not supported with temperature {short(temperature)} (only "
                "with temperature 0: this server samples from one shared generator)",
                param="seed",
            )
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise ApiError(
            f"min_tokens={short(min_tokens)}: must be an integer >= 0", param="min_tokens"
        )
    spaces = body.get("spaces_between_special_tokens")
    if spaces is not None and not isinstance(spaces, bool):
        raise ApiError(
            f"spaces_between_special_tokens={short(spaces)}: must be true or false",
            param="spaces_between_special_tokens",
        )
    return {
        "temperature": temperature,
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "user": user,
        "stop": _stop(body.get("stop")),
        "stop_token_ids": _stop_token_ids(body.get("stop_token_ids")),
        "include_stop_str_in_output": _bool(body, "include_stop_str_in_output", default=False),
        "ignore_eos": _bool(body, "ignore_eos", default=False),
        "min_tokens": min_tokens,
    }


def _bool(body: dict[str, Any], name: str, *, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{name}={short(v)}: must be true or false", param=name)
    return v


def _stream_options(opts: object, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats). As vLLM's ``StreamOptions``:
    ``include_usage`` defaults to true once ``stream_options`` is given,
    ``continuous_usage_stats`` to false and needs ``include_usage``; other keys are
    ignored; non-empty options without ``stream: true`` are refused."""
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise ApiError(f"stream_options={short(opts)}: must be an object", param="stream_options")
    if opts and not stream:  # as OpenAI and vLLM: the options of a stream need a stream
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    out = []
    for key, default in (("include_usage", True), ("continuous_usage_stats", False)):
        v = opts.get(key)
        if v is not None and not isinstance(v, bool):
            raise ApiError(
                f"stream_options.{key}={short(v)}: must be true or false",
                param=f"stream_options.{key}",
            )
        out.append(default if v is None else v)
    return (out[0], out[0] and out[1]) if stream else (False, False)


def _stop(stop: object) -> tuple[str, ...]:
    """null, a string or a list of strings; empty strings stop nothing and are dropped."""
    items = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(f"stop={short(stop)}: must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise ApiError(
            f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
    return tuple(text_prompt(s, param="stop") for s in dict.fromkeys(items) if s)


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_TOKEN_IDS
        or not all(_is_int(i) and 0 <= i < _INT64 for i in ids)
    ):
        raise ApiError(
            f"stop_token_ids={short(ids)}: must be a list of at most {MAX_STOP_TOKEN_IDS} "
            "token ids (integers >= 0)",
            param="stop_token_ids",
        )
    return tuple(dict.fromkeys(ids))


def _parse_prompt(prompt: object) -> str | tuple[int, ...]:
    """Text, token ids, or a batch of one of either (``["text"]``, ``[[ids]]``)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return text_prompt(prompt)
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return tuple(prompt)
    raise ApiError(
        "prompt must be a string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def _messages(messages: object) -> list[tuple[str, str]]:
    """(role, text) of each message. ``content`` is a string, null, or a list of
    ``{"type": "text", "text": ...}`` parts (what vLLM's benchmark client sends); other
    part types (images, audio) and tool calls are refused, naming the part."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of message objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where}: must be an object with role and content", param=where)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(f"{where}.role={short(role)}: must be a string", param=f"{where}.role")
        if m.get("tool_calls"):
            raise ApiError(
                f"{where}.tool_calls is not supported (only text messages)",
                param=f"{where}.tool_calls",
            )
        out.append((role, _content(m.get("content"), f"{where}.content")))
    return out


def _content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            f"{where}={short(content)}: must be a string or a list of text parts", param=where
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                f"{where}[{j}].type: {short(kind)} is not supported (only 'text' parts "
                "with a string 'text')",
                param=f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)
