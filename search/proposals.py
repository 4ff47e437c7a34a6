"""Which knob the tuner measures next before its sampler's turn (pure).

In order: the seed, then re-measurement of the best open point when little is left above
it (without a guide: once every seed was measured), then the roofline guide
(:mod:`search.guide`; without one, the remaining seeds), then
re-measurement of the best open point and of a doubtful point above the incumbent
(:mod:`search.remeasure`), then a climb above the declared incumbent until a batch over
the SLO brackets it (:meth:`search.guide.Guide.climb`). docs/search.md gives the reasons.
``reachable`` limits every answer to the knobs a staged search can measure under its
current cap (:func:`search.stages.reachable`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metrics.observation import Slo
from search.guide import Guide
from search.remeasure import ceiling, doubtful, open_best
from search.space import Knobs
from search.stop_rule import PointSummary, StopRule, incumbent


@dataclass(frozen=True, kw_only=True)
class Next:
    """The next fixed knob and its phase (None: the sampler's turn); ``guide_done``: the
    guide had nothing more to propose (the caller stores that, guidance is over)."""

    knobs: Knobs | None
    phase: str = "sampler"
    guide_done: bool = False


def next_fixed(
    points: Sequence[PointSummary],
    *,
    rule: StopRule,
    slo: Slo,
    declare_gain: float,
    guide: Guide | None,
    seeds: Sequence[Knobs],
    seeds_done: int,
    guided_done: int,
    guide_over: bool,
    reachable: Callable[[Knobs], bool] | None = None,
) -> Next:
    """The next seed, re-measured or guided knob (see the module doc). ``seeds_done`` and
    ``guided_done``: trials of those phases so far; ``guide_over``: guidance has ended."""

    def ok(knobs: Knobs) -> bool:
        return reachable is None or reachable(knobs)

    if seeds and seeds_done == 0 and ok(seeds[0]):
        return Next(knobs=seeds[0], phase="seed")
    # Re-measure before declaring. The best point that could still be declared (it met
    # the SLO in at least as many windows as not) is measured again at once when little
    # is left above it: its goodput is within `declare_gain` of the throughput measured
    # at the nearest larger batch not proven feasible (a ceiling under a saturating
    # load) or of what the guide's models predict at the largest batch they put within
    # the SLO (`Guide.ceiling`, the lower of the two; only once the point was measured
    # feasible or something is declared), or there is no guidance. Otherwise guidance
    # goes on and the re-measurement waits until it is over.
    declared = incumbent(
        points, confirmations=rule.confirmations, larger_batch_within=rule.larger_batch_within
    )
    best = open_best(points, confirmations=rule.confirmations)
    open_ = best is not None and (declared is None or best.goodput_rps > declared.goodput_rps)
    if best is not None and open_:
        top = ceiling(points, best)
        if guide is not None and (best.feasible or declared is not None):
            model_top = guide.ceiling(points, best)
            if math.isfinite(model_top) and not model_top >= top:
                top = model_top
        # Without a guide, the remaining start points come first: one point on the SLO's
        # edge under a noisy load would otherwise be re-measured until the budget is gone.
        unguided = guide is None and seeds_done >= len(seeds)
        if ok(best.knobs) and (
            unguided or (math.isfinite(top) and best.goodput_rps >= (1 - declare_gain) * top)
        ):
            return Next(knobs=best.knobs, phase="remeasure")
    done = False
    if guide is not None:
        if not guide_over:
            k = guide.propose(points, seeds[0], guided_done)
            if k is not None and ok(k):
                return Next(knobs=k, phase="guided")
            done = True
    elif seeds_done < len(seeds) and ok(seeds[seeds_done]):
        return Next(knobs=seeds[seeds_done], phase="seed")
    if best is not None and open_ and ok(best.knobs):
        return Next(knobs=best.knobs, phase="remeasure", guide_done=done)
    if guide is not None:
        again = doubtful(points, declared or best, slo=slo, max_measurements=rule.confirmations)
        if again is not None and ok(again.knobs):
            return Next(knobs=again.knobs, phase="remeasure", guide_done=done)
        up = (
            None
            if declared is None
            else guide.climb(points, declared, bracket_ratio=rule.bracket_ratio)
        )
        if up is not None and ok(up):
            return Next(knobs=up, phase="climb", guide_done=done)
    return Next(knobs=None, guide_done=done)
