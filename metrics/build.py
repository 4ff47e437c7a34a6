"""Building an :class:`Observation` from window counts and histograms, or from raw requests."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from metrics.binned import bin_samples, from_cumulative, sample_bounds
from metrics.names import TPOT_BUCKETS, TTFT_BUCKETS
from metrics.observation import Observation, Percentiles, Slo, SloVerdict
from metrics.quantile import histogram_quantile
from metrics.samples import exact_quantile, verdict_from_histogram, verdict_from_samples


def percentiles_from_histogram(buckets: Mapping[float, float]) -> Percentiles:
    return Percentiles(
        p50=histogram_quantile(0.5, buckets),
        p90=histogram_quantile(0.9, buckets),
        p99=histogram_quantile(0.99, buckets),
    )


def percentiles_from_samples(samples: Sequence[float]) -> Percentiles:
    return Percentiles(
        p50=exact_quantile(samples, 0.5),
        p90=exact_quantile(samples, 0.9),
        p99=exact_quantile(samples, 0.99),
    )


def _whole(name: str, v: float) -> int:
    if not math.isfinite(v) or v < -0.5:
        raise ValueError(f"{name}={v!r}: must be a finite non-negative count")
    return max(0, round(v))


def observation_from_histograms(
    *,
    slo: Slo,
    start_s: float,
    end_s: float,
    met: float | None,
    missed: float,
    rejected: float = 0.0,
    overloaded: float = 0.0,
    generated_tokens: float = 0.0,
    ttft_buckets: Mapping[float, float] | None,
    tpot_buckets: Mapping[float, float] | None,
    confidence: float = 0.95,
    staleness_s: float = 0.0,
    stale: bool = False,
    source: str = "",
    note: str = "",
    ttft_estimate_s: float | None = None,
    tpot_estimate_s: float | None = None,
    running: float = math.nan,
    waiting: float = math.nan,
    replica_tpot_buckets: Mapping[str, Mapping[float, float]] | None = None,
) -> Observation:
    """An Observation from a window's counter increases and cumulative bucket increases.

    Counts may be non-whole (a PromQL ``increase`` is extrapolated): they are rounded to the
    nearest whole request. Goodput is the ``slo_met="true"`` count (``met``) over the window;
    ``met=None`` says the server has no such count (``missed`` is then every completion) and
    the Observation is marked ``slo_met_known=False``. The SLO quantile's estimate is the
    histogram's (or the ``*_estimate_s`` given, e.g. computed by Prometheus); the verdict is
    on the exact count above the threshold when it is a bound, else bracketed, and the note
    says so when the bracket holds requests (a coarse layout such as vLLM's).
    A missing histogram gives NaN percentiles and an INSUFFICIENT verdict, never a number.
    """
    q = slo.quantile
    ttft = ttft_buckets or {}
    tpot = tpot_buckets or {}
    ttft_est = histogram_quantile(q, ttft) if ttft_estimate_s is None else ttft_estimate_s
    tpot_est = histogram_quantile(q, tpot) if tpot_estimate_s is None else tpot_estimate_s
    n_met = 0 if met is None else _whole("met", met)
    n_missed = _whole("missed", missed)
    ttft_v = verdict_from_histogram(ttft, slo.ttft_p99_s, ttft_est, q=q, confidence=confidence)
    tpot_v = verdict_from_histogram(tpot, slo.tpot_p99_s, tpot_est, q=q, confidence=confidence)
    notes = [note] if note else []
    notes += [w for w in (_bracket_note("TTFT", ttft_v), _bracket_note("TPOT", tpot_v)) if w]
    if met is None:
        notes.append("the server counts no SLO-met requests: goodput from the client's records")
    return Observation(
        start_s=start_s,
        end_s=end_s,
        completed=n_met + n_missed,
        slo_met=n_met,
        rejected=_whole("rejected", rejected),
        overloaded=_whole("overloaded", overloaded),
        generated_tokens=_whole("generated_tokens", generated_tokens),
        ttft=percentiles_from_histogram(ttft),
        tpot=percentiles_from_histogram(tpot),
        ttft_verdict=ttft_v,
        tpot_verdict=tpot_v,
        staleness_s=staleness_s,
        stale=stale,
        source=source,
        note="; ".join(notes),
        slo_met_known=met is not None,
        running=running,
        waiting=waiting,
        replica_tpot=replica_quantiles(q, replica_tpot_buckets or {}),
        ttft_hist=from_cumulative(ttft),
        tpot_hist=from_cumulative(tpot),
    )


def replica_quantiles(
    q: float, buckets: Mapping[str, Mapping[float, float]]
) -> tuple[tuple[str, float, int], ...]:
    """(replica, the q-quantile, requests) of each replica's cumulative bucket increases."""
    out = []
    for replica, b in sorted(buckets.items()):
        n = max(b.values(), default=0.0)  # the +Inf bucket: every request
        out.append((replica, histogram_quantile(q, b), round(n)))
    return tuple(out)


def _bracket_note(what: str, v: SloVerdict) -> str:
    """Words for a verdict whose threshold lies inside a bucket that holds requests."""
    if v.bracket_s is None or v.samples == 0:
        return ""
    lo, hi = v.bracket_s
    ex_lo, ex_hi = v.exceed_fraction_lower, v.exceed_fraction_upper
    if not ex_hi > ex_lo:
        return ""
    return (
        f"{what} p99 verdict bracketed: the SLO {v.threshold_s:g}s lies inside the bucket "
        f"({lo:g}, {hi:g}]s, so the count above it is only known to a range"
    )


def with_client_goodput(server: Observation, client: Observation) -> Observation:
    """The server's Observation with goodput taken from the client's records of the same
    window, for a server that cannot count SLO-met requests (``slo_met_known`` False).

    ``slo_met`` is the client's count, capped at the server's completions; the note says
    where it came from (the client's latencies include the network). An Observation that
    already knows its goodput is returned as is.
    """
    if server.slo_met_known:
        return server
    if not client.slo_met_known:
        raise ValueError("the client Observation does not know its goodput either")
    met = min(client.slo_met, server.completed)
    why = f"goodput from the client's records ({client.slo_met} of {client.completed} met)"
    kept = [n for n in server.note.split("; ") if n and "goodput from the client" not in n]
    return replace(server, slo_met=met, slo_met_known=True, note="; ".join([*kept, why]))


def observation_from_requests(
    *,
    slo: Slo,
    start_s: float,
    end_s: float,
    ttft_s: Sequence[float],
    tpot_s: Sequence[float],
    rejected: int = 0,
    generated_tokens: int = 0,
    confidence: float = 0.95,
    source: str = "samples",
) -> Observation:
    """An Observation from per-request latencies (``ttft_s[i]``, ``tpot_s[i]`` of request i).

    A NaN TPOT (a single-token request) meets the TPOT SLO and is left out of the TPOT
    percentiles and verdict. Percentiles are exact (nearest rank); verdicts binomial.
    """
    if len(ttft_s) != len(tpot_s):
        raise ValueError(f"ttft_s has {len(ttft_s)} requests but tpot_s has {len(tpot_s)}")
    ttft = np.asarray(ttft_s, dtype=np.float64)  # [n]
    tpot = np.asarray(tpot_s, dtype=np.float64)  # [n]
    if np.isnan(ttft).any():
        raise ValueError("ttft_s contains NaN: every completed request has a first token")
    has_tpot = ~np.isnan(tpot)  # [n]
    met = slo.met(ttft, tpot)  # [n]
    tpot_known = tpot[has_tpot]  # [m]
    q = slo.quantile
    return Observation(
        start_s=start_s,
        end_s=end_s,
        completed=int(ttft.size),
        slo_met=int(met.sum()),
        rejected=rejected,
        generated_tokens=generated_tokens,
        ttft=percentiles_from_samples(ttft),
        tpot=percentiles_from_samples(tpot_known),
        ttft_verdict=verdict_from_samples(ttft, slo.ttft_p99_s, q=q, confidence=confidence),
        tpot_verdict=verdict_from_samples(tpot_known, slo.tpot_p99_s, q=q, confidence=confidence),
        source=source,
        ttft_hist=bin_samples(ttft, sample_bounds(TTFT_BUCKETS, slo.ttft_p99_s)),
        tpot_hist=bin_samples(tpot_known, sample_bounds(TPOT_BUCKETS, slo.tpot_p99_s)),
    )
