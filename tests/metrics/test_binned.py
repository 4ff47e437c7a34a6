"""metrics.binned: requests per bucket, their quantile interval and the Mann-Whitney effect."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from metrics.binned import (
    bin_samples,
    from_attr,
    from_cumulative,
    pool,
    quantile_interval,
    sample_bounds,
    superiority,
    to_attr,
    total,
)
from metrics.names import TPOT_BUCKETS
from metrics.samples import exact_quantile

BOUNDS = (0.01, 0.02, 0.05, 0.1)


def test_samples_fall_in_the_first_bucket_at_or_above_them_and_overflow_to_inf() -> None:
    b = bin_samples([0.005, 0.01, 0.0100001, 0.05, 0.2, math.nan], BOUNDS)
    assert b == ((0.01, 2), (0.02, 1), (0.05, 1), (math.inf, 1))
    assert bin_samples([], BOUNDS) == ()


def test_cumulative_increases_become_per_bucket_counts_and_agree_with_binning() -> None:
    x = np.random.default_rng(0).lognormal(math.log(0.03), 0.5, 500)  # [500]
    cum = {le: float((x <= le).sum()) for le in BOUNDS} | {math.inf: float(x.size)}
    assert from_cumulative(cum) == bin_samples(x, BOUNDS)
    # an extrapolated increase rounds; a bucket that fell below the one before counts none
    assert from_cumulative({0.01: 2.4, 0.02: 1.0, math.inf: 5.2}) == ((0.01, 2), (math.inf, 3))
    # the empty bucket below the first request is kept: the lowest a request can be
    assert from_cumulative({0.01: 0, 0.02: 0, 0.05: 3, math.inf: 3}) == ((0.02, 0), (0.05, 3))
    assert bin_samples([0.03, 0.04], BOUNDS) == ((0.02, 0), (0.05, 2))


def test_pool_adds_windows_and_attrs_round_trip_through_json() -> None:
    a = ((0.01, 2), (math.inf, 1))
    b = ((0.005, 0), (0.01, 1), (0.05, 4))
    p = pool([a, b])
    assert p == ((0.005, 0), (0.01, 3), (0.05, 4), (math.inf, 1)) and total(p) == 8
    assert pool([((0.02, 0), (0.05, 1)), ((0.01, 0), (0.02, 1))]) == (
        (0.01, 0),
        (0.02, 1),
        (0.05, 1),
    )
    assert from_attr(to_attr(p)) == p and to_attr(p)[-1] == [None, 1]


def test_sample_bounds_add_the_slo_threshold() -> None:
    assert 0.0123 in sample_bounds(TPOT_BUCKETS, 0.0123)


def test_effect_is_mann_whitney_u_over_the_pairs_ties_half() -> None:
    rng = np.random.default_rng(1)
    a = bin_samples(rng.lognormal(math.log(0.03), 0.3, 400), TPOT_BUCKETS)
    b = bin_samples(rng.lognormal(math.log(0.033), 0.3, 300), TPOT_BUCKETS)
    xa = np.repeat([le for le, _ in a], [n for _, n in a])
    xb = np.repeat([le for le, _ in b], [n for _, n in b])
    u = stats.mannwhitneyu(xb, xa, alternative="greater").statistic
    s = superiority(a, b)
    assert s.effect == pytest.approx(u / (xa.size * xb.size), rel=1e-12)
    assert (s.n_a, s.n_b) == (400, 300)
    assert superiority(a, a).effect == pytest.approx(0.5)


def test_one_sided_test_holds_its_level_and_sees_a_shift() -> None:
    rng = np.random.default_rng(2)
    same, shifted = 0, 0
    reps = 300
    for _ in range(reps):
        a = bin_samples(rng.lognormal(math.log(0.03), 0.4, 200), TPOT_BUCKETS)
        b = bin_samples(rng.lognormal(math.log(0.03), 0.4, 200), TPOT_BUCKETS)
        c = bin_samples(rng.lognormal(math.log(0.03 * 1.3), 0.4, 200), TPOT_BUCKETS)
        same += superiority(a, b).p_above(0.5) < 0.05
        shifted += superiority(a, c).p_above(0.56) < 0.05
    assert 0.02 * reps <= same <= 0.09 * reps  # the level: about 5% false alarms
    assert shifted >= 0.95 * reps  # +30%: an effect well past "small" (0.56)


def test_quantile_interval_holds_the_samples_quantile() -> None:
    x = np.random.default_rng(3).lognormal(math.log(0.03), 0.5, 2000)  # [2000]
    lo, hi = quantile_interval(bin_samples(x, TPOT_BUCKETS), 0.99)
    assert lo <= exact_quantile(x, 0.99) <= hi and hi / lo < 1.5
    assert all(math.isnan(v) for v in quantile_interval((), 0.99))
    lo, hi = quantile_interval(((0.01, 5),), 0.99)  # five requests: no upper bound on a p99
    assert hi == math.inf
    # a tight window: the p99's lower bound is the edge below its lowest request, not 0
    lo, hi = quantile_interval(((0.02, 0), (0.025, 400)), 0.99)
    assert (lo, hi) == (0.02, 0.025)


def test_poisson_interval_is_garwoods_and_covers() -> None:
    from metrics.samples import poisson_interval

    assert poisson_interval(0) == (0.0, pytest.approx(3.689, rel=1e-3))  # the classic 0-count
    lo, hi = poisson_interval(100)
    assert lo == pytest.approx(81.36, rel=1e-3) and hi == pytest.approx(121.63, rel=1e-3)
    rng = np.random.default_rng(4)
    k = rng.poisson(40.0, 2000)
    cover = np.mean([(lambda b: b[0] <= 40.0 <= b[1])(poisson_interval(int(x))) for x in k])
    assert cover >= 0.95  # exact: at least the stated confidence
    with pytest.raises(ValueError, match="k=-1"):
        poisson_interval(-1)
