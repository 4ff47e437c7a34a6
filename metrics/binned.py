"""A window's latencies as counts per histogram bucket, and what two such windows say.

Raw per-request latencies exist only where slotune sees every request (the simulator, the
load generator); a server gives histograms. One representation serves both, so a window
read from Prometheus and a simulated one carry the same evidence: :data:`Binned`, the
non-empty buckets as ``(upper bound in seconds, requests)`` pairs in increasing order
(the last bound may be ``inf``). Raw samples are binned on the cluster-wide layout of
:mod:`metrics.names` (bounds at most 10% apart, 2.5% near the default SLO, exact at the
round SLO values), which is also what slotune's own server exports.

On such counts:

- :func:`quantile_interval`: a distribution-free confidence interval of a quantile (an
  order statistic's, widened to the bucket edges it falls between).
- :func:`superiority`: the Mann-Whitney comparison of two windows. Its statistic, the
  probability that a request of B is slower than one of A (ties count half: the
  Vargha-Delaney A, which is U / (n_A n_B)), with DeLong's variance from the placement
  values, so a one-sided test may ask for an effect larger than a stated size, not only
  "any difference" (with thousands of requests the smallest shift is significant).
  Requests in one bucket are ties; the layout's resolution bounds the effect it can see.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from metrics.samples import quantile_lower_bound, quantile_upper_bound

# (bucket upper bound s, requests), increasing bounds: the non-empty buckets, led by the
# empty bucket just below the first (its bound is the lowest any request can be).
Binned = tuple[tuple[float, int], ...]


def bin_samples(samples: Sequence[float] | np.ndarray, bounds: Sequence[float]) -> Binned:
    """Requests per bucket of ``bounds`` (finite, increasing; a request equal to a bound
    falls in that bucket, as Prometheus's ``le`` counts it; above the last: ``inf``)."""
    x = np.asarray(samples, dtype=np.float64)  # [n]
    x = x[~np.isnan(x)]
    if not x.size:
        return ()
    edges = np.asarray(bounds, dtype=np.float64)  # [k]
    idx = np.searchsorted(edges, x, side="left")  # [n], k: above every bound
    counts = np.bincount(idx, minlength=edges.size + 1)  # [k + 1]
    tops = [*edges.tolist(), math.inf]
    first = int(np.flatnonzero(counts)[0])
    return tuple((tops[i], int(c)) for i, c in enumerate(counts.tolist()) if c or i == first - 1)


@functools.lru_cache(maxsize=64)
def sample_bounds(layout: tuple[float, ...], threshold_s: float) -> tuple[float, ...]:
    """The bounds raw samples are binned on: a cluster-wide layout (``metrics.names``) with
    the SLO threshold added, so the count above the SLO stays exact. Cached: every
    simulated window asks for the same few."""
    return tuple(sorted({*layout, float(threshold_s)}))


def from_cumulative(buckets: Mapping[float, float]) -> Binned:
    """Requests per bucket from cumulative bucket increases (``le`` → count, as a window's
    ``increase(..._bucket[w])`` gives them), rounded to whole requests; a bucket whose
    cumulative count fell (a counter reset seen by one series only) counts none."""
    out: list[tuple[float, int]] = []
    prev = 0
    below: float | None = None  # the bound before the first non-empty bucket
    for le in sorted(buckets):
        cum = max(prev, round(float(buckets[le]))) if math.isfinite(buckets[le]) else prev
        if cum > prev:
            if not out and below is not None:
                out.append((below, 0))
            out.append((float(le), cum - prev))
        prev = cum
        below = float(le)
    return tuple(out)


def pool(parts: Iterable[Binned]) -> Binned:
    """The windows' buckets added together (one knob measured in several windows); the
    empty bucket below the lowest request is kept, as in each part."""
    acc: dict[float, int] = {}
    for b in parts:
        for le, n in b:
            acc[float(le)] = acc.get(float(le), 0) + int(n)
    items = sorted(acc.items())
    first = next((i for i, (_, n) in enumerate(items) if n), None)
    if first is None:
        return ()
    return tuple((le, n) for i, (le, n) in enumerate(items) if n or i == first - 1)


def total(b: Binned) -> int:
    return sum(n for _, n in b)


def to_attr(b: Binned) -> list[list[float | int | None]]:
    """JSON-safe (``inf`` → None), for a study's attributes and exported files."""
    return [[le if math.isfinite(le) else None, n] for le, n in b]


def from_attr(v: Iterable[Sequence[float | int | None]] | None) -> Binned:
    if not v:
        return ()
    out = []
    for pair in v:
        le, n = pair
        out.append((math.inf if le is None else float(le), int(n)))  # type: ignore[arg-type]
    return tuple(out)


def quantile_interval(b: Binned, q: float, confidence: float = 0.95) -> tuple[float, float]:
    """A two-sided ``confidence`` interval of the q-quantile of the requests behind ``b``:
    the order statistics' distribution-free bounds (each side at (1 + confidence) / 2),
    taken at the lower edge of the bucket the lower rank falls in and the upper edge of
    the one the upper rank falls in. (nan, nan) with no requests; ±inf with too few."""
    if not total(b):
        return math.nan, math.nan
    tops = np.array([le for le, _ in b])  # [k]
    lows = np.concatenate([[0.0], tops[:-1]])  # [k] (an empty bucket between: still below)
    n = np.array([c for _, c in b])  # [k]
    side = (1 + confidence) / 2
    lo = quantile_lower_bound(np.repeat(lows, n), q, side)
    hi = quantile_upper_bound(np.repeat(tops, n), q, side)
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class Superiority:
    """How much slower B's requests are than A's: ``effect`` = P(b > a) + P(b = a) / 2."""

    effect: float
    std_err: float
    n_a: int
    n_b: int

    def p_above(self, effect: float) -> float:
        """One-sided p-value of "B's effect is at most ``effect``" (0.5: no difference):
        small when B's requests are slower than A's by more than that."""
        if self.n_a == 0 or self.n_b == 0:
            return math.nan
        if self.std_err == 0:
            return 0.0 if self.effect > effect else 1.0
        return float(stats.norm.sf((self.effect - effect) / self.std_err))

    def interval(self, confidence: float = 0.95) -> tuple[float, float]:
        z = float(stats.norm.ppf((1 + confidence) / 2))
        return max(0.0, self.effect - z * self.std_err), min(1.0, self.effect + z * self.std_err)


def superiority(a: Binned, b: Binned) -> Superiority:
    """The Mann-Whitney comparison of B's requests against A's (ties: half), with DeLong's
    standard error: each request's placement value (the fraction of the other window it
    exceeds, ties half) has a variance within its window, and the effect's variance is
    their sum over the two windows' sizes."""
    n_a, n_b = total(a), total(b)
    if n_a == 0 or n_b == 0:
        return Superiority(effect=math.nan, std_err=math.nan, n_a=n_a, n_b=n_b)
    values = sorted({le for le, _ in a} | {le for le, _ in b})
    pos = {v: i for i, v in enumerate(values)}
    ca = np.zeros(len(values))  # [v] A's requests per value
    cb = np.zeros(len(values))  # [v]
    for le, n in a:
        ca[pos[le]] += n
    for le, n in b:
        cb[pos[le]] += n
    a_below = np.cumsum(ca) - ca  # [v] A's requests strictly below each value
    b_below = np.cumsum(cb) - cb  # [v]
    # placement of a B request at v among A; of an A request at v among B (the share of B above)
    place_b = (a_below + ca / 2) / n_a  # [v]
    place_a = (n_b - b_below - cb + cb / 2) / n_b  # [v]
    effect = float((cb * place_b).sum() / n_b)

    def var(place: np.ndarray, w: np.ndarray, n: int) -> float:
        if n < 2:
            return 0.0
        mean = (w * place).sum() / n
        return float((w * (place - mean) ** 2).sum() / (n - 1))

    se = math.sqrt(var(place_a, ca, n_a) / n_a + var(place_b, cb, n_b) / n_b)
    return Superiority(effect=effect, std_err=se, n_a=n_a, n_b=n_b)
