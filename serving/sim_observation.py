"""A simulated window's Observation from its per-request timings (serving/sim.py).

Exact percentiles and three-way SLO verdicts from the samples (metrics/samples.py),
the same Observation a deployment yields. TTFT and TPOT are computed as arrays with
the same float operations as RequestTiming's ``ttft_s`` and ``tpot_s``.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from metrics.observation import Observation, Percentiles, Slo
from metrics.samples import exact_quantile, verdict_from_samples
from serving.step_plan import RequestTiming

_TIMES = operator.attrgetter("arrival_s", "first_token_s", "last_token_s", "generated_tokens")


def observation_from_timings(
    timings: list[RequestTiming],
    *,
    slo: Slo,
    start_s: float,
    end_s: float,
    rejected: int,
    confidence: float,
    source: str = "sim",
) -> Observation:
    """The Observation of a window from per-request timings (exact quantiles, verdicts)."""
    # RequestTiming's ttft_s and tpot_s, as arrays: the same float operations.
    flat = itertools.chain.from_iterable(map(_TIMES, timings))
    rows = np.fromiter(flat, dtype=np.float64, count=4 * len(timings)).reshape(-1, 4)  # [n, 4]
    arrival, first, last, generated = rows.T  # [n] each
    ttft_a = first - arrival  # [n]
    has_tpot = generated >= 2  # [n]
    tpot_a = (last[has_tpot] - first[has_tpot]) / (generated[has_tpot] - 1)  # [m]
    tpot_ok = np.ones(len(timings), dtype=bool)  # [n]
    tpot_ok[has_tpot] = tpot_a <= slo.tpot_p99_s
    met = int(np.count_nonzero((ttft_a <= slo.ttft_p99_s) & tpot_ok))
    # Sorted once: the quantiles and verdicts below sort again, at little cost.
    ttft = np.sort(ttft_a).tolist()
    tpot = np.sort(tpot_a).tolist()

    def pct(x: list[float]) -> Percentiles:
        if not x:
            return Percentiles()
        return Percentiles(
            p50=exact_quantile(x, 0.5), p90=exact_quantile(x, 0.9), p99=exact_quantile(x, 0.99)
        )

    q = slo.quantile
    return Observation(
        start_s=start_s,
        end_s=end_s,
        completed=len(timings),
        slo_met=met,
        rejected=rejected,
        generated_tokens=int(generated.sum()),  # whole numbers: the float sum is exact
        ttft=pct(ttft),
        tpot=pct(tpot),
        ttft_verdict=verdict_from_samples(ttft, slo.ttft_p99_s, q=q, confidence=confidence),
        tpot_verdict=verdict_from_samples(tpot, slo.tpot_p99_s, q=q, confidence=confidence),
        source=source,
    )
