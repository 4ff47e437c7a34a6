"""``slotune export``: rebuild a tune run's report files from its stored Optuna study."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import typer

from controller.errors import BadInput, NoFeasiblePoint


def export(
    study: str = typer.Argument(..., help="Optuna study storage: a journal file or a URL."),
    study_name: str = typer.Option(
        None, "--study-name", help="Study name (if the storage holds several)."
    ),
    out: Path = typer.Option(None, "--out", help="Default: the journal file's folder."),
    price_per_hour: float = typer.Option(
        None, "--price-per-hour", help="USD per device-hour (default: the one tune used)."
    ),
) -> None:
    """Rebuild curve.csv, curve.json, curve.png and report.html from a stored study."""
    from controller.report.files import write_report
    from controller.tune import report_from_study

    if "://" not in study and not Path(study).exists():
        raise BadInput(f"STUDY {study}: no such file (give a journal file or an Optuna URL)")
    try:
        report = report_from_study(study, study_name)
    except (ValueError, KeyError) as e:
        raise BadInput(str(e)) from None
    if price_per_hour is not None:
        if not (math.isfinite(price_per_hour) and price_per_hour >= 0):
            raise BadInput(f"--price-per-hour {price_per_hour!r}: must be a number >= 0")
        meta = {**report.meta, "price": "--price-per-hour (given to export)"}
        report = replace(report, usd_per_hour=price_per_hour, meta=meta)
    out_dir = out or (Path(study).parent if "://" not in study else Path("slotune-out/export"))
    paths = write_report(report, out_dir)
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
    if report.chosen is None:
        raise NoFeasiblePoint(f"the study's {len(report.trials)} trials hold no feasible point")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
