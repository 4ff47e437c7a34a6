"""The measured curve: windows pooled by the batch that ran, with confidence intervals, its
knee and where the SLO cuts it.

A knob's windows are pooled (:class:`Pooled`: their requests, tokens and latency
histograms added), so every figure has an interval from its sample counts: tokens/s from
the Poisson interval of the requests completed (the answers' lengths as measured), a p99
from the order statistics of the pooled histogram (:func:`metrics.binned.quantile_interval`).

The batch that ran is ``min(max_batch_size, max_concurrency)``: a window at a
concurrency below the batch limit never fills the batch.

The measured knee (:func:`measured_knee`) is where tokens/s reaches half its ceiling:
below it a step costs about the same at any batch (reading the weights dominates), above
it each sequence adds step time and tokens/s flattens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from controller.report.records import TrialRecord
from metrics.binned import Binned, from_attr, pool, quantile_interval, total
from metrics.observation import Slo
from metrics.quantile import histogram_quantile
from metrics.samples import poisson_interval

CANARY = ("search", "sweep")  # the roles a canary measured (production: passive windows)


@dataclass(frozen=True, kw_only=True)
class Pooled:
    """Windows of one knob (or one batch), their requests and latencies added."""

    windows: int
    window_s: float
    completed: int
    slo_met: int
    tokens: float
    ttft: Binned
    tpot: Binned
    p99_tpot_fallback_s: float = math.nan  # the windows' own p99s, where no histogram is kept
    p50_tpot_fallback_s: float = math.nan
    confidence: float = 0.95

    @classmethod
    def of(cls, trials: Sequence[TrialRecord]) -> Pooled:
        ev = [t.evidence or {} for t in trials]

        def med(xs: Iterable[float]) -> float:
            v = [x for x in xs if math.isfinite(x)]
            return float(np.median(v)) if v else math.nan

        return cls(
            windows=len(trials),
            window_s=sum(t.window_s for t in trials if math.isfinite(t.window_s)),
            completed=sum(t.completed for t in trials),
            slo_met=sum(_slo_met(t) for t in trials),
            tokens=sum(
                t.tokens_per_s * t.window_s
                for t in trials
                if math.isfinite(t.tokens_per_s) and math.isfinite(t.window_s)
            ),
            ttft=pool(from_attr(e.get("ttft_hist")) for e in ev),
            tpot=pool(from_attr(e.get("tpot_hist")) for e in ev),
            p99_tpot_fallback_s=med(t.p99_tpot_ms / 1e3 for t in trials),
            p50_tpot_fallback_s=med(t.p50_tpot_ms / 1e3 for t in trials),
        )

    def _rate(self, x: float) -> float:
        return x / self.window_s if self.window_s > 0 else math.nan

    @property
    def goodput_rps(self) -> float:
        return self._rate(self.slo_met)

    def goodput_interval(self) -> tuple[float, float]:
        lo, hi = poisson_interval(self.slo_met, self.confidence)
        return self._rate(lo), self._rate(hi)

    @property
    def tokens_per_s(self) -> float:
        return self._rate(self.tokens)

    def tokens_interval(self) -> tuple[float, float]:
        """tokens/s scaled by the Poisson interval of the completed count (what varies
        between windows is how many requests finish; their lengths are as measured)."""
        if self.completed == 0:
            return math.nan, math.nan
        lo, hi = poisson_interval(self.completed, self.confidence)
        return self.tokens_per_s * lo / self.completed, self.tokens_per_s * hi / self.completed

    def quantile(self, which: str, q: float) -> tuple[float, float, float]:
        """(estimate, low, high) of the q-quantile of TTFT or TPOT in seconds: from the
        pooled histogram (Prometheus's interpolation; the order statistics' interval), else
        the windows' own median estimate with no interval."""
        b = self.tpot if which == "tpot" else self.ttft
        if not b:
            fb = self.p99_tpot_fallback_s if q >= 0.9 else self.p50_tpot_fallback_s
            return (fb if which == "tpot" else math.nan), math.nan, math.nan
        cum: dict[float, float] = {}
        run = 0
        for le, n in b:
            run += n
            cum[le] = float(run)
        cum[math.inf] = float(run)  # Prometheus's +Inf bucket: every request
        lo, hi = quantile_interval(b, q, self.confidence)
        return histogram_quantile(q, cum), lo, hi

    @property
    def latency_requests(self) -> tuple[int, int]:
        return total(self.ttft), total(self.tpot)


