"""Anytime-valid p99 verdicts: a verdict that may be read after every request.

"p99 ≤ T" is a claim about the fraction ``p`` of requests slower than T (:mod:`metrics.samples`):
it holds when ``p ≤ p0 = 1 - q``. A fixed-sample test (Clopper-Pearson at n requests) is valid
only if it is read once. A canary that stops a window as soon as its verdict looks decided, or
pools a second window with the first, reads it many times, and every read is another chance of
a false verdict.

This module uses two e-processes on the exceedance counts instead, one per side, each a mixture
of likelihood ratios (Wald's sequential probability ratio test, mixed over alternatives):

- MET rejects H0 ``p ≥ p0`` with
  ``E_met(n, k) = Σ_j w_j · r_j^k · ((1 - r_j p0)/(1 - p0))^(n-k)``
  over alternatives ``r_j ∈ {0, 0.1, 0.25, 0.5}`` (weights 0.4, 0.3, 0.2, 0.1);
- VIOLATED rejects H0 ``p ≤ p0`` with the same form over ``r_j ∈ {1.5, 2, 4, 10, 30}``
  (equal weights; alternatives at or above a fraction of 1 are dropped).

For every ``p`` in its null, each likelihood-ratio factor has conditional mean ≤ 1 (it equals 1
at ``p = p0`` and falls with the distance from it), so each mixture is a nonnegative
supermartingale under the whole composite null, and by Ville's inequality
``P(sup_n E_n ≥ 1/α) ≤ α``: the verdict stays valid however often it is read and whenever the
reading stops (Ramdas, Grünwald, Vovk, Shafer, "Game-theoretic statistics and safe anytime-valid
inference", Statistical Science 38(4), 2023, §2-3; Wald, "Sequential tests of statistical
hypotheses", Ann. Math. Statist. 16, 1945). The price against a single fixed-n read: with no
request over T, MET needs ~370 requests at 95% instead of 299; a clear violation (a third of
requests over T) is called after ~10.

The counts may come from several windows and, under a monotone model, from neighbouring knobs
(:mod:`search.evidence`): the product stays a supermartingale as long as every request added is
drawn with an exceedance probability on the null's side, whatever decided which knob to measure.

A histogram whose bounds bracket T gives a range of exceedances: MET is judged on its upper
end, VIOLATED on its lower end, so that neither rounds in its own favour.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrics.observation import Verdict

Mixture = tuple[tuple[float, float], ...]  # (ratio of the alternative to p0, its weight)
# The alternatives each e-process is mixed over.
MET_MIXTURE: Mixture = ((0.0, 0.4), (0.1, 0.3), (0.25, 0.2), (0.5, 0.1))
VIOLATED_MIXTURE: Mixture = tuple((r, 0.2) for r in (1.5, 2, 4, 10, 30))
# Where "what would decide it" stops looking.
_MAX_REQUESTS = 10_000_000


@dataclass(frozen=True, kw_only=True)
class SequentialVerdict:
    """One SLO's anytime-valid verdict on ``total`` requests: ``log_e_met`` and
    ``log_e_violated`` are the e-processes' logs, ``log_threshold`` is ln(1/α)."""

    verdict: Verdict
    total: int
    above: int
    above_at_most: int
    log_e_met: float
    log_e_violated: float
    log_threshold: float

    @property
    def decided(self) -> bool:
        return self.verdict is not Verdict.INSUFFICIENT


def _check(total: int, above: int, above_at_most: int, q: float, confidence: float) -> None:
    if not 0 < q < 1:
        raise ValueError(f"q={q!r}: must be in (0, 1)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: must be in (0, 1)")
    if not 0 <= above <= above_at_most <= total:
        raise ValueError(
            f"counts above={above}, above_at_most={above_at_most}, total={total}:"
            " need 0 <= above <= above_at_most <= total"
        )


