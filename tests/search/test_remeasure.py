"""Where re-measurements go: tables for open_best, ceiling and doubtful."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from metrics.observation import Slo, Verdict
from search.remeasure import ceiling, doubtful, open_best
from search.space import Knobs
from search.stop_rule import PointSummary

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)


def pt(
    b: int,
    *,
    n: int = 1,
    met: int = 1,
    g: float = 1.0,
    thr: float = math.nan,
    tpot: float = 0.04,
    ttft: float = 0.5,
    first: int = 0,
) -> PointSummary:
    return PointSummary(
        knobs=Knobs(max_batch_size=b, max_concurrency=b),
        measurements=n,
        goodput_rps=g,
        feasible=2 * met > n,
        met_windows=met,
        throughput_rps=thr,
        ttft_p99_s=ttft,
        tpot_p99_s=tpot,
        ttft_ok=met == n,
        tpot_ok=met == n,
        first_trial=first,
        last_trial=first + n - 1,
    )


@pytest.mark.parametrize(
    ("points", "want"),
    [
        ([], None),
        ([pt(10, g=5.0), pt(20, g=8.0, first=1)], 20),  # best goodput first
        ([pt(10, g=5.0), pt(20, n=2, met=2, g=8.0)], 10),  # 20 is declared already
        ([pt(10, g=5.0), pt(20, n=3, met=1, g=8.0)], 10),  # 20 lost its majority
        ([pt(10, g=5.0), pt(20, n=5, met=3, g=8.0)], 10),  # 20 is out of windows (2*2+1)
        ([pt(10, met=0, g=0.0)], None),  # never met the SLO
    ],
)
def test_open_best(points: list[PointSummary], want: int | None) -> None:
    got = open_best(points, confirmations=2)
    assert (got.knobs.max_batch_size if got else None) == want


def test_ceiling_is_the_nearest_larger_batch_not_proven_feasible() -> None:
    best = pt(32, g=9.0)
    far = pt(80, met=0, thr=12.0)  # the seed, far above: more throughput, irrelevant
    near = pt(36, met=0, thr=9.4)
    assert ceiling([best, far, near, pt(34, thr=9.3)], best) == 9.4  # 34 is feasible
    assert ceiling([best, far], best) == 12.0
    assert math.isnan(ceiling([best, pt(8, met=0, thr=3.0)], best))  # nothing above


def test_doubtful_is_the_nearest_unproven_point_above() -> None:
    top = pt(95, n=2, met=2)
    unproven = pt(99, met=0, tpot=0.049, ttft=0.99)  # INSUFFICIENT: estimates under the SLO
    violated = pt(97, met=0, tpot=0.06)  # p99 over the SLO: a real failure
    again = pt(98, n=3, met=1, tpot=0.049)  # measured enough already
    below = pt(90, met=0, tpot=0.04)
    pts = [top, unproven, violated, again, below]
    got = doubtful(pts, top, slo=SLO, max_measurements=2)
    assert got is not None and got.knobs.max_batch_size == 99
    assert doubtful([top, violated, again, below], top, slo=SLO, max_measurements=2) is None
    # With nothing declared, any unproven point qualifies, the smallest first.
    assert doubtful(pts, None, slo=SLO, max_measurements=2).knobs.max_batch_size == 90


def pooled(b: int, verdict: Verdict, *, n: int = 1, g: float = 1.0, tpot: float = 0.04):
    """A point judged on its windows' pooled requests (no window met the SLO alone)."""
    return replace(
        pt(b, n=n, met=0, g=g, tpot=tpot), feasible=verdict is Verdict.MET, pooled=verdict
    )


@pytest.mark.parametrize(
    ("points", "want"),
    [
        # Pooled INSUFFICIENT: more requests may prove it, so it is open (no window met).
        ([pt(10, g=5.0), pooled(20, Verdict.INSUFFICIENT, g=8.0)], 20),
        # Pooled VIOLATED: the union's requests are over the SLO with confidence.
        ([pt(10, g=5.0), pooled(20, Verdict.VIOLATED, g=8.0)], 10),
        # Pooled MET over two windows: declared, nothing left to measure.
        ([pt(10, g=5.0), pooled(20, Verdict.MET, n=2, g=8.0)], 10),
        ([pt(10, g=5.0), pooled(20, Verdict.MET, n=1, g=8.0)], 20),  # one window: not yet
        ([pt(10, g=5.0), pooled(20, Verdict.INSUFFICIENT, n=5, g=8.0)], 10),  # out of windows
    ],
)
def test_open_best_on_pooled_evidence(points: list[PointSummary], want: int) -> None:
    got = open_best(points, confirmations=2)
    assert got is not None and got.knobs.max_batch_size == want


def test_declared_on_pooled_evidence_needs_the_windows_and_a_met_union() -> None:
    assert pooled(20, Verdict.MET, n=2).declared(2)
    assert not pooled(20, Verdict.MET, n=1).declared(2)
    assert not pooled(20, Verdict.INSUFFICIENT, n=3).declared(2)
    # The window-majority rule still holds without pooled verdicts.
    assert pt(20, n=3, met=2).declared(2) and not pt(20, n=4, met=2).declared(2)


def test_doubtful_skips_a_pooled_violation() -> None:
    top = pt(95, n=2, met=2)
    # Both windows' p99 estimates under the SLO, yet the union is VIOLATED with confidence.
    assert doubtful([top, pooled(99, Verdict.VIOLATED)], top, slo=SLO, max_measurements=2) is None
    got = doubtful([top, pooled(99, Verdict.INSUFFICIENT)], top, slo=SLO, max_measurements=2)
    assert got is not None and got.knobs.max_batch_size == 99


def test_doubtful_takes_a_violation_held_for_a_second_window() -> None:
    top = pt(40, n=1, met=1)
    # one window 2% over the TPOT SLO: held (marginal), measured again before the climb
    held = replace(pooled(50, Verdict.INSUFFICIENT, tpot=0.051), marginal=True)
    got = doubtful([top, held], top, slo=SLO, max_measurements=1)
    assert got is not None and got.knobs.max_batch_size == 50
    # the same p99 not held (a real violation after its second window): not doubtful
    assert doubtful([top, replace(held, marginal=False)], top, slo=SLO, max_measurements=1) is None