def _slo_met(t: TrialRecord) -> int:
    ev = t.evidence or {}
    if ev.get("slo_met") is not None:
        return int(ev["slo_met"])
    x = t.goodput_rps * t.window_s
    return round(x) if math.isfinite(x) else 0


def ran_batch(t: TrialRecord) -> int:
    return max(1, min(t.max_batch_size, t.max_concurrency))


@dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    """One batch of the measured curve: its windows pooled."""

    batch: int
    pooled: Pooled
    roles: tuple[str, ...]  # the roles of its windows (search, sweep, production)
    slo: Slo

    @property
    def p99_tpot(self) -> tuple[float, float, float]:
        return self.pooled.quantile("tpot", self.slo.quantile)

    @property
    def p50_tpot_s(self) -> float:
        return self.pooled.quantile("tpot", 0.5)[0]

    @property
    def meets_tpot(self) -> bool:
        return self.p99_tpot[0] <= self.slo.tpot_p99_s


def measured_curve(
    trials: Iterable[TrialRecord], slo: Slo, *, roles: Sequence[str] = CANARY
) -> list[MeasuredPoint]:
    """The windows of ``roles`` pooled by the batch that ran, in batch order."""
    by: dict[int, list[TrialRecord]] = {}
    for t in trials:
        if t.role in roles and t.completed > 0:
            by.setdefault(ran_batch(t), []).append(t)
    return [
        MeasuredPoint(
            batch=b,
            pooled=Pooled.of(ts),
            roles=tuple(sorted({t.role for t in ts})),
            slo=slo,
        )
        for b, ts in sorted(by.items())
    ]


def measured_knee(points: Sequence[MeasuredPoint]) -> float | None:
    """The batch where measured tokens/s reaches half its ceiling: ``a / s`` of the line
    ``tpot(B) = a + s * B`` fitted (least squares) to the median TPOT of each batch, ``a``
    the fixed cost of a step (reading the weights), ``s`` what each sequence adds. There
    the two are equal; tokens/s = B / (a + s B) climbs towards ``1 / s`` and is half of it.
    (The roofline's knee is the sharp corner of the same picture: ``max(a, b B)`` turns at
    ``a / b``.) None with fewer than three batches, or no rise."""
    pts = [(p.batch, p.p50_tpot_s) for p in points if math.isfinite(p.p50_tpot_s)]
    if len(pts) < 3:
        return None
    b = np.array([x for x, _ in pts], dtype=np.float64)  # [n]
    y = np.array([v for _, v in pts], dtype=np.float64)  # [n]
    slope, intercept = np.polyfit(b, y, 1)
    if not (slope > 0 and intercept > 0):
        return None
    return float(intercept / slope)


def measured_slo_cut(points: Sequence[MeasuredPoint], slo: Slo) -> tuple[float | None, str]:
    """The batch where measured p99 TPOT crosses the SLO, interpolated between the largest
    batch within it and the next one over it; (None, why) when the curve does not cross."""
    pts = [p for p in points if math.isfinite(p.p99_tpot[0])]
    ok = [p for p in pts if p.meets_tpot]
    if not ok:
        return None, "no measured batch met the TPOT SLO"
    last = max(ok, key=lambda p: p.batch)
    over = [p for p in pts if p.batch > last.batch and not p.meets_tpot]
    if not over:
        return None, f"no measured batch above B={last.batch} went over the TPOT SLO"
    nxt = min(over, key=lambda p: p.batch)
    y0, y1 = last.p99_tpot[0], nxt.p99_tpot[0]
    w = (slo.tpot_p99_s - y0) / (y1 - y0) if y1 > y0 else 0.0
    return last.batch + w * (nxt.batch - last.batch), ""
