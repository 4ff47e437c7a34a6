"""What load to offer: request shapes (length distributions, JSONL traces) and the bounds.

Lengths are drawn from :class:`serving.sim.workload.LengthDist` (the simulator's too).

:class:`LoadSpec` says where (one URL), how (closed loop, open-loop Poisson, or a
trace's arrival times), how many and for how long, and what each request looks like
on the wire: which endpoint (``completions`` or ``chat``), how the prompt is sent
(``text`` or ``token_ids``), which tokenizer sizes it, whether ``ignore_eos`` is asked.
:func:`saturating_spec` is the default load for a candidate configuration.
:mod:`controller.load.generator` drives it; :mod:`controller.load.prompts` builds the prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from serving.sim.workload import LengthDist

MODES = ("closed", "open", "trace")
ENDPOINTS = ("completions", "chat")  # /v1/completions, /v1/chat/completions
PROMPT_FORMATS = ("text", "token_ids")
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Servers whose OpenAI-compatible API takes ``ignore_eos`` (and a prompt as a list of
# token ids): vLLM (vllm/entrypoints/openai/protocol.py, CompletionRequest and
# ChatCompletionRequest: ``ignore_eos: bool = False``, ``prompt: list[int] | ... | str``),
# SGLang (python/sglang/srt/entrypoints/openai/protocol.py, CompletionRequest), Ray
# Serve LLM, whose request models subclass vLLM's or SGLang's
# (ray/llm/_internal/serve/core/configs/openai_api_models.py), and slotune's own server
# (serving/app/openai_request.py).
IGNORE_EOS_SERVERS = frozenset({"slotune", "vllm", "sglang", "ray-serve-llm"})

# Filler words for synthetic prompts; with a byte-level tokenizer one character
# is one token, so prompts are cut to exactly the sampled number of characters.
_WORDS = (
    "the quick brown fox jumps over a lazy dog while serving engines batch decode "
    "steps under a latency objective and the roofline bounds every token"
).split()


@dataclass(frozen=True, kw_only=True)
class TraceItem:
    """One request of a trace: a prompt (text or a length) and an output length."""

    max_tokens: int
    prompt: str | None = None
    prompt_tokens: int | None = None
    arrival_s: float | None = None  # offset from the start of the run

    def __post_init__(self) -> None:
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"trace max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if self.prompt is None and self.prompt_tokens is None:
            raise ValueError("trace item needs 'prompt' or 'prompt_tokens'")
        if self.prompt is not None and not (isinstance(self.prompt, str) and self.prompt):
            raise ValueError(f"trace prompt={self.prompt!r}: must be a non-empty string")


def load_trace(path: str | Path) -> tuple[TraceItem, ...]:
    """Read a JSONL trace: one object a line with ``max_tokens`` (or ``output_tokens``),
    ``prompt`` or ``prompt_tokens``, and optionally ``arrival_s``."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            items.append(
                TraceItem(
                    max_tokens=int(obj.get("max_tokens", obj.get("output_tokens"))),
                    prompt=obj.get("prompt"),
                    prompt_tokens=obj.get("prompt_tokens"),
                    arrival_s=obj.get("arrival_s"),
                )
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"trace {path} line {n}: {e}") from None
    if not items:
        raise ValueError(f"trace {path}: no requests in it")
    return tuple(items)


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """What load to offer, and its bounds."""

    url: str  # the full endpoint, e.g. http://127.0.0.1:8000/v1/completions
    mode: str = "closed"
    concurrency: int = 8  # closed loop: workers; open/trace: in-flight cap
    rate_rps: float | None = None  # open loop
    max_requests: int = 1000
    duration_s: float = 30.0
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist(mean=32))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist(mean=32))
    trace: tuple[TraceItem, ...] | None = None
    model: str | None = None  # the "model" field; None leaves it to the server's default
    request_timeout_s: float = 60.0
    seed: int = 0
    endpoint: str = "completions"  # the body and stream format: completions or chat
    # text: the prompt as a string; token_ids: as a list of ids (completions only)
    prompt_format: str = "text"
    # a tokenizer.json (or a directory holding one) of the served model: prompts are
    # sized in its tokens; None: text prompts are sized in characters (one token each
    # with slotune's byte tokenizer), token-id prompts are ASCII codes
    tokenizer: str | None = None
    ignore_eos: bool = False  # ask the server to run every request to max_tokens

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url={self.url!r}: must be an http(s) URL with a host")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: allowed {MODES}")
        if not (isinstance(self.concurrency, int) and self.concurrency >= 1):
            raise ValueError(f"concurrency={self.concurrency!r}: must be an integer >= 1")
        if self.mode == "open" and not (
            self.rate_rps is not None and math.isfinite(self.rate_rps) and self.rate_rps > 0
        ):
            raise ValueError(f"rate_rps={self.rate_rps!r}: open loop needs a rate > 0")
        if self.mode == "trace" and not self.trace:
            raise ValueError("mode='trace' needs a trace (load_trace(path))")
        if not (isinstance(self.max_requests, int) and self.max_requests >= 1):
            raise ValueError(f"max_requests={self.max_requests!r}: must be an integer >= 1")
        for name in ("duration_s", "request_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r}: must be a positive number of seconds")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={self.endpoint!r}: allowed {ENDPOINTS}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format={self.prompt_format!r}: allowed {PROMPT_FORMATS}")
        if self.endpoint == "chat" and self.prompt_format == "token_ids":
            raise ValueError(
                "prompt_format='token_ids': chat messages are text; use endpoint='completions'"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: must be True or False")
        if self.tokenizer is not None:
            tokenizer_file(self.tokenizer)  # raises naming the path
        elif self.prompt_format == "token_ids" and any(
            item.prompt is not None for item in self.trace or ()
        ):
            raise ValueError(
                "prompt_format='token_ids' with a trace of text prompts needs a tokenizer "
                "to encode them"
            )

    def summary(self) -> dict[str, object]:
        """What was offered, for a report: the loop, the wire format and the shapes."""
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate_rps": self.rate_rps,
            "endpoint": self.endpoint,
            "prompt_format": self.prompt_format,
            "tokenizer": self.tokenizer,
            "ignore_eos": self.ignore_eos,
            "prompt_tokens": None if self.trace else _dist_text(self.prompt_tokens),
            "output_tokens": None if self.trace else _dist_text(self.output_tokens),
            "trace_requests": len(self.trace) if self.trace else None,
            "seed": self.seed,
        }


