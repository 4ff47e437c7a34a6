"""Pooling the windows of one knob: the SLO verdict on the union of their requests.

A p99 verdict is a count test (:mod:`metrics.samples`): ``above`` of ``total``
requests over the threshold, judged with one-sided Clopper-Pearson bounds. Two
windows of the same knob are two samples of the same latency distribution, so
the verdict on their union is the same test on the summed counts: exact samples
concatenate, and histogram bucket increases add (the threshold is a bucket bound
in the contract's ``slo_buckets``, else the count is bracketed and the verdict
takes the side that cannot flatter it, as :func:`verdict_from_histogram` does).
A window too short to call a p99 (INSUFFICIENT) thus lends its requests to the
next window of the same knob instead of being wasted.

An :class:`~metrics.observation.SloVerdict` states its ``samples`` and the
Clopper-Pearson bounds it computed from the counts, not the counts themselves;
:func:`counts_of` recovers them exactly by inverting the bounds (each is strictly
monotone in its count) and checks the result, so this works for any Observation
source (the simulator, Prometheus histograms, raw request samples). A verdict
without bounds (a hand-built one) gives None, and the tuner then falls back to a
majority vote of windows.

Sequential looks at growing evidence raise the chance of a false MET above
``1 - confidence`` (at most by the number of looks, here a few windows): the
tuner bounds the windows a point gets (:mod:`search.remeasure`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metrics.observation import SloVerdict, Verdict
from metrics.samples import exceed_fraction_bounds, verdict_from_counts

# Relative tolerance when matching a recomputed Clopper-Pearson bound to the stored one.
_MATCH_RTOL = 1e-9


@dataclass(frozen=True, kw_only=True)
class Counts:
    """Requests behind one verdict: ``above`` are known to exceed the threshold,
    ``above_at_most`` may (equal for exact samples and thresholds on a bucket bound)."""

    total: int
    above: int
    above_at_most: int
    confidence: float

    def __post_init__(self) -> None:
        if not 0 <= self.above <= self.above_at_most <= self.total:
            raise ValueError(
                f"counts above={self.above}, above_at_most={self.above_at_most},"
                f" total={self.total}: need 0 <= above <= above_at_most <= total"
            )
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence={self.confidence!r}: must be in (0, 1)")

    def as_list(self) -> list[float]:
        return [self.total, self.above, self.above_at_most, self.confidence]

    @classmethod
    def from_list(cls, xs: Sequence[float] | None) -> Counts | None:
        if xs is None or len(xs) != 4:
            return None
        return cls(
            total=int(xs[0]), above=int(xs[1]), above_at_most=int(xs[2]), confidence=float(xs[3])
        )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _MATCH_RTOL * max(1.0, abs(a), abs(b))


def _invert(total: int, target: float, confidence: float, *, side: int) -> int | None:
    """The count whose bound (``side`` 0: lower, 1: upper) equals ``target`` (None: none)."""

    def bound(a: int) -> float:
        return exceed_fraction_bounds(total, a, confidence)[side]

    lo, hi = 0, total
    while lo < hi:  # least a with bound(a) >= target (bounds grow with the count)
        mid = (lo + hi) // 2
        if bound(mid) < target and not _close(bound(mid), target):
            lo = mid + 1
        else:
            hi = mid
    return lo if _close(bound(lo), target) else None


def counts_of(verdict: SloVerdict | None) -> Counts | None:
    """The request counts behind ``verdict``, recovered exactly, or None when it does not
    state them (no bounds, or bounds that no count reproduces)."""
    if verdict is None:
        return None
    n, lo_b, hi_b = verdict.samples, verdict.exceed_fraction_lower, verdict.exceed_fraction_upper
    conf = verdict.confidence
    if not (isinstance(n, int) and n >= 0 and 0 < conf < 1):
        return None
    if not (math.isfinite(lo_b) and math.isfinite(hi_b)):
        return None
    if n == 0:
        return Counts(total=0, above=0, above_at_most=0, confidence=conf)
    above = _invert(n, lo_b, conf, side=0)
    at_most = _invert(n, hi_b, conf, side=1)
    if above is None or at_most is None or above > at_most:
        return None
    return Counts(total=n, above=above, above_at_most=at_most, confidence=conf)


def pooled_verdict(
    windows: Sequence[Counts], *, threshold_s: float, estimate_s: float, q: float
) -> SloVerdict | None:
    """The verdict on the union of the windows' requests (None: no windows, or windows
    judged at different confidences, which do not pool)."""
    if not windows or len({c.confidence for c in windows}) != 1:
        return None
    return verdict_from_counts(
        sum(c.total for c in windows),
        sum(c.above for c in windows),
        threshold_s,
        estimate_s,
        q=q,
        confidence=windows[0].confidence,
        above_at_most=sum(c.above_at_most for c in windows),
    )


def combine(ttft: Verdict | None, tpot: Verdict | None) -> Verdict | None:
    """Both SLOs at once: VIOLATED if either is, MET if both are, else INSUFFICIENT."""
    if ttft is None or tpot is None:
        return None
    if Verdict.VIOLATED in (ttft, tpot):
        return Verdict.VIOLATED
    if ttft is Verdict.MET and tpot is Verdict.MET:
        return Verdict.MET
    return Verdict.INSUFFICIENT
