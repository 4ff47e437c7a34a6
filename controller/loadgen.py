"""Load generator: streaming requests against an OpenAI-compatible ``/v1/completions``.

Drives any such server (the built-in Ray Serve app, vLLM, ...) with one of:

- closed loop: ``concurrency`` workers, each sending the next request as soon as
  its previous one ends (saturating: every admission slot stays occupied);
- open loop: Poisson arrivals at ``rate_rps`` (in-flight capped, excess counted);
- trace: arrivals at the ``arrival_s`` offsets of a JSONL trace.

Every run is bounded by a request count and a wall-clock duration; in-flight
requests still running at the deadline are cancelled (which frees their KV slot
on a server that aborts on disconnect) and counted as ``cancelled``. It only
ever sends ``POST`` to the one URL it was given, never follows redirects and
ignores proxy settings from the environment.

Per request it records the client-side times (send, first token, last token),
the number of streamed tokens and the HTTP status; 429 and 503 are counted as
rejections (backpressure), anything else non-200 as errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from metrics.observation import Observation, Percentiles, Slo
from metrics.samples import exact_quantile, verdict_from_samples

log = logging.getLogger(__name__)

MODES = ("closed", "open", "trace")
DIST_KINDS = ("fixed", "uniform", "lognormal")
REJECT_STATUSES = (429, 503)

# Filler words for synthetic prompts; with a byte-level tokenizer one character
# is one token, so prompts are cut to exactly the sampled number of characters.
_WORDS = (
    "the quick brown fox jumps over a lazy dog while serving engines batch decode "
    "steps under a latency objective and the roofline bounds every token"
).split()


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    """A distribution of token counts (prompt or output lengths), clipped to [low, high]."""

    kind: str = "fixed"
    mean: int = 32
    low: int = 1
    high: int = 4096
    sigma: float = 0.5  # lognormal shape

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"length distribution kind={self.kind!r}: allowed {DIST_KINDS}")
        if not (isinstance(self.low, int) and self.low >= 1):
            raise ValueError(f"low={self.low!r}: must be an integer >= 1")
        if not (isinstance(self.high, int) and self.high >= self.low):
            raise ValueError(f"high={self.high!r}: must be an integer >= low={self.low}")
        if not (isinstance(self.mean, int) and self.low <= self.mean <= self.high):
            raise ValueError(f"mean={self.mean!r}: must be an integer in [{self.low}, {self.high}]")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma={self.sigma!r}: must be a finite number >= 0")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """``"32"`` or ``"fixed:32"``, ``"uniform:16-64"``, ``"lognormal:32,0.5"``."""
        text = spec.strip()
        kind, _, arg = text.partition(":") if ":" in text else ("fixed", "", text)
        try:
            if kind == "fixed":
                n = int(arg)
                return cls(kind="fixed", mean=n, low=1, high=max(n, 1))
            if kind == "uniform":
                lo, hi = (int(x) for x in arg.split("-"))
                return cls(kind="uniform", mean=(lo + hi) // 2, low=lo, high=hi)
            if kind == "lognormal":
                m, s = arg.split(",")
                mean = int(m)
                return cls(kind="lognormal", mean=mean, sigma=float(s), high=max(mean * 8, 1))
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"length spec {spec!r}: expected N, fixed:N, uniform:LO-HI or lognormal:MEAN,SIGMA"
                f" ({e})"
            ) from None
        raise ValueError(f"length spec {spec!r}: kind {kind!r} not in {DIST_KINDS}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            n = self.mean
        elif self.kind == "uniform":
            n = rng.randint(self.low, self.high)
        else:
            # Median exp(mu) chosen so the mean of the lognormal is `mean`.
            mu = math.log(self.mean) - self.sigma**2 / 2
            n = round(rng.lognormvariate(mu, self.sigma))
        return max(self.low, min(self.high, n))


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


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One request as the client saw it (unix seconds)."""

    sent_s: float
    done_s: float
    first_token_s: float | None
    last_token_s: float | None
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    status: int  # HTTP status; 0 when the transport failed
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.output_tokens > 0

    @property
    def rejected(self) -> bool:
        return self.status in REJECT_STATUSES

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s if self.first_token_s is not None else math.nan

    @property
    def tpot_s(self) -> float:
        """(last − first) / (tokens − 1); NaN for a single-token answer."""
        if self.first_token_s is None or self.last_token_s is None or self.output_tokens < 2:
            return math.nan
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """Everything one run did: the records of finished requests and what was cut off."""

    start_s: float
    end_s: float
    records: tuple[RequestRecord, ...]
    cancelled: int = 0  # in flight at the deadline, cancelled
    dropped: int = 0  # open loop: arrivals not sent because the in-flight cap was full

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.records)

    @property
    def rejected(self) -> int:
        return sum(r.rejected for r in self.records)

    @property
    def errors(self) -> int:
        return sum((not r.ok) and not r.rejected for r in self.records)

    @property
    def status_counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.records:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    @property
    def generated_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records if r.ok)

    def between(self, start_s: float, end_s: float) -> LoadResult:
        """The requests that finished inside [start_s, end_s] (a measurement window)."""
        recs = tuple(r for r in self.records if start_s <= r.done_s <= end_s)
        return LoadResult(start_s=start_s, end_s=end_s, records=recs)


