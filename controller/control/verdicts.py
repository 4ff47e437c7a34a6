"""What a window's p99 verdicts say about the SLO: its p99s as shares of it, and whether a
window they leave undecided measured them all the same. Pure; controller/control/decide.py
judges a window on them, beside what controller/control/gauges.py reads from its gauges.
"""

from __future__ import annotations

import math

from metrics.observation import Observation, Slo, Verdict


def left_undecided(o: Observation) -> tuple[str, bool]:
    """Why the window's p99 verdicts leave it undecided ("" when they do not), and whether
    its p99s are measured all the same: a verdict left insufficient (the p99 near the SLO,
    or too few samples in the tail to bound it) with an estimate on both sides. Such a
    window says where the level is, if not on which side of the SLO."""
    verdicts = (o.ttft_verdict, o.tpot_verdict)
    if any(v is not None and v.verdict is Verdict.VIOLATED for v in verdicts):
        return "", False  # a violation judged on one side is conclusive whatever the other says
    why = ""
    for name, v in zip(("TTFT", "TPOT"), verdicts, strict=True):
        if v is None or not math.isfinite(v.estimate_s):
            return f"p99 {name} not decided ({'no verdict' if v is None else 'no estimate'})", False
        if v.verdict is not Verdict.MET and not why:
            share = v.estimate_s / v.threshold_s
            why = f"p99 {name} at {share:.0%} of its SLO, undecided on {v.samples} samples"
    return why, bool(why)


def share_of_slo(o: Observation, slo: Slo) -> tuple[float, float]:
    """The window's p99 TTFT and p99 TPOT as shares of their SLOs (NaN where unmeasured)."""

    def share(v: object, bound: float) -> float:
        est = getattr(v, "estimate_s", math.nan)
        return est / bound if math.isfinite(est) else math.nan

    return share(o.ttft_verdict, slo.ttft_p99_s), share(o.tpot_verdict, slo.tpot_p99_s)
