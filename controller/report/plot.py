"""``curve.png``: tokens/s against p99 TPOT, measured and predicted (matplotlib)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from controller.report.figure import declutter, new_figure, to_png

if TYPE_CHECKING:
    from controller.report.curve import CurveReport


def _ms(seconds: float) -> float:
    return seconds * 1e3 if math.isfinite(seconds) else math.nan


def plot_png(report: CurveReport) -> bytes:
    """``curve.png``."""
    return to_png(curve_figure(report))


def curve_figure(report: CurveReport) -> Any:
    """tokens/s against p99 TPOT: measured trials, the predicted curve, knee, SLO, the
    choice (the caller closes it: ``figure.to_png``). Point labels that would overlap
    another label or the legend are left out (``figure.declutter``): the chosen point's box
    and the knee's first, then the trials' in order, then the roofline's batches."""
    fig, ax = new_figure(figsize=(9, 5.6), dpi=110)
    fixed: list[Any] = []  # labels that stay
    trial_labels: list[Any] = []
    roof_labels: list[Any] = []
    pred = sorted(report.predicted, key=lambda p: p.batch)
    if pred:
        ax.plot(
            [_ms(p.tpot_s) for p in pred],
            [p.tokens_per_s for p in pred],
            "-",
            color="#7a7a7a",
            lw=1.6,
            label="roofline prediction",
        )
        for p in pred[:: max(1, len(pred) // 8)]:
            roof_labels.append(
                ax.annotate(
                    f"B={p.batch}",
                    (_ms(p.tpot_s), p.tokens_per_s),
                    fontsize=7,
                    color="#7a7a7a",
                    xytext=(3, -10),
                    textcoords="offset points",
                )
            )
    knee = report.predicted_at(report.knee_batch) if report.knee_batch else None
    if knee is not None:
        ax.plot([_ms(knee.tpot_s)], [knee.tokens_per_s], "D", color="#555", ms=8)
        ridge = report.ridge_flops_per_byte
        fixed.append(
            ax.annotate(
                f"knee B≈{report.knee_batch}" + (f"\nridge {ridge:.0f} FLOP/B" if ridge else ""),
                (_ms(knee.tpot_s), knee.tokens_per_s),
                fontsize=8,
                xytext=(8, 8),
                textcoords="offset points",
            )
        )
    trial_labels += _draw_trials(ax, report)
    ax.axvline(
        _ms(report.slo.tpot_p99_s),
        color="#2166ac",
        ls="--",
        lw=1.2,
        label=f"p99 TPOT SLO {_ms(report.slo.tpot_p99_s):.0f} ms",
    )
    op = report.operating_point()
    if op is not None:
        cost = op["usd_per_million_tokens"]
        text = f"chosen B={op['max_batch_size']}, C={op['max_concurrency']}\n"
        text += f"{op['tokens_per_s']:.0f} tok/s, {op['goodput_rps']:.2f} req/s"
        if math.isfinite(cost):
            text += f"\n${cost:.3g} per 1M tokens"
        ax.scatter(
            [op["p99_tpot_ms"]],
            [op["tokens_per_s"]],
            s=220,
            facecolors="none",
            edgecolors="#2166ac",
            linewidths=2,
            zorder=4,
        )
        fixed.append(
            ax.annotate(
                text,
                (op["p99_tpot_ms"], op["tokens_per_s"]),
                fontsize=9,
                xytext=(-150, 18),
                textcoords="offset points",
                arrowprops={"arrowstyle": "->", "color": "#2166ac"},
                bbox={"boxstyle": "round", "fc": "white", "ec": "#2166ac"},
            )
        )
    ax.set_xlabel("p99 TPOT (ms per output token); measured points labelled batch/concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"{report.model or 'model'} on {report.hardware or 'device'}: throughput against latency"
    )
    _scale_axes(ax, report)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    fig.tight_layout()
    declutter(fig, trial_labels + roof_labels, keep=fixed)
    return fig


# role → (marker, legend words); production windows are drawn apart (open squares)
_ROLE_MARKS = {"search": ("o", "measured"), "sweep": ("D", "curve sweep")}


def _draw_trials(ax: Any, report: CurveReport) -> list[Any]:
    """The windows as points, by role and verdict; returns their batch/concurrency labels."""
    labels = []
    for role, (marker, what) in _ROLE_MARKS.items():
        for feasible, color, verdict in (
            (True, "#1a9850", "meets SLO"),
            (False, "#d73027", "misses SLO"),
        ):
            pts = [
                t
                for t in report.trials
                if t.role == role
                and t.feasible is feasible
                and math.isfinite(t.p99_tpot_ms)
                and t.tokens_per_s > 0
            ]
            if not pts:
                continue
            ax.scatter(
                [t.p99_tpot_ms for t in pts],
                [t.tokens_per_s for t in pts],
                s=36,
                marker=marker,
                color=color,
                edgecolor="black",
                linewidths=0.4,
                zorder=3,
                label=f"{what}, {verdict}",
            )
            for t in pts:
                labels.append(
                    ax.annotate(
                        f"{t.max_batch_size}/{t.max_concurrency}",
                        (t.p99_tpot_ms, t.tokens_per_s),
                        fontsize=7,
                        color=color,
                        xytext=(5, 4),
                        textcoords="offset points",
                    )
                )
    prod = [
        t
        for t in report.trials
        if t.role == "production" and math.isfinite(t.p99_tpot_ms) and t.tokens_per_s > 0
    ]
    if prod:
        ax.scatter(
            [t.p99_tpot_ms for t in prod],
            [t.tokens_per_s for t in prod],
            s=44,
            marker="s",
            facecolors="none",
            edgecolors="#555555",
            linewidths=1.2,
            zorder=3,
            label="production windows (passive)",
        )
    return labels


def _scale_axes(ax: Any, report: CurveReport) -> None:
    """Linear from 0 when the prediction and the measurements are of one size; log-log when
    they are decades apart (a tiny model far below its roofline), so both stay readable."""
    xs = [_ms(p.tpot_s) for p in report.predicted]
    ys = [p.tokens_per_s for p in report.predicted]
    xs += [t.p99_tpot_ms for t in report.trials] + [_ms(report.slo.tpot_p99_s)]
    ys += [t.tokens_per_s for t in report.trials]
    xs = [x for x in xs if math.isfinite(x) and x > 0]
    ys = [y for y in ys if math.isfinite(y) and y > 0]
    if xs and max(xs) / min(xs) > 30:
        ax.set_xscale("log")
    else:
        ax.set_xlim(left=0)
    if ys and max(ys) / min(ys) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
