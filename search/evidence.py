"""Pooling the requests behind a knob's SLO verdicts, and judging them anytime-validly.

A window's p99 verdict is a count test (:mod:`metrics.samples`): ``above`` of ``total``
requests over the threshold. Two windows of the same knob are two samples of the same
latency distribution, so their requests pool: exact samples concatenate, and histogram
bucket increases add (the threshold is a bucket bound in the contract's ``slo_buckets``,
else the count is bracketed and each side of the verdict takes the end that cannot flatter
it). A window that stopped before its verdict was decided thus lends its requests to the
next window of the same knob instead of being wasted.

:func:`judge` decides on the pooled counts with the e-processes of
:mod:`metrics.sequential`, which stay valid however many times the growing evidence is read
(after each look inside a window, after each window): the canary may stop a window as soon
as it is decided and measure a knob again without inflating its error rates. Under the
monotone model (at a fixed headroom, the fraction over the threshold does not fall as the
load grows) it also borrows neighbouring knobs' requests, with a stated confidence.
:func:`disagreement` tells windows that differ beyond sampling error: noise in the
environment, never evidence about the knob.

An :class:`~metrics.observation.SloVerdict` states its ``samples`` and the
Clopper-Pearson bounds it computed from the counts, not the counts themselves;
:func:`counts_of` recovers them exactly by inverting the bounds (each is strictly
monotone in its count) and checks the result, so this works for any Observation
source (the simulator, Prometheus histograms, raw request samples). A verdict
without bounds (a hand-built one) gives None, and the tuner then falls back to a
majority vote of windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from metrics.observation import SloVerdict, Verdict
from metrics.samples import exceed_fraction_bounds
from metrics.sequential import log_e_met, log_e_violated, log_sum_exp, requests_to_met

# Relative tolerance when matching a recomputed Clopper-Pearson bound to the stored one.
_MATCH_RTOL = 1e-9
# Neighbouring knobs lend requests by bins of this load ratio (judge()).
BORROW_BIN_RATIO = 1.25
BORROW_SHARE = 0.25  # the prior weight all neighbour bins on one side share
# How far (nats) a window's own e-value must clear its threshold before the window stops
# (metrics.sequential.decided / first_decision's ``margin``). judge() keeps at least
# 1 - BORROW_SHARE of the weight on the knob's own requests, so a window decided with this
# margin on its own stays decided when its neighbours are mixed in. Without it, a window
# that stopped just past 1/alpha read INSUFFICIENT in the tuner as soon as any neighbour
# on that side had been measured (the mixture pays the neighbours' prior share whatever
# they say), and was measured again.
STOP_MARGIN = -math.log1p(-BORROW_SHARE)


@dataclass(frozen=True, kw_only=True)
class Counts:
    """Requests behind one verdict: ``above`` are known to exceed the threshold,
    ``above_at_most`` may (equal for exact samples and thresholds on a bucket bound)."""

    total: int
    above: int
    above_at_most: int
    confidence: float

    def __post_init__(self) -> None:
        if not 0 <= self.above <= self.above_at_most <= self.total:
            raise ValueError(
                f"counts above={self.above}, above_at_most={self.above_at_most},"
                f" total={self.total}: need 0 <= above <= above_at_most <= total"
            )
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence={self.confidence!r}: must be in (0, 1)")

    def as_list(self) -> list[float]:
        return [self.total, self.above, self.above_at_most, self.confidence]

    @classmethod
    def from_list(cls, xs: Sequence[float] | None) -> Counts | None:
        if xs is None or len(xs) != 4:
            return None
        return cls(
            total=int(xs[0]), above=int(xs[1]), above_at_most=int(xs[2]), confidence=float(xs[3])
        )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _MATCH_RTOL * max(1.0, abs(a), abs(b))


def _invert(total: int, target: float, confidence: float, *, side: int) -> int | None:
    """The count whose bound (``side`` 0: lower, 1: upper) equals ``target`` (None: none)."""

    def bound(a: int) -> float:
        return exceed_fraction_bounds(total, a, confidence)[side]

    lo, hi = 0, total
    while lo < hi:  # least a with bound(a) >= target (bounds grow with the count)
        mid = (lo + hi) // 2
        if bound(mid) < target and not _close(bound(mid), target):
            lo = mid + 1
        else:
            hi = mid
    return lo if _close(bound(lo), target) else None


def counts_of(verdict: SloVerdict | None) -> Counts | None:
    """The request counts behind ``verdict``, recovered exactly, or None when it does not
    state them (no bounds, or bounds that no count reproduces)."""
    if verdict is None:
        return None
    n, lo_b, hi_b = verdict.samples, verdict.exceed_fraction_lower, verdict.exceed_fraction_upper
    conf = verdict.confidence
    if not (isinstance(n, int) and n >= 0 and 0 < conf < 1):
        return None
    if not (math.isfinite(lo_b) and math.isfinite(hi_b)):
        return None
    if n == 0:
        return Counts(total=0, above=0, above_at_most=0, confidence=conf)
    above = _invert(n, lo_b, conf, side=0)
    at_most = _invert(n, hi_b, conf, side=1)
    if above is None or at_most is None or above > at_most:
        return None
    return Counts(total=n, above=above, above_at_most=at_most, confidence=conf)


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """One SLO's anytime-valid verdict on a knob's pooled requests (:mod:`metrics.sequential`),
    with what it rests on: ``total``/``above``/``above_at_most`` of the knob's own windows,
    the e-processes' logs, and ``borrowed`` requests lent by neighbouring knobs."""

    verdict: Verdict
    total: int
    above: int
    above_at_most: int
    confidence: float
    log_e_met: float
    log_e_violated: float
    borrowed: int = 0

    @property
    def log_threshold(self) -> float:
        return -math.log1p(-self.confidence)

    def requests_to_met(self, q: float) -> int | None:
        """More requests of this knob alone, none over the threshold, that would make it
        MET (0: it is; None: not within ten million)."""
        return requests_to_met(self.total, self.above_at_most, q=q, confidence=self.confidence)


