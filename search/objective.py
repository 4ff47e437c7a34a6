"""The pure objective: goodput to maximise, latency constraints to keep at or below zero.

``evaluate(observation, slo)`` reads one measurement window and returns the value
the tuner maximises (goodput: completed requests per second that met both SLOs)
and two constraints in seconds, ``p99 TTFT - SLO`` and ``p99 TPOT - SLO``, feasible
when both are ``<= 0`` (Optuna's convention for ``Trial.set_constraint``).

It is honest about evidence: a window is feasible only when both SLO verdicts
are :attr:`~metrics.observation.Verdict.MET` on fresh data. A verdict that is
VIOLATED or INSUFFICIENT (too few samples to call) gets a strictly positive
constraint even when its point estimate is under the threshold, so no sampler or
incumbent rule can mistake it for a feasible point. No I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from metrics.observation import Observation, Slo, SloVerdict, Verdict

# Constraint given to a not-MET verdict whose estimate is under the threshold (seconds).
UNPROVEN_MARGIN_S = 1e-6


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    value: float  # goodput, requests/s meeting both SLOs (0 when unknown)
    constraints: tuple[float, float]  # (p99 TTFT - SLO, p99 TPOT - SLO), seconds; <= 0 is ok
    feasible: bool
    reason: str = ""  # why not feasible ("" when feasible)

    def __post_init__(self) -> None:
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(f"value={self.value!r}: must be a finite goodput >= 0")
        if len(self.constraints) != 2 or not all(math.isfinite(c) for c in self.constraints):
            raise ValueError(f"constraints={self.constraints!r}: need two finite numbers")
        if self.feasible and any(c > 0 for c in self.constraints):
            raise ValueError(f"feasible with constraints={self.constraints!r} > 0")


def _constraint(verdict: SloVerdict | None, estimate: float, threshold: float) -> float:
    if not math.isfinite(estimate):
        estimate = verdict.estimate_s if verdict is not None else math.nan
    gap = estimate - threshold if math.isfinite(estimate) else threshold  # unknown: 100% over
    if verdict is not None and verdict.verdict is Verdict.MET:
        return min(gap, 0.0)
    return max(gap, UNPROVEN_MARGIN_S)


def _why(name: str, v: SloVerdict | None) -> str:
    if v is None:
        return f"{name}: no verdict"
    if v.verdict is Verdict.MET:
        return ""
    return (
        f"{name}: {v.verdict.value}"
        f" (p99 {v.estimate_s:.4g}s vs {v.threshold_s:.4g}s, n={v.samples})"
    )


def evaluate(observation: Observation, slo: Slo) -> Evaluation:
    """Goodput and the two latency constraints of one window (pure)."""
    obs = observation
    value = obs.goodput_rps
    if not math.isfinite(value) or value < 0:
        value = 0.0
    c_ttft = _constraint(obs.ttft_verdict, obs.ttft.p99, slo.ttft_p99_s)
    c_tpot = _constraint(obs.tpot_verdict, obs.tpot.p99, slo.tpot_p99_s)
    reasons = [r for r in (_why("ttft", obs.ttft_verdict), _why("tpot", obs.tpot_verdict)) if r]
    if obs.stale:
        reasons.insert(0, f"stale data ({obs.staleness_s:.1f}s old)")
    feasible = not reasons and obs.feasible
    if not feasible:
        # Staleness alone leaves both verdicts MET: make the constraint say "not proven".
        c_ttft = max(c_ttft, UNPROVEN_MARGIN_S) if c_tpot <= 0 else c_ttft
    return Evaluation(
        value=float(value),
        constraints=(float(c_ttft), float(c_tpot)),
        feasible=feasible,
        reason="; ".join(reasons),
    )
