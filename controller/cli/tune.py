"""``slotune tune``: the canary job.

``slotune tune`` with no arguments starts a local Ray, deploys the built-in
``small`` model on the local device (CUDA if there is one, else CPU), calibrates
the device at the replica's torch thread count (cached), and tunes. ``--address``
attaches to a running Ray cluster (and deploys the built-in model there); ``--app``
tunes an existing Ray Serve application through an actuator (``serve``: any deployment,
through Serve's REST API; ``serve-llm``: a Ray Serve LLM app); ``--actuator none`` measures
a server slotune cannot configure (a standalone vLLM or SGLang at ``--url``) and only
recommends. Exit codes: 0 a feasible point was found, 3 none meets the SLO, 2 bad input, 1
the run was stopped by a fault, 130 Ctrl-C; in every case the report of what was measured
is written.

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
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from controller.attach import shutdown_local
from controller.cli import flags, tune_backend, tune_load
from controller.cli.flags import slo_from_ms
from controller.cli.paths import output_dir, study_storage
from controller.errors import BadInput, NoFeasiblePoint, Undecided
from controller.report.cost import cost_sentence
from controller.report.undecided import undecided_summary
from controller.sweep import DEMO_CURVE_POINTS, sweep_plan
from controller.tune_plan import DEFAULT_MAX_BATCH, DEFAULT_MAX_SLOTS, MODELS
from controller.tune_setup import SetupFailed, prepare
from metrics.observation import DEFAULT_SLO

if TYPE_CHECKING:
    from controller.tune import TuneOutcome

log = logging.getLogger(__name__)


# The --help panels: the flags grouped by what they choose.
WHERE = "Where: the deployment to tune"
SERVE = "Backend serve / serve-llm: a Ray Serve app (--app)"
METRICS = "Metrics: how TTFT, TPOT and goodput are read"
ROOF = "Roofline seed: the model and device the deployment runs"
BUILTIN = "Built-in model (no --app)"
SLO = "SLO and cost"
LOAD = "Load: the requests offered"
SEARCH = "Search and windows"
OUT = "Output"


def _positive(flag: str, v: float) -> None:
    if not (math.isfinite(v) and v > 0):
        raise BadInput(f"{flag} {v!r}: must be a positive number")


def _choice(flag: str, value: str | None, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise BadInput(f"{flag} {value}: choose one of {', '.join(allowed)}")


def tune(
    address: str = typer.Option(
        None, "--address", help="Attach to this Ray cluster.", rich_help_panel=WHERE
    ),
    app_name: str = typer.Option(
        None, "--app", help="Tune this existing Serve application.", rich_help_panel=WHERE
    ),
    actuator: str = typer.Option(
        None,
        "--actuator",
        help="How knobs reach it: serve (default with --app: Serve's REST API), serve-llm "
        "(a Ray Serve LLM app: batch limit by restart), none (not configurable: measure "
        "and recommend; needs --url).",
        rich_help_panel=WHERE,
    ),
    url: str = typer.Option(
        None, "--url", help="HTTP base of the server (default: from Serve).", rich_help_panel=WHERE
    ),
    deployment: str = typer.Option(
        None,
        "--deployment",
        help="Deployment within --app (default: its only one; serve-llm: its LLMServer).",
        rich_help_panel=SERVE,
    ),
    batch_knob: str = typer.Option(
        None,
        "--batch-knob",
        help="Config path of the batch limit (serve: user_config.max_batch_size; serve-llm: "
        "args.llm_configs[0].engine_kwargs.max_num_seqs).",
        rich_help_panel=SERVE,
    ),
    dashboard_url: str = typer.Option(
        None,
        "--dashboard-url",
        help="Ray dashboard (Serve's REST API; default: the attached cluster's).",
        rich_help_panel=SERVE,
    ),
    metrics_profile: str = typer.Option(
        None,
        "--metrics-profile",
        help="slotune | vllm | sglang | client (the load generator's own records). "
        "Default: detected from the metrics endpoint.",
        rich_help_panel=METRICS,
    ),
    metrics_url: str = typer.Option(
        None, "--metrics-url", help="Prometheus text endpoint.", rich_help_panel=METRICS
    ),
    prometheus_url: str = typer.Option(
        None, "--prometheus-url", help="Prometheus server.", rich_help_panel=METRICS
    ),
    metrics_prefix: str = typer.Option(
        None,
        "--metrics-prefix",
        help="Prefix of the exported names (default: detected; ray_ under Ray).",
        rich_help_panel=METRICS,
    ),
    model_config: str = typer.Option(
        None,
        "--model-config",
        help="The served model for the roofline: a Hugging Face config.json (or its folder) "
        "or a catalogue name. Without it an --app is searched unseeded.",
        rich_help_panel=ROOF,
    ),
    hardware: str = typer.Option(
        None,
        "--hardware",
        help="The device: a catalogue name, a calibration JSON, or local (calibrate this "
        "machine; the default when slotune starts the deployment here).",
        rich_help_panel=ROOF,
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel devices.", rich_help_panel=ROOF),
    max_batch: int = typer.Option(
        None,
        "--max-batch",
        help=f"Largest batch searched (default: what memory holds; {DEFAULT_MAX_BATCH} unseeded).",
        rich_help_panel=ROOF,
    ),
    model: str = typer.Option(
        "small", "--model", help="Built-in model: tiny | small.", rich_help_panel=BUILTIN
    ),
    max_slots: int = typer.Option(
        None, "--max-slots", help="KV slots of the built-in app.", rich_help_panel=BUILTIN
    ),
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help="The built-in app serves this local Hugging Face checkpoint folder (config.json,"
        " *.safetensors) instead of --model's random weights; its config.json seeds the"
        " roofline.",
        rich_help_panel=BUILTIN,
    ),
    slo_ttft_ms: float = typer.Option(
        DEFAULT_SLO.ttft_p99_s * 1e3,
        "--slo-ttft-ms",
        help="p99 TTFT SLO (ms).",
        rich_help_panel=SLO,
    ),
    slo_tpot_ms: float = typer.Option(
        DEFAULT_SLO.tpot_p99_s * 1e3,
        "--slo-tpot-ms",
        help="p99 TPOT SLO (ms).",
        rich_help_panel=SLO,
    ),
    price_per_hour: float = typer.Option(
        None, "--price-per-hour", help="USD per device-hour.", rich_help_panel=SLO
    ),
    prompt_tokens: str = typer.Option(
        "16", "--prompt-tokens", help="N, uniform:A-B, ...", rich_help_panel=LOAD
    ),
    output_tokens: str = typer.Option(
        "8", "--output-tokens", help="N, uniform:A-B, ...", rich_help_panel=LOAD
    ),
    trace: Path = typer.Option(
        None, "--trace", help="JSONL trace of requests to replay.", rich_help_panel=LOAD
    ),
    served_model: str = typer.Option(
        None,
        "--served-model",
        "--served-model-name",
        help="Request 'model' field; the built-in app serves under this id too.",
        rich_help_panel=LOAD,
    ),
    tokenizer: Path = typer.Option(
        None,
        "--tokenizer",
        help="The served model's tokenizer.json: prompts sized in its tokens.",
        rich_help_panel=LOAD,
    ),
    prompt_format: str = typer.Option(
        "text", "--prompt-format", help="text | token_ids.", rich_help_panel=LOAD
    ),
    endpoint: str = typer.Option(
        "completions", "--endpoint", help="completions | chat.", rich_help_panel=LOAD
    ),
    ignore_eos: bool = typer.Option(
        None,
        "--ignore-eos/--no-ignore-eos",
        help="Ask for exactly the output lengths (default: on for slotune, vLLM, SGLang).",
        rich_help_panel=LOAD,
    ),
    max_trials: int = typer.Option(
        20, "--max-trials", help="At most this many trials.", rich_help_panel=SEARCH
    ),
    time_budget: float = typer.Option(
        240.0,
        "--time-budget",
        help="Seconds for the trials; on a slow deployment, at least six windows of"
        " --budget-requests at its measured rate.",
        rich_help_panel=SEARCH,
    ),
    warmup_s: float = typer.Option(
        2.0, "--warmup", help="Warm-up seconds per trial.", rich_help_panel=SEARCH
    ),
    window_s: float = typer.Option(
        2.0, "--window", help="Least measurement seconds.", rich_help_panel=SEARCH
    ),
    max_window_s: float = typer.Option(
        900.0, "--max-window", help="Most measurement seconds.", rich_help_panel=SEARCH
    ),
    min_requests: int = typer.Option(
        300,
        "--min-requests",
        help="A window's nominal size: before it, only a clear violation (99.5%) ends it.",
        rich_help_panel=SEARCH,
    ),
    budget_requests: int = typer.Option(
        800,
        "--budget-requests",
        help="A window stops once its verdict is decided (95%, anytime-valid), else after"
        " this many requests.",
        rich_help_panel=SEARCH,
    ),
    seed: int = typer.Option(0, "--seed", help="Sampler and load seed.", rich_help_panel=SEARCH),
    curve_points: int = typer.Option(
        None,
        "--curve-points",
        help="After the search, measure N more batches, log-spaced from 1 to the largest"
        f" within the SLO and past it, for the report's curve (default {DEMO_CURVE_POINTS} for"
        " the embedded default, else 0).",
        rich_help_panel=SEARCH,
    ),
    out: Path = typer.Option(
        None, "--out", help="Default ./slotune-out/<timestamp>/.", rich_help_panel=OUT
    ),
    study: str = typer.Option(
        None,
        "--study",
        help="Optuna study storage: a journal file or a URL (default OUT/study).",
        rich_help_panel=OUT,
    ),
    study_name: str = typer.Option(
        "slotune-tune", "--study-name", help="Study name.", rich_help_panel=OUT
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No live progress display.", rich_help_panel=OUT
    ),
) -> None:
    """Find the operating point of a live deployment and export the curve.

    Exit codes: 0 a feasible point was found; 2 bad input; 1 a fault; 130 interrupted.

    3 no feasible point: every setting measured was judged to violate the SLO.

    4 undecided: none was shown to meet it, some not to violate it (see the message).
    """
    from controller.backends.registry import ACTUATORS
    from controller.load.spec import ENDPOINTS, PROMPT_FORMATS
    from controller.progress import Progress, RichProgress
    from controller.report.curve import CurveReport
    from controller.targets import RayServeTarget, RequestShape, WindowPlan
    from controller.tune import TuneLimits, run_tune
    from controller.tune_plan import roofline_model
    from metrics.profiles import PROFILE_NAMES
    from search.tuner import Tuner

    # Every value is checked here, before Ray starts or anything is measured.
    slo = slo_from_ms(slo_ttft_ms, slo_tpot_ms)
    _positive("--time-budget", time_budget)
    flags.price("--price-per-hour", price_per_hour)
    if model not in MODELS:
        raise BadInput(f"--model {model}: choose one of {', '.join(MODELS)}")
    # a canary is its own Serve app, tuned through Serve (kuberay: slotune control's)
    _choice("--actuator", actuator, tuple(a for a in ACTUATORS if a not in ("embedded", "kuberay")))
    _choice("--metrics-profile", metrics_profile, PROFILE_NAMES)
    _choice("--endpoint", endpoint, ENDPOINTS)
    _choice("--prompt-format", prompt_format, PROMPT_FORMATS)
    if metrics_url and prometheus_url:
        raise BadInput("--metrics-url and --prometheus-url: give one, not both")
    if deployment is not None and app_name is None:
        raise BadInput(f"--deployment {deployment}: names a deployment within --app; give --app")
    if actuator in ("serve", "serve-llm") and app_name is None:
        raise BadInput(f"--actuator {actuator}: tunes an existing application; give --app")
    if actuator == "none":
        if url is None:
            raise BadInput("--actuator none: give --url, the server to measure")
        for flag, value in (("--address", address), ("--batch-knob", batch_knob)):
            if value is not None:
                raise BadInput(f"{flag} {value}: --actuator none changes nothing on a cluster")
    elif batch_knob is not None and app_name is None:
        raise BadInput(f"--batch-knob {batch_knob}: names a config path of --app; give --app")
    for flag, value in (
        ("--url", url),
        ("--metrics-url", metrics_url),
        ("--prometheus-url", prometheus_url),
        ("--dashboard-url", dashboard_url),
    ):
        flags.http_url(flag, value)
    flags.at_least("--max-slots", max_slots, 1)
    flags.at_least("--min-requests", min_requests, 0)
    flags.at_least("--budget-requests", budget_requests, 1)
    flags.at_least("--tp", tp, 1)
    flags.at_least("--max-batch", max_batch, 1)
    flags.seed("--seed", seed)
    if curve_points is not None:
        flags.at_least("--curve-points", curve_points, 0)
    if not (math.isfinite(warmup_s) and warmup_s >= 0):
        raise BadInput(f"--warmup {warmup_s!r}: must be a number of seconds >= 0")
    _positive("--window", window_s)
    _positive("--max-window", max_window_s)
    builtin = app_name is None and actuator is None  # slotune deploys its own model
    embedded = builtin and address is None  # ... on the local Ray it starts
    try:
        roof_model = roofline_model(model_config, None)
    except ValueError as e:
        raise BadInput(f"--model-config {model_config}: {e}") from None
    if builtin and (roof_model is not None or hardware is not None or tp != 1):
        raise BadInput(
            "--model-config, --hardware and --tp describe an --app's deployment; the "
            "built-in model's roofline is known (give --app, or leave them out)"
        )
    ckpt, ckpt_model = tune_backend.checkpoint(checkpoint, builtin=builtin)
    if ckpt_model is not None:  # the built-in app's roofline: its checkpoint's config.json
        roof_model = ckpt_model
    served_name = tune_backend.served_name(served_model, builtin=builtin)
    tune_backend.check_hardware(hardware)
    try:
        limits = TuneLimits(
            max_trials=max_trials,
            time_budget_s=time_budget,
            budget_requests=budget_requests,
            curve_points=(DEMO_CURVE_POINTS if embedded else 0)
            if curve_points is None
            else curve_points,
        )
        plan = WindowPlan(
            warmup_s=warmup_s,
            window_s=window_s,
            max_window_s=max(max_window_s, window_s),
            min_requests=min_requests,
            sequential=True,
            budget_requests=max(budget_requests, min_requests),
        )
        shape = RequestShape(
            prompt_tokens=tune_load.lengths("--prompt-tokens", prompt_tokens),
            output_tokens=tune_load.lengths("--output-tokens", output_tokens),
            trace=tune_load.trace(trace) if trace else None,
            model=served_model,
            seed=seed,
            endpoint=endpoint,
            prompt_format=prompt_format,
            tokenizer=tune_load.tokenizer(tokenizer),
            ignore_eos=tune_backend.ignore_eos(ignore_eos, actuator, metrics_profile, builtin),
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    if builtin:  # the built-in model: its context is known before it is deployed
        tune_load.fits_context(shape, model, prompt_tokens, output_tokens, trace, checkpoint=ckpt)
    if study is not None:
        study_storage("--study", study, must_exist=False)
    out_dir = output_dir("--out", out or Path("slotune-out") / time.strftime("%Y%m%d-%H%M%S"))
    if study is None:
        study = study_storage("--out", str(out_dir / "study.journal"), must_exist=False)
    max_slots = max_slots or DEFAULT_MAX_SLOTS[model]
    price_per_hour, price_source = tune_backend.price(price_per_hour, embedded=embedded)
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
                profile=metrics_profile,
                slo=slo,
                model=model,
                max_slots=max_slots,
                price=price_per_hour,
                shape=shape,
                quiet=quiet,
                actuator=actuator,
                batch_knob=batch_knob,
                dashboard_url=dashboard_url,
                roofline_model=roof_model,
                checkpoint=ckpt,
                served_model_name=served_name,
                hardware=hardware,
                tp=tp,
                max_batch=max_batch,
            )
        setup, hw, searched = prepared.setup, prepared.hardware, prepared.plan
        if not quiet and not searched.seeded:
            typer.echo(f"slotune: {searched.reason}", err=True)
        costs = tune_backend.knob_costs(setup.actuator)
        current = setup.actuator.current() if costs.batch == "restart" else None
        tuner = Tuner(
            space=searched.space,
            slo=slo,
            storage=study,
            study_name=study_name,
            seed_knobs=searched.seeds,
            model_tpot_s=searched.model_tpot_s,
            seed=seed,
            costs=costs,
            applied_batch_cap=None if current is None else current.max_batch_size,
        )
        plan = tune_backend.fit_to_scrapes(plan, setup.reader, quiet=quiet)
        target = RayServeTarget(
            url=setup.url,
            slo=slo,
            reader=setup.reader,
            actuator=setup.actuator,
            plan=plan,
            shape=shape,
        )
        a = searched.analysis
        base = CurveReport(
            slo=slo,
            trials=(),
            predicted=searched.predicted,
            model=tune_backend.model_label(
                searched,
                (ckpt_model.name if ckpt_model else MODELS[model]) if builtin else None,
                app_name or url,
            ),
            hardware=hw.name if hw is not None else "unknown (give --hardware)",
            hardware_detail=tune_backend.hardware_detail(hw, prepared.hardware_note, setup.device),
            usd_per_hour=price_per_hour,
            knee_batch=None if a is None else a.knee_batch,
            ridge_flops_per_byte=None if a is None else round(a.ridge_flops_per_byte, 1),
            predicted_batch=searched.seed_batch,
            model_curve=searched.model_curve,
            seed_note=searched.reason,
            backend={**setup.actuator.describe(), "metrics": setup.reader_desc},
            meta={
                "command": "slotune " + " ".join(sys.argv[1:]),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "app": setup.app,
                "url": setup.url,
                "metrics": setup.reader_desc,
                "storage": study,
                "study": study_name,
                "window": f"warm-up {plan.warmup_s:g} s, then until the verdict is decided"
                f" (anytime-valid, 95%; before {plan.window_s:g} s and {plan.min_requests}"
                " requests only a clear violation), at most"
                f" {plan.budget_requests} requests or {plan.max_window_s:g} s",
                "load": f"closed loop at each trial's max_concurrency; prompt {prompt_tokens}, "
                f"output {output_tokens} tokens; {endpoint}, {prompt_format} prompts"
                + (f" sized by {shape.tokenizer}" if shape.tokenizer else "")
                + (", ignore_eos" if shape.ignore_eos else ""),
                "price": price_source,
                "setup_s": round(time.monotonic() - started, 1),
            },
        )
        progress = Progress() if quiet else RichProgress(slo)
        sweep_target = RayServeTarget(
            url=setup.url,
            slo=slo,
            reader=setup.reader,
            actuator=setup.actuator,
            plan=sweep_plan(plan),
            shape=shape,
        )
        outcome = run_tune(
            target=target,
            tuner=tuner,
            base=base,
            limits=limits,
            out_dir=out_dir,
            progress=progress,
            sweep_target=sweep_target,
        )
    finally:
        if setup is not None and setup.started_ray:
            shutdown_local()
    _finish(outcome, out_dir, quiet)


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
    if sweep := outcome.report.meta.get("curve_sweep"):
        lines.append(f"curve sweep: {sweep}")
    lines.append(outcome.final_note)
    for line in lines:  # the result, even with --quiet (which silences only the progress)
        typer.echo(line, err=op is None)
    if outcome.interrupted:
        typer.echo("slotune: interrupted; study saved, best so far exported", err=True)
        raise typer.Exit(130)
    if outcome.aborted:
        typer.echo(f"slotune: stopped by a fault: {outcome.aborted}", err=True)
        raise typer.Exit(1)
    if op is None and (cand := outcome.report.undecided()) is not None:
        raise Undecided(
            f"{len(outcome.report.searched)} trials; {undecided_summary(cand, outcome.report.slo)}."
            f" See {out_dir / 'report.html'}"
        )
    if op is None:
        hint = outcome.report.sample_hint()
        raise NoFeasiblePoint(
            f"{len(outcome.report.searched)} trials, none met both SLOs with confidence"
            + (f"; {hint}" if hint else "")
            + f" See {out_dir / 'report.html'}"
        )


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