def _log_mixture(total: Any, above: Any, p0: float, mixture: Mixture) -> Any:
    """ln of the weighted mixture of likelihood ratios at ``above`` of ``total`` requests:
    numbers, or arrays of one shape (every prefix of a window at once)."""
    kept = sum(w for r, w in mixture if 0 <= r * p0 < 1)
    scalar = np.ndim(total) == 0 and np.ndim(above) == 0
    terms = []
    for ratio, weight in mixture:
        p = ratio * p0
        if not 0 <= p < 1:
            continue
        # the alternative's log-likelihood ratio; p = 0 is out after one request over
        if p == 0:
            ll: Any = total * -math.log1p(-p0)
            if scalar:
                ll = -math.inf if above > 0 else ll
            else:
                ll = np.where(np.asarray(above) > 0, -np.inf, ll)
        else:
            ll = above * math.log(ratio) + (total - above) * (math.log1p(-p) - math.log1p(-p0))
        terms.append(math.log(weight / kept) + ll)
    if not scalar:
        return np.logaddexp.reduce(np.stack(np.broadcast_arrays(*terms)), axis=0)
    return log_sum_exp(terms)


def log_sum_exp(terms: Sequence[float]) -> float:
    """ln Σ exp(t) of a few numbers, without overflow (-inf when every term is)."""
    top = max(terms)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(t - top) for t in terms))


def log_e_met(total: int, above_at_most: int, *, q: float = 0.99) -> float:
    """ln E_met: evidence against "the q-quantile is over the threshold"."""
    return _log_mixture(total, above_at_most, 1 - q, MET_MIXTURE)


def log_e_violated(total: int, above: int, *, q: float = 0.99) -> float:
    """ln E_violated: evidence against "the q-quantile is within the threshold"."""
    return _log_mixture(total, above, 1 - q, VIOLATED_MIXTURE)


def sequential_verdict(
    total: int,
    above: int,
    *,
    q: float = 0.99,
    confidence: float = 0.95,
    above_at_most: int | None = None,
) -> SequentialVerdict:
    """The anytime-valid verdict on "q-quantile ≤ threshold" from ``above`` (to
    ``above_at_most``) of ``total`` requests over it (see the module doc)."""
    hi = above if above_at_most is None else above_at_most
    _check(total, above, hi, q, confidence)
    thr = -math.log1p(-confidence)
    e_met = log_e_met(total, hi, q=q)
    e_vio = log_e_violated(total, above, q=q)
    if e_met >= thr:
        v = Verdict.MET
    elif e_vio >= thr:
        v = Verdict.VIOLATED
    else:
        v = Verdict.INSUFFICIENT
    return SequentialVerdict(
        verdict=v,
        total=total,
        above=above,
        above_at_most=hi,
        log_e_met=e_met,
        log_e_violated=e_vio,
        log_threshold=thr,
    )


def requests_to_met(
    total: int, above_at_most: int, *, q: float = 0.99, confidence: float = 0.95
) -> int | None:
    """How many more requests, none of them over the threshold, would make the verdict MET
    (0: it is already; None: not within ten million)."""
    thr = -math.log1p(-confidence)
    if log_e_met(total, above_at_most, q=q) >= thr:
        return 0
    lo, hi = 0, 1
    while log_e_met(total + hi, above_at_most, q=q) < thr:
        lo, hi = hi, hi * 2
        if hi > _MAX_REQUESTS:
            return None
    while hi - lo > 1:  # E_met grows with every request under the threshold
        mid = (lo + hi) // 2
        if log_e_met(total + mid, above_at_most, q=q) >= thr:
            hi = mid
        else:
            lo = mid
    return hi


# Before its nominal length, a window stops only on a violation this clear.
EARLY_CONFIDENCE = 0.995

Tally = tuple[int, int, int]  # requests, over the threshold, possibly over it


def _check_margin(margin: float) -> None:
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin={margin!r}: must be a number >= 0 (nats of e-value)")


