"""``slotune roofline``: the decode throughput-latency curve of a model on a device.

It derives the curve from the bandwidth/compute roofline (search/roofline/curve.py) and
says where to operate under a TPOT SLO, at what cost. ``--hardware local`` reads what
``slotune calibrate`` measured on this machine.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from controller.cli.paths import file_error, output_file
from controller.errors import BadInput, NoFeasiblePoint
from search.roofline.curve import Roofline
from search.roofline.hardware import HARDWARE_NAMES, HardwareSpec, resolve_hardware
from search.roofline.models import MODEL_NAMES, ModelSpec, resolve_model
from search.roofline.operating_point import RooflineAnalysis, analyze

LOCAL = "local"


def _hardware(value: str) -> HardwareSpec:
    if value == LOCAL:
        from search.calibrate.device import default_cache_path, pick_device

        path = default_cache_path(pick_device(None))
        if not path.exists():
            raise BadInput(
                f"--hardware local: no calibration at {path}; run `slotune calibrate` first, "
                f"or use one of {', '.join(HARDWARE_NAMES)} or a JSON file"
            )
        try:
            return HardwareSpec.from_json(path)
        except ValueError as e:
            raise BadInput(f"--hardware local: {e}; run `slotune calibrate` again") from None
    try:
        return resolve_hardware(value)
    except ValueError as e:
        raise BadInput(f"--hardware {value}: {e}") from None


def model_spec(value: str) -> ModelSpec:
    """The ``--model`` flag's model spec; a bad value is a one-line error."""
    try:
        return resolve_model(value)
    except ValueError as e:
        raise BadInput(f"--model {value}: {e}") from None


def _rows_to_show(a: RooflineAnalysis) -> list[int]:
    n = len(a.curve)
    rows = {b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= n}
    rows.add(n)
    if a.knee_batch <= n:
        rows.add(a.knee_batch)
    if a.operating_point is not None:
        rows.add(a.operating_point.batch)
    if 1 <= a.max_batch_memory <= n:
        rows.add(a.max_batch_memory)
    return sorted(rows)


def _print_table(a: RooflineAnalysis, console: Console) -> None:
    r = a.roofline
    op = a.operating_point
    cal = " (calibrated)" if r.calibrated else ""
    t = Table(
        title=f"{r.model.name} on {r.tp} x {r.hardware.name}{cal}, {r.dtype}, context {r.context}",
        title_justify="left",
    )
    for col in ("batch", "TPOT ms", "tokens/s", "bound", "note"):
        t.add_column(col, justify="right" if col not in ("bound", "note") else "left")
    for b in _rows_to_show(a):
        p = a.at(b)
        notes = []
        if b == a.knee_batch:
            notes.append("knee")
        if op is not None and b == op.batch:
            notes.append("operating point")
        if b == a.max_batch_memory:
            notes.append("KV cache full")
        if not p.fits:
            notes.append("does not fit")
        meets = p.tpot_s <= a.slo_tpot_s
        style = None if meets else "dim"
        t.add_row(
            str(b),
            f"{p.tpot_s * 1e3:.2f}",
            f"{p.tokens_per_s:,.0f}",
            p.bound,
            ", ".join(notes),
            style=style,
        )
    console.print(t)
    knee_txt = f"{a.knee_batch} ({r.knee_bound})"
    cross = r.compute_crossover_batch
    lines = [
        f"ridge point          {a.ridge_flops_per_byte:,.1f} FLOP/byte",
        f"KV bytes per token   {a.kv_bytes_per_token:,} B "
        f"({r.kv_bytes_per_token_per_device:,.0f} B per device)",
        f"weights per device   {r.weight_bytes_per_device / 1e9:,.1f} GB",
        f"knee batch           {knee_txt}; "
        + (f"compute-bound from B={cross}" if cross else "never compute-bound at this context"),
        f"KV-cache batch cap   {a.max_batch_memory:,} sequences of {r.context} tokens",
    ]
    if op is not None:
        cost = (
            f"${op.usd_per_million_tokens:.4f} per million output tokens "
            f"at ${a.usd_per_hour:g}/h x {r.tp}"
            if op.usd_per_million_tokens is not None
            else "no price (--price-per-hour)"
        )
        lines.append(
            f"operating point      B={op.batch}, TPOT {op.tpot_s * 1e3:.2f} ms, "
            f"{op.tokens_per_s:,.0f} tokens/s, {cost}"
        )
    else:
        lines.append(f"operating point      none meets TPOT <= {a.slo_tpot_s * 1e3:g} ms")
    console.print("\n".join(lines), highlight=False)
    console.print()
    console.print("\n".join(a.explain()), highlight=False, soft_wrap=False)


