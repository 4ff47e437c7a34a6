"""A simulated window's Observation from its per-request timings (serving/sim/simulator.py).

Exact percentiles and three-way SLO verdicts from the samples (metrics/samples.py),
the same Observation a deployment yields. TTFT and TPOT are computed as arrays with
the same float operations as RequestTiming's ``ttft_s`` and ``tpot_s``; goodput counts
:meth:`metrics.observation.Slo.met`. Each sample set is sorted once: percentiles are
read off it at the ranks :func:`metrics.samples.exact_quantile` takes and verdicts are
:func:`metrics.samples.verdict_from_counts` of the count above the threshold (what
``verdict_from_samples`` computes; tests/serving/test_sim.py checks they agree).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from metrics.binned import bin_samples, sample_bounds
from metrics.names import TPOT_BUCKETS, TTFT_BUCKETS
from metrics.observation import Observation, Percentiles, Slo, SloVerdict
from metrics.samples import verdict_from_counts

_TIMES = operator.attrgetter("arrival_s", "first_token_s", "last_token_s", "generated_tokens")
# The same four of a finished serving.scheduler.seq.Seq.
SEQ_TIMES = operator.attrgetter("arrival_s", "first_token_s", "last_token_s", "generated")


def _nearest_rank(x: np.ndarray, q: float) -> float:
    """``exact_quantile(x, q)`` of a sorted, non-empty array: the same rank."""
    k = max(1, math.ceil(round(q * x.size, 6)))  # 1-based rank; as exact_quantile rounds
    return float(x[k - 1])


def _percentiles(x: np.ndarray) -> Percentiles:
    if not x.size:
        return Percentiles()
    return Percentiles(
        p50=_nearest_rank(x, 0.5), p90=_nearest_rank(x, 0.9), p99=_nearest_rank(x, 0.99)
    )


def _verdict(x: np.ndarray, threshold_s: float, q: float, confidence: float) -> SloVerdict:
    """``verdict_from_samples(x, threshold_s, q=q, confidence=confidence)`` of a sorted
    array: the count above the threshold, the q-quantile as the estimate."""
    if np.isnan(x).any():  # as verdict_from_samples refuses them
        raise ValueError("samples contain NaN: drop unknown latencies before computing quantiles")
    above = int(x.size - np.searchsorted(x, threshold_s, side="right"))
    estimate = _nearest_rank(x, q) if x.size else math.nan
    return verdict_from_counts(x.size, above, threshold_s, estimate, q=q, confidence=confidence)


def _columns(
    timings: Sequence[Any], times: Callable[[Any], tuple]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(arrival_s, first_token_s, last_token_s, generated)`` of each, as float arrays [n]:
    the finished sequences' (:data:`SEQ_TIMES`) read in one loop, at about a third of
    what ``times`` called on each costs."""
    if times is SEQ_TIMES:
        arrival: list[float] = []
        first: list[float] = []
        last: list[float] = []
        generated: list[int] = []
        a, f, la, g = arrival.append, first.append, last.append, generated.append
        for s in timings:
            a(s.arrival_s)
            f(s.first_token_s)
            la(s.last_token_s)
            g(s.generated)
        f64 = np.float64
        return (
            np.array(arrival, dtype=f64),
            np.array(first, dtype=f64),
            np.array(last, dtype=f64),
            np.array(generated, dtype=f64),
        )
    flat = itertools.chain.from_iterable(map(times, timings))
    rows = np.fromiter(flat, dtype=np.float64, count=4 * len(timings)).reshape(-1, 4)  # [n, 4]
    return rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]


def observation_from_timings(
    timings: Sequence[Any],  # RequestTiming, or what ``times`` reads (a finished Seq)
    *,
    slo: Slo,
    start_s: float,
    end_s: float,
    rejected: int,
    confidence: float,
    source: str = "sim",
    times: Callable[[Any], tuple] = _TIMES,
    running: float = math.nan,
    waiting: float = math.nan,
) -> Observation:
    """The Observation of a window from per-request timings (exact quantiles, verdicts).
    ``times`` reads ``(arrival_s, first_token_s, last_token_s, generated_tokens)`` of one
    (:data:`SEQ_TIMES`: the simulator hands in the finished sequences themselves).
    ``running`` and ``waiting``: the window's mean requests in the batch and waiting for a
    place in it (NaN: not known)."""
    # RequestTiming's ttft_s and tpot_s, as arrays: the same float operations.
    arrival, first, last, generated = _columns(timings, times)  # [n] each
    ttft_a = first - arrival  # [n]
    has_tpot = generated >= 2  # [n]
    tpot_a = (last[has_tpot] - first[has_tpot]) / (generated[has_tpot] - 1)  # [m]
    tpot_all = np.full(len(timings), np.nan)  # [n], NaN: a single token, no TPOT
    tpot_all[has_tpot] = tpot_a
    met = int(np.count_nonzero(slo.met(ttft_a, tpot_all)))
    ttft = np.sort(ttft_a)  # [n]
    tpot = np.sort(tpot_a)  # [m]
    q = slo.quantile
    return Observation(
        start_s=start_s,
        end_s=end_s,
        completed=len(timings),
        slo_met=met,
        rejected=rejected,
        overloaded=rejected,  # the simulated server refuses only for want of room
        generated_tokens=int(generated.sum()),  # whole numbers: the float sum is exact
        ttft=_percentiles(ttft),
        tpot=_percentiles(tpot),
        ttft_verdict=_verdict(ttft, slo.ttft_p99_s, q, confidence),
        tpot_verdict=_verdict(tpot, slo.tpot_p99_s, q, confidence),
        source=source,
        running=running,
        waiting=waiting,
        ttft_hist=bin_samples(ttft, sample_bounds(TTFT_BUCKETS, slo.ttft_p99_s)),
        tpot_hist=bin_samples(tpot, sample_bounds(TPOT_BUCKETS, slo.tpot_p99_s)),
    )
