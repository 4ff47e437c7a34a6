"""What the tuner knows about each knob: one window's stored attributes, and their summary.

:func:`observation_attrs` is what a trial stores of its Observation (Optuna user
attributes, so a resumed study knows it too), including the request counts behind
each SLO verdict (:func:`search.evidence.counts_of`). :func:`summarize` turns every
window of one knob into a :class:`~search.stop_rule.PointSummary`: goodput over the
pooled windows, worst p99s, and both SLO verdicts on the union of the fresh windows'
requests (:mod:`search.evidence`). Stale windows lend no requests. A study written
before the counts were stored (or an Observation whose verdicts state no bounds)
falls back to a majority vote of windows. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from metrics.observation import Observation, Slo, SloVerdict, Verdict
from search.evidence import Counts, combine, counts_of, pooled_verdict
from search.space import Knobs
from search.stop_rule import PointSummary

Attrs = Mapping[str, Any]


def _num(x: float) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _mean(xs: Any) -> float:
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _counts_attr(v: SloVerdict | None) -> list[float] | None:
    c = counts_of(v)
    return c.as_list() if c is not None else None


def observation_attrs(obs: Observation) -> dict[str, Any]:
    """The attributes a trial stores of its window (JSON-serialisable)."""

    def verdict(v: SloVerdict | None) -> str:
        return v.verdict.value if v is not None else "none"

    return {
        "goodput_rps": _num(obs.goodput_rps),
        "throughput_rps": _num(obs.throughput_rps),
        "tokens_per_s": _num(obs.tokens_per_s),
        "ttft_p99_s": _num(obs.ttft.p99),
        "tpot_p99_s": _num(obs.tpot.p99),
        "ttft_p50_s": _num(obs.ttft.p50),
        "tpot_p50_s": _num(obs.tpot.p50),
        "ttft_verdict": verdict(obs.ttft_verdict),
        "tpot_verdict": verdict(obs.tpot_verdict),
        "completed": obs.completed,
        "slo_met": obs.slo_met,
        "rejected": obs.rejected,
        "window_s": _num(obs.window_s),
        "stale": obs.stale,
        # [total, above, above_at_most, confidence] behind each verdict (None: unknown),
        # so that the windows of one knob pool exactly.
        "ttft_counts": _counts_attr(obs.ttft_verdict),
        "tpot_counts": _counts_attr(obs.tpot_verdict),
    }


def _pooled(
    windows: Sequence[Attrs], key: str, *, threshold_s: float, estimate_s: float, q: float
) -> Verdict | None:
    """One SLO's verdict on the union of the fresh windows' requests (None: some window's
    counts are unknown)."""
    counts = [Counts.from_list(a.get(f"{key}_counts")) for a in windows]
    if any(c is None or "stale" not in a for a, c in zip(windows, counts, strict=True)):
        return None
    fresh = [c for a, c in zip(windows, counts, strict=True) if c is not None and not a["stale"]]
    if not fresh:  # only stale windows: no evidence either way
        return Verdict.INSUFFICIENT
    v = pooled_verdict(fresh, threshold_s=threshold_s, estimate_s=estimate_s, q=q)
    return v.verdict if v is not None else None


def summarize(
    knobs: Knobs,
    windows: Sequence[Attrs],
    *,
    values: Sequence[float],
    numbers: Sequence[int],
    slo: Slo,
) -> PointSummary:
    """Every window of ``knobs`` (stored attributes, objective values, trial numbers) as
    one :class:`PointSummary` (see the module doc)."""
    if not windows or not len(windows) == len(values) == len(numbers):
        raise ValueError(
            f"{len(windows)} windows, {len(values)} values, {len(numbers)} trial numbers:"
            " need one of each per window, at least one"
        )
    met = sum(1 for a in windows if a.get("feasible", False))

    def worst(key: str) -> float:
        vals = [a.get(key) for a in windows]
        return math.nan if any(v is None for v in vals) else max(vals)

    ttft_p99, tpot_p99 = worst("ttft_p99_s"), worst("tpot_p99_s")
    q = slo.quantile
    ttft_v = _pooled(windows, "ttft", threshold_s=slo.ttft_p99_s, estimate_s=ttft_p99, q=q)
    tpot_v = _pooled(windows, "tpot", threshold_s=slo.tpot_p99_s, estimate_s=tpot_p99, q=q)
    pooled = combine(ttft_v, tpot_v)
    # Goodput of the pooled windows: their SLO-meeting requests over their total time.
    spans = [a.get("window_s") for a in windows]
    if all(isinstance(w, (int, float)) and w > 0 for w in spans):
        goodput = sum(int(a.get("slo_met") or 0) for a in windows) / sum(spans)  # type: ignore[arg-type]
    else:
        goodput = sum(values) / len(values)

    def ok(key: str, v: Verdict | None) -> bool:
        if pooled is not None:
            return v is Verdict.MET
        return all(a.get(f"{key}_verdict") == Verdict.MET.value for a in windows)

    return PointSummary(
        knobs=knobs,
        measurements=len(windows),
        goodput_rps=goodput,
        feasible=pooled is Verdict.MET if pooled is not None else 2 * met > len(windows),
        met_windows=met,
        throughput_rps=_mean(a.get("throughput_rps") for a in windows),
        ttft_p99_s=ttft_p99,
        tpot_p99_s=tpot_p99,
        ttft_ok=ok("ttft", ttft_v),
        tpot_ok=ok("tpot", tpot_v),
        first_trial=min(numbers),
        last_trial=max(numbers),
        pooled=pooled,
    )
