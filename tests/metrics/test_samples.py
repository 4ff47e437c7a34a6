from __future__ import annotations

import math

import numpy as np
import pytest

from metrics.observation import Verdict
from metrics.samples import (
    exact_quantile,
    exceed_fraction_bounds,
    quantile_lower_bound,
    quantile_upper_bound,
    verdict_from_counts,
    verdict_from_histogram,
    verdict_from_samples,
)


def test_exact_quantile_is_nearest_rank() -> None:
    s = list(range(1, 101))  # 1..100
    assert exact_quantile(s, 0.99) == 99
    assert exact_quantile(s, 0.5) == 50
    assert exact_quantile(s, 1.0) == 100
    assert exact_quantile([3.0], 0.99) == 3.0
    # q*n off by float noise either way (0.07*100 = 7.000000000000001, 0.29*100 = 28.99...)
    assert exact_quantile(s, 0.07) == 7 and exact_quantile(s, 0.29) == 29
    assert math.isnan(exact_quantile([], 0.5))
    with pytest.raises(ValueError, match="NaN"):
        exact_quantile([1.0, math.nan], 0.5)


def test_twenty_requests_never_make_a_p99_verdict_met() -> None:
    v = verdict_from_samples([0.01] * 20, threshold_s=1.0)
    assert v.verdict is Verdict.INSUFFICIENT
    assert v.samples == 20 and v.estimate_s == 0.01
    assert v.exceed_fraction_upper > 0.01


def test_met_needs_299_clean_requests_at_95_percent() -> None:
    # 1 - 0.99**n >= 0.95  <=>  n >= 299 (zero requests above the threshold).
    assert verdict_from_counts(298, 0, 1.0, 0.5).verdict is Verdict.INSUFFICIENT
    assert verdict_from_counts(299, 0, 1.0, 0.5).verdict is Verdict.MET


def test_clear_violation_is_called_even_on_few_samples() -> None:
    v = verdict_from_samples([0.1] * 15 + [2.0] * 5, threshold_s=1.0)
    assert v.verdict is Verdict.VIOLATED
    assert v.exceed_fraction_lower > 0.01


def test_sample_equal_to_threshold_meets_it() -> None:
    v = verdict_from_samples([1.0] * 400, threshold_s=1.0)
    assert v.verdict is Verdict.MET


def test_verdict_matches_order_statistic_bound() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 2000))
        x = rng.lognormal(0.0, 1.0, n)
        t = float(np.quantile(x, rng.uniform(0.95, 1.0)))
        v = verdict_from_samples(x, t)
        ub = quantile_upper_bound(x, 0.99)
        lb = quantile_lower_bound(x, 0.99)
        assert (v.verdict is Verdict.MET) == (ub <= t), (n, t, ub)
        assert (v.verdict is Verdict.VIOLATED) == (lb > t), (n, t, lb)
        assert lb <= exact_quantile(x, 0.99) <= ub


def test_upper_bound_covers_true_quantile_at_stated_rate() -> None:
    # Coverage of the one-sided 95% bound on the p99 of Exp(1): at least ~95%.
    rng = np.random.default_rng(11)
    true_p99 = -math.log(0.01)
    hits = sum(
        quantile_upper_bound(rng.exponential(1.0, 1000), 0.99) >= true_p99 for _ in range(400)
    )
    assert hits / 400 >= 0.92


def test_clopper_pearson_bounds() -> None:
    lo, hi = exceed_fraction_bounds(100, 0, 0.95)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.05 ** (1 / 100))
    lo, hi = exceed_fraction_bounds(10, 10, 0.95)
    assert hi == 1.0 and lo == pytest.approx(0.05 ** (1 / 10))


def test_counts_are_validated() -> None:
    with pytest.raises(ValueError, match="above"):
        verdict_from_counts(10, 11, 1.0, 0.5)
    with pytest.raises(ValueError, match="total"):
        verdict_from_counts(-1, 0, 1.0, 0.5)
    with pytest.raises(ValueError, match="confidence"):
        verdict_from_counts(10, 0, 1.0, 0.5, confidence=1.0)


def test_histogram_verdict_exact_when_threshold_is_a_bound() -> None:
    inf = math.inf
    b = {0.5: 300.0, 1.0: 400.0, 2.0: 405.0, inf: 405.0}
    v = verdict_from_histogram(b, 1.0, 0.9)
    ref = verdict_from_counts(405, 5, 1.0, 0.9)
    assert v == ref