def write_csv(a: RooflineAnalysis, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["batch", "tpot_ms", "tokens_per_s", "bound", "fits"])
        for p in a.curve:
            w.writerow(
                [p.batch, f"{p.tpot_s * 1e3:.6g}", f"{p.tokens_per_s:.6g}", p.bound, int(p.fits)]
            )


def roofline(
    model: str = typer.Option(
        "llama-3.1-8b", "--model", "-m", help=f"{', '.join(MODEL_NAMES)}, or a JSON file."
    ),
    hardware: str = typer.Option(
        "h100-sxm",
        "--hardware",
        help=f"{', '.join(HARDWARE_NAMES)}, '{LOCAL}' (from slotune calibrate), or a JSON file.",
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel devices."),
    context: int = typer.Option(4096, "--context", help="Tokens in each sequence's KV cache."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weights and KV dtype: bf16, fp16, fp8..."),
    slo_tpot_ms: float = typer.Option(50.0, "--slo-tpot-ms", help="TPOT SLO in milliseconds."),
    price_per_hour: float = typer.Option(
        None, "--price-per-hour", help="USD per device-hour (default: the catalog's)."
    ),
    max_batch: int = typer.Option(
        None, "--max-batch", help="Largest batch on the curve (default: what memory holds)."
    ),
    mem_utilization: float = typer.Option(
        0.9, "--mem-utilization", help="Share of device memory for weights + KV cache."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead."),
    csv_path: Path = typer.Option(None, "--csv", help="Write the curve as CSV."),
    plot_path: Path = typer.Option(None, "--plot", help="Draw tokens/s against TPOT (PNG)."),
) -> None:
    """Derive the decode throughput-latency curve from the roofline and place the
    operating point under a TPOT SLO, with its cost."""
    if not (math.isfinite(slo_tpot_ms) and slo_tpot_ms > 0):
        raise BadInput(f"--slo-tpot-ms {slo_tpot_ms:g}: must be a positive number of ms")
    if price_per_hour is not None and not (math.isfinite(price_per_hour) and price_per_hour >= 0):
        raise BadInput(f"--price-per-hour {price_per_hour:g}: must be a number >= 0")
    if max_batch is not None and max_batch < 1:
        raise BadInput(f"--max-batch {max_batch}: must be >= 1")
    if plot_path is not None and plot_path.suffix.lower() != ".png":
        raise BadInput(f"--plot {plot_path}: must end in .png")
    if csv_path is not None:
        output_file("--csv", csv_path)
    if plot_path is not None:
        output_file("--plot", plot_path)
    m, hw = model_spec(model), _hardware(hardware)
    try:
        r = Roofline(
            model=m,
            hardware=hw,
            tp=tp,
            dtype=dtype,
            context=context,
            mem_utilization=mem_utilization,
        )
        a = analyze(
            r, slo_tpot_s=slo_tpot_ms / 1e3, max_batch=max_batch, usd_per_hour=price_per_hour
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    console = Console(soft_wrap=True)
    if as_json:
        typer.echo(json.dumps(a.to_dict()))
    else:
        _print_table(a, console)
    notes = []
    if csv_path is not None:
        try:
            write_csv(a, csv_path)
        except OSError as e:
            raise file_error("--csv", csv_path, e) from None
        notes.append(f"wrote {csv_path}")
    if plot_path is not None:
        from controller.report.roofline_plot import plot_analysis

        try:
            plot_analysis(a, plot_path)
        except OSError as e:
            raise file_error("--plot", plot_path, e) from None
        notes.append(f"wrote {plot_path}")
    for n in notes:
        typer.echo(n, err=as_json)
    if a.operating_point is None:
        raise NoFeasiblePoint(
            f"no batch meets TPOT <= {slo_tpot_ms:g} ms: B=1 takes {a.at(1).tpot_s * 1e3:.1f} ms"
        )


def register(app: typer.Typer) -> None:
    app.command("roofline")(roofline)
