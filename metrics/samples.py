"""Exact percentiles, distribution-free confidence bounds and three-way SLO verdicts.

"p99 ≤ T" is a claim about the fraction of requests slower than T: the q-quantile is at
most T exactly when at most 1-q of the population exceeds T. With k of n requests above T,
the one-sided Clopper-Pearson bounds on that fraction decide:

- MET when the upper bound is ≤ 1-q (e.g. ≥ 299 requests, none above T, at 95%),
- VIOLATED when the lower bound is > 1-q,
- INSUFFICIENT otherwise: 20 requests never make a p99 verdict.

The same test on counts works for histograms whose bounds contain T exactly (the contract's
``slo_buckets`` inserts the thresholds), and it is equivalent to comparing T with the
order-statistic confidence bound of the quantile (:func:`quantile_upper_bound`).

Speed: a verdict on counts is a fixed cost of every simulated window, and ``scipy.stats``'
distribution objects spend ~100 µs per scalar call checking and broadcasting their
arguments. The scalar helpers below call the public regularized incomplete beta functions
of ``scipy.special`` (binomial tails are incomplete beta values) at ~1 µs. ``betainc`` and
``betaincinv`` give ``scipy.stats``' binomial survival function and beta quantile bit for
bit; ``betaincc`` gives its binomial CDF to within a few ulp, which leaves every verdict
unchanged (tests/metrics/test_samples.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace

import numpy as np
from scipy import stats
from scipy.special import betainc, betaincc, betaincinv

from metrics.observation import SloVerdict, Verdict


def _check(q: float, confidence: float) -> None:
    if not 0 < q < 1:
        raise ValueError(f"q={q!r}: must be in (0, 1)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: must be in (0, 1)")


def _sorted(samples: Iterable[float]) -> np.ndarray:
    x = np.sort(np.asarray(list(samples), dtype=np.float64))  # [n]
    if np.isnan(x).any():
        raise ValueError("samples contain NaN: drop unknown latencies before computing quantiles")
    return x


def exact_quantile(samples: Iterable[float], q: float) -> float:
    """The q-quantile of the samples as the smallest sample x with F(x) ≥ q (nearest rank).

    It is always one of the samples (no interpolation), and ``exact_quantile(s, q) <= T``
    holds exactly when at least a fraction q of the samples is ≤ T. NaN for no samples.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q={q!r}: must be in [0, 1]")
    x = _sorted(samples)
    if x.size == 0:
        return math.nan
    k = max(1, math.ceil(round(q * x.size, 6)))  # 1-based rank; round off float noise in q*n
    return float(x[k - 1])


def quantile_upper_bound(samples: Iterable[float], q: float, confidence: float = 0.95) -> float:
    """Distribution-free upper confidence bound of the q-quantile: an order statistic.

    The k-th smallest sample with the least k such that P(Binomial(n, q) ≥ k) ≤ 1-confidence;
    +inf when even the largest sample is not enough (too few samples).
    """
    _check(q, confidence)
    x = _sorted(samples)
    n = x.size
    # P(Bin(n, q) >= k) = sf(k - 1); find the least k in 1..n with sf(k-1) <= 1 - conf.
    ks = np.arange(1, n + 1)
    ok = stats.binom.sf(ks - 1, n, q) <= 1 - confidence
    return float(x[ks[ok][0] - 1]) if ok.any() else math.inf


def quantile_lower_bound(samples: Iterable[float], q: float, confidence: float = 0.95) -> float:
    """Distribution-free lower confidence bound of the q-quantile (-inf with too few samples)."""
    _check(q, confidence)
    x = _sorted(samples)
    n = x.size
    # The k-th smallest with the greatest k such that P(Bin(n, q) < k) <= 1 - conf.
    ks = np.arange(1, n + 1)
    ok = stats.binom.cdf(ks - 1, n, q) <= 1 - confidence
    return float(x[ks[ok][-1] - 1]) if ok.any() else -math.inf


def poisson_interval(k: int, confidence: float = 0.95) -> tuple[float, float]:
    """Garwood's exact two-sided interval of a Poisson mean from one count ``k`` (requests
    in a window: divide by its length for a rate)."""
    if not (isinstance(k, int) and k >= 0):
        raise ValueError(f"k={k!r}: must be a whole count >= 0")
    _check(0.5, confidence)
    a = 1 - confidence
    lo = 0.0 if k == 0 else float(stats.chi2.ppf(a / 2, 2 * k)) / 2
    return lo, float(stats.chi2.ppf(1 - a / 2, 2 * k + 2)) / 2


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(Bin(n, p) <= k) of whole ``k`` and ``n >= 0``, ``0 <= p <= 1``."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    v = float(betaincc(k + 1.0, float(n - k), float(p)))
    return 0.0 if v < 0 else 1.0 if v > 1 else v  # np.clip(v, 0, 1), NaN kept


def _binom_sf(k: int, n: int, p: float) -> float:
    """P(Bin(n, p) > k) of whole ``k`` and ``n >= 0``, ``0 <= p <= 1``."""
    if k < 0:
        return 1.0
    if k >= n:
        return 0.0
    v = float(betainc(k + 1.0, float(n - k), float(p)))
    return 0.0 if v < 0 else 1.0 if v > 1 else v  # np.clip(v, 0, 1), NaN kept


