"""``slotune tune``: the canary job.

``slotune tune`` with no arguments starts a local Ray, deploys the built-in
``small`` model on the local device (CUDA if there is one, else CPU), calibrates
the device at the replica's torch thread count (cached), and tunes. ``--address``
attaches to a running Ray cluster (and deploys the built-in model there); ``--app``
attaches to an existing deployment of ``serving.app.server:app`` instead. Exit codes: 0 a
feasible point was found, 3 none meets the SLO, 2 bad input, 1 the run was stopped by
a fault, 130 Ctrl-C; in every case the report of what was measured is written.

Setting up lives in :mod:`controller.tune_setup`, the calibration and the roofline's
plan in :mod:`controller.tune_plan`, the loop in :mod:`controller.tune`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from controller.cli import flags
from controller.cli.flags import slo_from_ms
from controller.cli.paths import file_error, input_file, output_dir, study_storage
from controller.errors import BadInput, NoFeasiblePoint
from controller.report.cost import catalog_price, cost_sentence
from controller.tune_plan import DEFAULT_MAX_SLOTS, MODELS
from controller.tune_setup import SetupFailed, local_device, prepare, shutdown_local
from metrics.observation import DEFAULT_SLO

if TYPE_CHECKING:
    from controller.load.spec import TraceItem
    from controller.targets import RequestShape, WindowPlan
    from controller.tune import TuneOutcome
    from controller.windows import WindowReader
    from serving.sim.workload import LengthDist

log = logging.getLogger(__name__)


def _positive(flag: str, v: float) -> None:
    if not (math.isfinite(v) and v > 0):
        raise BadInput(f"{flag} {v!r}: must be a positive number")


def _lengths(flag: str, spec: str) -> LengthDist:
    from serving.sim.workload import LengthDist

    try:
        return LengthDist.parse(spec)
    except ValueError as e:
        raise BadInput(f"{flag} {e}") from None


def _trace(path: Path) -> tuple[TraceItem, ...]:
    from controller.load.spec import load_trace

    input_file("--trace", path)
    try:
        return load_trace(path)
    except OSError as e:
        raise file_error("--trace", path, e, "read") from None
    except ValueError as e:  # load_trace's message starts "trace PATH line N: ..."
        msg = str(e)
        msg = f"--{msg}" if msg.startswith("trace ") else f"--trace {path}: {msg}"
        raise BadInput(msg) from None


def _fits_context(
    shape: RequestShape, model: str, prompt_spec: str, output_spec: str, trace: Path | None
) -> None:
    """Every request the load can send fits one KV slot of the built-in model (prompt +
    output <= its context); else the server would answer each with a 400, and a whole
    budget would be spent measuring them."""
    from serving.engine.engine import slot_context
    from serving.model.config import ModelConfig

    ctx = slot_context(ModelConfig.from_name(model))
    holds = f"the built-in {model!r} model holds {ctx} tokens a request (prompt + output)"
    if shape.trace is not None:
        for i, item in enumerate(shape.trace, start=1):
            n = item.prompt_tokens
            if isinstance(item.prompt, str):
                n = len(item.prompt.encode("utf-8"))  # the byte-level tokenizer's count
            elif item.prompt is not None:
                raise BadInput(f"--trace {trace}: request {i}: prompt must be a string")
            elif not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
                raise BadInput(
                    f"--trace {trace}: request {i}: prompt_tokens={n!r}: must be an integer >= 1"
                )
            if n + item.max_tokens > ctx:
                raise BadInput(
                    f"--trace {trace}: request {i} has {n} prompt + {item.max_tokens} output "
                    f"tokens, but {holds}"
                )
        return
    p, o = shape.prompt_tokens.max_tokens, shape.output_tokens.max_tokens
    if p + o > ctx:
        cut = [
            f"{spec} draws up to {d.hi}"
            for spec, d in ((prompt_spec, shape.prompt_tokens), (output_spec, shape.output_tokens))
            if d.kind == "lognormal"
        ]
        raise BadInput(
            f"--prompt-tokens {prompt_spec} --output-tokens {output_spec}: a request can "
            f"reach {p} + {o} = {p + o} tokens, but {holds}; give smaller lengths"
            + (f" ({'; '.join(cut)})" if cut else "")
        )


def tune(
    address: str = typer.Option(None, "--address", help="Attach to this Ray cluster."),
    app_name: str = typer.Option(None, "--app", help="Tune this existing Serve application."),
    deployment: str = typer.Option(None, "--deployment", help="Deployment within --app."),
    url: str = typer.Option(None, "--url", help="HTTP base of the app (default: from Serve)."),
    metrics_url: str = typer.Option(None, "--metrics-url", help="Prometheus text endpoint."),
    prometheus_url: str = typer.Option(None, "--prometheus-url", help="Prometheus server."),
    metrics_prefix: str = typer.Option("ray_", "--metrics-prefix", help="Exported name prefix."),
    slo_ttft_ms: float = typer.Option(
        DEFAULT_SLO.ttft_p99_s * 1e3, "--slo-ttft-ms", help="p99 TTFT SLO (ms)."
    ),
    slo_tpot_ms: float = typer.Option(
        DEFAULT_SLO.tpot_p99_s * 1e3, "--slo-tpot-ms", help="p99 TPOT SLO (ms)."
    ),
    price_per_hour: float = typer.Option(None, "--price-per-hour", help="USD per device-hour."),
    max_trials: int = typer.Option(20, "--max-trials", help="At most this many trials."),
    time_budget: float = typer.Option(240.0, "--time-budget", help="Seconds for the trials."),
    warmup_s: float = typer.Option(2.0, "--warmup", help="Warm-up seconds per trial."),
    window_s: float = typer.Option(5.0, "--window", help="Least measurement seconds."),
    max_window_s: float = typer.Option(30.0, "--max-window", help="Most measurement seconds."),
    min_requests: int = typer.Option(300, "--min-requests", help="Requests a window aims at."),
    prompt_tokens: str = typer.Option("16", "--prompt-tokens", help="N, uniform:A-B, ..."),
    output_tokens: str = typer.Option("8", "--output-tokens", help="N, uniform:A-B, ..."),
    trace: Path = typer.Option(None, "--trace", help="JSONL trace of requests to replay."),
    served_model: str = typer.Option(None, "--served-model", help="Request 'model' field."),
    model: str = typer.Option("small", "--model", help="Built-in model: tiny | small."),
    max_slots: int = typer.Option(None, "--max-slots", help="KV slots of the built-in app."),
    out: Path = typer.Option(None, "--out", help="Default ./slotune-out/<timestamp>/."),
    study: str = typer.Option(
        None, "--study", help="Optuna study storage: a journal file or a URL (default OUT/study)."
    ),
    study_name: str = typer.Option("slotune-tune", "--study-name", help="Study name."),
    seed: int = typer.Option(0, "--seed", help="Sampler and load seed."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No live progress display."),
) -> None:
    """Find the operating point of a live deployment and export the curve."""
    from controller.progress import Progress, RichProgress
    from controller.report.curve import CurveReport
    from controller.targets import RayServeTarget, RequestShape, WindowPlan
    from controller.tune import TuneLimits, run_tune
    from search.tuner import Tuner

    # Every value is checked here, before Ray starts or anything is measured.
    slo = slo_from_ms(slo_ttft_ms, slo_tpot_ms)
    _positive("--time-budget", time_budget)
    flags.price("--price-per-hour", price_per_hour)
    if model not in MODELS:
        raise BadInput(f"--model {model}: choose one of {', '.join(MODELS)}")
    if metrics_url and prometheus_url:
        raise BadInput("--metrics-url and --prometheus-url: give one, not both")
    if deployment is not None and app_name is None:
        raise BadInput(f"--deployment {deployment}: names a deployment within --app; give --app")
    for flag, value in (
        ("--url", url),
        ("--metrics-url", metrics_url),
        ("--prometheus-url", prometheus_url),
    ):
        flags.http_url(flag, value)
    flags.at_least("--max-slots", max_slots, 1)
    flags.at_least("--min-requests", min_requests, 0)
    flags.seed("--seed", seed)
    if not (math.isfinite(warmup_s) and warmup_s >= 0):
        raise BadInput(f"--warmup {warmup_s!r}: must be a number of seconds >= 0")
    _positive("--window", window_s)
    _positive("--max-window", max_window_s)
    try:
        limits = TuneLimits(max_trials=max_trials, time_budget_s=time_budget)
        plan = WindowPlan(
            warmup_s=warmup_s,
            window_s=window_s,
            max_window_s=max(max_window_s, window_s),
            min_requests=min_requests,
        )
        shape = RequestShape(
            prompt_tokens=_lengths("--prompt-tokens", prompt_tokens),
            output_tokens=_lengths("--output-tokens", output_tokens),
            trace=_trace(trace) if trace else None,
            model=served_model,
            seed=seed,
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    if app_name is None:  # the built-in model: its context is known before it is deployed
        _fits_context(shape, model, prompt_tokens, output_tokens, trace)
    if study is not None:
        study_storage("--study", study, must_exist=False)
    out_dir = output_dir("--out", out or Path("slotune-out") / time.strftime("%Y%m%d-%H%M%S"))
    if study is None:
        study = study_storage("--out", str(out_dir / "study.journal"), must_exist=False)
    max_slots = max_slots or DEFAULT_MAX_SLOTS[model]
    price_per_hour, price_source = _price(price_per_hour, embedded=address is None and not app_name)
    started = time.monotonic()
    setup = None
    try:
        with _setup_errors():
            prepared = prepare(
                address=address,
                app_name=app_name,
                deployment=deployment,
                url=url,
                metrics_url=metrics_url,
                prometheus_url=prometheus_url,
                prefix=metrics_prefix,
                slo=slo,
                model=model,
                max_slots=max_slots,
                price=price_per_hour,
                shape=shape,
                quiet=quiet,
            )
        setup, hw, searched = prepared.setup, prepared.hardware, prepared.plan
        a = searched.analysis
        tuner = Tuner(
            space=searched.space,
            slo=slo,
            storage=study,
            study_name=study_name,
            seed_knobs=searched.seeds,
            model_tpot_s=searched.roofline.step_time_s,
            seed=seed,
        )
        plan = _fit_to_scrapes(plan, setup.reader, quiet=quiet)
        target = RayServeTarget(
            url=setup.url, app_name=setup.app, slo=slo, reader=setup.reader, plan=plan, shape=shape
        )
        base = CurveReport(
            slo=slo,
            trials=(),
            predicted=searched.predicted,
            model=MODELS[model] if app_name is None else f"{app_name} ({MODELS[model]} assumed)",
            hardware=hw.name,
            hardware_detail={
                "source": prepared.hardware_note,
                "memory_bandwidth_gb_s": round(hw.mem_bandwidth / 1e9, 1),
                "bf16_peak_tflops": round(hw.peak_flops.get("bf16", math.nan) / 1e12, 2),
                "device": setup.device,
            },
            usd_per_hour=price_per_hour,
            knee_batch=a.knee_batch,
            ridge_flops_per_byte=round(a.ridge_flops_per_byte, 1),
            predicted_batch=searched.seed_batch,
            meta={
                "command": "slotune " + " ".join(sys.argv[1:]),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "app": setup.app,
                "url": setup.url,
                "metrics": setup.reader_desc,
                "storage": study,
                "study": study_name,
                "window": f"warm-up {plan.warmup_s:g} s, {plan.window_s:g}-{plan.max_window_s:g}"
                f" s, aiming at {plan.min_requests} requests",
                "load": f"closed loop at each trial's max_concurrency; prompt {prompt_tokens}, "
                f"output {output_tokens} tokens",
                "price": price_source,
                "setup_s": round(time.monotonic() - started, 1),
            },
        )
        progress = Progress() if quiet else RichProgress(slo)
        outcome = run_tune(
            target=target, tuner=tuner, base=base, limits=limits, out_dir=out_dir, progress=progress
        )
    finally:
        if setup is not None and setup.started_ray:
            shutdown_local()
    _finish(outcome, out_dir, quiet)


def _price(given: float | None, *, embedded: bool) -> tuple[float | None, str]:
    """The device price and where it came from: the flag; else, for the built-in
    deployment on a catalogued GPU, the catalog's indicative rate; else none."""
    if given is not None:
        return given, "--price-per-hour"
    if embedded and local_device() == "cuda":
        import torch

        found = catalog_price(torch.cuda.get_device_name())
        if found is not None:
            return found
    return None, "not given"


