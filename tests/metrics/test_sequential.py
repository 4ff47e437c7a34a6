"""The anytime-valid p99 verdicts: valid under a look after every request, decisive when clear."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metrics.observation import Verdict
from metrics.sequential import (
    first_decision,
    log_e_met,
    log_e_violated,
    requests_to_met,
    sequential_verdict,
)


def _first_decision(exceed: np.ndarray, *, confidence: float = 0.95) -> Verdict:
    """Read the verdict after every request; the first decided one (or INSUFFICIENT)."""
    above = np.cumsum(exceed)
    for n in range(1, exceed.size + 1):
        v = sequential_verdict(n, int(above[n - 1]), confidence=confidence).verdict
        if v is not Verdict.INSUFFICIENT:
            return v
    return Verdict.INSUFFICIENT


@pytest.mark.parametrize("p, wrong", [(0.01, Verdict.MET), (0.01, Verdict.VIOLATED)])
def test_looking_after_every_request_keeps_the_error_rate(p: float, wrong: Verdict) -> None:
    # At the boundary p = p0 both nulls hold: neither verdict may come out more often
    # than alpha, although it is read after each of 1500 requests.
    rng = np.random.default_rng(7)
    runs = 400
    wrong_calls = sum(_first_decision(rng.random(1500) < p) is wrong for _ in range(runs))
    # alpha = 0.05; 400 runs: a 3-sigma allowance over the bound
    assert wrong_calls / runs <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)


def test_a_fixed_n_test_read_after_every_request_would_not() -> None:
    # The reason for the module: Clopper-Pearson read after every request calls a
    # boundary deployment MET far more often than 5% (the test above would fail for it).
    from metrics.samples import verdict_from_counts

    rng = np.random.default_rng(7)
    runs, wrong = 200, 0
    for _ in range(runs):
        above = np.cumsum(rng.random(1500) < 0.01)
        for n in range(1, 1501):
            v = verdict_from_counts(n, int(above[n - 1]), 1.0, math.nan).verdict
            if v is not Verdict.INSUFFICIENT:
                wrong += v is Verdict.MET
                break
    assert wrong / runs > 0.10


def test_a_clear_violation_is_called_after_a_few_requests() -> None:
    assert sequential_verdict(10, 3).verdict is Verdict.VIOLATED
    assert sequential_verdict(30, 10).verdict is Verdict.VIOLATED
    assert sequential_verdict(10, 0).verdict is Verdict.INSUFFICIENT


def test_a_clean_pass_needs_a_few_hundred_requests() -> None:
    need = requests_to_met(0, 0)
    assert need is not None and 299 < need < 400  # more than one fixed-n read, not much
    assert sequential_verdict(need, 0).verdict is Verdict.MET
    assert sequential_verdict(need - 1, 0).verdict is Verdict.INSUFFICIENT
    assert requests_to_met(need, 0) == 0
    # one request over the threshold costs a few hundred more
    one = requests_to_met(0, 1)
    assert one is not None and one > need


def test_evidence_moves_the_right_way() -> None:
    # more requests under the threshold: more evidence of MET; more over it: of VIOLATED
    assert log_e_met(400, 0) > log_e_met(300, 0) > log_e_met(300, 1)
    assert log_e_violated(300, 9) > log_e_violated(300, 6) > log_e_violated(400, 6)


def test_a_bracketed_count_judges_each_side_on_its_unflattering_end() -> None:
    # 400 requests: 0 known over, up to 5 maybe over: MET is judged on the 5
    v = sequential_verdict(400, 0, above_at_most=5)
    assert v.verdict is Verdict.INSUFFICIENT
    assert sequential_verdict(400, 0).verdict is Verdict.MET
    # 20 requests, 2 known over, 12 maybe: VIOLATED is judged on the 2
    assert sequential_verdict(20, 2, above_at_most=12).verdict is Verdict.INSUFFICIENT


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(total=10, above=11), "above=11"),
        (dict(total=10, above=2, above_at_most=1), "above_at_most=1"),
        (dict(total=10, above=0, q=1.0), "q=1.0"),
        (dict(total=10, above=0, confidence=0.0), "confidence=0.0"),
    ],
)
def test_bad_counts_say_what_is_allowed(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sequential_verdict(**kwargs)


def test_first_decision_stops_a_window_where_a_reader_of_every_request_would() -> None:
    rng = np.random.default_rng(5)
    clean = (rng.random(2000) < 0.0).astype(float)
    slow = (rng.random(2000) < 0.4).astype(float)
    n, v = first_decision([clean, clean])
    assert v is Verdict.MET and n == requests_to_met(0, 0)
    n, v = first_decision([clean, slow])  # one SLO far over: VIOLATED within a few dozen
    assert v is Verdict.VIOLATED and n < 40
    assert sequential_verdict(n, int(slow[:n].sum())).verdict is Verdict.VIOLATED
    assert sequential_verdict(n - 1, int(slow[: n - 1].sum())).verdict is Verdict.INSUFFICIENT
    # a request without a sample (NaN) counts for neither side of that SLO
    gaps = clean.copy()
    gaps[::2] = np.nan
    n, v = first_decision([clean, gaps])
    assert v is Verdict.MET and n == 2 * requests_to_met(0, 0)
    # undecided: the whole window
    assert first_decision([clean[:100], clean[:100]]) == (100, Verdict.INSUFFICIENT)
    assert first_decision([clean[:0]]) == (0, Verdict.INSUFFICIENT)
    with pytest.raises(ValueError, match="lengths"):
        first_decision([clean, clean[:10]])
