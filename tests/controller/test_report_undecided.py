"""What an undecided run says about its best candidate (controller/report/undecided.py)."""

from __future__ import annotations

from dataclasses import replace

from controller.report.undecided import undecided_summary
from metrics.observation import Slo, Verdict
from search.evidence import Judgement
from search.space import Knobs
from search.stop_rule import PointSummary

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)


def _held(**kw) -> PointSummary:
    j = Judgement(
        verdict=Verdict.INSUFFICIENT,
        total=362,
        above=0,
        above_at_most=0,
        confidence=0.95,
        log_e_met=3.3,
        log_e_violated=-3.3,
    )
    return PointSummary(
        knobs=Knobs(max_batch_size=17, max_concurrency=17),
        measurements=1,
        goodput_rps=22.0,
        feasible=False,
        ttft_p99_s=0.5,
        tpot_p99_s=0.097,
        ttft_ok=False,
        tpot_ok=False,
        first_trial=3,
        last_trial=3,
        throughput_rps=22.0,
        pooled=Verdict.INSUFFICIENT,
        ttft=j,
        tpot=j,
        **kw,
    )


def test_a_held_verdict_asks_for_a_second_window_not_more_requests() -> None:
    text = undecided_summary(_held(marginal=True), SLO)
    assert "within 5% of the SLO" in text and "a second window decides it" in text
    assert "more requests" not in text
    # not held: its evidence for MET is already past 20, so no request count is asked for;
    # a noisy one asks for a quieter machine
    noisy = undecided_summary(replace(_held(), noise="TPOT windows disagree"), SLO)
    assert "quieter machine" in noisy and "second window" not in noisy