def _fit_to_scrapes(plan: WindowPlan, reader: WindowReader, *, quiet: bool) -> WindowPlan:
    """Through a Prometheus server, a window must span ``reader.min_scrapes`` scrapes (else
    it is stale and judged by nobody): lengthen the least window to that, and wait for a
    fresh sample up to three scrape intervals."""
    from controller.windows import PromQLWindow

    if not isinstance(reader, PromQLWindow):
        return plan
    interval = reader.scrape_interval_s()
    if interval is None:
        return plan
    reader.fresh_timeout_s = max(reader.fresh_timeout_s, 3 * interval)
    need = reader.min_scrapes * interval + reader.report_lag_s
    if plan.window_s >= need:
        return plan
    if not quiet:
        typer.echo(
            f"slotune: Prometheus scrapes every {interval:g} s: windows of at least {need:g} s "
            f"(--window {plan.window_s:g} was too short to judge)",
            err=True,
        )
    return replace(plan, window_s=need, max_window_s=max(plan.max_window_s, need))


@contextmanager
def _setup_errors() -> Iterator[None]:
    """A failed or interrupted set-up ends the command with one line (exit 1 or 130)."""
    try:
        yield
    except SetupFailed as e:
        typer.echo(f"slotune: error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("slotune: interrupted during set-up; nothing was tuned", err=True)
        raise typer.Exit(130) from None


def _finish(outcome: TuneOutcome, out_dir: Path, quiet: bool) -> None:
    op = outcome.report.operating_point()
    lines = [f"report: {out_dir / 'report.html'}", f"stopped: {outcome.stop_reason}"]
    if op is not None:
        lines.append(
            f"operating point: max_batch_size={op['max_batch_size']} "
            f"max_concurrency={op['max_concurrency']}: {op['goodput_rps']:.2f} req/s within "
            f"SLO, {op['tokens_per_s']:.0f} tokens/s, p99 TTFT {op['p99_ttft_ms']:.0f} ms, "
            f"p99 TPOT {op['p99_tpot_ms']:.1f} ms"
        )
        rep = outcome.report
        lines.append(
            "cost: "
            + cost_sentence(rep.usd_per_hour, op["tokens_per_s"], str(rep.meta.get("price", "")))
        )
    lines.append(outcome.final_note)
    for line in lines:  # the result, even with --quiet (which silences only the progress)
        typer.echo(line, err=op is None)
    if outcome.interrupted:
        typer.echo("slotune: interrupted; study saved, best so far exported", err=True)
        raise typer.Exit(130)
    if outcome.aborted:
        typer.echo(f"slotune: stopped by a fault: {outcome.aborted}", err=True)
        raise typer.Exit(1)
    if op is None:
        hint = outcome.report.sample_hint()
        raise NoFeasiblePoint(
            f"{len(outcome.report.trials)} trials, none met both SLOs with confidence"
            + (f"; {hint}" if hint else "")
            + f" See {out_dir / 'report.html'}"
        )


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
