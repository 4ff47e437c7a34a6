"""``slotune calibrate``: measure this machine so the roofline can be drawn for it.

It writes a hardware JSON (memory bandwidth, matmul peaks, decode-shape rates) that
``slotune roofline --hardware local`` (or ``--hardware PATH``) reads. ``--served`` measures
the serving path instead: slotune's own app in a local Ray Serve, through HTTP streaming and
the load generator, at a few batch sizes (controller/tune_served.py), and caches the fitted
served-step model that seeds ``slotune tune`` of that app.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from controller.cli import flags
from controller.cli.paths import file_error, output_file
from controller.cli.roofline import LOCAL, model_spec
from controller.errors import BadInput

log = logging.getLogger(__name__)


def calibrate(
    quick: bool = typer.Option(False, "--quick", help="A few seconds, coarse (for tests)."),
    device: str = typer.Option(None, "--device", help="cpu, cuda, cuda:N (default: cuda if any)."),
    out: Path = typer.Option(
        None, "--out", help="Where to write the hardware JSON (default: the user cache)."
    ),
    model: str = typer.Option(
        "slotune-small", "--model", "-m", help="Model whose decode shapes to measure."
    ),
    dtypes: str = typer.Option("fp32,bf16", "--dtypes", help="Comma-separated: fp32,bf16,fp16."),
    name: str = typer.Option(None, "--name", help="Name of the hardware spec."),
    threads: int = typer.Option(
        None, "--threads", help="torch CPU threads (default: torch's; match the server's)."
    ),
    price_per_hour: float = typer.Option(0.0, "--price-per-hour", help="USD per device-hour."),
    as_json: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
    served: bool = typer.Option(
        False,
        "--served",
        help="Measure the serving path (local Ray Serve app, HTTP streaming, the load "
        "generator) at a few batches and cache the served-step model `slotune tune` seeds from.",
    ),
    prompt_tokens: str = typer.Option(
        "16", "--prompt-tokens", help="--served: the workload's prompt lengths (tune's default)."
    ),
    output_tokens: str = typer.Option(
        "8", "--output-tokens", help="--served: the workload's output lengths (tune's default)."
    ),
) -> None:
    """Measure this device (memory bandwidth, matmul peaks, decode-shape throughput) and
    write a hardware JSON that `slotune roofline --hardware` reads."""
    if served:
        _served(model=model, prompt_tokens=prompt_tokens, output_tokens=output_tokens, out=out)
        return
    flags.price("--price-per-hour", price_per_hour)
    flags.at_least("--threads", threads, 1)
    wanted = tuple(d.strip() for d in dtypes.split(",") if d.strip())
    if not wanted:
        raise BadInput(f"--dtypes {dtypes!r}: name at least one of fp32, bf16, fp16")
    if out is not None:
        output_file("--out", out)
    m = model_spec(model)
    if "torch" in sys.modules:
        log.warning("torch already imported: OMP_WAIT_POLICY cannot be set any more")
    # Spinning OpenMP threads on a shared CPU distort every figure (docs/roofline.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from search.calibrate import device as calib  # torch is imported only when calibrating

    if threads is not None:
        calib.torch.set_num_threads(threads)
    try:
        dev = calib.pick_device(device)
        cal = calib.calibrate(
            device=device,
            plan=calib.PLANS["quick" if quick else "full"],
            model=m,
            dtypes=wanted,
            name=name,
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    spec = dataclasses.replace(cal.spec, usd_per_hour=price_per_hour)
    path = out or calib.default_cache_path(dev)
    try:
        spec.to_json(path, extra=cal.measured)
    except OSError as e:
        raise file_error("--out", path, e) from None
    if as_json:
        typer.echo(json.dumps({"path": str(path), **cal.measured}))
        return
    ms = cal.measured
    console = Console(soft_wrap=True)
    console.print(
        f"{ms['device']}, {ms['threads']} threads, {cal.elapsed_s:.1f} s "
        f"({ms['plan']} plan; decode shapes of {m.name})",
        highlight=False,
    )
    console.print(
        f"memory bandwidth     {ms['mem_bandwidth_gb_s']:.1f} GB/s (sum over a filled tensor)",
        highlight=False,
    )
    console.print(
        "  ".join(
            f"{d}: matmul peak {spec.peak_flops[d] / 1e9:,.0f} GFLOP/s, "
            f"ridge {spec.ridge_flops_per_byte(d):.0f} FLOP/B"
            for d in wanted
        ),
        highlight=False,
    )
    t = Table(
        title="decode shapes: the model's linears (weight GB/s | GFLOP/s)", title_justify="left"
    )
    t.add_column("batch", justify="right")
    for d in wanted:
        t.add_column(f"{d} GB/s", justify="right")
        t.add_column(f"{d} GFLOP/s", justify="right")
    for b in spec.decode[wanted[0]].weight_rate:
        cells = []
        for d in wanted:
            cells.append(f"{ms['decode_linear_gb_s'][d][b]:.2f}")
            cells.append(f"{ms['decode_linear_gflop_s'][d][b]:.0f}")
        t.add_row(str(b), *cells)
    console.print(t)
    for d in wanted:
        kv = ", ".join(f"B={b}: {r / 1e9:.2f}" for b, r in spec.decode[d].kv_rate.items())
        ov = ", ".join(f"B={b}: {t:.0f}" for b, t in ms["decode_layer_overhead_us"][d].items())
        console.print(
            f"{d} attention KV read (context {ms['context']}) GB/s: {kv}; "
            f"rest of a layer (norms, rotary, cache writes) us: {ov}",
            highlight=False,
        )
    console.print(f"wrote {path}", highlight=False)
    console.print(
        f"use it: slotune roofline --hardware {LOCAL if out is None else path} "
        f"--model {m.name} --context 256 --slo-tpot-ms 50",
        highlight=False,
    )


def calib_label(device: str) -> str:
    from search.calibrate import device as calib

    return calib.device_label(calib.pick_device(device))


def _served(*, model: str, prompt_tokens: str, output_tokens: str, out: Path | None) -> None:
    """``--served``: start a local Ray, deploy the built-in ``model`` (a roofline name of a
    preset, e.g. slotune-small) as ``slotune tune`` does, measure and cache the served-step
    model (or write it to ``out``)."""
    from controller.attach import embedded_threads, shutdown_local
    from controller.cli import tune_load
    from controller.targets import RayServeTarget, RequestShape
    from controller.tune_plan import MODELS
    from controller.tune_served import SERVED_WINDOW, measure_served, save_served, served_path
    from controller.tune_setup import SetupFailed, prepare_builtin
    from metrics.observation import DEFAULT_SLO

    preset = {v: k for k, v in MODELS.items()}.get(model)
    if preset is None:
        known = ", ".join(MODELS.values())
        raise BadInput(f"--model {model}: --served measures a built-in app: {known}")
    shape = RequestShape(
        prompt_tokens=tune_load.lengths("--prompt-tokens", prompt_tokens),
        output_tokens=tune_load.lengths("--output-tokens", output_tokens),
        ignore_eos=True,
    )
    tune_load.fits_context(shape, preset, prompt_tokens, output_tokens, None)
    if out is not None:
        output_file("--out", out)
    threads = embedded_threads()
    setup = None
    try:
        # served=False: this measures the served step itself
        prepared = prepare_builtin(
            model=preset, slo=DEFAULT_SLO, shape=shape, quiet=False, served=False
        )
        setup = prepared.setup
        target = RayServeTarget(
            url=setup.url,
            slo=DEFAULT_SLO,
            reader=setup.reader,
            actuator=setup.actuator,
            plan=SERVED_WINDOW,
            shape=shape,
        )
        fitted = measure_served(
            target,
            model=model,
            device=calib_label(setup.device),
            threads=threads,
            shape=shape,
            say=lambda s: typer.echo(s, err=True),
        )
    except (SetupFailed, RuntimeError) as e:
        typer.echo(f"slotune: error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        if setup is not None and setup.started_ray:
            shutdown_local()
    path = out or served_path(setup.device, threads, model)
    try:
        save_served(fitted, path)
    except OSError as e:
        raise file_error("--out", path, e) from None
    typer.echo(fitted.describe())
    typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
