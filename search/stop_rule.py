"""When the tuner may stop: the incumbent is confirmed and nothing nearby beats it.

Measurements are noisy, so the tuner keeps one :class:`PointSummary` per distinct
knob (all its measurements pooled) and only ever *declares* a point measured in at
least ``confirmations`` windows whose SLO verdicts, judged on the union of their
requests (:mod:`search.evidence`), are both MET: a window too short to call a p99
lends its requests to the next one, and one lucky window does not declare a point.
When a window's request counts are unknown, a majority vote of windows decides
instead (at least ``confirmations`` met the SLO, and more than did not). The
rule, in order:

1. ``max_trials`` reached: stop (with or without a feasible point).
2. No confirmed incumbent: continue.
3. Bracketed: a point with a larger batch, at most ``bracket_ratio`` times the
   largest declared batch (the incumbent's or above it), was judged to violate TPOT
   (undecided is not enough). Under the monotone physics (TPOT grows with batch) there is no
   better batch: stop.
4. Stale: the last ``patience`` trials did not raise the incumbent's goodput by
   more than ``min_improvement`` (relative): stop.

Pure functions of the per-point summaries and the trial count; tested by tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metrics.observation import Verdict
from search.evidence import Judgement
from search.space import Knobs


@dataclass(frozen=True, kw_only=True)
class PointSummary:
    """Every measurement of one knob, pooled (what the tuner knows about it)."""

    knobs: Knobs
    measurements: int
    goodput_rps: float  # mean over measurements
    feasible: bool  # pooled verdicts both MET (without counts: most of its windows met the SLO)
    ttft_p99_s: float  # worst over measurements (nan when unknown)
    tpot_p99_s: float
    ttft_ok: bool  # every TTFT verdict MET
    tpot_ok: bool
    last_trial: int  # trial number of the latest measurement
    first_trial: int
    met_windows: int | None = None  # windows that met the SLO (None: all or none, by feasible)
    throughput_rps: float = math.nan  # completions/s, mean over measurements (SLO or not)
    # Both SLOs judged on the union of the windows' requests (search.evidence): VIOLATED if
    # either is, MET if both are, else INSUFFICIENT; None when some window's counts are
    # unknown (the majority of windows decides then).
    pooled: Verdict | None = None
    # Each SLO's anytime-valid judgement (search.evidence.judge; None: counts unknown) and
    # why the knob's windows look noisy ("" when they agree).
    ttft: Judgement | None = None
    tpot: Judgement | None = None
    noise: str = ""
    # Its verdicts rest on one window whose p99 lies within search.points.NOISE_BAND of an
    # SLO: held undecided until a second window (pooled then, or judged by majority).
    marginal: bool = False

    def __post_init__(self) -> None:
        if self.met_windows is None:
            object.__setattr__(self, "met_windows", self.measurements if self.feasible else 0)

    @property
    def failed_windows(self) -> int:
        return self.measurements - int(self.met_windows or 0)

    def declared(self, confirmations: int) -> bool:
        """Measured in at least ``confirmations`` windows and the pooled verdicts are MET
        (without pooled verdicts: met the SLO in ``confirmations`` windows, and in most)."""
        if self.pooled is not None:
            return self.measurements >= confirmations and self.pooled is Verdict.MET
        met = int(self.met_windows or 0)
        return met >= confirmations and met > self.failed_windows

    def undecided(self, confirmations: int) -> bool:
        """Not declared, yet more windows (at most ``2·confirmations + 1`` in all) could
        declare it: its pooled verdicts are not VIOLATED (without pooled verdicts: it met
        the SLO in at least one window and in at least as many as not)."""
        if self.declared(confirmations) or self.measurements >= 2 * confirmations + 1:
            return False
        if self.pooled is not None:
            return self.pooled is not Verdict.VIOLATED
        met = int(self.met_windows or 0)
        return met > 0 and 2 * met >= self.measurements


# The incumbent: among the declared points within this fraction of the best pooled goodput,
# the largest batch (0: the best pooled goodput itself). Under a saturating load a larger
# feasible batch has at least the goodput, so a point of less goodput within a window's
# noise is the noise: on this CPU the served tokens/s levels off from B~13 to the TPOT
# edge at B~19, two windows at one knob differed by up to 7%, and the canary's best pooled
# goodput fell anywhere in B=12-19 from run to run (docs/BENCHMARKS.md, issue 19). The
# largest such batch is where the SLO cuts the curve: the operating point slotune is
# asked for.
LARGER_BATCH_WITHIN = 0.05


@dataclass(frozen=True, kw_only=True)
class StopRule:
    # One window suffices: the pooled verdicts are anytime-valid (search.evidence), so a
    # knob judged MET after one window keeps its confidence, and more windows of it pool.
    confirmations: int = 1
    patience: int = 4
    min_improvement: float = 0.02
    bracket_ratio: float = 1.15
    max_trials: int = 40
    larger_batch_within: float = LARGER_BATCH_WITHIN  # see LARGER_BATCH_WITHIN

    def __post_init__(self) -> None:
        if self.confirmations < 1:
            raise ValueError(f"confirmations={self.confirmations!r}: must be >= 1")
        if self.patience < 1:
            raise ValueError(f"patience={self.patience!r}: must be >= 1")
        if not 0 <= self.min_improvement < 1:
            raise ValueError(f"min_improvement={self.min_improvement!r}: must be in [0, 1)")
        if not (math.isfinite(self.bracket_ratio) and self.bracket_ratio > 1):
            raise ValueError(f"bracket_ratio={self.bracket_ratio!r}: must be a number > 1")
        if self.max_trials < 1:
            raise ValueError(f"max_trials={self.max_trials!r}: must be >= 1")
        if not 0 <= self.larger_batch_within < 1:
            raise ValueError(f"larger_batch_within={self.larger_batch_within!r}: must be in [0, 1)")

    @classmethod
    def preset(cls, name: str) -> StopRule:
        presets = {
            "default": cls(),
            "thorough": cls(confirmations=3, patience=8, min_improvement=0.01, max_trials=80),
            "quick": cls(confirmations=1, patience=3, min_improvement=0.03, max_trials=20),
        }
        if name not in presets:
            raise ValueError(f"stop rule preset {name!r}: choose one of {sorted(presets)}")
        return presets[name]


def incumbent(
    points: Sequence[PointSummary],
    *,
    confirmations: int = 1,
    larger_batch_within: float = LARGER_BATCH_WITHIN,
) -> PointSummary | None:
    """The point with the highest pooled goodput among those declared with ``confirmations``
    (see :meth:`PointSummary.declared`; ties: the earliest measured). With
    ``larger_batch_within`` > 0: the largest batch among the declared points whose pooled
    goodput is within that fraction of the highest (ties: goodput, then earliest)."""
    cands = [p for p in points if p.feasible and p.declared(confirmations)]
    if not cands:
        return None
    best = max(cands, key=lambda p: (p.goodput_rps, -p.first_trial))
    if larger_batch_within <= 0:
        return best
    near = [p for p in cands if p.goodput_rps >= (1 - larger_batch_within) * best.goodput_rps]
    return max(near, key=lambda p: (p.knobs.max_batch_size, p.goodput_rps, -p.first_trial))


def _violates_tpot(p: PointSummary) -> bool:
    """TPOT judged VIOLATED (without request counts: not every window met it)."""
    if p.tpot is not None:
        return p.tpot.verdict is Verdict.VIOLATED
    return not p.tpot_ok


def stop_reason(points: Sequence[PointSummary], n_trials: int, rule: StopRule) -> str | None:
    """Why the search may stop now, or None to continue (see the module doc)."""
    if n_trials >= rule.max_trials:
        return f"max_trials={rule.max_trials} reached"
    best = incumbent(
        points, confirmations=rule.confirmations, larger_batch_within=rule.larger_batch_within
    )
    if best is None:
        return None
    # Bracketed above the largest declared batch: under the monotone model no batch between
    # the incumbent and it has more goodput than it (the incumbent's higher measured goodput
    # is the windows' noise), and none above it within the ratio meets TPOT.
    top = max(
        (p for p in points if p.feasible and p.declared(rule.confirmations)),
        key=lambda p: p.knobs.max_batch_size,
    )
    b = top.knobs.max_batch_size
    for p in points:
        pb = p.knobs.max_batch_size
        if b < pb <= b * rule.bracket_ratio and _violates_tpot(p):
            return f"bracketed: {p.knobs} violates TPOT just above {top.knobs}, declared"
    # The trial that last raised the bar by more than min_improvement.
    bar, last_gain = -math.inf, -1
    for p in sorted(points, key=lambda p: p.first_trial):
        if p.feasible and p.goodput_rps > bar * (1 + rule.min_improvement):
            bar, last_gain = p.goodput_rps, p.first_trial
    if n_trials - 1 - last_gain >= rule.patience:
        return f"stable: no gain over {rule.min_improvement:.0%} in the last {rule.patience} trials"
    return None
