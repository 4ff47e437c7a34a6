"""The OpenAI completions subset the example speaks: the request body, SSE chunks, errors.

Shapes follow OpenAI's ``POST /v1/completions`` (``choices[].text/index/finish_reason``,
``stream_options.include_usage`` adding a last chunk with ``usage`` and empty
``choices``, then ``data: [DONE]``) and vLLM's ``ignore_eos`` extension
(vllm-project/vllm: vllm/entrypoints/openai/protocol.py ``CompletionRequest``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from deploy.examples.serve_batch.tokens import EOS_ID, VOCAB_SIZE, encode

MODEL_ID = "serve-batch-tiny-gru"
MAX_PROMPT_TOKENS = 2048
MAX_NEW_TOKENS = 4096


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The request body; fields the example does not use (temperature, top_p, ...) are
    accepted and ignored (decoding is greedy)."""

    model_config = ConfigDict(extra="allow")
    prompt: str | list[StrictInt]
    max_tokens: int = Field(default=16, ge=1, le=MAX_NEW_TOKENS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    model: str | None = None


class ApiError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True, kw_only=True)
class Job:
    """One request as the batch handler sees it."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids=(): must hold at least one token")
        if not (isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= MAX_NEW_TOKENS):
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be in 1..{MAX_NEW_TOKENS}")

    def finish_reason(self, token: int, n_emitted: int) -> str | None:
        """Why the request ends with ``token`` as its ``n_emitted``-th, or None if it goes on."""
        if token == EOS_ID and not self.ignore_eos:
            return "stop"
        if n_emitted >= self.max_tokens:
            return "length"
        return None


def to_job(req: CompletionRequest) -> Job:
    """The job for a validated body; an :class:`ApiError` for what pydantic cannot check."""
    if req.model is not None and req.model != MODEL_ID:
        raise ApiError(f"model {req.model!r} is not served; use {MODEL_ID!r}", status=404)
    if isinstance(req.prompt, str):
        ids = encode(req.prompt) or (EOS_ID,)  # an empty prompt starts at EOS
    else:
        bad = [t for t in req.prompt if not 0 <= t < VOCAB_SIZE]
        if bad:
            msg = f"prompt token {bad[0]} out of range 0..{VOCAB_SIZE - 1}"
            raise ApiError(msg, param="prompt")
        ids = tuple(req.prompt) or (EOS_ID,)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ApiError(f"prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS}", param="prompt")
    return Job(prompt_ids=ids, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)


def chunk(
    cid: str, created: int, *, text: str | None, finish_reason: str | None = None
) -> dict[str, Any]:
    """A ``text_completion`` object: one choice, or none when ``text`` is None (usage chunk)."""
    choices = (
        []
        if text is None
        else [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]
    )
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": MODEL_ID,
        "choices": choices,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``obj`` as JSON (a str is sent as is: ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"
