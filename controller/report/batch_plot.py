"""The curve against batch: tokens/s and p99 TPOT for each batch that ran, measured (with
95% error bars from the windows' sample counts) beside the roofline's prediction, with the
measured and predicted knees and where the SLO cuts each. One drawing for a run's report
(``curve_by_batch.png``) and for ``slotune compare`` (two runs on the same axes)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from controller.report.figure import new_figure, to_png
from controller.report.measured import (
    MeasuredPoint,
    Pooled,
    measured_curve,
    measured_knee,
    measured_slo_cut,
    ran_batch,
)

if TYPE_CHECKING:
    from controller.report.curve import CurveReport


def _bars(v: float, lo: float, hi: float) -> tuple[float, float]:
    """Error-bar lengths below and above ``v`` (0 where the bound is unknown or infinite)."""
    below = v - lo if math.isfinite(lo) and math.isfinite(v) else 0.0
    above = hi - v if math.isfinite(hi) and math.isfinite(v) else 0.0
    return max(0.0, below), max(0.0, above)


def _errorbar(ax: Any, pts: Sequence[MeasuredPoint], which: str, **kw: Any) -> None:
    xs, ys, lo, hi = [], [], [], []
    for p in pts:
        if which == "tokens":
            v = p.pooled.tokens_per_s
            a, b = _bars(v, *p.pooled.tokens_interval())
        else:
            v, lo_s, hi_s = p.p99_tpot
            v, a, b = v * 1e3, *_bars(v * 1e3, lo_s * 1e3, hi_s * 1e3)
        if math.isfinite(v) and v > 0:
            xs.append(p.batch)
            ys.append(v)
            lo.append(a)
            hi.append(b)
    if xs:
        ax.errorbar(xs, ys, yerr=[lo, hi], capsize=3, elinewidth=1, **kw)


def draw_run(
    ax_tok: Any,
    ax_tpot: Any,
    report: CurveReport,
    *,
    color: str,
    label: str = "",
    annotate: bool = True,
) -> dict[str, Any]:
    """One run's curves on the two axes; returns its measured knee and SLO cut."""
    prefix = f"{label}: " if label else ""
    pred = sorted(report.predicted, key=lambda p: p.batch)
    if pred:
        bs = [p.batch for p in pred]
        kw = {"color": color, "ls": "--", "lw": 1.1, "alpha": 0.6}
        ax_tok.plot(bs, [p.tokens_per_s for p in pred], label=f"{prefix}roofline prediction", **kw)
        ax_tpot.plot(bs, [p.tpot_s * 1e3 for p in pred], **kw)
    canary = measured_curve(report.trials, report.slo)
    prod = measured_curve(report.trials, report.slo, roles=("production",))
    for ax, which in ((ax_tok, "tokens"), (ax_tpot, "tpot")):
        _errorbar(
            ax,
            canary,
            which,
            fmt="-o",
            color=color,
            ms=5,
            lw=1.4,
            label=f"{prefix}measured (canary)" if which == "tokens" else None,
        )
        _errorbar(
            ax,
            prod,
            which,
            fmt="s",
            color=color,
            mfc="white",
            ms=7,
            label=f"{prefix}production windows" if which == "tokens" and prod else None,
        )
    knee = measured_knee(canary)
    cut, _ = measured_slo_cut(canary, report.slo)
    chosen = report.chosen
    if chosen is not None:  # its windows pooled, as the table's operating point
        op = Pooled.of(report.measurements_of(chosen))
        b = ran_batch(chosen)
        star = {"ms": 16, "color": color, "mec": "black", "zorder": 5}
        ax_tok.plot(
            [b],
            [op.tokens_per_s],
            "*",
            label=f"{prefix}operating point B={chosen.max_batch_size} C={chosen.max_concurrency}",
            **star,
        )
        p99 = op.quantile("tpot", report.slo.quantile)[0]
        if math.isfinite(p99):
            ax_tpot.plot([b], [p99 * 1e3], "*", **star)
    if annotate:
        for x, text, ls in (
            (knee, "measured knee", "-."),
            (report.knee_batch, "roofline knee", ":"),
            (cut, "measured SLO cut", "-"),
        ):
            if x:
                for ax in (ax_tok, ax_tpot):
                    ax.axvline(x, color=color, ls=ls, lw=1, alpha=0.7)
                ax_tpot.annotate(
                    f"{text} B≈{x:.0f}",
                    (x, 1.0),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    fontsize=7,
                    va="top",
                    ha="right",
                    color=color,
                )
    tok = [p.pooled.tokens_interval()[1] for p in canary + prod]
    tok_max = max((x for x in tok if math.isfinite(x)), default=math.nan)
    return {"knee": knee, "cut": cut, "tokens_max": tok_max}


def finish_axes(
    ax_tok: Any, ax_tpot: Any, slo_tpot_s: float, *, tokens_max: float = math.nan
) -> None:
    """Labels, scales and legends; the tokens/s axis ends a little above the highest
    measurement (``tokens_max``), so a roofline far above the measured curve runs off the
    top instead of flattening it."""
    ax_tpot.axhline(
        slo_tpot_s * 1e3,
        color="black",
        ls="--",
        lw=1.2,
        label=f"p99 TPOT SLO {slo_tpot_s * 1e3:g} ms",
    )
    for ax in (ax_tok, ax_tpot):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch that ran (min of batch limit and concurrency)")
        ax.grid(alpha=0.3, which="both")
    ax_tok.set_ylabel("output tokens/s")
    ax_tpot.set_ylabel("p99 TPOT (ms)")
    if math.isfinite(tokens_max) and tokens_max > 0:
        ax_tok.set_ylim(0, tokens_max * 1.6)
    else:
        ax_tok.set_ylim(bottom=0)
    ax_tpot.set_ylim(bottom=0)
    ax_tok.legend(loc="upper left", fontsize=7, framealpha=0.85)
    ax_tpot.legend(loc="upper left", fontsize=7, framealpha=0.85)


def batch_figure(report: CurveReport) -> Any:
    """The figure of ``curve_by_batch.png`` (the caller closes it: :func:`to_png`)."""
    fig, (ax_tok, ax_tpot) = new_figure(ncols=2, figsize=(11, 4.6), dpi=110)
    got = draw_run(ax_tok, ax_tpot, report, color="#1b7837")
    finish_axes(ax_tok, ax_tpot, report.slo.tpot_p99_s, tokens_max=got["tokens_max"])
    fig.suptitle(
        f"{report.model or 'model'} on {report.hardware or 'device'}: the curve by batch"
        " (error bars: 95% from each point's request count)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def batch_png(report: CurveReport) -> bytes:
    """``curve_by_batch.png`` of one run."""
    return to_png(batch_figure(report))
