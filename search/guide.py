"""Roofline-guided proposals: the seed, then brackets corrected by what was measured.

:class:`Guide` models p99 TPOT as the peak roofline times a batch-dependent factor learned
from the measurements (``k(B) = measured p99 TPOT / predicted step time``, interpolated in
log-log) and TTFT by a log-log fit, and proposes the largest batch both models put within
``aim`` of the SLOs, safeguarded like a bracketing root finder. :meth:`Guide.ceiling` is the
goodput the models predict at that batch. Guidance ends when the bracket is narrower than
``resolution``, after ``max_steps``, or on a knob already measured. docs/search.md gives the
safeguards and their defaults. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metrics.observation import Slo, Verdict
from search.space import Knobs, SearchSpace
from search.stop_rule import PointSummary


@dataclass(frozen=True, kw_only=True)
class Guide:
    model_tpot_s: Callable[[int], float]  # predicted (peak roofline) TPOT at batch B
    space: SearchSpace
    slo: Slo
    aim: float = 0.97  # aim the corrected TPOT at this fraction of the SLO
    ttft_aim: float = 0.85  # and the extrapolated TTFT at this fraction
    max_steps: int = 6  # guided proposals after the seed at most
    resolution: float = 0.05  # stop when the feasible/infeasible bracket is this narrow
    max_step_down: float = 8.0  # with nothing feasible yet, come down at most this factor a step
    # Below the smallest measured batch, assume p99 TPOT falls at least like B**this (the
    # peak roofline is flat there, and would send a small overshoot far down).
    min_elasticity: float = 0.5
    # From one measured batch b0 the TPOT model's batch B_m below it is a one-point
    # extrapolation whose error grows with its distance: step to b0·(B_m/b0)**(1 + this).
    extrapolation_spread: float = 0.4

    def __post_init__(self) -> None:
        for name in ("aim", "ttft_aim"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name}={v!r}: must be in (0, 1]")
        if self.max_steps < 0:
            raise ValueError(f"max_steps={self.max_steps!r}: must be >= 0")
        if not (math.isfinite(self.extrapolation_spread) and self.extrapolation_spread >= 0):
            raise ValueError(
                f"extrapolation_spread={self.extrapolation_spread!r}: must be a number >= 0"
            )
        if not 0 <= self.min_elasticity <= 1:
            raise ValueError(f"min_elasticity={self.min_elasticity!r}: must be in [0, 1]")
        if not (math.isfinite(self.max_step_down) and self.max_step_down > 1):
            raise ValueError(f"max_step_down={self.max_step_down!r}: must be a number > 1")

    def correction(self, points: Sequence[PointSummary]) -> Callable[[int], float]:
        """``k(B)``: measured over predicted TPOT, interpolated in log-log."""
        obs: dict[int, list[float]] = {}
        for p in points:
            b = p.knobs.max_batch_size
            pred = self.model_tpot_s(b)
            if math.isfinite(p.tpot_p99_s) and p.tpot_p99_s > 0 and pred > 0:
                obs.setdefault(b, []).append(math.log(p.tpot_p99_s / pred))
        xs = sorted(obs)
        ys = [sum(obs[b]) / len(obs[b]) for b in xs]
        lx = [math.log(b) for b in xs]

        def k(b: int) -> float:
            if not xs:
                return 1.0
            x = math.log(b)
            i = bisect.bisect_left(lx, x)
            if i == 0:
                return math.exp(ys[0])
            if i >= len(xs):
                return math.exp(ys[-1])
            t = (x - lx[i - 1]) / (lx[i] - lx[i - 1])
            return math.exp(ys[i - 1] + t * (ys[i] - ys[i - 1]))

        return k

    def predict_tpot(self, points: Sequence[PointSummary]) -> Callable[[int], float]:
        """p99 TPOT at batch B: the roofline times ``k(B)``; below the smallest measured
        batch ``b0`` no more than ``TPOT(b0)·(B/b0)**min_elasticity``."""
        k = self.correction(points)
        low = min(
            (
                (p.knobs.max_batch_size, p.tpot_p99_s)
                for p in points
                if math.isfinite(p.tpot_p99_s) and p.tpot_p99_s > 0
            ),
            default=None,
        )

        def tpot(b: int) -> float:
            t = k(b) * self.model_tpot_s(b)
            if low is not None and b < low[0] and self.min_elasticity > 0:
                t = min(t, low[1] * (b / low[0]) ** self.min_elasticity)
            return t

        return tpot

    def _tpot_batch(
        self, points: Sequence[PointSummary], lo: int, hi: int, aim: float | None = None
    ) -> int:
        """Largest batch in [lo, hi] whose corrected TPOT meets ``aim · SLO`` (default
        :attr:`aim`); ``lo`` when none does."""
        tpot = self.predict_tpot(points)
        goal = (self.aim if aim is None else aim) * self.slo.tpot_p99_s
        best = lo
        for b in _log_candidates(lo, hi):
            if tpot(b) <= goal:
                best = max(best, b)
        return best

    def step_from_one(self, points: Sequence[PointSummary], b: int) -> int:
        """``b``, the TPOT model's batch, moved further from the measured batch ``b0`` by
        :attr:`extrapolation_spread` in log scale when ``b0`` is the only batch measured and
        ``b`` lies below it; ``b`` otherwise."""
        measured = {
            p.knobs.max_batch_size
            for p in points
            if math.isfinite(p.tpot_p99_s) and p.tpot_p99_s > 0
        }
        if len(measured) != 1 or b >= (b0 := min(measured)):
            return b
        moved = math.floor(b0 * (b / b0) ** (1.0 + self.extrapolation_spread))
        return max(self.space.batch_min, moved)

    def _ttft_batch(
        self, points: Sequence[PointSummary], lo: int, hi: int, aim: float | None = None
    ) -> int:
        """Largest batch whose TTFT, extrapolated in log-log from the measured points
        (slope from the two nearest, clamped to [0.5, 3]; 1 with one point), meets
        ``ttft_aim · SLO`` (``aim · SLO`` when given)."""
        pts = sorted(
            (p.knobs.max_batch_size, p.ttft_p99_s)
            for p in points
            if math.isfinite(p.ttft_p99_s) and p.ttft_p99_s > 0
        )
        if not pts:
            return hi
        goal = (self.ttft_aim if aim is None else aim) * self.slo.ttft_p99_s

        def predict(b: int) -> float:
            near = sorted(pts, key=lambda q: abs(math.log(q[0] / b)))[:2]
            (b1, t1) = near[0]
            slope = 1.0
            if len(near) > 1 and near[1][0] != b1:
                (b2, t2) = near[1]
                slope = math.log(t2 / t1) / math.log(b2 / b1)
                slope = min(3.0, max(0.5, slope))
            return t1 * (b / b1) ** slope

        best = lo
        for b in _log_candidates(lo, hi):
            if predict(b) <= goal:
                best = max(best, b)
        return best

    def ceiling(self, points: Sequence[PointSummary], best: PointSummary) -> float:
        """The throughput the models predict at the largest batch they put within both SLOs
        (TPOT and TTFT at 1·SLO, no discount): ``best``'s measured throughput scaled by
        ``B / TPOT(B)`` (a full batch decoding); ``best``'s own when that batch is not
        above it, nan when ``best`` has no throughput."""
        thr = best.throughput_rps if math.isfinite(best.throughput_rps) else best.goodput_rps
        bf = best.knobs.max_batch_size
        if not (math.isfinite(thr) and thr > 0):
            return math.nan
        lo, hi = self.space.batch_min, self.space.batch_max
        tpot = self.predict_tpot(points)
        bm = self._tpot_batch(points, lo, hi, aim=1.0)
        bm = min(bm, self._ttft_batch(points, lo, hi, aim=1.0))
        tf, tm = tpot(bf), tpot(bm)
        if bm <= bf or not (tf > 0 and tm > 0):
            return thr
        return thr * (bm / tm) / (bf / tf)

    def bracket(self, points: Sequence[PointSummary]) -> tuple[int | None, int | None]:
        """(largest batch measured feasible, smallest batch above it not proven feasible).

        With no feasible point yet, only batches measured *over* an SLO bound it from above
        (a low batch can be unproven for want of samples, not for being too slow). A point
        held for a second window (``marginal``: its one window's p99 within the noise band
        of an SLO) bounds it from neither side, nor does one left undecided whose every
        window's p99 lay under both SLOs (its windows too close to the SLO to call, which
        one window's slowdown does to a truly feasible batch)."""
        feas = [p.knobs.max_batch_size for p in points if p.feasible]
        top = max(feas) if feas else None
        over = [
            p.knobs.max_batch_size
            for p in points
            if not p.marginal
            and (
                (
                    top is not None
                    and not p.feasible
                    and p.knobs.max_batch_size > top
                    and not _undecided_under(p, self.slo)
                )
                or (not p.tpot_ok and p.tpot_p99_s > self.slo.tpot_p99_s)
                or (not p.ttft_ok and p.ttft_p99_s > self.slo.ttft_p99_s)
            )
        ]
        if top is not None:
            over = [b for b in over if b > top]
        return top, (min(over) if over else None)

    def target_batch(self, points: Sequence[PointSummary]) -> int | None:
        """The next batch: the models' answer (corrected TPOT under ``aim · SLO``, TTFT
        extrapolated under ``ttft_aim · SLO``), safeguarded like a bracketing root finder:
        inside the bracket [largest feasible, smallest over-SLO] it is clamped to the
        middle half of the bracket in log scale; None once the bracket is narrower than
        ``resolution`` (goodput grows with batch under a saturating load, so the largest
        feasible batch is the answer)."""
        lo0, hi0 = self.space.batch_min, self.space.batch_max
        feas, over = self.bracket(points)
        hi = hi0 if over is None else max(lo0, over - 1)
        tpot_b = self.step_from_one(points, self._tpot_batch(points, lo0, hi))
        model = min(tpot_b, self._ttft_batch(points, lo0, hi))
        if feas is not None and over is not None:
            if over <= feas + 1 or over <= feas * (1 + self.resolution):
                return None
            a = math.ceil(feas * (over / feas) ** 0.25)
            z = math.floor(feas * (over / feas) ** 0.75)
            return min(max(model, a, feas + 1), max(z, feas + 1), over - 1)
        if feas is not None:  # nothing over the SLO yet: probe above the best feasible
            if feas >= hi0:
                return None
            return min(hi0, max(model, math.ceil(feas * 1.25), feas + 1))
        if over is not None:  # nothing feasible yet: come down, not all the way at once
            floor = round(over / self.max_step_down)
            return max(lo0, min(max(model, floor), round(over * 0.9), over - 1))
        return model

    def climb(
        self, points: Sequence[PointSummary], best: PointSummary, *, bracket_ratio: float
    ) -> Knobs | None:
        """After guidance, the next batch above the declared ``best`` while nothing within
        ``bracket_ratio`` of it is judged over the SLO: the geometric middle of [largest
        feasible, smallest judged over], or 1.25x the largest feasible with nothing over; at
        ``best``'s headroom. None when bracketed or already measured: under a saturating
        load goodput grows with the batch, so a smaller batch cannot beat ``best`` and the
        sampler's turn is better spent above it.

        Unlike :meth:`bracket` (which aims guidance and takes any batch above the feasible
        ones that is not proven feasible for over), a batch left undecided after its windows
        does not stop the climb: near the SLO one window's slowdown can hold a truly feasible
        batch undecided, while the next batch up, measured in its own windows, decides."""
        top, _ = self.bracket(points)
        above = [
            p.knobs.max_batch_size
            for p in points
            if not p.marginal and _judged_over(p, self.slo) and p.knobs.max_batch_size > (top or 0)
        ]
        over = min(above) if above else None
        b0 = max(top or 0, best.knobs.max_batch_size)
        if over is not None and over <= b0 * bracket_ratio:
            return None
        hi = self.space.batch_max if over is None else over - 1
        b = math.ceil(b0 * 1.25) if over is None else round(math.sqrt(b0 * over))
        b = min(max(b, b0 + 1), hi)
        if b <= b0:
            return None
        h = best.knobs.headroom
        knobs = self.space.clip(Knobs(max_batch_size=b, max_concurrency=max(b, round(b * h))))
        return None if any(p.knobs == knobs for p in points) else knobs

    def headroom(self, points: Sequence[PointSummary], seed: Knobs) -> float:
        """The seed's headroom, its log halved once per TTFT-violating measurement."""
        h = seed.headroom
        for p in sorted(points, key=lambda p: p.first_trial):
            if not p.ttft_ok and p.knobs.headroom <= h * 1.001:
                h = max(1.0, math.sqrt(h) if h > 1.0 else 1.0)
        return h

    def propose(self, points: Sequence[PointSummary], seed: Knobs, steps_done: int) -> Knobs | None:
        """The next guided knob, or None when guidance is done (converged or out of steps)."""
        if steps_done >= self.max_steps or not points:
            return None
        b = self.target_batch(points)
        if b is None:
            return None
        h = self.headroom(points, seed)
        knobs = self.space.clip(Knobs(max_batch_size=b, max_concurrency=max(b, round(b * h))))
        measured = {p.knobs: p for p in points}
        if knobs in measured and not measured[knobs].feasible and b > self.space.batch_min:
            # Pointed back at a batch not proven feasible: step below it instead.
            b = max(self.space.batch_min, min(b - 1, round(b * 0.85)))
            knobs = self.space.clip(Knobs(max_batch_size=b, max_concurrency=max(b, round(b * h))))
        if knobs in measured:
            return None  # the models point at a measured knob: converged
        return knobs


