"""What a run that could not decide says: its best candidate, the evidence, what would decide it.

A canary that ends with no point shown to meet the SLO is either a failure (every knob
measured was shown to violate it: exit 3) or undecided (some knob was not shown either
way: exit 4). An undecided run names its best candidate
(:meth:`controller.report.curve.CurveReport.undecided`), the requests each SLO's
anytime-valid verdict rests on (:mod:`search.evidence`), and the cheapest thing that
would decide it: more requests at its measured rate, a quieter machine when its
windows disagreed beyond sampling error, or a second window when its one window's p99 sat
within the noise band of the SLO (``PointSummary.marginal``).
"""

from __future__ import annotations

import math
from typing import Any

from metrics.observation import Slo
from search.points import NOISE_BAND


def undecided_summary(p: Any, slo: Slo) -> str:
    """The best undecided candidate (a ``search.stop_rule.PointSummary``), its evidence and
    what would decide it, in a sentence or three."""
    parts = []
    need = 0
    for name, j, thr in (("TTFT", p.ttft, slo.ttft_p99_s), ("TPOT", p.tpot, slo.tpot_p99_s)):
        if j is None:
            continue
        p99 = p.ttft_p99_s if name == "TTFT" else p.tpot_p99_s
        lent = f", {j.borrowed} lent by neighbours" if j.borrowed else ""
        parts.append(
            f"{name} {j.verdict.value}: {j.above_at_most} of {j.total} requests over"
            f" {thr * 1e3:g} ms{lent} (p99 {p99 * 1e3:.0f} ms; evidence for MET"
            f" {math.exp(min(j.log_e_met, 50)):.3g}, {math.exp(j.log_threshold):.0f} decides)"
        )
        if j.verdict.value != "met":
            more = j.requests_to_met(slo.quantile)
            need = -1 if more is None or need < 0 else max(need, more)
    text = f"best candidate {p.knobs} ({p.goodput_rps:.2f} req/s within the SLO, "
    text += f"{p.measurements} window(s)): " + "; ".join(parts or ["request counts unknown"])
    if p.marginal:
        text += (
            f". Its one window put a p99 within {NOISE_BAND:.0%} of the SLO, where a slower"
            " or faster window flips the verdict: a second window decides it (raise"
            " --max-trials or --time-budget)"
        )
    elif p.noise:
        text += (
            f". The environment was noisy: {p.noise}; rerun on a quieter machine, or with"
            " more --max-trials so that it is measured again"
        )
    elif need > 0:
        rate = p.throughput_rps if math.isfinite(p.throughput_rps) and p.throughput_rps > 0 else 0
        at = f" (~{need / rate:.0f} s at its {rate:.1f} req/s)" if rate else ""
        text += (
            f". It would be decided MET by about {need} more requests with none over the SLO"
            f"{at}: raise --budget-requests, --max-window or --time-budget"
        )
    elif need < 0:
        text += ". Its p99 sits at the SLO's edge: no affordable window decides it"
    return text
