"""The roofline's PNG: tokens/s against TPOT, with the knee, the SLO and the operating point."""

from __future__ import annotations

import logging
from pathlib import Path

from search.roofline.operating_point import RooflineAnalysis

logger = logging.getLogger(__name__)


def plot_analysis(analysis: RooflineAnalysis, path: str | Path) -> Path:
    """Draw the curve to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = analysis.roofline
    pts = analysis.curve
    x = [p.tpot_s * 1e3 for p in pts]
    y = [p.tokens_per_s for p in pts]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    fits = [p for p in pts if p.fits]
    over = [p for p in pts if not p.fits]
    ax.plot(
        [p.tpot_s * 1e3 for p in fits],
        [p.tokens_per_s for p in fits],
        color="tab:blue",
        lw=2,
        label="predicted decode (B = 1 ..)",
    )
    if over:
        ax.plot(
            [p.tpot_s * 1e3 for p in over],
            [p.tokens_per_s for p in over],
            color="tab:blue",
            lw=1,
            ls=":",
            label="KV cache does not fit",
        )
    for b in (1, 8, 32, 128, 512):
        if b <= len(pts):
            p = pts[b - 1]
            ax.annotate(
                f"B={b}",
                (p.tpot_s * 1e3, p.tokens_per_s),
                fontsize=7,
                color="gray",
                xytext=(4, -10),
                textcoords="offset points",
            )
    knee = r.knee_batch
    if knee <= len(pts):
        k = pts[knee - 1]
        why = "compute bound" if r.knee_bound == "compute" else "KV reads = weight reads"
        ax.scatter(
            [k.tpot_s * 1e3],
            [k.tokens_per_s],
            s=60,
            color="tab:orange",
            zorder=5,
            label=f"knee B={knee} ({why})",
        )
    slo_ms = analysis.slo_tpot_s * 1e3
    ax.axvline(slo_ms, color="tab:red", ls="--", lw=1.2, label=f"SLO TPOT {slo_ms:g} ms")
    op = analysis.operating_point
    if op is not None:
        ax.scatter(
            [op.tpot_s * 1e3],
            [op.tokens_per_s],
            s=160,
            marker="*",
            color="tab:green",
            zorder=6,
            label=f"operating point B={op.batch}, {op.tokens_per_s:,.0f} tok/s",
        )
        if op.limited_by == "memory":
            ax.annotate(
                "KV cache full",
                (op.tpot_s * 1e3, op.tokens_per_s),
                xytext=(8, 4),
                textcoords="offset points",
                fontsize=8,
                color="tab:green",
            )
    ax.set_xlabel("TPOT (ms per output token)")
    ax.set_ylabel("output tokens / s (all sequences)")
    ax.set_xlim(left=0, right=max(max(x), slo_ms) * 1.08)
    ax.set_ylim(bottom=0, top=max(y) * 1.1)
    cal = ", calibrated" if r.calibrated else ""
    ax.set_title(
        f"{r.model.name} on {r.tp} x {r.hardware.name} ({r.dtype}{cal}), context {r.context}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out
