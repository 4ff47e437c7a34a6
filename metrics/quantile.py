"""PromQL's ``histogram_quantile`` and counter increases, bit for bit.

Mirrors Prometheus 2.42 ``promql/quantile.go`` (``bucketQuantile``,
``coalesceBuckets``, ``ensureMonotonic``) and the counter-reset rule of
``increase()``/``rate()``: a drop in a counter is a restart from zero.
``tests/metrics/test_quantile_prometheus.py`` checks both against a real server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """The ``q``-quantile of cumulative bucket counts keyed by upper bound (``math.inf`` for +Inf).

    Exactly PromQL's semantics: NaN without a +Inf bucket, with fewer than two buckets or
    with zero observations; the highest finite bound when the rank falls into +Inf; the first
    bucket's lower bound is 0 (or its own bound when that is ≤ 0); counts forced monotonic;
    -Inf for q < 0 and +Inf for q > 1.
    """
    return bucket_quantile(q, buckets.items())


def bucket_quantile(q: float, pairs: Iterable[tuple[float, float]]) -> float:
    """:func:`histogram_quantile` over ``(upper_bound, cumulative_count)`` pairs.

    Unlike a mapping, pairs may repeat a bound (``le="1"`` and ``le="1.0"`` are two series
    in Prometheus): repeated bounds are merged by summing their counts, as PromQL does.
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    bkts = sorted((float(b), float(c)) for b, c in pairs)
    if not bkts or not (math.isinf(bkts[-1][0]) and bkts[-1][0] > 0):
        return math.nan
    bkts = _coalesce(bkts)
    _ensure_monotonic(bkts)
    if len(bkts) < 2:
        return math.nan
    observations = bkts[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = _search(len(bkts) - 1, lambda i: bkts[i][1] >= rank)
    if b == len(bkts) - 1:
        return bkts[-2][0]
    if b == 0 and bkts[0][0] <= 0:
        return bkts[0][0]
    bucket_start = 0.0
    bucket_end, count = bkts[b]
    if b > 0:
        bucket_start = bkts[b - 1][0]
        count -= bkts[b - 1][1]
        rank -= bkts[b - 1][1]
    return bucket_start + (bucket_end - bucket_start) * _go_div(rank, count)


def _go_div(a: float, b: float) -> float:
    # IEEE division as Go does it: x/0 is ±Inf or NaN, never an exception.
    if b != 0 or math.isnan(b):
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _search(n: int, pred: Callable[[int], bool]) -> int:
    # Go's sort.Search, binary as in Go, so that NaN counts land where Prometheus's do.
    i, j = 0, n
    while i < j:
        h = (i + j) // 2
        if not pred(h):
            i = h + 1
        else:
            j = h
    return i


def _coalesce(bkts: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = [list(bkts[0])]
    for bound, count in bkts[1:]:
        if bound == out[-1][0]:
            out[-1][1] += count
        else:
            out.append([bound, count])
    return out


def _ensure_monotonic(bkts: list[list[float]]) -> None:
    # NaN compares false both ways, so a NaN count stays NaN, as in Go.
    hi = -math.inf
    for bkt in bkts:
        if bkt[1] > hi:
            hi = bkt[1]
        elif bkt[1] < hi:
            bkt[1] = hi


def counter_increase(start: float, end: float) -> float:
    """Increase of one counter series between two samples; a drop means it restarted at 0.

    This is the reset rule of PromQL's ``increase()`` without its extrapolation: two
    scrapes bound the window exactly, so nothing is extrapolated.
    """
    if math.isnan(start) or math.isnan(end):
        return math.nan
    return end - start if end >= start else end


def bucket_increase(start: Mapping[float, float], end: Mapping[float, float]) -> dict[float, float]:
    """Per-bucket :func:`counter_increase`; a bucket absent at ``start`` starts from 0.

    Each ``le`` series resets independently, as it does in Prometheus; any resulting
    non-monotonicity is what :func:`histogram_quantile` then forces monotonic.
    """
    return {b: counter_increase(start.get(b, 0.0), c) for b, c in end.items()}