def _beta_ppf(q: float, a: float, b: float) -> float:
    """``stats.beta.ppf(q, a, b)``."""
    if not (0 < q < 1 and a > 0 and b > 0):
        return float(stats.beta.ppf(q, a, b))  # its special cases
    return float(betaincinv(float(a), float(b), float(q)))


def exceed_fraction_bounds(total: int, above: int, confidence: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson (lower, upper) bounds on the fraction above the threshold."""
    if total <= 0:
        return (0.0, 1.0)
    lo = 0.0 if above == 0 else _beta_ppf(1 - confidence, above, total - above + 1)
    hi = 1.0 if above == total else _beta_ppf(confidence, above + 1, total - above)
    return (lo, hi)


def verdict_from_counts(
    total: int,
    above: int,
    threshold_s: float,
    estimate_s: float,
    *,
    q: float = 0.99,
    confidence: float = 0.95,
    above_at_most: int | None = None,
) -> SloVerdict:
    """Verdict on "q-quantile ≤ threshold" from ``above`` of ``total`` requests over it.

    ``above`` is the count known to exceed the threshold; when only a range is known (a
    histogram whose bounds bracket the threshold), ``above_at_most`` is its upper end and
    MET is judged on it, VIOLATED on ``above``: the verdict never rounds in its own favour.
    """
    _check(q, confidence)
    hi_count = above if above_at_most is None else above_at_most
    for name, v in (("total", total), ("above", above), ("above_at_most", hi_count)):
        if int(v) != v or v < 0:
            raise ValueError(f"{name}={v!r}: must be a non-negative whole count")
    total, above, hi_count = int(total), int(above), int(hi_count)
    if not above <= hi_count <= total:
        raise ValueError(
            f"counts above={above}, above_at_most={hi_count}, total={total}: "
            "need above <= above_at_most <= total"
        )
    allowed = 1 - q
    alpha = 1 - confidence
    if total == 0:
        verdict = Verdict.INSUFFICIENT
    # MET: even the upper bound of the exceedance fraction is within 1-q.
    elif _binom_cdf(hi_count, total, allowed) <= alpha:
        verdict = Verdict.MET
    # VIOLATED: even the lower bound of the exceedance fraction is beyond 1-q.
    elif above > 0 and _binom_sf(above - 1, total, allowed) <= alpha:
        verdict = Verdict.VIOLATED
    else:
        verdict = Verdict.INSUFFICIENT
    lo, _ = exceed_fraction_bounds(total, above, confidence)
    _, hi = exceed_fraction_bounds(total, hi_count, confidence)
    return SloVerdict(
        verdict=verdict,
        threshold_s=threshold_s,
        estimate_s=estimate_s,
        samples=total,
        confidence=confidence,
        exceed_fraction_upper=hi,
        exceed_fraction_lower=lo,
    )


def verdict_from_samples(
    samples: Iterable[float],
    threshold_s: float,
    *,
    q: float = 0.99,
    confidence: float = 0.95,
) -> SloVerdict:
    """Verdict from raw per-request latencies; a sample equal to the threshold meets it."""
    x = _sorted(samples)
    above = int(np.count_nonzero(x > threshold_s))
    return verdict_from_counts(
        int(x.size),
        above,
        threshold_s,
        exact_quantile(x, q) if x.size else math.nan,
        q=q,
        confidence=confidence,
    )


def verdict_from_histogram(
    buckets: Mapping[float, float],
    threshold_s: float,
    estimate_s: float,
    *,
    q: float = 0.99,
    confidence: float = 0.95,
) -> SloVerdict:
    """Verdict from cumulative bucket counts (keyed by upper bound, +Inf included).

    Exact when the threshold is a bucket bound. Otherwise the count above it is bracketed by
    the neighbouring bounds (named in the verdict's ``bracket_s``) and the verdict uses the
    side that cannot flatter it. Counts
    that are not whole (a PromQL ``increase`` is extrapolated) are rounded to the nearest.
    """
    inf_count = buckets.get(math.inf)
    valid = all(math.isfinite(c) and c >= 0 for c in buckets.values())
    if inf_count is None or not valid or inf_count <= 0:
        return verdict_from_counts(0, 0, threshold_s, estimate_s, q=q, confidence=confidence)
    total = round(inf_count)
    below = [c for b, c in buckets.items() if b <= threshold_s]
    at_or_above = [c for b, c in buckets.items() if b >= threshold_s]
    # Counts are cumulative: below the threshold, take the largest bound's count (fewest
    # known to exceed); at or above, the smallest bound's count.
    le_lower = round(max(below)) if below else 0
    le_upper = round(min(at_or_above))
    le_lower = min(le_lower, le_upper, total)
    le_upper = min(le_upper, total)
    v = verdict_from_counts(
        total,
        total - le_upper,
        threshold_s,
        estimate_s,
        q=q,
        confidence=confidence,
        above_at_most=total - le_lower,
    )
    if threshold_s in buckets:
        return v
    lo = max((b for b in buckets if b < threshold_s), default=0.0)
    hi = min(b for b in buckets if b > threshold_s)  # +Inf at least
    return replace(v, bracket_s=(lo, hi))
