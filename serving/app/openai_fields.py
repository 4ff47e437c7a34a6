"""Which OpenAI/vLLM request fields this server knows, and the policy for each.

Pure, no Ray and no torch. Field names and defaults are OpenAI's
(platform.openai.com/docs/api-reference/completions/create, .../chat/create) and vLLM's
(vllm-project/vllm: vllm/entrypoints/openai/protocol.py, ``CompletionRequest``,
``ChatCompletionRequest``); docs/serving.md "Client compatibility" explains the policy.

- Honoured (:data:`COMPLETION_FIELDS`, :data:`CHAT_FIELDS` less the default-only ones):
  their values are validated by serving/app/openai_request.py.
- Known but not honoured (:data:`AT_DEFAULT_ONLY`): accepted at their default (what a
  client sends when it does not use them), a 400 naming the field otherwise: an
  accepted-but-ignored ``top_p: 0.9`` would be a silent lie.
- Unknown: ignored and logged once per name, as vLLM does (``OpenAIBaseModel`` has
  ``extra="allow"`` and its ``__log_extra_fields__`` validator logs "The following fields
  were present in the request but ignored"), so a tool that adds its own metadata works.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from serving.app.openai_api import ApiError, short

logger = logging.getLogger(__name__)


def _none_or(*values: object) -> Callable[[object], bool]:
    """A predicate: the value is null or equal (same JSON type) to one of ``values``."""

    def ok(v: object) -> bool:
        if v is None:
            return True
        for want in values:
            if isinstance(want, bool) or isinstance(v, bool):
                if v is want:
                    return True
            elif isinstance(want, (int, float)) and isinstance(v, (int, float)):
                if v == want:
                    return True
            elif type(v) is type(want) and v == want:
                return True
        return False

    return ok


# Fields this server does not honour: (the accepted values, in words; the test). Their
# defaults are OpenAI's and vLLM's (protocol.py; vLLM's top_k -1 and 0 both disable it).
AT_DEFAULT_ONLY: dict[str, tuple[str, Callable[[object], bool]]] = {
    "best_of": ("1", _none_or(1)),
    "echo": ("false", _none_or(False)),
    "frequency_penalty": ("0", _none_or(0)),
    "presence_penalty": ("0", _none_or(0)),
    "repetition_penalty": ("1", _none_or(1)),
    "length_penalty": ("1", _none_or(1)),
    "logit_bias": ("null or {}", _none_or({})),
    "logprobs": ("null or false", _none_or(False)),
    "top_logprobs": ("null or 0", _none_or(0)),
    "prompt_logprobs": ("null", _none_or()),
    "suffix": ("null or ''", _none_or("")),
    "top_p": ("1", _none_or(1)),
    "top_k": ("-1 or 0", _none_or(-1, 0)),
    "min_p": ("0", _none_or(0)),
    "use_beam_search": ("false", _none_or(False)),
    "skip_special_tokens": ("true", _none_or(True)),
    "truncate_prompt_tokens": ("null", _none_or()),
    "allowed_token_ids": ("null", _none_or()),
    "bad_words": ("null or []", _none_or([])),
    "response_format": ("null or {'type': 'text'}", _none_or({"type": "text"})),
    "guided_json": ("null", _none_or()),
    "guided_regex": ("null", _none_or()),
    "guided_choice": ("null", _none_or()),
    "guided_grammar": ("null", _none_or()),
    "structured_outputs": ("null", _none_or()),
    "logits_processors": ("null", _none_or()),
    "prompt_embeds": ("null", _none_or()),
    "priority": ("0", _none_or(0)),
    "tools": ("null or []", _none_or([])),
    "tool_choice": ("null, 'none' or 'auto' (no tools)", _none_or("none", "auto")),
    "functions": ("null or []", _none_or([])),
    "continue_final_message": ("false", _none_or(False)),
    "reasoning_effort": ("null", _none_or()),
}
# Honoured by both endpoints (openai_request.py ``_options``); plus each endpoint's own.
_COMMON = frozenset(
    {
        "model", "max_tokens", "temperature", "stream", "stream_options", "n", "user", "seed",
        "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
        "spaces_between_special_tokens",  # no effect: special tokens are never shown
    }
)  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt"} | frozenset(AT_DEFAULT_ONLY)
CHAT_FIELDS = (
    _COMMON
    | {"messages", "max_completion_tokens", "add_generation_prompt"}
    | frozenset(AT_DEFAULT_ONLY)
)

_warned: set[str] = set()  # unknown field names already logged (bounded below)
_MAX_WARNED = 256


def check_fields(body: dict[str, Any], known: frozenset[str] | set[str]) -> None:
    """400 for a known field at a value this server does not honour; unknown fields are
    logged (once per name) and ignored."""
    for name, (allowed, ok) in AT_DEFAULT_ONLY.items():
        if name in body and not ok(body[name]):
            raise ApiError(
                f"{name}: {short(body[name])} is not supported (only {allowed})", param=name
            )
    unknown = [k for k in body if k not in known and k not in _warned]
    if unknown and len(_warned) < _MAX_WARNED:
        _warned.update(unknown)
        logger.warning(
            "ignoring request field(s) this server does not know: %s",
            ", ".join(short(k) for k in unknown[:10]),
        )