def _judged_over(p: PointSummary, slo: Slo) -> bool:
    """Either SLO judged VIOLATED on the knob's pooled requests (without request counts:
    some window's p99 over its bound)."""
    for judged, ok, p99, bound in (
        (p.tpot, p.tpot_ok, p.tpot_p99_s, slo.tpot_p99_s),
        (p.ttft, p.ttft_ok, p.ttft_p99_s, slo.ttft_p99_s),
    ):
        if judged is not None:
            if judged.verdict is Verdict.VIOLATED:
                return True
        elif not ok and p99 > bound:
            return True
    return False


def _undecided_under(p: PointSummary, slo: Slo) -> bool:
    """Neither SLO judged VIOLATED, and every window's p99 under both bounds."""
    tpot_under = p.tpot_p99_s <= slo.tpot_p99_s or math.isnan(p.tpot_p99_s)
    return tpot_under and p.ttft_p99_s <= slo.ttft_p99_s and not _judged_over(p, slo)


def _log_candidates(lo: int, hi: int) -> list[int]:
    """Every integer in [lo, hi] when few, else a dense log grid (about 1% apart) plus ends."""
    if hi - lo <= 512:
        return list(range(lo, hi + 1))
    out = {lo, hi}
    x = float(lo)
    while x < hi:
        out.add(int(x))
        x = max(x * 1.01, x + 1)
    return sorted(out)
