"""The pure objective: goodput, constraints in seconds, and honesty about evidence."""

from __future__ import annotations

import math

import pytest

from metrics.observation import Observation, Percentiles, Slo, SloVerdict, Verdict
from search.objective import UNPROVEN_MARGIN_S, Evaluation, evaluate

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)


def verdict(v: Verdict, est: float, thr: float, n: int = 1000) -> SloVerdict:
    return SloVerdict(verdict=v, threshold_s=thr, estimate_s=est, samples=n, confidence=0.95)


def obs(
    *,
    ttft: float = 0.4,
    tpot: float = 0.03,
    tv: Verdict = Verdict.MET,
    pv: Verdict = Verdict.MET,
    met: int = 900,
    window: float = 60.0,
    stale: bool = False,
) -> Observation:
    return Observation(
        start_s=0.0,
        end_s=window,
        completed=1000,
        slo_met=met,
        ttft=Percentiles(p99=ttft),
        tpot=Percentiles(p99=tpot),
        ttft_verdict=verdict(tv, ttft, SLO.ttft_p99_s),
        tpot_verdict=verdict(pv, tpot, SLO.tpot_p99_s),
        stale=stale,
    )


def test_feasible_window_gives_goodput_and_negative_constraints() -> None:
    e = evaluate(obs(), SLO)
    assert e.feasible and e.reason == ""
    assert e.value == pytest.approx(900 / 60.0)
    assert e.constraints == pytest.approx((0.4 - 1.0, 0.03 - 0.05))


def test_violated_constraint_is_the_p99_excess() -> None:
    e = evaluate(obs(tpot=0.07, pv=Verdict.VIOLATED), SLO)
    assert not e.feasible
    assert e.constraints[1] == pytest.approx(0.02)
    assert "tpot: violated" in e.reason


def test_insufficient_is_never_feasible_even_under_the_threshold() -> None:
    e = evaluate(obs(ttft=0.2, tv=Verdict.INSUFFICIENT), SLO)
    assert not e.feasible
    assert e.constraints[0] >= UNPROVEN_MARGIN_S > 0
    assert "insufficient" in e.reason


def test_stale_data_is_not_feasible() -> None:
    e = evaluate(obs(stale=True), SLO)
    assert not e.feasible
    assert max(e.constraints) > 0
    assert "stale" in e.reason


def test_unknown_percentiles_and_empty_window_stay_finite() -> None:
    o = Observation(start_s=5.0, end_s=5.0, completed=0, slo_met=0)
    e = evaluate(o, SLO)
    assert e.value == 0.0 and not e.feasible
    assert all(math.isfinite(c) and c > 0 for c in e.constraints)


def test_evaluation_refuses_feasible_with_positive_constraint() -> None:
    with pytest.raises(ValueError, match="feasible with constraints"):
        Evaluation(value=1.0, constraints=(0.1, -0.1), feasible=True)
