"""The exported files of a report: ``curve.csv``, ``curve.json``, ``curve.png`` and
``report.html``, written by :func:`write_report` from a
:class:`~controller.report.curve.CurveReport`."""

from __future__ import annotations

import base64
import csv
import json
import logging
import math
from dataclasses import asdict, fields
from pathlib import Path

from controller.report.batch_plot import batch_png
from controller.report.curve import CurveReport
from controller.report.html import render_html
from controller.report.plot import plot_png
from controller.report.records import TrialRecord

log = logging.getLogger(__name__)

FILES = ("curve.csv", "curve.json", "curve.png", "curve_by_batch.png", "report.html")
# The tuner's predicted p99 TPOT as the report resolves it (recorded, else its model curve).
CSV_COLUMNS = [
    f.name for f in fields(TrialRecord) if f.name not in ("evidence", "predicted_tpot_s")
] + ["predicted_p99_tpot_ms", "roofline_fraction"]


def write_csv(report: CurveReport, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for t in report.trials:
            row = {
                **asdict(t),
                "predicted_p99_tpot_ms": report.predicted_tpot_s(t) * 1e3,
                "roofline_fraction": report.roofline_fraction(t),
            }
            row.pop("evidence", None)
            row.pop("predicted_tpot_s", None)
            w.writerow(
                {k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            )


def write_report(report: CurveReport, out_dir: str | Path) -> dict[str, Path]:
    """Write the report's files (:data:`FILES`) into ``out_dir`` (created); returns their
    paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    write_csv(report, paths["curve.csv"])
    paths["curve.json"].write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n")
    png = plot_png(report)
    paths["curve.png"].write_bytes(png)
    by_batch = batch_png(report)
    paths["curve_by_batch.png"].write_bytes(by_batch)
    html = render_html(
        report,
        png_b64=base64.b64encode(png).decode("ascii"),
        batch_png_b64=base64.b64encode(by_batch).decode("ascii"),
    )
    paths["report.html"].write_text(html, encoding="utf-8")
    log.info("report written to %s", out)
    return paths