def test_histogram_verdict_brackets_when_threshold_between_bounds() -> None:
    inf = math.inf
    # 1000 requests, all ≤ 2.0, but the threshold 1.5 lies inside (1.0, 2.0]: with 2 in that
    # bucket the exceedance is 0..2 of 1000, and even 2 of 1000 is MET at p99 with 95%...
    b = {1.0: 998.0, 2.0: 1000.0, inf: 1000.0}
    assert verdict_from_histogram(b, 1.5, 1.2).verdict is Verdict.MET
    # ...but 30 in the straddling bucket could all be above: neither MET nor VIOLATED.
    b = {1.0: 970.0, 2.0: 1000.0, inf: 1000.0}
    assert verdict_from_histogram(b, 1.5, 1.2).verdict is Verdict.INSUFFICIENT
    # With the threshold as a bound, the 30 above are known: VIOLATED.
    b = {1.0: 970.0, 1.5: 970.0, 2.0: 1000.0, inf: 1000.0}
    assert verdict_from_histogram(b, 1.5, 1.7).verdict is Verdict.VIOLATED


def test_histogram_verdict_insufficient_without_observations() -> None:
    v = verdict_from_histogram({1.0: 0.0, math.inf: 0.0}, 1.0, math.nan)
    assert v.verdict is Verdict.INSUFFICIENT and v.samples == 0


def test_scalar_binomial_and_beta_helpers_equal_scipy_stats() -> None:
    # verdict_from_counts and exceed_fraction_bounds call scipy.special's public incomplete
    # beta functions (speed): the sf and the ppf are scipy.stats' bits, the cdf within ulps.
    from scipy import stats

    from metrics.samples import _beta_ppf, _binom_cdf, _binom_sf

    rng = np.random.default_rng(5)
    n = np.concatenate([np.repeat(np.arange(1, 400), 8), rng.integers(1, 20_000, 4000)])
    k = np.concatenate([np.tile(np.arange(-1, 7), 399), rng.integers(-1, 60, 4000)])
    k = np.minimum(k, n + 1)
    for p in (0.01, 0.05, 1 - 0.99, 1 - 0.9, 0.5):
        cdf = stats.binom.cdf(k, n, p)
        sf = stats.binom.sf(k, n, p)
        for j in range(0, len(n), 7):
            nj, kj = int(n[j]), int(k[j])
            assert _binom_cdf(kj, nj, p) == pytest.approx(cdf[j], rel=1e-12, abs=1e-200)
            assert _binom_sf(kj, nj, p) == sf[j], (kj, nj, p)
    a = np.maximum(k, 1)
    b = np.maximum(n - k, 1)
    for q in (0.05, 0.95, 1 - 0.95, 0.9, 0.0, 1.0):
        ppf = stats.beta.ppf(q, a, b)
        for j in range(0, len(n), 7):
            got = _beta_ppf(q, int(a[j]), int(b[j]))
            assert got == ppf[j] or (math.isnan(got) and math.isnan(ppf[j])), (q, a[j], b[j])


def test_verdict_from_counts_equals_the_scipy_stats_computation() -> None:
    from scipy import stats

    from metrics.observation import SloVerdict

    def reference(total: int, above: int, q: float, confidence: float) -> SloVerdict:
        allowed, alpha = 1 - q, 1 - confidence
        if total == 0:
            verdict = Verdict.INSUFFICIENT
        elif stats.binom.cdf(above, total, allowed) <= alpha:
            verdict = Verdict.MET
        elif above > 0 and stats.binom.sf(above - 1, total, allowed) <= alpha:
            verdict = Verdict.VIOLATED
        else:
            verdict = Verdict.INSUFFICIENT
        lo = 0.0 if above == 0 else float(stats.beta.ppf(alpha, above, total - above + 1))
        hi = 1.0 if above == total else float(stats.beta.ppf(confidence, above + 1, total - above))
        return SloVerdict(
            verdict=verdict,
            threshold_s=1.0,
            estimate_s=0.5,
            samples=total,
            confidence=confidence,
            exceed_fraction_upper=hi if total else 1.0,
            exceed_fraction_lower=lo if total else 0.0,
        )

    rng = np.random.default_rng(9)
    pairs = [(n, k) for n in (0, 1, 2, 20, 298, 299, 300, 1000) for k in range(min(n, 12) + 1)]
    pairs += [(int(n), int(rng.integers(0, n + 1) ** 0.5)) for n in rng.integers(1, 5000, 150)]
    for total, above in pairs:
        for q, conf in ((0.99, 0.95), (0.9, 0.9), (0.95, 0.99)):
            got = verdict_from_counts(total, above, 1.0, 0.5, q=q, confidence=conf)
            assert got == reference(total, above, q, conf), (total, above, q, conf)