def _stricter(confidence: float, margin: float) -> float:
    """The confidence whose threshold is ``confidence``'s raised by ``margin`` nats."""
    _check_margin(margin)
    return -math.expm1(math.log1p(-confidence) - margin)


def decided(
    tallies: Sequence[Tally],
    *,
    q: float,
    confidence: float,
    early: bool = False,
    margin: float = 0.0,
) -> bool:
    """Whether a window with these tallies (one per SLO) may stop: some SLO VIOLATED or
    every SLO MET at ``confidence``; ``early`` (before the window's nominal size): only a
    violation at :data:`EARLY_CONFIDENCE` (the rule :func:`first_decision` applies to a
    window read after every request). ``margin``: the deciding e-values must clear their
    thresholds by this many nats (a window whose requests will be judged mixed with others'
    must stay decided there: search.evidence.STOP_MARGIN)."""
    conf = max(confidence, EARLY_CONFIDENCE) if early else confidence
    conf = _stricter(conf, margin)
    verdicts = [
        sequential_verdict(n, k, q=q, confidence=conf, above_at_most=hi).verdict
        for n, k, hi in tallies
    ]
    if early:
        return Verdict.VIOLATED in verdicts
    return Verdict.VIOLATED in verdicts or all(v is Verdict.MET for v in verdicts)


def first_decision(
    over: Sequence[np.ndarray],
    *,
    q: float = 0.99,
    confidence: float = 0.95,
    start: int = 1,
    nominal: int = 1,
    early_confidence: float = EARLY_CONFIDENCE,
    margin: float = 0.0,
) -> tuple[int, Verdict]:
    """Where a window read after every request would stop. ``over`` holds one float array
    per SLO, all of one length (the window's requests in finish order): 1 where the request
    was over that SLO's threshold, 0 where not, NaN where it has no sample (a one-token
    answer has no TPOT). Returns ``(n, verdict)``: the first prefix of at least ``start``
    requests at which some SLO is VIOLATED at ``early_confidence`` or, from the ``nominal``
    prefix on, some SLO is VIOLATED or every SLO is MET at ``confidence``; else the whole
    window and INSUFFICIENT. ``margin``: as in :func:`decided`.

    Why the nominal length: a window stopped at the first MET would leave its p99 and
    goodput estimates biased (it stops where the sample looks best), and the search reads
    them; a mild violation stopped early likewise. A clear violation (a stricter threshold
    of the same e-process, still anytime-valid) costs only a few dozen requests, and an
    undecided window runs past its nominal length until it is decided."""
    size = len(over[0]) if over else 0
    if any(len(x) != size for x in over):
        raise ValueError(f"over: arrays of lengths {[len(x) for x in over]}: need equal lengths")
    if size == 0:
        return 0, Verdict.INSUFFICIENT
    _check_margin(margin)
    thr = -math.log1p(-confidence) + margin
    thr_early = -math.log1p(-early_confidence) + margin
    met = np.ones(size, dtype=bool)  # [size]
    violated = np.zeros(size, dtype=bool)  # [size]
    clear = np.zeros(size, dtype=bool)  # [size] violated at early_confidence
    for x in over:
        x = np.asarray(x, dtype=np.float64)  # [size]
        seen = ~np.isnan(x)
        n = np.cumsum(seen)  # [size] samples so far
        k = np.cumsum(np.where(seen, x, 0.0) > 0)  # [size] of them over the threshold
        met &= _log_mixture(n, k, 1 - q, MET_MIXTURE) >= thr
        e_vio = _log_mixture(n, k, 1 - q, VIOLATED_MIXTURE)
        violated |= e_vio >= thr
        clear |= e_vio >= thr_early
    early = np.arange(size) < nominal - 1  # [size] prefixes shorter than the nominal one
    decided = np.where(early, clear, met | violated)
    first = max(0, start - 1)
    if not decided[first:].any():
        return size, Verdict.INSUFFICIENT
    i = int(np.argmax(decided[first:])) + first
    return i + 1, Verdict.VIOLATED if violated[i] else Verdict.MET