def _sum(windows: Sequence[Counts]) -> tuple[int, int, int]:
    return (
        sum(c.total for c in windows),
        sum(c.above for c in windows),
        sum(c.above_at_most for c in windows),
    )


def borrow_bin(own_load: int, other_load: int) -> int:
    """Which bin of neighbours ``other_load`` falls in, seen from ``own_load``: 0 the same
    load, ``j`` ≥ 1 heavier by a ratio in (1.25^(j-1), 1.25^j], ``-j`` lighter alike."""
    if own_load < 1 or other_load < 1:
        raise ValueError(f"loads {own_load}, {other_load}: must be >= 1")
    if other_load == own_load:
        return 0
    ratio = max(own_load, other_load) / min(own_load, other_load)
    j = max(1, math.ceil(math.log(ratio) / math.log(BORROW_BIN_RATIO) - 1e-12))
    return j if other_load > own_load else -j


def borrow_weight(j: int) -> float:
    """The prior weight of neighbour bin ``j`` in a monotone verdict:
    ``BORROW_SHARE``·(6/π²)/j², so that the bins on one side sum to ``BORROW_SHARE`` and
    the knob's own requests keep the rest. The share is small because it is paid whatever
    the neighbours turn out to be: a heavier neighbour over the SLO lends nothing, and the
    knob's own evidence then has to reach 1/(α·(1 - share)) instead of 1/α."""
    return BORROW_SHARE * 6 / math.pi**2 / j**2


def judge(
    own: Sequence[Counts],
    *,
    q: float,
    neighbours: Mapping[int, Sequence[Counts]] | None = None,
) -> Judgement | None:
    """The anytime-valid verdict on ``own`` windows pooled, borrowing from ``neighbours``
    (keyed by :func:`borrow_bin`) under a monotone model (None: no windows, or windows
    judged at different confidences, which do not pool).

    The model: at a fixed headroom the fraction of requests over the threshold does not
    fall as the load grows. Then a heavier knob's requests are evidence for MET of this
    one (if this one were over the quantile, so would the heavier be) and a lighter
    knob's for VIOLATED. Each side mixes, with fixed weights (:func:`borrow_weight`),
    the e-process on the knob's own requests and on its own plus each bin's: a mixture of
    e-processes with fixed weights is one, so the verdict keeps its stated confidence
    (given the model); a bin not measured yet contributes the knob's own e-process."""
    near = dict(neighbours or {})
    every = [*own, *(c for cs in near.values() for c in cs)]
    if not own or len({c.confidence for c in every}) != 1:
        return None
    conf = own[0].confidence
    mine = _sum(own)  # requests, above, above_at_most
    n, k, k_hi = mine

    def side(sign: int, log_e: Callable[[int, int], float], pick: int) -> tuple[float, int]:
        # one side's mixture; pick: which count it judges (1: above, 2: above_at_most)
        terms, rest, lent = [], 1.0, 0
        for j, cs in near.items():
            if j * sign <= 0 or not cs:
                continue
            tot = _sum(cs)
            w = borrow_weight(abs(j))
            rest -= w
            lent += tot[0]
            terms.append(math.log(w) + log_e(n + tot[0], mine[pick] + tot[pick]))
        terms.append(math.log(rest) + log_e(n, mine[pick]))
        return log_sum_exp(terms), lent

    e_met, lent_met = side(+1, lambda t, a: log_e_met(t, a, q=q), 2)
    e_vio, lent_vio = side(-1, lambda t, a: log_e_violated(t, a, q=q), 1)
    thr = -math.log1p(-conf)
    if e_met >= thr:
        verdict, lent = Verdict.MET, lent_met
    elif e_vio >= thr:
        verdict, lent = Verdict.VIOLATED, lent_vio
    else:
        verdict, lent = Verdict.INSUFFICIENT, 0
    return Judgement(
        verdict=verdict,
        total=n,
        above=k,
        above_at_most=k_hi,
        confidence=conf,
        log_e_met=e_met,
        log_e_violated=e_vio,
        borrowed=lent,
    )


def disagreement(windows: Sequence[Counts]) -> float:
    """The p-value of "these windows share one fraction over the threshold" (1.0: fewer
    than two windows with requests, or none over it, or all): Fisher's exact test for two windows,
    a G-test of homogeneity for more. Small values mean the windows differ beyond sampling
    error: the environment changed between them."""
    rows = [(c.above, c.total - c.above) for c in windows if c.total > 0]
    if len(rows) < 2 or sum(a for a, _ in rows) == 0 or sum(b for _, b in rows) == 0:
        return 1.0  # none over the threshold, or all: nothing to disagree about
    from scipy import stats

    if len(rows) == 2:
        return float(stats.fisher_exact(rows).pvalue)
    table = [[a for a, _ in rows], [b for _, b in rows]]
    return float(stats.chi2_contingency(table, lambda_="log-likelihood").pvalue)


def combine(ttft: Verdict | None, tpot: Verdict | None) -> Verdict | None:
    """Both SLOs at once: VIOLATED if either is, MET if both are, else INSUFFICIENT."""
    if ttft is None or tpot is None:
        return None
    if Verdict.VIOLATED in (ttft, tpot):
        return Verdict.VIOLATED
    if ttft is Verdict.MET and tpot is Verdict.MET:
        return Verdict.MET
    return Verdict.INSUFFICIENT