def _dist_text(d: LengthDist) -> str:
    if d.kind == "fixed":
        return str(d.mean)
    if d.kind == "uniform":
        return f"uniform:{d.lo}-{d.hi}"
    return f"lognormal:{d.mean},{d.sigma:g}"


def tokenizer_file(path: str) -> Path:
    """The ``tokenizer.json`` that ``path`` names (the file, or a directory holding one)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"tokenizer={path!r}: must be the path of a tokenizer.json")
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(
            f"tokenizer={path!r}: no such file (give a tokenizer.json or a directory with one)"
        )
    return p


def honours_ignore_eos(server: str) -> bool:
    """Whether ``server`` (a name in :data:`IGNORE_EOS_SERVERS`, or any other) takes
    ``ignore_eos``: the default of :attr:`LoadSpec.ignore_eos` for a known server."""
    return server in IGNORE_EOS_SERVERS


def synth_prompt(n_tokens: int, rng: random.Random) -> str:
    """A prompt of exactly ``n_tokens`` characters (one token each with a byte tokenizer)."""
    words: list[str] = []
    length = -1  # no space before the first word
    while length < n_tokens:
        w = rng.choice(_WORDS)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)[:n_tokens]


def saturating_spec(url: str, *, max_concurrency: int, duration_s: float, **kw: object) -> LoadSpec:
    """The default load for a candidate: a closed loop with one worker per admission slot,
    so the deployment always has ``max_concurrency`` requests in flight (saturated) and
    nothing queues in front of it."""
    return LoadSpec(
        url=url,
        mode="closed",
        concurrency=max_concurrency,
        duration_s=duration_s,
        max_requests=kw.pop("max_requests", 100_000),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def completions_url(base: str, endpoint: str = "completions") -> str:
    """``http://host:port[/prefix]`` → ``.../v1/completions`` (``endpoint="chat"``:
    ``.../v1/chat/completions``); a URL that already ends in either path gets the one asked."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint={endpoint!r}: allowed {ENDPOINTS}")
    base = base.rstrip("/")
    for path in sorted(_PATHS.values(), key=len, reverse=True):
        if base.endswith(path):
            base = base[: -len(path)]
            break
    return base + _PATHS[endpoint]
