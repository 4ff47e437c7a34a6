"""``slotune export``: rebuild a tune run's report files from its stored Optuna study."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from controller.cli import flags
from controller.cli.paths import file_error, input_file, output_dir, study_storage
from controller.errors import BadInput, NoFeasiblePoint, Undecided
from controller.report.undecided import undecided_summary

if TYPE_CHECKING:
    from controller.report.curve import CurveReport

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
    control_log: list[Path] = typer.Option(
        [],
        "--control-log",
        metavar="AUDIT.jsonl",
        help="A `slotune control` audit log: its windows are drawn as production points "
        "(never chosen). Repeatable.",
    ),
) -> None:
    """Rebuild curve.csv, curve.json, the two plots and report.html from a stored study."""
    from controller.report.files import write_report
    from controller.tune_study import report_from_study

    flags.price("--price-per-hour", price_per_hour)
    study_storage("STUDY", study, must_exist=True)
    for log_path in control_log:
        input_file("--control-log", log_path)
    is_url = "://" in study
    out_dir = output_dir("--out", out or (Path(study).parent if not is_url else DEFAULT_URL_OUT))
    try:
        report = report_from_study(study, study_name)
    except OSError as e:
        raise file_error("STUDY", study, e, "read") from None
    except (ValueError, KeyError) as e:
        raise BadInput(f"STUDY {study}: {e}") from None
    study_trials = len(report.searched)  # the exit code is the search's, whatever is merged
    if control_log:
        report = _merge_production(report, control_log)
    if price_per_hour is not None:
        meta = {**report.meta, "price": "--price-per-hour (given to export)"}
        report = replace(report, usd_per_hour=price_per_hour, meta=meta)
    try:
        paths = write_report(report, out_dir)
    except OSError as e:
        raise file_error("--out", out_dir, e) from None
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
    if report.chosen is None and (cand := report.undecided()) is not None:
        raise Undecided(f"the study's {study_trials} trials; {undecided_summary(cand, report.slo)}")
    if report.chosen is None:
        raise NoFeasiblePoint(f"the study's {study_trials} trials hold no feasible point")


def _merge_production(report: CurveReport, logs: list[Path]) -> CurveReport:
    """The report with each audit log's windows added as production trials, numbered after
    the study's; says what each log gave."""
    from controller.report.production import production_records

    trials = list(report.trials)
    for path in logs:
        first = max((t.number for t in trials), default=-1) + 1
        try:
            got = production_records(path, slo=report.slo, first_number=first)
        except OSError as e:
            raise file_error("--control-log", path, e, "read") from None
        except ValueError as e:  # a line that is not an audit line: file, line and why
            raise BadInput(f"--control-log {e}") from None
        trials += got.records
        typer.echo(got.summary())
    return report.with_trials(trials)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
