"""What the load generator saw: per-request records, a run's result, the client-side
Observation of a window (the cross-check of the server's metrics)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.load.spec import LoadSpec
from metrics.binned import bin_samples, sample_bounds
from metrics.names import TPOT_BUCKETS, TTFT_BUCKETS
from metrics.observation import Observation, Percentiles, Slo
from metrics.samples import exact_quantile, verdict_from_samples

REJECT_STATUSES = (429, 503)


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One request as the client saw it (unix seconds).

    ``prompt_tokens`` is the client's count (exact in the served model's tokens with a
    tokenizer or token-id prompts; characters otherwise, see LoadSpec); ``output_tokens``
    the server's ``usage.completion_tokens`` when it sent one (``output_from_usage``),
    else the number of stream events that carried text.
    """

    sent_s: float
    done_s: float
    first_token_s: float | None
    last_token_s: float | None
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    status: int  # HTTP status; 0 when the transport failed
    error: str = ""
    output_from_usage: bool = False
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when the server sent it

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.output_tokens > 0

    @property
    def rejected(self) -> bool:
        return self.status in REJECT_STATUSES

    @property
    def length_mismatch(self) -> bool:
        """A completed request whose output length is not the ``max_tokens`` it asked for
        (an EOS the server did not ignore, a stop, or events that packed several tokens)."""
        return self.ok and self.output_tokens != self.max_tokens

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
    spec: LoadSpec | None = None  # the load that was offered (endpoint, prompt format, ...)

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

    @property
    def length_mismatches(self) -> int:
        """Completed requests whose output length differs from what they asked for."""
        return sum(r.length_mismatch for r in self.records)

    def between(self, start_s: float, end_s: float) -> LoadResult:
        """The requests that finished inside [start_s, end_s] (a measurement window)."""
        recs = tuple(r for r in self.records if start_s <= r.done_s <= end_s)
        return LoadResult(start_s=start_s, end_s=end_s, records=recs, spec=self.spec)


def client_observation(result: LoadResult, slo: Slo, *, confidence: float = 0.95) -> Observation:
    """The load generator's own Observation of a window (the cross-check of the server's).

    TTFT samples: every completed request; TPOT samples: those with ≥ 2 tokens. Goodput
    counts the requests that met the SLO (:meth:`metrics.observation.Slo.met`).
    Percentiles and verdicts come from :mod:`metrics.samples` (exact, from raw samples).
    """
    ok = [r for r in result.records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
    met = sum(slo.met(r.ttft_s, r.tpot_s) for r in ok)
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
        overloaded=result.rejected,  # REJECT_STATUSES: the server had no room
        generated_tokens=sum(r.output_tokens for r in ok),
        ttft=pct(ttft),
        tpot=pct(tpot),
        ttft_verdict=verdict_from_samples(ttft, slo.ttft_p99_s, q=q, confidence=confidence),
        tpot_verdict=verdict_from_samples(tpot, slo.tpot_p99_s, q=q, confidence=confidence),
        source="client",
        ttft_hist=bin_samples(ttft, sample_bounds(TTFT_BUCKETS, slo.ttft_p99_s)),
        tpot_hist=bin_samples(tpot, sample_bounds(TPOT_BUCKETS, slo.tpot_p99_s)),
    )