def synth_prompt(n_tokens: int, rng: random.Random) -> str:
    """A prompt of exactly ``n_tokens`` characters (one token each with a byte tokenizer)."""
    words: list[str] = []
    length = -1  # no space before the first word
    while length < n_tokens:
        w = rng.choice(_WORDS)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)[:n_tokens]


class _Plan:
    """Produces the (prompt, max_tokens, arrival offset) of request i, deterministically."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.next_arrival = 0.0

    def request(self, i: int) -> tuple[str, int, int]:
        spec = self.spec
        if spec.trace:
            item = spec.trace[i % len(spec.trace)]
            if item.prompt is not None:
                return item.prompt, len(item.prompt), item.max_tokens
            n = int(item.prompt_tokens or 1)
            return synth_prompt(n, self.rng), n, item.max_tokens
        n = spec.prompt_tokens.sample(self.rng)
        return synth_prompt(n, self.rng), n, spec.output_tokens.sample(self.rng)

    def arrival(self, i: int) -> float:
        spec = self.spec
        if spec.mode == "trace":
            assert spec.trace is not None
            period = len(spec.trace)
            item = spec.trace[i % period]
            if item.arrival_s is not None:
                last = spec.trace[-1].arrival_s or 0.0
                return (i // period) * (last + 1e-3) + item.arrival_s
            return 0.0
        self.next_arrival += self.rng.expovariate(spec.rate_rps or 1.0)
        return self.next_arrival


async def _one_request(
    client: httpx.AsyncClient, spec: LoadSpec, prompt: str, n_prompt: int, max_tokens: int
) -> RequestRecord:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if spec.model is not None:
        body["model"] = spec.model
    sent = time.time()
    first: float | None = None
    last: float | None = None
    tokens = 0
    usage_tokens: int | None = None
    status = 0
    error = ""
    try:
        async with client.stream("POST", spec.url, json=body) as resp:
            status = resp.status_code
            if status != 200:
                detail = (await resp.aread())[:200].decode("utf-8", "replace")
                error = f"HTTP {status}: {detail}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.time()
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        error = f"malformed SSE data: {data[:80]!r}"
                        break
                    if chunk.get("error"):
                        error = f"server error in stream: {chunk['error']}"
                        break
                    usage = chunk.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    if chunk.get("choices"):
                        tokens += 1
                        if first is None:
                            first = now
                        last = now
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if usage_tokens is not None and usage_tokens > 0:
        tokens = usage_tokens
    return RequestRecord(
        sent_s=sent,
        done_s=time.time(),
        first_token_s=first,
        last_token_s=last,
        prompt_tokens=n_prompt,
        max_tokens=max_tokens,
        output_tokens=tokens,
        status=status,
        error=error,
    )


async def run_load(
    spec: LoadSpec,
    *,
    client: httpx.AsyncClient | None = None,
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> LoadResult:
    """Offer the load ``spec`` describes; returns when the count or the duration is spent,
    or as soon as ``stop`` is set (in-flight requests are then cancelled). ``on_record`` is
    called with each finished request as it finishes."""
    own = client is None
    if client is None:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(spec.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=spec.concurrency + 4, max_keepalive_connections=0),
            follow_redirects=False,
            trust_env=False,
        )
    plan = _Plan(spec)
    records: list[RequestRecord] = []
    issued = 0
    dropped = 0
    in_flight: set[asyncio.Task[RequestRecord]] = set()
    start = time.time()
    t0 = time.monotonic()
    deadline = t0 + spec.duration_s

    def take() -> int | None:
        nonlocal issued
        if issued >= spec.max_requests or time.monotonic() >= deadline:
            return None
        if stop is not None and stop.is_set():
            return None
        issued += 1
        return issued - 1

    async def worker() -> None:
        while (i := take()) is not None:
            prompt, n, max_tokens = plan.request(i)
            rec = await _one_request(client, spec, prompt, n, max_tokens)
            records.append(rec)
            if on_record is not None:
                on_record(rec)

    async def arrivals() -> None:
        nonlocal dropped
        while (i := take()) is not None:
            delay = t0 + plan.arrival(i) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() >= deadline:
                return
            if len(in_flight) >= spec.concurrency:
                dropped += 1
                continue
            prompt, n, max_tokens = plan.request(i)
            task = asyncio.create_task(_one_request(client, spec, prompt, n, max_tokens))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            task.add_done_callback(lambda t: _collect(t, records, on_record))

    if spec.mode == "closed":
        tasks = [asyncio.create_task(worker()) for _ in range(spec.concurrency)]
    else:
        tasks = [asyncio.create_task(arrivals())]
    waits: set[asyncio.Future[Any]] = set(tasks)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        done, pending = await _wait_all_or(waits, stopper, deadline)
        if spec.mode != "closed" and in_flight and not pending:
            # All arrivals sent: wait for the stragglers until the deadline (or the stop).
            await _wait_all_or(set(in_flight), stopper, deadline)
        cancelled = sum(not t.done() for t in pending) if spec.mode == "closed" else 0
        cancelled += sum(not t.done() for t in in_flight)
        for t in [*pending, *in_flight]:
            t.cancel()
        await asyncio.gather(*pending, *in_flight, return_exceptions=True)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        if stopper is not None:
            stopper.cancel()
        if own:
            await client.aclose()
    result = LoadResult(
        start_s=start,
        end_s=time.time(),
        records=tuple(sorted(records, key=lambda r: r.sent_s)),
        cancelled=cancelled,
        dropped=dropped,
    )
    log.info(
        "load %s: %d sent, %d ok, %d rejected, %d errors, %d cancelled, %d dropped in %.1f s",
        spec.mode,
        issued,
        result.completed,
        result.rejected,
        result.errors,
        result.cancelled,
        result.dropped,
        result.end_s - result.start_s,
    )
    return result


async def _wait_all_or(
    tasks: set[asyncio.Future[Any]], stopper: asyncio.Future[Any] | None, deadline: float
) -> tuple[set[asyncio.Future[Any]], set[asyncio.Future[Any]]]:
    """Wait until every task is done, the deadline passes or the stopper fires."""
    pending = set(tasks)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0 or (stopper is not None and stopper.done()):
            break
        watch = pending | ({stopper} if stopper is not None else set())
        await asyncio.wait(watch, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        pending = {t for t in pending if not t.done()}
    return set(tasks) - pending, pending


def _collect(
    task: asyncio.Task[RequestRecord],
    records: list[RequestRecord],
    on_record: Callable[[RequestRecord], None] | None,
) -> None:
    if not task.cancelled() and task.exception() is None:
        records.append(task.result())
        if on_record is not None:
            on_record(task.result())


def client_observation(result: LoadResult, slo: Slo, *, confidence: float = 0.95) -> Observation:
    """The load generator's own Observation of a window (the cross-check of the server's).

    TTFT samples: every completed request; TPOT samples: those with ≥ 2 tokens. A request
    met the SLO when its TTFT and (if it has one) its TPOT are within the thresholds.
    Percentiles and verdicts come from :mod:`metrics.samples` (exact, from raw samples).
    """
    ok = [r for r in result.records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
    met = sum(
        r.ttft_s <= slo.ttft_p99_s and (math.isnan(r.tpot_s) or r.tpot_s <= slo.tpot_p99_s)
        for r in ok
    )
    q = slo.quantile

    def pct(xs: list[float]) -> Percentiles:
        if not xs:
            return Percentiles()
        return Percentiles(
            p50=exact_quantile(xs, 0.5), p90=exact_quantile(xs, 0.9), p99=exact_quantile(xs, q)
        )

    return Observation(
        start_s=result.start_s,
        end_s=result.end_s,
        completed=len(ok),
        slo_met=int(met),
        rejected=result.rejected,
        generated_tokens=sum(r.output_tokens for r in ok),
        ttft=pct(ttft),
        tpot=pct(tpot),
        ttft_verdict=verdict_from_samples(ttft, slo.ttft_p99_s, q=q, confidence=confidence),
        tpot_verdict=verdict_from_samples(tpot, slo.tpot_p99_s, q=q, confidence=confidence),
        source="client",
    )


def run_load_sync(spec: LoadSpec) -> LoadResult:
    """:func:`run_load` from synchronous code (its own event loop)."""
    return asyncio.run(run_load(spec))


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


__all__: Sequence[str] = (
    "LengthDist",
    "LoadResult",
    "LoadSpec",
    "RequestRecord",
    "TraceItem",
    "client_observation",
    "completions_url",
    "load_trace",
    "run_load",
    "run_load_sync",
    "saturating_spec",
    "synth_prompt",
)
