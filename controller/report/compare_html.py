"""The files of ``slotune compare``: ``compare.json``, ``compare.png`` (both runs' curves by
batch) and ``compare.html`` (the verdict, the operating points with their intervals, the
tests and the picture, on one page)."""

from __future__ import annotations

import base64
import html
import json
import logging
import math
from pathlib import Path
from typing import Any

from controller.report.batch_plot import draw_run, finish_axes
from controller.report.compare import Comparison
from controller.report.figure import new_figure, to_png
from controller.report.html import CSS

log = logging.getLogger(__name__)

FILES = ("compare.json", "compare.png", "compare.html")
COLORS = ("#2166ac", "#b2182b")  # A, B


def compare_figure(c: Comparison, labels: tuple[str, str]) -> Any:
    """The figure of ``compare.png`` (the caller closes it: ``figure.to_png``)."""
    fig, (ax_tok, ax_tpot) = new_figure(ncols=2, figsize=(11, 4.8), dpi=110)
    top = math.nan
    for report, color, label in zip((c.report_a, c.report_b), COLORS, labels, strict=True):
        got = draw_run(ax_tok, ax_tpot, report, color=color, label=label, annotate=False)
        top = max(top, got["tokens_max"]) if math.isfinite(top) else got["tokens_max"]
    finish_axes(ax_tok, ax_tpot, c.report_a.slo.tpot_p99_s, tokens_max=top)
    fig.suptitle(
        f"{labels[0]} against {labels[1]}: {c.verdict()} (error bars: 95% from request"
        " counts; stars: operating points)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _cell(iv: dict[str, Any] | None, fmt: str) -> str:
    if not iv or iv.get("value") is None:
        return "–"
    v = format(iv["value"], fmt)
    lo, hi = iv.get("low"), iv.get("high")
    if lo is None or hi is None:
        return v
    return f"{v} <span class=ci>({format(lo, fmt)} – {format(hi, fmt)})</span>"


def _points_table(d: dict[str, Any]) -> str:
    rows = [
        ("knobs", lambda s: f"B={s['max_batch_size']}, C={s['max_concurrency']}"),
        ("goodput, req/s within SLO", lambda s: _cell(s["goodput_rps"], ".3g")),
        ("output tokens/s", lambda s: _cell(s["tokens_per_s"], ".4g")),
        ("$ per million tokens", lambda s: _cell(s["usd_per_million_tokens"], ".3g")),
        ("p99 TPOT, ms", lambda s: _cell(s["p99_tpot_ms"], ".1f")),
        ("p99 TTFT, ms", lambda s: _cell(s["p99_ttft_ms"], ".0f")),
        ("windows, s measured", lambda s: f"{s['windows']}, {s['window_s']:.0f}"),
        ("requests (SLO met)", lambda s: f"{s['completed']} ({s['slo_met']})"),
    ]
    a, b = d.get("a"), d.get("b")
    head = "<tr><th class=l></th><th>A</th><th>B</th></tr>"
    body = ""
    for name, f in rows:
        cells = "".join(f"<td>{f(s) if s else 'no operating point'}</td>" for s in (a, b))
        body += f"<tr><td class=l>{html.escape(name)}</td>{cells}</tr>"
    return f"<table>{head}{body}</table>"


def _tests_table(d: dict[str, Any]) -> str:
    if not d["tests"]:
        return ""
    rows = "".join(
        f"<tr><td class=l>{html.escape(t['name'])}</td><td class=l>{html.escape(t['question'])}"
        f"</td><td>{'–' if t['statistic'] is None else format(t['statistic'], '.3f')}</td>"
        f"<td>{'–' if t['p_value'] is None else format(t['p_value'], '.2g')}</td>"
        f"<td>{'yes' if t['rejected'] else 'no'}</td>"
        f"<td class=l>{html.escape(t['detail'])}</td></tr>"
        for t in d["tests"]
    )
    head = (
        "<tr><th class=l>test</th><th class=l>question</th><th>statistic</th><th>p</th>"
        "<th>rejected</th><th class=l>detail</th></tr>"
    )
    return f"<table>{head}{rows}</table>"


def render_compare_html(c: Comparison, labels: tuple[str, str], png_b64: str) -> str:
    d = c.to_dict()
    m = d["method"]
    box = "box bad" if c.worse or not c.comparable else "box"
    reasons = "".join(f"<p>{html.escape(r)}</p>" for r in c.reasons)
    notes = "".join(f"<p class=sub>{html.escape(n)}</p>" for n in c.notes)
    runs = "".join(
        f"<dt>{k.upper()}: {html.escape(lab)}</dt><dd>{html.escape(r['model'])} on "
        f"{html.escape(r['hardware'])}, {r['trials']} search trials; "
        f"{html.escape(r['stop_reason'] or '')}</dd>"
        for (k, r), lab in zip(d["runs"].items(), labels, strict=True)
    )
    method = (
        f"Three one-sided tests, each at {m['per_test_level']:.3g} ({m['correction']}: "
        f"α = {m['alpha']:g} for the whole verdict). Goodput: {m['goodput_test']}, margin "
        f"{m['goodput_margin']:.0%}. Latency: {m['latency_test']}; effect size "
        f"{m['latency_effect']:g} (0.5: no difference). Intervals are 95%: goodput and "
        "tokens/s exact Poisson on the request counts, p99s from order statistics of the "
        "pooled histograms."
    )
    slo = d["slo"]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>slotune compare: {html.escape(labels[0])} against {html.escape(labels[1])}</title>
<style>{CSS}.ci{{color:#666;font-size:.9em}}</style></head>
<body>
<h1>slotune compare: is B worse than A?</h1>
<p class="sub">SLO: p{slo["quantile"] * 100:g} TTFT ≤ {slo["ttft_p99_ms"]:g} ms,
p{slo["quantile"] * 100:g} TPOT ≤ {slo["tpot_p99_ms"]:g} ms</p>
<dl>{runs}</dl>
<div class="{box}"><h2 style="margin-top:.2em">{html.escape(c.verdict())}</h2>{reasons}{notes}
</div>
<h2>Operating points (95% intervals)</h2>
{_points_table(d)}
<h2>The curves by batch</h2>
<img alt="tokens/s and p99 TPOT against batch for both runs, operating points as stars"
 src="data:image/png;base64,{png_b64}">
<h2>Tests</h2>
<p>{html.escape(method)}</p>
{_tests_table(d)}
</body></html>
"""


def write_compare(c: Comparison, labels: tuple[str, str], out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    d = c.to_dict()
    d["labels"] = {"a": labels[0], "b": labels[1]}
    paths["compare.json"].write_text(json.dumps(d, indent=2, allow_nan=False) + "\n")
    png = to_png(compare_figure(c, labels))
    paths["compare.png"].write_bytes(png)
    page = render_compare_html(c, labels, base64.b64encode(png).decode("ascii"))
    paths["compare.html"].write_text(page, encoding="utf-8")
    log.info("comparison written to %s", out)
    return paths
