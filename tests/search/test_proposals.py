"""Which knob comes next before the sampler's turn (search/proposals.py)."""

from __future__ import annotations

import math
from dataclasses import replace

from metrics.observation import Slo, Verdict
from search.evidence import Judgement
from search.guide import Guide
from search.proposals import next_fixed
from search.space import Knobs, SearchSpace
from search.stop_rule import PointSummary, StopRule

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.02)
SEEDS = [Knobs(max_batch_size=b, max_concurrency=b) for b in (4, 2, 8)]


def _point(b: int, *, met: int, windows: int) -> PointSummary:
    return PointSummary(
        knobs=Knobs(max_batch_size=b, max_concurrency=b),
        measurements=windows,
        goodput_rps=10.0,
        feasible=met * 2 >= windows,
        ttft_p99_s=0.5,
        tpot_p99_s=0.019,
        ttft_ok=True,
        tpot_ok=met == windows,
        last_trial=windows - 1,
        first_trial=0,
        met_windows=met,
        throughput_rps=math.nan,
        pooled=Verdict.INSUFFICIENT,
    )


def _next(points: list[PointSummary], seeds_done: int):
    return next_fixed(
        points,
        rule=StopRule(),
        slo=SLO,
        declare_gain=0.02,
        guide=None,
        seeds=SEEDS,
        seeds_done=seeds_done,
        guided_done=0,
        guide_over=False,
    )


def test_unseeded_search_measures_every_start_point_before_remeasuring_one() -> None:
    # The first start point met its SLO in one window of two (on the edge, a noisy load):
    # the other start points come first, then it is measured again.
    edge = _point(4, met=1, windows=2)
    nxt = _next([edge], seeds_done=1)
    assert (nxt.knobs, nxt.phase) == (SEEDS[1], "seed")
    nxt = _next([edge, _point(2, met=1, windows=1)], seeds_done=2)
    assert (nxt.knobs, nxt.phase) == (SEEDS[2], "seed")
    nxt = _next([edge, _point(2, met=1, windows=1), _point(8, met=0, windows=1)], seeds_done=3)
    assert nxt.phase == "remeasure"


def _judged(b: int, verdict: Verdict, *, marginal: bool = False) -> PointSummary:
    met = verdict is Verdict.MET
    return PointSummary(
        knobs=Knobs(max_batch_size=b, max_concurrency=b),
        measurements=1,
        goodput_rps=float(b),
        feasible=met,
        ttft_p99_s=0.5,
        tpot_p99_s=0.015 if met else 0.03,
        ttft_ok=True,
        tpot_ok=met,
        last_trial=b,
        first_trial=b,
        throughput_rps=float(b),
        pooled=verdict,
        marginal=marginal,
    )


def test_after_guidance_the_tuner_climbs_above_the_incumbent_until_bracketed() -> None:
    guide = Guide(
        model_tpot_s=lambda b: 0.01, space=SearchSpace(batch_min=1, batch_max=256), slo=SLO
    )

    def nxt(points: list[PointSummary]):
        return next_fixed(
            points,
            rule=StopRule(),
            slo=SLO,
            declare_gain=0.02,
            guide=guide,
            seeds=SEEDS,
            seeds_done=1,
            guided_done=6,
            guide_over=True,
        )

    met40, over109 = _judged(40, Verdict.MET), _judged(109, Verdict.VIOLATED)
    got = nxt([met40, over109])
    assert got.phase == "climb" and got.knobs == Knobs(max_batch_size=66, max_concurrency=66)
    # nothing over the SLO yet: a quarter above
    assert nxt([met40]).knobs == Knobs(max_batch_size=50, max_concurrency=50)
    # bracketed within the stop rule's ratio: the sampler's turn
    assert nxt([met40, _judged(45, Verdict.VIOLATED)]).knobs is None
    # a violation held for a second window does not bracket: the climb goes on below 109
    held = _judged(45, Verdict.INSUFFICIENT, marginal=True)
    assert guide.bracket([met40, held, over109]) == (40, 109)


def test_a_batch_left_undecided_under_the_slo_bounds_neither_guidance_nor_the_climb() -> None:
    # Its windows read p99 TPOT just under the SLO but too close to call (one window's
    # slowdown can do that to a truly feasible batch): the climb passes it, and only a
    # batch judged VIOLATED bounds it.
    guide = Guide(
        model_tpot_s=lambda b: 0.01, space=SearchSpace(batch_min=1, batch_max=256), slo=SLO
    )
    met40, over109 = _judged(40, Verdict.MET), _judged(109, Verdict.VIOLATED)
    judged = Judgement(
        verdict=Verdict.INSUFFICIENT,
        total=1000,
        above=9,
        above_at_most=9,
        confidence=0.95,
        log_e_met=1.0,
        log_e_violated=0.0,
    )
    undecided = replace(
        _judged(45, Verdict.INSUFFICIENT), measurements=2, tpot_p99_s=0.0198, tpot=judged
    )
    # neither guidance's bracket nor the climb takes it for the upper end: between 40 and 109
    assert guide.bracket([met40, undecided, over109]) == (40, 109)
    got = guide.climb([met40, undecided, over109], met40, bracket_ratio=1.15)
    assert got == Knobs(max_batch_size=66, max_concurrency=66)
    # judged VIOLATED, the same batch ends it
    violated = replace(undecided, tpot=replace(judged, verdict=Verdict.VIOLATED, above=30))
    assert guide.bracket([met40, violated, over109]) == (40, 45)
    assert guide.climb([met40, violated, over109], met40, bracket_ratio=1.15) is None
    # undecided with a window over the SLO: guidance takes it for over, the climb does not
    over_once = replace(undecided, tpot_p99_s=0.021, tpot_ok=False)
    assert guide.bracket([met40, over_once, over109]) == (40, 45)
    assert guide.climb([met40, over_once, over109], met40, bracket_ratio=1.15) == got
