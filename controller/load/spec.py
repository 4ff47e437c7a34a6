"""What load to offer: request shapes (length distributions, JSONL traces) and the bounds.

Lengths are drawn from :class:`serving.sim.workload.LengthDist` (the simulator's too).

:class:`LoadSpec` says where (one URL), how (closed loop, open-loop Poisson, or a
trace's arrival times), how many and for how long; :func:`saturating_spec` is the
default load for a candidate configuration. :mod:`controller.load.generator` drives it.
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


def completions_url(base: str) -> str:
    """``http://host:port[/prefix]`` → ``.../v1/completions`` (unchanged if already there)."""
    base = base.rstrip("/")
    return base if base.endswith("/v1/completions") else base + "/v1/completions"
