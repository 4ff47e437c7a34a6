"""``report.html``: one self-contained page (inline CSS, the plot as a base64 PNG) and the
plain-language explanation of the result."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.report.curve import CurveReport
    from controller.report.records import TrialRecord


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;
max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.6em}
.sub{color:#666;margin-top:0}
.box{border:2px solid #2166ac;border-radius:8px;padding:.8em 1.2em;background:#f4f8fc}
.box.bad{border-color:#d73027;background:#fdf3f2}
table{border-collapse:collapse;font-size:.85em;width:100%}
th,td{border-bottom:1px solid #ddd;padding:.3em .45em;text-align:right}
th{background:#f0f0f0;position:sticky;top:0}
td.l,th.l{text-align:left}tr.ok td{background:#eef8ee}tr.chosen td{background:#cfe8cf;
font-weight:600}tr.no td{color:#a33}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em}dt{color:#666}
img{max-width:100%;border:1px solid #ddd}
"""


def _f(x: Any, fmt: str = ".1f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, fmt)


def explain(report: CurveReport) -> list[str]:
    """The recommendation and why, in plain sentences."""
    from controller.report.cost import cost_sentence

    slo = report.slo
    lines: list[str] = []
    if not report.predicted and report.seed_note:
        lines.append(f"No roofline prediction: {report.seed_note}")
    if report.backend.get("applied") is False:
        lines.append(
            "slotune could not change this server's configuration: the limits below are "
            "recommendations measured at each client concurrency, not applied; set them in "
            "the server's own configuration."
        )
    restarts = int(report.backend.get("restarts") or 0)
    if restarts:
        lines.append(
            f"The batch limit restarts the replicas: the search changed it {restarts} "
            f"time(s), {float(report.backend.get('restart_s') or 0):.0f} s of restarts in all "
            "(counted in the trials' wall time)."
        )
    if report.knee_batch:
        ridge = (
            f" (the device's ridge point is {report.ridge_flops_per_byte:.0f} FLOP/byte)"
            if report.ridge_flops_per_byte
            else ""
        )
        lines.append(
            f"The roofline puts the knee of the curve near batch {report.knee_batch}{ridge}: "
            "below it a decode step costs about the same at any batch (reading the weights "
            "dominates), so more sequences give more tokens/s almost for free; above it each "
            "extra sequence adds step time, so tokens/s flattens while TPOT grows."
        )
    cut = report.slo_cut_predicted()
    if cut is not None:
        lines.append(
            f"The p99 TPOT SLO of {slo.tpot_p99_s * 1e3:.0f} ms cuts the predicted curve at "
            f"batch {cut.batch} ({cut.tokens_per_s:.0f} tokens/s predicted)."
        )
    feasible = [t for t in report.searched if t.feasible]
    if feasible:
        big = max(feasible, key=lambda t: t.max_batch_size)
        lines.append(
            f"Measured, the largest batch limit that met both p99 SLOs (TTFT "
            f"{slo.ttft_p99_s * 1e3:.0f} ms, TPOT {slo.tpot_p99_s * 1e3:.0f} ms) was "
            f"{big.max_batch_size} ({len(feasible)} of {len(report.searched)} search trials met"
            " them)."
        )
    c = report.chosen
    if c is None:
        lines.append(
            f"No configuration tried met both SLOs with enough samples to say so "
            f"({len(report.searched)} trials). Do not ship: relax the SLO, add capacity, or "
            "look at the table below for the closest miss."
        )
        if report.sample_hint():
            lines.append(report.sample_hint())
        return lines
    rec = (
        f"Recommended: max_batch_size={c.max_batch_size}, max_concurrency={c.max_concurrency}. "
        f"It served {c.goodput_rps:.2f} requests/s within both SLOs and {c.tokens_per_s:.0f} "
        f"output tokens/s, with p99 TTFT {_f(c.p99_ttft_ms)} ms (n={c.ttft_samples}) and "
        f"p99 TPOT {_f(c.p99_tpot_ms)} ms (n={c.tpot_samples})."
    )
    rec += " " + cost_sentence(
        report.usd_per_hour, c.tokens_per_s, str(report.meta.get("price", ""))
    )
    lines.append(rec)
    op = report.operating_point() or {}
    n, met = op.get("measurements", 1), op.get("met_windows", 0)
    if op.get("confirmed"):
        lines.append(
            f"It was measured in {n} windows ({met} of them met both SLOs on their own); "
            "on their pooled requests both p99s are within the SLO, which is how the tuner "
            f"declares a point (at least {report.confirmations} windows)."
        )
    else:
        lines.append(
            f"Caution: it was measured in only {n} window(s), fewer than the "
            f"{report.confirmations} the tuner needs to declare a point (the run ended "
            "first); re-measure it before shipping."
        )
    frac = report.roofline_fraction(c)
    if math.isfinite(frac):
        lines.append(
            f"The measurement reaches {frac:.0%} of the roofline's tokens/s at that batch; "
            "the rest is what the implementation leaves on the table (kernels, Python, "
            "scheduling, HTTP)."
        )
    if math.isfinite(c.client_p99_tpot_ms) and math.isfinite(c.p99_tpot_ms) and c.p99_tpot_ms:
        lines.append(
            f"Cross-check: the load generator measured p99 TPOT {c.client_p99_tpot_ms:.1f} ms "
            f"and p99 TTFT {_f(c.client_p99_ttft_ms)} ms on the client side "
            f"({(c.client_p99_tpot_ms / c.p99_tpot_ms - 1):+.0%} TPOT against the server's "
            "metrics; the client adds network and HTTP time)."
        )
    x = report.cross_check()
    if x["median_p99_tpot_rel_diff"] is not None:
        ttft = x["median_p99_ttft_rel_diff"]
        lines.append(
            f"Over {x['trials']} trials the client-side p99s differ from the server-side ones "
            f"by a median {x['median_p99_tpot_rel_diff']:+.0%} (TPOT)"
            + (f" and {ttft:+.0%} (TTFT)" if ttft is not None else "")
            + "."
        )
    return lines


def _row(report: CurveReport, t: TrialRecord, chosen: TrialRecord | None) -> str:
    cls = "chosen" if t is chosen else ("ok" if t.feasible else "no")
    cells = [
        str(t.number),
        t.role,
        str(t.max_batch_size),
        str(t.max_concurrency),
        _f(t.tokens_per_s, ".0f"),
        _f(t.goodput_rps, ".2f"),
        _f(t.p50_ttft_ms),
        _f(t.p99_ttft_ms),
        _f(t.p50_tpot_ms),
        _f(t.p99_tpot_ms),
        _f(report.predicted_tpot_s(t) * 1e3),
        f"{t.ttft_verdict}/{t.tpot_verdict}",
        f"{t.ttft_samples}/{t.tpot_samples}",
        _f(report.roofline_fraction(t), ".0%"),
        _f(t.client_p99_tpot_ms),
        _f(t.wall_s, ".0f"),
    ]
    tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
    return f'<tr class="{cls}">{tds}<td class="l">{html.escape(t.note)}</td></tr>'


def _pairs(items: Mapping[str, Any]) -> str:
    """``<dt>key</dt><dd>value</dd>`` for each item, escaped."""
    return "".join(
        f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(str(v))}</dd>" for k, v in items.items()
    )


