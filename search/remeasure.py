"""Which measured point to measure again, and when (pure functions of the point summaries).

A point is only ever declared after ``confirmations`` windows whose pooled
requests meet the SLO (:mod:`search.stop_rule`, :mod:`search.evidence`), so the
tuner spends trials re-measuring. These rules decide where those trials go:

- :func:`open_best`: the best point that could still be declared
  (:meth:`PointSummary.undecided`: its pooled verdicts are not VIOLATED, it is not
  declared yet, and has not had ``2·confirmations + 1`` windows already).
- :func:`ceiling`: the throughput measured at the nearest larger batch not
  proven feasible. Under a saturating load throughput grows with batch, so no
  batch in between can have more goodput: when the open best is within a few
  percent of it, guidance has little left to gain and the tuner re-measures at once.
- :func:`doubtful`: after guidance, the nearest point above the incumbent that
  failed only for want of evidence (INSUFFICIENT: no p99 over the SLO in any
  window) or whose one window was too near the SLO to judge the knob rather than
  the environment (``PointSummary.marginal``); one more window pools its requests
  with the first (or outvotes it) and may settle it before the climb and the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from metrics.observation import Slo, Verdict
from search.stop_rule import PointSummary


def open_best(points: Sequence[PointSummary], *, confirmations: int) -> PointSummary | None:
    """The best (by pooled goodput; ties: earliest) point that could still be declared."""
    open_ = [p for p in points if p.undecided(confirmations)]
    return max(open_, key=lambda p: (p.goodput_rps, -p.first_trial), default=None)


def ceiling(points: Sequence[PointSummary], best: PointSummary) -> float:
    """Throughput at the nearest batch above ``best`` not proven feasible (nan: none)."""
    b = best.knobs.max_batch_size
    above = [p for p in points if p.knobs.max_batch_size > b and not p.feasible]
    if not above:
        return math.nan
    nearest = min(p.knobs.max_batch_size for p in above)
    vals = [
        p.throughput_rps
        for p in above
        if p.knobs.max_batch_size == nearest and math.isfinite(p.throughput_rps)
    ]
    return max(vals, default=math.nan)


def doubtful(
    points: Sequence[PointSummary], top: PointSummary | None, *, slo: Slo, max_measurements: int
) -> PointSummary | None:
    """The nearest point above ``top`` that is not feasible, yet had no p99 over the SLO
    in any window or is held for a second window (``marginal``: its one window's p99 within
    the noise band of an SLO, either side), measured at most ``max_measurements`` times
    (None: no such point)."""
    floor = top.knobs.max_batch_size if top is not None else 0
    cands = [
        p
        for p in points
        if p.knobs.max_batch_size > floor
        and not p.feasible
        and p.pooled is not Verdict.VIOLATED
        and p.measurements <= max_measurements
        and (
            p.marginal
            or (
                math.isfinite(p.tpot_p99_s)
                and math.isfinite(p.ttft_p99_s)
                and p.tpot_p99_s <= slo.tpot_p99_s
                and p.ttft_p99_s <= slo.ttft_p99_s
            )
        )
    ]
    return min(cands, key=lambda p: p.knobs.max_batch_size, default=None)
