"""``slotune compare RUN_A RUN_B``: is B's operating point worse than A's, beyond noise?

Exit code 0 when B is not worse, 5 when it is (a pipeline gates a rollout on it), 6 when
neither run has an operating point, 2 on bad input."""

from __future__ import annotations

from pathlib import Path

import typer

from controller.cli.paths import file_error, output_dir
from controller.errors import BadInput, NotComparable, Worse
from controller.report.compare import ALPHA, EFFECT, MARGIN


def _run(flag: str, path: Path) -> object:
    from controller.report.compare import load_run, run_file

    f = run_file(path)
    if not f.is_file():
        raise BadInput(
            f"{flag} {path}: no exported run there (give the folder slotune tune or export "
            "wrote, or its curve.json)"
        )
    try:
        return load_run(f)
    except OSError as e:
        raise file_error(flag, f, e, "read") from None
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{flag} {f}: not a slotune curve.json ({e})") from None


def compare(
    run_a: Path = typer.Argument(..., help="The baseline run: its folder or curve.json."),
    run_b: Path = typer.Argument(..., help="The candidate run: its folder or curve.json."),
    out: Path = typer.Option(
        Path("slotune-out/compare"), "--out", help="Where compare.html/json/png go."
    ),
    alpha: float = typer.Option(ALPHA, "--alpha", help="False-alarm rate of the verdict."),
    margin: float = typer.Option(
        MARGIN, "--margin", help="Goodput loss tolerated as noise (0.1: 10%)."
    ),
    effect: float = typer.Option(
        EFFECT, "--effect", help="P(B slower) a latency must exceed (0.5: any)."
    ),
    label_a: str = typer.Option(None, "--label-a", help="Name of A (default: its folder)."),
    label_b: str = typer.Option(None, "--label-b", help="Name of B (default: its folder)."),
) -> None:
    """Compare two exported runs' operating points; exit 5 when B is worse beyond noise."""
    from controller.report.compare import compare as judge
    from controller.report.compare import describe_point
    from controller.report.compare_html import write_compare

    ra, rb = _run("RUN_A", run_a), _run("RUN_B", run_b)
    labels = (label_a or _name(run_a), label_b or _name(run_b))
    try:
        c = judge(ra, rb, labels=labels, alpha=alpha, margin=margin, effect=effect)  # type: ignore[arg-type]
    except ValueError as e:
        raise BadInput(f"--{str(e).split('=')[0]} {e}") from None
    out_dir = output_dir("--out", out)
    try:
        paths = write_compare(c, labels, out_dir)
    except OSError as e:
        raise file_error("--out", out_dir, e) from None
    d = c.to_dict()
    for side in ("a", "b"):
        if d[side] is not None:
            typer.echo(describe_point(d[side]))
    for t in d["tests"]:
        stat = "–" if t["statistic"] is None else f"{t['statistic']:.3f}"
        p = "–" if t["p_value"] is None else f"{t['p_value']:.2g}"
        typer.echo(
            f"  {t['name']}: statistic {stat}, p={p}{' (rejected)' if t['rejected'] else ''}"
            f"; {t['detail']}"
        )
    typer.echo(f"{c.verdict()}: {'; '.join(c.reasons)}")
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
    if not c.comparable:
        raise NotComparable("; ".join(c.reasons))
    if c.worse:
        raise Worse("; ".join(c.reasons))


def _name(p: Path) -> str:
    p = p.parent if p.name == "curve.json" else p
    return p.resolve().name or str(p)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
