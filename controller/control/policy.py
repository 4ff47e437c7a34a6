"""The control policy: the bounds, thresholds and steps ``decide`` works within, and the
p99 TPOT curve it predicts a loosening on (a canary's ``curve.json`` through
:func:`policy_from_curve`, or p99 in proportion to the batch without one). Pure: no I/O.
controller/control/decide.py applies it a tick at a time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from metrics.observation import Observation, Slo
from search.space import Knobs


def _share(name: str, v: float, *, lo: float = 0.0, hi: float = 1.0) -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and lo < v < hi):
        raise ValueError(f"{name}={v!r}: must be a number in ({lo:g}, {hi:g})")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the controller moves the limits (see the module doc for each rule)."""

    slo: Slo
    batch_max: int
    batch_min: int = 1
    headroom: float = 1.0  # admission limit / batch limit, kept when the batch moves
    concurrency_max: int | None = None  # None: batch_max x headroom
    tighten_at: float = 0.95
    loosen_below: float = 0.9
    near_windows: int = 2  # windows at the knobs before their mean may tighten (decide.py)
    # the share of windows the TPOT level is kept within the SLO at, given the spread of the
    # windows measured at unchanged knobs: once known, it lowers tighten_at and loosen_below
    # alike where the spread would put more windows than this over the SLO (decide.py)
    attainment: float = 0.95
    decrease: float = 0.9
    increase: int = 1  # at least this many a loosening tick ...
    increase_share: float = 0.05  # ... or this share of the batch, whichever is more
    max_step: float = 0.25
    stabilization_s: float = 300.0
    min_requests: int = 100
    burn_window_s: float = 300.0
    burn_rate: float = 14.4
    # (batch, p99 TPOT seconds) of the canary's measured curve, or the roofline's prediction;
    # empty: p99 TPOT taken to grow in proportion to the batch (the compute-bound worst case)
    curve: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("batch_min", "batch_max", "increase", "min_requests", "near_windows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if self.batch_max < self.batch_min:
            raise ValueError(f"batch_max={self.batch_max} < batch_min={self.batch_min}")
        if not (math.isfinite(self.headroom) and self.headroom >= 1):
            raise ValueError(f"headroom={self.headroom!r}: must be a number >= 1")
        if self.concurrency_max is not None and self.concurrency_max < self.batch_max:
            raise ValueError(
                f"concurrency_max={self.concurrency_max} < batch_max={self.batch_max}: the "
                "admission limit must allow the largest batch"
            )
        _share("tighten_at", self.tighten_at, hi=1.0 + 1e-9)
        _share("loosen_below", self.loosen_below)
        if self.loosen_below >= self.tighten_at:
            raise ValueError(
                f"loosen_below={self.loosen_below} >= tighten_at={self.tighten_at}: the "
                "tolerance band between them would be empty"
            )
        _share("attainment", self.attainment, lo=0.5)
        _share("decrease", self.decrease)
        _share("increase_share", self.increase_share)
        _share("max_step", self.max_step)
        for name in ("stabilization_s", "burn_window_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: must be a number of seconds >= 0")
        if not (math.isfinite(self.burn_rate) and self.burn_rate >= 1):
            raise ValueError(f"burn_rate={self.burn_rate!r}: must be a number >= 1")
        for b, t in self.curve:
            if not (isinstance(b, int) and b >= 1 and math.isfinite(t) and t > 0):
                raise ValueError(f"curve point ({b!r}, {t!r}): need a batch >= 1, seconds > 0")

    @property
    def concurrency_limit(self) -> int:
        if self.concurrency_max is not None:
            return self.concurrency_max
        return max(self.batch_max, round(self.batch_max * self.headroom))

    def knobs(self, batch: int, concurrency: int | None = None) -> Knobs:
        """``batch`` within the bounds, at this policy's headroom (or ``concurrency``)."""
        b = min(self.batch_max, max(self.batch_min, batch))
        c = round(b * self.headroom) if concurrency is None else concurrency
        return Knobs(max_batch_size=b, max_concurrency=min(self.concurrency_limit, max(b, c)))

    def predict_tpot_s(self, batch_from: int, p99_from: float, batch_to: int) -> float:
        """The p99 TPOT at ``batch_to`` given ``p99_from`` measured at ``batch_from``: the
        curve's ratio between them (log-log interpolation, flat beyond its ends)."""
        if len(self.curve) < 2:
            return p99_from * batch_to / batch_from
        return p99_from * _on_curve(self.curve, batch_to) / _on_curve(self.curve, batch_from)


# The spread of p99 TPOT from window to window at unchanged knobs is read from the relative
# differences of successive windows' shares there, both with the batch held by the limit:
# the last SPREAD_PAIRS of them, and at least SPREAD_MIN before it moves the band.
SPREAD_PAIRS = 24
SPREAD_MIN = 4
_Z = statistics.NormalDist()


def window_spread(diffs: tuple[float, ...]) -> float:
    """The windows' p99 TPOT spread (standard deviation over mean) from the relative
    differences of successive windows at unchanged knobs: the median of their sizes over
    0.674 x sqrt(2), the normal's quartile of a difference of two (a median, so one
    difference across a change of load does not count); NaN with fewer than SPREAD_MIN."""
    if len(diffs) < SPREAD_MIN:
        return math.nan
    return statistics.median(abs(d) for d in diffs) / (_Z.inv_cdf(0.75) * math.sqrt(2))


# Windows whose answers differ in mean length by more than this factor came from another
# load: a knobs' level keeps only the windows of the load now running (controller/control/
# decide.py). Answers of one load differ in mean length from window to window by a few
# percent (a window holds a hundred answers or more); the evening of a simulated day made
# them 2.5x longer, and the live bench doubles them (8 -> 16 tokens).
LOAD_SHIFT = 1.5


def answer_tokens(o: Observation) -> float:
    """The window's mean generated tokens per completed request (NaN where it has none)."""
    if o.completed > 0 and o.generated_tokens > 0:
        return o.generated_tokens / o.completed
    return math.nan


def same_load(a: float, b: float) -> bool:
    """Whether two windows' mean answer lengths (:func:`answer_tokens`) are within
    LOAD_SHIFT of each other; where either is unknown, taken to be the same load."""
    if not (math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0):
        return True
    return max(a, b) <= LOAD_SHIFT * min(a, b)


def tpot_band(policy: Policy, diffs: tuple[float, ...]) -> tuple[float, float, float]:
    """(tighten at, loosen below, spread) for the TPOT level: ``tighten_at`` and
    ``loosen_below``, both lowered in proportion where the windows' spread would put more
    than 1 - ``attainment`` of them over the SLO at a level of ``tighten_at``. A window
    reads the level x (1 + spread x Z), so at most 1 - attainment of them are over it at a
    level of 1 / (1 + z x spread), z the normal's ``attainment`` quantile (live, windows at
    one batch spread 8-14%, and a level of 91-97% put one in eight over). ``diffs``: the
    relative differences :func:`window_spread` reads."""
    cv = window_spread(diffs)
    if not (math.isfinite(cv) and cv > 0):
        return policy.tighten_at, policy.loosen_below, cv
    at = min(policy.tighten_at, 1 / (1 + _Z.inv_cdf(policy.attainment) * cv))
    return at, policy.loosen_below * at / policy.tighten_at, cv


def _on_curve(curve: tuple[tuple[int, float], ...], b: int) -> float:
    pts = sorted(curve)
    if b <= pts[0][0]:
        return pts[0][1]
    if b >= pts[-1][0]:
        # beyond the measured curve: the last segment's slope, never flatter than linear/2
        (b1, t1), (b2, t2) = pts[-2], pts[-1]
        slope = max(0.5, math.log(t2 / t1) / math.log(b2 / b1)) if b2 != b1 else 1.0
        return t2 * (b / b2) ** slope
    for (b1, t1), (b2, t2) in zip(pts, pts[1:], strict=False):
        if b1 <= b <= b2:
            if b2 == b1:
                return t1
            w = math.log(b / b1) / math.log(b2 / b1)
            return math.exp(math.log(t1) + w * (math.log(t2) - math.log(t1)))
    raise AssertionError("unreachable")  # pragma: no cover


def policy_from_curve(report: dict[str, Any], *, slo: Slo, **kw: Any) -> Policy:
    """A policy bounded by a canary's ``curve.json`` (``slotune tune --out``): the batch
    never above the largest batch the canary measured (its search and its sweep;
    production windows an export merged in are left out), the admission limit at the
    operating point's headroom, and the p99 TPOT the canary measured per batch (the median
    of its windows) as the curve loosening is predicted on. ValueError when the report has
    no operating point or no measured TPOT."""
    op = report.get("operating_point") or {}
    try:
        b0, c0 = int(op["max_batch_size"]), int(op["max_concurrency"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("the curve has no operating point (the canary found none)") from None
    per: dict[int, list[float]] = {}
    largest = b0
    for t in report.get("trials") or []:
        if t.get("role") == "production":  # merged by export: what production ran, not a bound
            continue
        b, ms = t.get("max_batch_size"), t.get("p99_tpot_ms")
        if not isinstance(b, int) or b < 1:
            continue
        largest = max(largest, b)
        if isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0:
            per.setdefault(b, []).append(ms / 1e3)
    if not per:
        raise ValueError("the curve holds no measured p99 TPOT")
    curve = tuple((b, sorted(v)[len(v) // 2]) for b, v in sorted(per.items()))
    kw.setdefault("batch_max", largest)
    return Policy(slo=slo, headroom=c0 / b0, curve=curve, **kw)
