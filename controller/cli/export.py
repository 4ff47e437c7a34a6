"""``slotune export``: rebuild a tune run's report files from its stored Optuna study."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from controller.cli import flags
from controller.cli.paths import file_error, output_dir, study_storage
from controller.errors import BadInput, NoFeasiblePoint, Undecided
from controller.report.undecided import undecided_summary

DEFAULT_URL_OUT = Path("slotune-out/export")  # where a study held at a URL is exported


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
    from controller.tune_study import report_from_study

    flags.price("--price-per-hour", price_per_hour)
    study_storage("STUDY", study, must_exist=True)
    is_url = "://" in study
    out_dir = output_dir("--out", out or (Path(study).parent if not is_url else DEFAULT_URL_OUT))
    try:
        report = report_from_study(study, study_name)
    except OSError as e:
        raise file_error("STUDY", study, e, "read") from None
    except (ValueError, KeyError) as e:
        raise BadInput(f"STUDY {study}: {e}") from None
    if price_per_hour is not None:
        meta = {**report.meta, "price": "--price-per-hour (given to export)"}
        report = replace(report, usd_per_hour=price_per_hour, meta=meta)
    try:
        paths = write_report(report, out_dir)
    except OSError as e:
        raise file_error("--out", out_dir, e) from None
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
    if report.chosen is None and (cand := report.undecided()) is not None:
        raise Undecided(
            f"the study's {len(report.trials)} trials; {undecided_summary(cand, report.slo)}"
        )
    if report.chosen is None:
        raise NoFeasiblePoint(f"the study's {len(report.trials)} trials hold no feasible point")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
