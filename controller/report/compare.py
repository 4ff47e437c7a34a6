"""``slotune compare``: is run B's operating point worse than run A's, beyond noise?

Two exported runs (a model version before and after, two devices) each have an operating
point, measured in one or more windows. Their windows are pooled (the requests of every
window at the chosen knobs) and B is judged against A by three one-sided tests, each at
``alpha / 3`` (Bonferroni: the whole verdict's false-alarm rate is at most ``alpha``):

- **goodput** (requests per second within both SLOs): B's SLO-meeting requests, given
  both runs' together, are binomial with the share the window lengths give when B's rate
  is ``(1 - margin)`` times A's (the conditional test of two Poisson rates). Rejecting it
  says B serves less than ``1 - margin`` of A's goodput.
- **TPOT** and **TTFT**: the Mann-Whitney comparison of the two windows' latencies
  (:func:`metrics.binned.superiority`, on requests per histogram bucket): the probability
  that a request of B is slower than one of A (ties half) exceeds ``effect`` (0.5 is no
  difference; Vargha and Delaney call 0.56 a small effect), with DeLong's standard error.

B is **worse** when its goodput is lower (the first test), or, when both runs chose the
same knobs, when a latency is higher. At different knobs the latency tests are reported but
do not judge: the batch and the admission limit set TPOT and TTFT by design (a point
further up the curve trades latency for goodput, both within the SLO), so latencies
measured at different knobs say which point the tuner chose, not whether the version
regressed. A run with no operating point is worse than one with; two without cannot be
compared.

The margin is the tuner's own noise: reruns of one version on the simulator (10 seeds on
each of three scenarios, docs/BENCHMARKS.md) chose operating points whose goodput was
0.91-1.11 of the first run's, while a version 30% slower per step gave 0.68 or less.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats

from controller.report.cost import million_token_cost
from controller.report.curve import CurveReport
from controller.report.measured import Pooled
from controller.report.records import json_num
from metrics.binned import superiority

ALPHA = 0.05
MARGIN = 0.10
EFFECT = 0.56


def run_file(path: str | Path) -> Path:
    """The ``curve.json`` of an exported run given as its folder or as the file itself."""
    p = Path(path)
    return p / "curve.json" if p.is_dir() else p


def load_run(path: str | Path) -> CurveReport:
    """An exported run: its folder (holding ``curve.json``) or the ``curve.json`` itself."""
    return CurveReport.from_dict(json.loads(run_file(path).read_text(encoding="utf-8")))


def _interval(x: float, lo: float, hi: float) -> dict[str, float]:
    return {"value": x, "low": lo, "high": hi}


@dataclass(frozen=True, kw_only=True)
class OperatingStats:
    """A run's operating point, its windows pooled, with 95% confidence intervals."""

    label: str
    batch: int
    concurrency: int
    pooled: Pooled
    usd_per_hour: float | None

    @classmethod
    def of(cls, label: str, report: CurveReport) -> OperatingStats | None:
        c = report.chosen
        if c is None:
            return None
        return cls(
            label=label,
            batch=c.max_batch_size,
            concurrency=c.max_concurrency,
            pooled=Pooled.of(report.measurements_of(c)),
            usd_per_hour=report.usd_per_hour,
        )

    @property
    def goodput_rps(self) -> float:
        return self.pooled.goodput_rps

    def to_dict(self, q: float) -> dict[str, Any]:
        p = self.pooled
        t_lo, t_hi = p.tokens_interval()
        cost = million_token_cost(self.usd_per_hour, p.tokens_per_s)
        # cost falls as tokens/s rises: its interval is the tokens interval turned over
        c_lo = million_token_cost(self.usd_per_hour, t_hi)
        c_hi = million_token_cost(self.usd_per_hour, t_lo)
        ttft_n, tpot_n = p.latency_requests
        return {
            "label": self.label,
            "max_batch_size": self.batch,
            "max_concurrency": self.concurrency,
            "windows": p.windows,
            "window_s": p.window_s,
            "completed": p.completed,
            "slo_met": p.slo_met,
            "goodput_rps": _interval(p.goodput_rps, *p.goodput_interval()),
            "tokens_per_s": _interval(p.tokens_per_s, t_lo, t_hi),
            "usd_per_million_tokens": _interval(cost, c_lo, c_hi),
            "p99_tpot_ms": _interval(*(x * 1e3 for x in p.quantile("tpot", q))),
            "p99_ttft_ms": _interval(*(x * 1e3 for x in p.quantile("ttft", q))),
            "tpot_requests": tpot_n,
            "ttft_requests": ttft_n,
            "confidence": p.confidence,
        }


