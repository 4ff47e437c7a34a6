"""Pooling windows of one knob: counts recovered exactly, the union's verdict, the tuner's use."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import optuna
import pytest

from metrics.build import observation_from_histograms, observation_from_requests
from metrics.observation import Slo, SloVerdict, Verdict
from metrics.samples import verdict_from_histogram, verdict_from_samples
from metrics.sequential import decided, sequential_verdict
from search.evidence import (
    STOP_MARGIN,
    Counts,
    borrow_bin,
    borrow_weight,
    combine,
    counts_of,
    disagreement,
    judge,
)
from search.space import Knobs, SearchSpace
from search.tuner import Tuner

optuna.logging.set_verbosity(optuna.logging.WARNING)
SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)
SPACE = SearchSpace(batch_min=1, batch_max=256, headroom_max=4.0)
K = Knobs(max_batch_size=32, max_concurrency=32)


@pytest.mark.parametrize("n", [0, 1, 20, 299, 1000, 5000])
@pytest.mark.parametrize("frac", [0.0, 0.004, 0.01, 0.05, 1.0])
def test_counts_are_recovered_exactly_from_a_sample_verdict(n: int, frac: float) -> None:
    rng = np.random.default_rng(n)
    x = rng.random(n)  # [n]
    above = round(frac * n)
    thr = float(np.sort(x)[n - above - 1]) if 0 < n - above else -1.0
    v = verdict_from_samples(x, thr)
    c = counts_of(v)
    assert c == Counts(total=n, above=above, above_at_most=above, confidence=0.95)


def test_counts_of_a_histogram_verdict_keep_the_bracket() -> None:
    buckets = {0.1: 900.0, 0.2: 970.0, 0.3: 990.0, math.inf: 1000.0}
    c = counts_of(verdict_from_histogram(buckets, 0.15, 0.2))  # between bounds 0.1 and 0.2
    assert c == Counts(total=1000, above=30, above_at_most=100, confidence=0.95)
    c = counts_of(verdict_from_histogram(buckets, 0.2, 0.2))  # on a bound: exact
    assert c == Counts(total=1000, above=30, above_at_most=30, confidence=0.95)


def test_a_verdict_without_bounds_has_no_counts() -> None:
    v = SloVerdict(
        verdict=Verdict.MET, threshold_s=1.0, estimate_s=0.5, samples=100, confidence=0.95
    )
    assert counts_of(v) is None
    assert counts_of(None) is None
    # Bounds no count reproduces are refused, not rounded.
    assert counts_of(replace(v, exceed_fraction_lower=0.0123, exceed_fraction_upper=0.2)) is None


def test_judge_is_the_anytime_verdict_on_the_concatenated_samples() -> None:
    rng = np.random.default_rng(1)
    thr = 0.05
    windows = [rng.lognormal(np.log(0.03), 0.1, n) for n in (180, 150, 400)]  # [n] each
    counts = [counts_of(verdict_from_samples(w, thr)) for w in windows]
    assert all(c is not None for c in counts)
    for k in (1, 2, 3):
        got = judge(counts[:k], q=0.99)
        x = np.concatenate(windows[:k])
        want = sequential_verdict(x.size, int((x > thr).sum()))
        assert got is not None
        assert (got.verdict, got.total, got.above) == (want.verdict, want.total, want.above)
        assert got.log_e_met == pytest.approx(want.log_e_met)
    # 180 and 150 requests cannot prove a p99 alone, nor together; with the third they do.
    assert judge(counts[:2], q=0.99).verdict is Verdict.INSUFFICIENT
    assert judge(counts, q=0.99).verdict is Verdict.MET
    # One slow request in the last window: the union's counts carry it.
    windows[2][0] = 2 * thr
    c = counts_of(verdict_from_samples(windows[2], thr))
    assert judge([*counts[:2], c], q=0.99).above == 1


def test_judged_histograms_take_the_unflattering_end_of_a_bracket() -> None:
    a = {0.05: 340.0, 0.1: 350.0, math.inf: 350.0}
    b = {0.05: 198.0, 0.1: 200.0, math.inf: 200.0}
    ca, cb = (counts_of(verdict_from_histogram(h, 0.07, 0.05)) for h in (a, b))  # bracketed
    got = judge([ca, cb], q=0.99)
    assert (got.total, got.above, got.above_at_most) == (550, 0, 12)
    assert got.verdict is Verdict.INSUFFICIENT  # 12 may be over the threshold
    assert judge([], q=0.99) is None
    assert judge([ca, replace(ca, confidence=0.9)], q=0.99) is None


def _clean(n: int) -> Counts:
    return Counts(total=n, above=0, above_at_most=0, confidence=0.95)


def test_a_heavier_neighbour_lends_evidence_of_met_a_lighter_one_does_not() -> None:
    own = [_clean(200)]
    assert judge(own, q=0.99).verdict is Verdict.INSUFFICIENT
    assert judge(own, q=0.99, neighbours={1: [_clean(400)]}).verdict is Verdict.MET
    assert judge(own, q=0.99, neighbours={1: [_clean(400)]}).borrowed == 400
    assert judge(own, q=0.99, neighbours={-1: [_clean(400)]}).verdict is Verdict.INSUFFICIENT
    # a far neighbour weighs less than a near one
    near = judge(own, q=0.99, neighbours={1: [_clean(300)]}).log_e_met
    far = judge(own, q=0.99, neighbours={4: [_clean(300)]}).log_e_met
    assert near > far > judge(own, q=0.99).log_e_met
    # a lighter knob far over the threshold is evidence of VIOLATED, a heavier one is not
    bad = [Counts(total=40, above=20, above_at_most=20, confidence=0.95)]
    few = [Counts(total=10, above=1, above_at_most=1, confidence=0.95)]
    assert judge(few, q=0.99).verdict is Verdict.INSUFFICIENT
    assert judge(few, q=0.99, neighbours={-1: bad}).verdict is Verdict.VIOLATED
    assert judge(few, q=0.99, neighbours={1: bad}).verdict is Verdict.INSUFFICIENT


def test_borrowing_keeps_the_error_rate_at_the_boundary() -> None:
    # Both knobs exactly at the quantile (the monotone model holds with equality): judged
    # after every window of 50 requests, MET must come out at most ~alpha of the time.
    rng = np.random.default_rng(3)
    runs, wrong = 300, 0
    for _ in range(runs):
        own: list[Counts] = []
        heavier: list[Counts] = []
        for _ in range(20):
            for side in (own, heavier):
                k = int((rng.random(50) < 0.01).sum())
                side.append(Counts(total=50, above=k, above_at_most=k, confidence=0.95))
            if judge(own, q=0.99, neighbours={1: heavier}).verdict is Verdict.MET:
                wrong += 1
                break
    assert wrong / runs <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)


def _first_met(margin: float, above: int = 0) -> int:
    """The fewest requests (``above`` of them over) at which a window may stop MET."""
    n = 100 * (above + 1)  # past the counts at which ``above`` over would be VIOLATED
    assert sequential_verdict(n, above).verdict is Verdict.INSUFFICIENT
    while not decided([(n, above, above)], q=0.99, confidence=0.95, margin=margin):
        n += 1
    return n


@pytest.mark.parametrize("above", [0, 2])
def test_a_window_stopped_with_the_margin_stays_decided_among_its_neighbours(above: int) -> None:
    # Heavier neighbours in every bin, all far over the threshold: they lend nothing to MET
    # but take their whole prior share. A window that stopped the moment its own requests
    # were MET is then undecided in the tuner; one stopped with STOP_MARGIN is not.
    bad = [Counts(total=40, above=40, above_at_most=40, confidence=0.95)]
    heavier = {j: bad for j in range(1, 40)}
    bare, kept = _first_met(0.0, above), _first_met(STOP_MARGIN, above)
    assert bare < kept
    own = Counts(total=bare, above=above, above_at_most=above, confidence=0.95)
    assert judge([own], q=0.99).verdict is Verdict.MET
    assert judge([own], q=0.99, neighbours=heavier).verdict is Verdict.INSUFFICIENT
    own = replace(own, total=kept)
    assert judge([own], q=0.99, neighbours=heavier).verdict is Verdict.MET
    # the same on the VIOLATED side, lighter neighbours far under the threshold
    clean = [Counts(total=2000, above=0, above_at_most=0, confidence=0.95)]
    lighter = {-j: clean for j in range(1, 40)}
    n = 8
    while decided([(n + 1, 8, 8)], q=0.99, confidence=0.95, margin=STOP_MARGIN):
        n += 1  # the most requests at which 8 over still stops the window VIOLATED
    assert (
        judge(
            [Counts(total=n + 1, above=8, above_at_most=8, confidence=0.95)],
            q=0.99,
            neighbours=lighter,
        ).verdict
        is Verdict.INSUFFICIENT
    )
    own = Counts(total=n, above=8, above_at_most=8, confidence=0.95)
    assert judge([own], q=0.99, neighbours=lighter).verdict is Verdict.VIOLATED


def test_the_stop_margin_must_be_a_non_negative_number() -> None:
    for bad in (-0.1, math.nan):
        with pytest.raises(ValueError, match="margin="):
            decided([(10, 0, 0)], q=0.99, confidence=0.95, margin=bad)


def test_borrow_bins_and_weights() -> None:
    assert borrow_bin(10, 10) == 0
    assert borrow_bin(10, 12) == 1 and borrow_bin(10, 13) == 2 and borrow_bin(12, 10) == -1
    assert borrow_weight(1) > borrow_weight(2)
    assert sum(borrow_weight(j) for j in range(1, 100_000)) == pytest.approx(0.25, abs=1e-5)
    with pytest.raises(ValueError, match="loads 0, 3"):
        borrow_bin(0, 3)


def test_disagreement_tells_noise_from_sampling() -> None:
    def c(n: int, k: int) -> Counts:
        return Counts(total=n, above=k, above_at_most=k, confidence=0.95)

    assert disagreement([c(300, 0), c(300, 0)]) == 1.0
    assert disagreement([c(300, 1)]) == 1.0
    assert disagreement([c(20, 20), c(30, 30), c(25, 25)]) == 1.0  # all over in each
    assert disagreement([c(300, 2), c(280, 3), c(310, 1)]) > 0.1
    # the B=10: one window far over the others
    assert disagreement([c(300, 0), c(280, 14), c(310, 1)]) < 1e-3
    assert disagreement([c(300, 0), c(280, 14)]) < 1e-3


def test_counts_validate() -> None:
    with pytest.raises(ValueError, match="above=3, above_at_most=2"):
        Counts(total=5, above=3, above_at_most=2, confidence=0.95)
    with pytest.raises(ValueError, match="confidence=1.0"):
        Counts(total=5, above=0, above_at_most=0, confidence=1.0)


def test_combine() -> None:
    M, V, I = Verdict.MET, Verdict.VIOLATED, Verdict.INSUFFICIENT  # noqa: E741
    assert combine(M, M) is M
    assert combine(M, I) is I and combine(I, M) is I
    assert combine(V, I) is V and combine(M, V) is V
    assert combine(None, M) is None


def requests_window(n: int, *, seed: int, tpot_s: float = 0.03, slow: int = 0, t0: float = 0.0):
    """``n`` requests in 10 s, TPOT lognormal around ``tpot_s``, ``slow`` of them at 2x SLO."""
    rng = np.random.default_rng(seed)
    tpot = rng.lognormal(np.log(tpot_s), 0.1, n)  # [n]
    tpot[:slow] = 2 * SLO.tpot_p99_s
    ttft = rng.uniform(0.1, 0.3, n)  # [n]
    return observation_from_requests(
        slo=SLO, start_s=t0, end_s=t0 + 10.0, ttft_s=list(ttft), tpot_s=list(tpot)
    )


def tuner(storage: str | None = None) -> Tuner:
    return Tuner(space=SPACE, slo=SLO, storage=storage, study_name="pool", seed=0)


def test_tuner_declares_a_knob_on_the_union_of_two_short_windows(tmp_path: Path) -> None:
    """Two windows of 200 requests, none slow: neither proves the p99 alone (INSUFFICIENT),
    the 400 together do; a window-by-window vote would never declare the knob."""
    t = tuner(str(tmp_path / "j"))
    w1, w2 = requests_window(200, seed=1), requests_window(200, seed=2, t0=10.0)
    assert w1.tpot_verdict.verdict is Verdict.INSUFFICIENT
    t.report(K, w1)
    (pt,) = t.points()
    assert pt.pooled is Verdict.INSUFFICIENT and not pt.feasible
    assert t.best(confirmed=False) is None
    t.report(K, w2)
    (pt,) = t.points()
    assert pt.pooled is Verdict.MET and pt.feasible and pt.measurements == 2
    assert pt.met_windows == 0  # not one window met the SLO on its own
    assert pt.goodput_rps == pytest.approx((w1.slo_met + w2.slo_met) / 20.0)
    best = t.best()
    assert best is not None and best[0] == K
    # A resumed controller judges the same evidence the same way.
    again = tuner(str(tmp_path / "j"))
    assert again.points() == t.points()


def test_pooling_does_not_hide_a_violation() -> None:
    """Six slow requests of 400 (1.5%) are over a p99: pooled, the knob is not declared."""
    t = tuner()
    t.report(K, requests_window(200, seed=1, slow=3))
    t.report(K, requests_window(200, seed=2, slow=3))
    (pt,) = t.points()
    assert pt.pooled is not Verdict.MET and not pt.feasible and t.best() is None


def test_a_stale_window_lends_no_requests() -> None:
    t = tuner()
    t.report(K, requests_window(200, seed=1))
    t.report(K, replace(requests_window(200, seed=2), stale=True, staleness_s=90.0))
    (pt,) = t.points()
    assert pt.pooled is Verdict.INSUFFICIENT and t.best() is None


def test_live_histogram_windows_pool_through_report() -> None:
    """What controller/tune.py hands the tuner: Observations from Prometheus histograms
    (SLO thresholds are bucket bounds). 150 + 200 requests, none over the TPOT SLO."""
    t = tuner()

    def window(n: float) -> object:
        ttft = {0.5: n, SLO.ttft_p99_s: n, math.inf: n}
        tpot = {0.02: 0.8 * n, SLO.tpot_p99_s: n, math.inf: n}
        return observation_from_histograms(
            slo=SLO,
            start_s=0.0,
            end_s=10.0,
            met=n,
            missed=0.0,
            ttft_buckets=ttft,
            tpot_buckets=tpot,
        )

    w1 = window(150.0)
    assert w1.tpot_verdict.verdict is Verdict.INSUFFICIENT
    t.report(K, w1)
    t.report(K, window(200.0))
    (pt,) = t.points()
    assert pt.pooled is Verdict.MET and t.best() is not None
