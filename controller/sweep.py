"""The curve sweep (``slotune tune --curve-points N``): after the search has found the
operating point, N more windows that draw the curve across its range.

The search spends its trials near the operating point, so the curve it leaves is thin. The
sweep measures batches log-spaced from 1 to the largest batch the search measured within
the SLO, then one or two past it (where the SLO cuts the curve), each at a concurrency equal
to its batch so that the batch is what varies. Its windows are drawn, never searched
(``TrialRecord.role`` "sweep"): the operating point stays the search's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from controller.report.records import TrialRecord
from controller.targets import WindowPlan
from search.space import Knobs, SearchSpace

# How far past the largest batch within the SLO the sweep looks, as multiples of it.
PAST_CUT = (1.3, 1.7)
# The embedded default's sweep: four batches from 1 to the cut and two past it.
DEMO_CURVE_POINTS = 6
# A sweep window is a fixed-size measurement, not a verdict: until this many requests (a
# p99 with a finite 95% upper bound needs about 300), at most SWEEP_MAX_WINDOW_S.
SWEEP_MIN_REQUESTS = 300
SWEEP_MAX_WINDOW_S = 30.0


def sweep_plan(plan: WindowPlan) -> WindowPlan:
    """The search's window plan made into the sweep's: the same warm-up, then a whole
    window of at least ``plan.window_s``, until :data:`SWEEP_MIN_REQUESTS` requests or
    :data:`SWEEP_MAX_WINDOW_S` (a slow batch-1 point draws with a wider error bar rather
    than holding the run for minutes)."""
    window = min(plan.window_s, SWEEP_MAX_WINDOW_S)
    return replace(
        plan,
        sequential=False,
        window_s=window,
        min_requests=SWEEP_MIN_REQUESTS,
        max_window_s=max(window, min(plan.max_window_s, SWEEP_MAX_WINDOW_S)),
    )


def sweep_knobs(
    trials: Sequence[TrialRecord], points: int, space: SearchSpace
) -> tuple[list[Knobs], str]:
    """The knobs of ``points`` sweep windows, smallest batch first, and "" (or why there
    are none: no batch met the SLO, so there is no range to draw)."""
    if not (isinstance(points, int) and points >= 0):
        raise ValueError(f"curve points={points!r}: must be an integer >= 0")
    if points == 0:
        return [], ""
    met = [min(t.max_batch_size, t.max_concurrency) for t in trials if t.feasible]
    if not met:
        return [], "no batch the search measured met the SLO: no range to sweep"
    top = max(met)
    past = PAST_CUT[: 1 if points <= 3 else 2]
    beyond = sorted({min(space.batch_max, max(top + 1, math.ceil(top * f))) for f in past})
    beyond = [b for b in beyond if b > top]
    n_log = max(1, points - len(beyond))
    batches = sorted({round(float(b)) for b in np.geomspace(1, top, n_log)}) + beyond
    knobs = [space.clip(Knobs(max_batch_size=b, max_concurrency=b)) for b in batches]
    seen: set[Knobs] = set()
    out = [k for k in knobs if not (k in seen or seen.add(k))]  # type: ignore[func-returns-value]
    return out, ""