@dataclass(frozen=True, kw_only=True)
class Test:
    name: str
    question: str  # what rejecting it says
    statistic: float
    p_value: float
    detail: str = ""

    def rejected(self, level: float) -> bool:
        return math.isfinite(self.p_value) and self.p_value < level


@dataclass(frozen=True, kw_only=True)
class Comparison:
    a: OperatingStats | None
    b: OperatingStats | None
    report_a: CurveReport
    report_b: CurveReport
    worse: bool
    comparable: bool
    reasons: tuple[str, ...]
    tests: tuple[Test, ...] = ()
    alpha: float = ALPHA
    margin: float = MARGIN
    effect: float = EFFECT
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def level(self) -> float:
        """Each test's level: ``alpha`` shared among them (Bonferroni)."""
        return self.alpha / max(1, len(self.tests))

    def verdict(self) -> str:
        if not self.comparable:
            return "not comparable"
        return "B is worse" if self.worse else "B is not worse"

    def to_dict(self) -> dict[str, Any]:
        q = self.report_a.slo.quantile
        return json_num(
            {
                "verdict": self.verdict(),
                "worse": self.worse,
                "comparable": self.comparable,
                "reasons": list(self.reasons),
                "notes": list(self.notes),
                "method": {
                    "alpha": self.alpha,
                    "per_test_level": self.level,
                    "correction": "Bonferroni over the tests below",
                    "goodput_margin": self.margin,
                    "latency_effect": self.effect,
                    "goodput_test": "conditional binomial test of two Poisson rates, "
                    "B's rate at (1 - margin) of A's under the null",
                    "latency_test": "one-sided Mann-Whitney on requests per histogram bucket"
                    " (ties half), DeLong standard error, null: P(B slower) <= effect; it"
                    " judges only when both operating points are at the same knobs",
                },
                "tests": [
                    {
                        "name": t.name,
                        "question": t.question,
                        "statistic": t.statistic,
                        "p_value": t.p_value,
                        "rejected": t.rejected(self.level),
                        "detail": t.detail,
                    }
                    for t in self.tests
                ],
                "slo": {
                    "ttft_p99_ms": self.report_a.slo.ttft_p99_s * 1e3,
                    "tpot_p99_ms": self.report_a.slo.tpot_p99_s * 1e3,
                    "quantile": q,
                },
                "a": None if self.a is None else self.a.to_dict(q),
                "b": None if self.b is None else self.b.to_dict(q),
                "runs": {
                    "a": _run_summary(self.report_a),
                    "b": _run_summary(self.report_b),
                },
            }
        )


def _run_summary(r: CurveReport) -> dict[str, Any]:
    return {
        "model": r.model,
        "hardware": r.hardware,
        "trials": len(r.searched),
        "stop_reason": r.stop_reason,
        "started": (r.meta or {}).get("started"),
    }


def compare(
    report_a: CurveReport,
    report_b: CurveReport,
    *,
    labels: tuple[str, str] = ("A", "B"),
    alpha: float = ALPHA,
    margin: float = MARGIN,
    effect: float = EFFECT,
) -> Comparison:
    """Judge B's operating point against A's (see the module's docstring)."""
    for name, v, ok in (
        ("alpha", alpha, 0 < alpha < 1),
        ("margin", margin, 0 <= margin < 1),
        ("effect", effect, 0.5 <= effect < 1),
    ):
        if not ok:
            allowed = {"alpha": "(0, 1)", "margin": "[0, 1)", "effect": "[0.5, 1)"}[name]
            raise ValueError(f"{name}={v!r}: must be in {allowed}")
    a, b = OperatingStats.of(labels[0], report_a), OperatingStats.of(labels[1], report_b)
    kw: dict[str, Any] = {
        "a": a,
        "b": b,
        "report_a": report_a,
        "report_b": report_b,
        "alpha": alpha,
        "margin": margin,
        "effect": effect,
    }
    notes = _slo_notes(report_a, report_b)
    if a is None and b is None:
        why = "neither run has an operating point that met the SLO"
        return Comparison(worse=False, comparable=False, reasons=(why,), notes=notes, **kw)
    if a is None:
        why = f"{labels[0]} has no operating point that met the SLO; {labels[1]} has one"
        return Comparison(worse=False, comparable=True, reasons=(why,), notes=notes, **kw)
    if b is None:
        why = f"{labels[1]} has no operating point that met the SLO; {labels[0]} has one"
        return Comparison(worse=True, comparable=True, reasons=(why,), notes=notes, **kw)
    tests = (_goodput_test(a, b, margin), _latency_test("TPOT", a, b, effect))
    tests += (_latency_test("TTFT", a, b, effect),)
    level = alpha / len(tests)
    g, tpot, ttft = (t.rejected(level) for t in tests)
    same_knobs = (a.batch, a.concurrency) == (b.batch, b.concurrency)
    reasons = []
    if g:
        reasons.append(
            f"goodput {b.goodput_rps:.3g} req/s against {a.goodput_rps:.3g}: below"
            f" {1 - margin:.0%} of A's (p={tests[0].p_value:.2g} < {level:.3g})"
        )
    for hit, t in ((tpot, tests[1]), (ttft, tests[2])):
        if hit and same_knobs:
            reasons.append(
                f"{t.name} slower at the same knobs: P(B slower) {t.statistic:.2f} > {effect:g}"
                f" (p={t.p_value:.2g} < {level:.3g})"
            )
        elif hit:
            notes += (
                f"{t.name} is slower (P(B slower) {t.statistic:.2f}), at other knobs (A: "
                f"B={a.batch} C={a.concurrency}, B: B={b.batch} C={b.concurrency}): the knobs "
                "set latency, so it does not judge",
            )
    if not reasons:
        reasons.append(
            f"goodput {b.goodput_rps:.3g} req/s against {a.goodput_rps:.3g}: not shown below"
            f" {1 - margin:.0%} of A's (p={tests[0].p_value:.2g}, needs < {level:.3g})"
            + ("" if same_knobs else "; latencies at other knobs do not judge")
        )
    worse = g or (same_knobs and (tpot or ttft))
    return Comparison(
        worse=worse, comparable=True, reasons=tuple(reasons), tests=tests, notes=notes, **kw
    )


