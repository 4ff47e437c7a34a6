"""Summaries of every knob: anytime-valid pooled verdicts, neighbours' requests, noise."""

from __future__ import annotations

from typing import Any

from metrics.observation import Slo, Verdict
from search.evidence import Counts
from search.points import summarize_all
from search.space import Knobs

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)


def _window(
    n: int, ttft_over: int = 0, tpot_over: int = 0, *, tpot_p99: float = 0.08, stale: bool = False
) -> dict[str, Any]:
    def c(k: int) -> list[float]:
        return Counts(total=n, above=k, above_at_most=k, confidence=0.95).as_list()

    return {
        "goodput_rps": n / 30,
        "throughput_rps": n / 30,
        "slo_met": n - max(ttft_over, tpot_over),
        "window_s": 30.0,
        "ttft_p99_s": 0.5,
        "tpot_p99_s": tpot_p99,
        "stale": stale,
        "feasible": False,
        "ttft_counts": c(ttft_over),
        "tpot_counts": c(tpot_over),
    }


def _k(b: int, c: int | None = None) -> Knobs:
    return Knobs(max_batch_size=b, max_concurrency=c or b)


def _summaries(groups: dict[Knobs, list[dict[str, Any]]]) -> dict[Knobs, Any]:
    n = iter(range(1000))
    got = summarize_all(
        {k: [(a, a["goodput_rps"], next(n)) for a in ws] for k, ws in groups.items()}, slo=SLO
    )
    return {p.knobs: p for p in got}


def test_a_heavier_knob_that_met_the_slo_lends_its_requests() -> None:
    alone = _summaries({_k(8): [_window(200)]})[_k(8)]
    assert alone.pooled is Verdict.INSUFFICIENT
    both = _summaries({_k(8): [_window(200)], _k(9): [_window(400)]})
    assert both[_k(8)].pooled is Verdict.MET
    assert both[_k(8)].tpot is not None and both[_k(8)].tpot.borrowed == 400
    # a knob with a queue (C > B) borrows for TPOT only: its TTFT stays its own
    queued = _summaries({_k(8, 12): [_window(200)], _k(9): [_window(400)]})[_k(8, 12)]
    assert queued.tpot.verdict is Verdict.MET and queued.ttft.verdict is Verdict.INSUFFICIENT


def test_windows_that_disagree_are_noise_not_a_violation() -> None:
    # the B=10: three windows, one far over the TPOT SLO
    w = [_window(300, tpot_p99=0.076), _window(280, tpot_over=14, tpot_p99=0.109), _window(310)]
    p = _summaries({_k(10): w})[_k(10)]
    assert p.noise and "disagree beyond sampling error" in p.noise and "76/109/80" in p.noise
    assert p.pooled is Verdict.INSUFFICIENT  # not VIOLATED: measured again instead
    # the same windows agreeing: no noise
    calm = _summaries({_k(10): [_window(300), _window(280), _window(310)]})[_k(10)]
    assert calm.noise == "" and calm.pooled is Verdict.MET


def test_a_violation_below_a_batch_that_met_the_slo_is_noise() -> None:
    got = _summaries({_k(8): [_window(100, tpot_over=30)], _k(12): [_window(800)]})
    assert got[_k(12)].pooled is Verdict.MET
    assert got[_k(8)].pooled is Verdict.INSUFFICIENT
    assert "against the monotone model" in got[_k(8)].noise
    # above it, a violation is what the model expects
    got = _summaries({_k(16): [_window(100, tpot_over=30)], _k(12): [_window(800)]})
    assert got[_k(16)].pooled is Verdict.VIOLATED and got[_k(16)].noise == ""


def test_stale_windows_lend_nothing() -> None:
    p = _summaries({_k(8): [_window(900, stale=True)]})[_k(8)]
    assert p.pooled is Verdict.INSUFFICIENT and p.ttft is None


def test_one_window_within_the_noise_band_is_held_for_a_second() -> None:
    # p99 TPOT 97 ms against 100: a window 3% slower would have violated it
    near = _summaries({_k(8): [_window(900, tpot_p99=0.097)]})[_k(8)]
    assert near.marginal and near.pooled is Verdict.INSUFFICIENT and not near.feasible
    assert near.tpot is not None and near.tpot.verdict is Verdict.INSUFFICIENT
    clear = _summaries({_k(8): [_window(900, tpot_p99=0.08)]})[_k(8)]
    assert not clear.marginal and clear.pooled is Verdict.MET
    # a second window decides: pooled with the first
    two = [_window(900, tpot_p99=0.097), _window(900, tpot_p99=0.096)]
    both = _summaries({_k(8): two})[_k(8)]
    assert not both.marginal and both.pooled is Verdict.MET
    # a violation by 2% is held too; by 30% it is not
    over = _summaries({_k(8): [_window(100, tpot_over=50, tpot_p99=0.102)]})[_k(8)]
    assert over.marginal and over.pooled is Verdict.INSUFFICIENT
    far = _summaries({_k(8): [_window(100, tpot_over=50, tpot_p99=0.13)]})[_k(8)]
    assert not far.marginal and far.pooled is Verdict.VIOLATED