def curve_sentences(report: CurveReport) -> list[str]:
    """What the measured curve says against the predicted one, in plain sentences."""
    from controller.report.measured import measured_curve, measured_knee, measured_slo_cut

    canary = measured_curve(report.trials, report.slo)
    sweep = [t for t in report.trials if t.role == "sweep"]
    prod = [t for t in report.trials if t.role == "production"]
    lines = []
    if canary:
        lo, hi = canary[0].batch, canary[-1].batch
        lines.append(
            f"Measured at {len(canary)} batches from B={lo} to B={hi}"
            + (
                f" ({len(sweep)} of the windows were the curve sweep after the search,"
                f" {sum(t.wall_s for t in sweep if math.isfinite(t.wall_s)):.0f} s)"
                if sweep
                else " (the search's trials only: give --curve-points N for a sweep)"
            )
            + ". Error bars are 95% intervals from each point's request count."
        )
    knee = measured_knee(canary)
    if knee is not None:
        pred = f" (the roofline's: B≈{report.knee_batch})" if report.knee_batch else ""
        lines.append(
            f"Measured, tokens/s reaches half its ceiling at B≈{knee:.0f}{pred}, where each"
            " sequence's share of a step equals the fixed cost of reading the weights: below"
            " it more sequences come almost free, above it tokens/s flattens while TPOT grows."
        )
    elif canary:
        lines.append("The measurements do not locate a knee (fewer than three batches, or flat).")
    cut, why = measured_slo_cut(canary, report.slo)
    predicted = report.slo_cut_predicted()
    pred_cut = f"; the roofline predicted B={predicted.batch}" if predicted else ""
    if cut is not None:
        lines.append(f"The measured p99 TPOT crosses the SLO at B≈{cut:.0f}{pred_cut}.")
    elif canary:
        lines.append(f"Where the SLO cuts the measured curve is not known: {why}{pred_cut}.")
    if prod:
        lines.append(
            f"{len(prod)} production windows (slotune control's audit log) are drawn as open "
            "squares at the batch production ran; they are passive observations, never used "
            "to choose the operating point."
        )
    return lines