def _slo_notes(ra: CurveReport, rb: CurveReport) -> tuple[str, ...]:
    if ra.slo == rb.slo:
        return ()
    return (
        f"the runs were tuned to different SLOs (A: TTFT {ra.slo.ttft_p99_s * 1e3:g} ms, TPOT"
        f" {ra.slo.tpot_p99_s * 1e3:g} ms; B: TTFT {rb.slo.ttft_p99_s * 1e3:g} ms, TPOT"
        f" {rb.slo.tpot_p99_s * 1e3:g} ms): goodput counts each run's own SLO",
    )


def _goodput_test(a: OperatingStats, b: OperatingStats, margin: float) -> Test:
    ka, kb = a.pooled.slo_met, b.pooled.slo_met
    n = ka + kb
    ta, tb = a.pooled.window_s, b.pooled.window_s
    share = tb * (1 - margin) / (ta + tb * (1 - margin))
    p = float(stats.binomtest(kb, n, share, alternative="less").pvalue) if n else math.nan
    ratio = b.goodput_rps / a.goodput_rps if a.goodput_rps > 0 else math.nan
    return Test(
        name="goodput",
        question=f"is B's goodput below {1 - margin:.0%} of A's?",
        statistic=ratio,
        p_value=p,
        detail=f"B/A {ratio:.3f}; {kb} of {n} SLO-meeting requests are B's over "
        f"{tb:.0f} s against A's {ta:.0f} s",
    )


def _latency_test(name: str, a: OperatingStats, b: OperatingStats, effect: float) -> Test:
    pa, pb = a.pooled, b.pooled
    ha, hb = (pa.tpot, pb.tpot) if name == "TPOT" else (pa.ttft, pb.ttft)
    s = superiority(ha, hb)
    lo, hi = s.interval()
    return Test(
        name=name,
        question=f"are B's {name}s slower than A's, P(B slower) > {effect:g}?",
        statistic=s.effect,
        p_value=s.p_above(effect),
        detail=(
            f"P(B slower) {s.effect:.3f} (95% {lo:.3f}-{hi:.3f}) on {s.n_a} and {s.n_b} requests"
            if s.n_a and s.n_b
            else "no latency distribution stored with a run (exported before slotune kept one)"
        ),
    )


def describe_point(s: Mapping[str, Any]) -> str:
    """One line of an operating point's figures, as the CLI prints them."""
    g, c, p = s["goodput_rps"], s["usd_per_million_tokens"], s["p99_tpot_ms"]
    cost = ""
    if c["value"] is not None:
        cost = f", ${c['value']:.3g}/Mtok ({c['low']:.3g}-{c['high']:.3g})"
    return (
        f"{s['label']}: B={s['max_batch_size']} C={s['max_concurrency']}, goodput "
        f"{g['value']:.3g} req/s ({g['low']:.3g}-{g['high']:.3g}){cost}, p99 TPOT "
        f"{_ms(p['value'])} ms ({_ms(p['low'])}-{_ms(p['high'])}), {s['windows']} window(s)"
    )


def _ms(x: Any) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.1f}"
