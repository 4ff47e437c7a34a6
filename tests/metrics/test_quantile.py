from __future__ import annotations

import math

import pytest

from metrics.quantile import (
    bucket_increase,
    bucket_quantile,
    counter_increase,
    histogram_quantile,
)

INF = math.inf


def test_interpolates_linearly_within_bucket() -> None:
    # 10 in (0, 1], 10 in (1, 2]: the median is the upper edge of the first bucket.
    b = {1.0: 10, 2.0: 20, INF: 20}
    assert histogram_quantile(0.5, b) == 1.0
    assert histogram_quantile(0.75, b) == 1.5
    assert histogram_quantile(0.25, b) == 0.5  # first bucket's lower bound is 0


def test_rank_in_inf_bucket_returns_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, {1.0: 1, 2.0: 2, INF: 100}) == 2.0


@pytest.mark.parametrize(
    "buckets",
    [
        {1.0: 1, 2.0: 2},  # no +Inf
        {INF: 5},  # fewer than two buckets
        {1.0: 0, INF: 0},  # no observations
        {},
    ],
)
def test_nan_cases(buckets: dict[float, float]) -> None:
    assert math.isnan(histogram_quantile(0.5, buckets))


def test_q_out_of_range() -> None:
    b = {1.0: 1, INF: 1}
    assert histogram_quantile(-0.1, b) == -INF
    assert histogram_quantile(1.1, b) == INF
    assert math.isnan(histogram_quantile(math.nan, b))


def test_non_positive_first_bound_is_returned_as_is() -> None:
    assert histogram_quantile(0.1, {-1.0: 5, 1.0: 10, INF: 10}) == -1.0


def test_non_monotonic_counts_are_forced_monotonic() -> None:
    # The dip at 2.0 is raised to 10, so half the mass sits in (0, 1].
    assert histogram_quantile(0.5, {1.0: 10, 2.0: 5, 3.0: 20, INF: 20}) == 1.0
    assert histogram_quantile(0.75, {1.0: 10, 2.0: 5, 3.0: 20, INF: 20}) == 2.5


def test_duplicate_bounds_are_summed() -> None:
    pairs = [(1.0, 4.0), (1.0, 6.0), (2.0, 20.0), (INF, 20.0)]
    assert bucket_quantile(0.5, pairs) == 1.0


def test_counter_increase_handles_reset() -> None:
    assert counter_increase(5, 8) == 3
    assert counter_increase(8, 3) == 3  # restarted from 0, now at 3
    assert math.isnan(counter_increase(math.nan, 1))


def test_bucket_increase_resets_each_series_independently() -> None:
    start = {1.0: 5.0, INF: 10.0}
    end = {1.0: 2.0, INF: 14.0, 2.0: 1.0}
    assert bucket_increase(start, end) == {1.0: 2.0, INF: 4.0, 2.0: 1.0}