def render_html(report: CurveReport, *, png_b64: str, batch_png_b64: str = "") -> str:
    slo = report.slo
    chosen = report.chosen
    heads = (
        "trial,measured for,batch,conc.,tok/s,goodput req/s,p50 TTFT ms,p99 TTFT ms,p50 TPOT ms,"
        "p99 TPOT ms,predicted p99 TPOT ms,verdicts TTFT/TPOT,samples,of roofline,"
        "client p99 TPOT ms,wall s"
    ).split(",")
    head = "".join(f"<th>{h}</th>" for h in heads) + '<th class="l">note</th>'
    rows = "\n".join(_row(report, t, chosen) for t in report.trials)
    by_batch = ""
    if batch_png_b64:
        said = "".join(f"<p>{html.escape(s)}</p>" for s in curve_sentences(report))
        by_batch = (
            f'<h2>The curve by batch</h2>{said}<img alt="tokens/s and p99 TPOT against batch:'
            f' measured with error bars, roofline prediction, knees, SLO cut"'
            f' src="data:image/png;base64,{batch_png_b64}">'
        )
    why = "".join(f"<p>{html.escape(s)}</p>" for s in explain(report))
    hw = _pairs(report.hardware_detail)
    meta = _pairs(report.meta)
    backend = _pairs(report.backend)
    box = "box" if chosen is not None else "box bad"
    title = "Operating point found" if chosen is not None else "No feasible operating point"
    price = (
        f"${report.usd_per_hour:g}/h"
        if report.usd_per_hour is not None
        else "not given (no cost: give --price-per-hour)"
    )
    who = f"{html.escape(report.model or 'model')} on {html.escape(report.hardware or 'device')}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>slotune report: {html.escape(report.model)} on {html.escape(report.hardware)}</title>
<style>{CSS}</style></head>
<body>
<h1>slotune: {who}</h1>
<p class="sub">SLO: p{slo.quantile * 100:g} TTFT ≤ {slo.ttft_p99_s * 1e3:g} ms,
p{slo.quantile * 100:g} TPOT ≤ {slo.tpot_p99_s * 1e3:g} ms · price {price} ·
{len(report.searched)} trials · {html.escape(report.stop_reason)}</p>
<div class="{box}"><h2 style="margin-top:.2em">{title}</h2>{why}</div>
<h2>Throughput against latency</h2>
<img alt="tokens/s against p99 TPOT: measured trials, roofline prediction, SLO line, chosen point"
 src="data:image/png;base64,{png_b64}">
{by_batch}
<h2>Trials</h2>
<table><thead><tr>{head}</tr></thead><tbody>
{rows}
</tbody></table>
<h2>Hardware and model</h2>
<dl><dt>model</dt><dd>{html.escape(report.model)}</dd>
<dt>hardware</dt><dd>{html.escape(report.hardware)}</dd>{hw}
<dt>knee (roofline)</dt><dd>{_f(report.knee_batch, "d")}</dd>
<dt>ridge point</dt><dd>{_f(report.ridge_flops_per_byte, ".0f")} FLOP/byte</dd>
<dt>predicted operating point (the seed)</dt><dd>batch {_f(report.predicted_batch, "d")}</dd>
<dt>roofline seed</dt><dd>{html.escape(report.seed_note or "–")}</dd>{backend}
</dl>
<h2>Run</h2><dl>{meta}</dl>
</body></html>
"""
