"""``slotune tune`` (the canary job) and ``slotune export`` (rebuild a report from a study).

``slotune tune`` with no arguments starts a local Ray, deploys the built-in
``small`` model on the local device (CUDA if there is one, else CPU), calibrates
the device (cached), and tunes. ``--address`` attaches to a running Ray cluster
(and deploys the built-in model there); ``--app`` attaches to an existing
deployment of ``serving.app:app`` instead. Exit codes: 0 a feasible point was
found, 3 none meets the SLO, 2 bad input, 1 the run was stopped by a fault, 130
Ctrl-C; in every case the report of what was measured is written.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from controller.errors import BadInput, NoFeasiblePoint

log = logging.getLogger(__name__)

MODELS = {"tiny": "slotune-tiny", "small": "slotune-small"}  # serving preset → roofline model
DEFAULT_SLOTS = {"tiny": 64, "small": 128}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _positive(flag: str, v: float | None, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if v is None or not (math.isfinite(v) and v > 0):
        raise BadInput(f"{flag} {v!r}: must be a positive number")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Where the deployment is and how to read it (what the run attached to or started)."""

    app: str
    url: str  # HTTP base of the app
    reader: Any
    reader_desc: str
    started_ray: bool
    device: str


def start_local_ray() -> tuple[int, int]:
    """Ray + Serve on this machine, loopback only; returns (metrics port, HTTP port)."""
    from serving.deploy import start_local_ray as start

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    metrics_port, http_port = _free_port(), _free_port()
    start(num_cpus=os.cpu_count() or 2, metrics_port=metrics_port, http_port=http_port)
    return metrics_port, http_port


def attach_ray(address: str | None) -> None:
    import ray

    if address and address != "auto":
        _check_reachable(address)
    if ray.is_initialized():
        return
    from serving.deploy import ray_env_defaults

    ray_env_defaults()
    try:
        ray.init(address=address or "auto", log_to_driver=False)
    except Exception as e:  # ConnectionError, RuntimeError... all mean "cannot attach"
        raise BadInput(
            f"--address {address or 'auto'}: cannot connect to a Ray cluster ({e}); "
            "start one with `ray start --head` or omit --address to run locally"
        ) from None


def _check_reachable(address: str) -> None:
    """Fail fast on a Ray address nobody listens on (ray.init would retry for minutes)."""
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise BadInput(f"--address {address}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=3.0).close()
    except OSError as e:
        raise BadInput(
            f"--address {address}: nothing answers there ({e.strerror or e}); "
            "start a cluster with `ray start --head` or omit --address to run locally"
        ) from None


def serve_url(app: str) -> str:
    """http://host:port/prefix of ``app`` from Serve's own details."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        raise BadInput("no Ray Serve instance runs on this cluster: nothing to tune")
    details = client.get_serve_details()
    apps = details.get("applications", {})
    if app not in apps:
        raise BadInput(f"--app {app}: no such application (running: {sorted(apps) or 'none'})")
    http = details.get("http_options") or {}
    host = http.get("host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    prefix = apps[app].get("route_prefix") or "/"
    return f"http://{host}:{http.get('port', 8000)}{prefix.rstrip('/')}"


def check_deployment(app: str, deployment: str | None) -> None:
    from ray import serve

    from serving.app import DEPLOYMENT_NAME

    apps = serve.status().applications
    if app not in apps:
        raise BadInput(f"--app {app}: no such application (running: {sorted(apps) or 'none'})")
    deps = apps[app].deployments
    name = deployment or DEPLOYMENT_NAME
    if name not in deps:
        raise BadInput(f"--deployment {name}: not in app {app!r} (it has {sorted(deps)})")
    if name != DEPLOYMENT_NAME:
        raise BadInput(
            f"--deployment {name}: slotune turns the batch limit of serving.app:app "
            f"deployments ({DEPLOYMENT_NAME}) live; this one has no such knob"
        )


def ray_metrics_url() -> str:
    """The metrics export endpoint of the (single) node of the attached cluster."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) != 1:
        raise BadInput(
            f"the cluster has {len(nodes)} nodes: give --metrics-url of the replica's node "
            "or --prometheus-url of a Prometheus that scrapes them all"
        )
    n = nodes[0]
    return f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"


def make_reader(
    *, slo: Any, app: str, metrics_url: str | None, prometheus_url: str | None, prefix: str
) -> tuple[Any, str]:
    from controller.targets import PromQLWindow, ScrapeWindow
    from metrics.sources import PromQLSource, ScrapeSource

    sel = {"application": app}
    try:
        if prometheus_url:
            src = PromQLSource(prometheus_url, slo=slo, prefix=prefix, selector=sel)
            return PromQLWindow(src), f"Prometheus {prometheus_url}"
        url = metrics_url or ray_metrics_url()
        src = ScrapeSource(url, slo=slo, prefix=prefix, selector=sel)
        return ScrapeWindow(src), f"scrape {url}"
    except ValueError as e:
        raise BadInput(f"metrics source: {e}") from None


def hardware_spec(device: str, *, quiet: bool) -> tuple[Any, str]:
    """The calibrated HardwareSpec of this device, measured once and cached."""
    from search import calibrate as calib
    from search.hardware import HardwareSpec

    dev = calib.pick_device(device)
    path = calib.default_cache_path(dev)
    if path.exists():
        return HardwareSpec.from_json(path), f"calibration cached at {path}"
    if not quiet:
        print(f"slotune: calibrating {dev} once (cached at {path}) ...", file=sys.stderr)
    cal = calib.calibrate(device=device, plan=calib.PLANS["full"])
    cal.spec.to_json(path, extra=cal.measured)
    return cal.spec, f"calibrated now ({cal.elapsed_s:.0f} s), cached at {path}"


def plan_search(
    *, model: str, hardware: Any, slo: Any, price: float | None, max_slots: int, context: int
) -> dict[str, Any]:
    """The roofline's prediction, the search box it bounds and the seed knobs."""
    from controller.report import PredictedPoint
    from search.models import resolve_model
    from search.roofline import Roofline, analyze
    from search.space import Knobs, SearchSpace

    roof = Roofline(
        model=resolve_model(MODELS[model]), hardware=hardware, dtype="bf16", context=context
    )
    cap = max(1, min(max_slots, roof.max_batch_memory))
    a = analyze(roof, slo_tpot_s=slo.tpot_p99_s, max_batch=cap, usd_per_hour=price)
    try:
        space = SearchSpace.bounded(
            step_time_s=roof.step_time_s, max_batch_memory=cap, slo=slo, headroom_max=2.0
        )
    except ValueError as e:
        raise NoFeasiblePoint(f"the roofline rules out every batch: {e}") from None
    b = a.operating_point.batch if a.operating_point is not None else 1
    seeds = [space.clip(Knobs(max_batch_size=b, max_concurrency=b))]
    for f in (0.5, 1.5):
        bb = max(1, round(b * f))
        k = space.clip(Knobs(max_batch_size=bb, max_concurrency=bb))
        if k not in seeds:
            seeds.append(k)
    return {
        "roofline": roof,
        "analysis": a,
        "space": space,
        "seeds": seeds,
        "predicted": tuple(PredictedPoint.of(p) for p in a.curve),
        "seed_batch": b,
    }


def tune(
    address: str = typer.Option(None, "--address", help="Attach to this Ray cluster."),
    app_name: str = typer.Option(None, "--app", help="Tune this existing Serve application."),
    deployment: str = typer.Option(None, "--deployment", help="Deployment within --app."),
    url: str = typer.Option(None, "--url", help="HTTP base of the app (default: from Serve)."),
    metrics_url: str = typer.Option(None, "--metrics-url", help="Prometheus text endpoint."),
    prometheus_url: str = typer.Option(None, "--prometheus-url", help="Prometheus server."),
    metrics_prefix: str = typer.Option("ray_", "--metrics-prefix", help="Exported name prefix."),
    slo_ttft_ms: float = typer.Option(1000.0, "--slo-ttft-ms", help="p99 TTFT SLO (ms)."),
    slo_tpot_ms: float = typer.Option(100.0, "--slo-tpot-ms", help="p99 TPOT SLO (ms)."),
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
    storage: str = typer.Option(None, "--storage", help="Optuna storage (default OUT/study)."),
    study_name: str = typer.Option("slotune-tune", "--study", help="Study name."),
    seed: int = typer.Option(0, "--seed", help="Sampler and load seed."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No live progress display."),
) -> None:
    """Find the operating point of a live deployment and export the curve."""
    from controller.loadgen import LengthDist, load_trace
    from controller.report import CurveReport
    from controller.targets import RayServeTarget, RequestShape, WindowPlan
    from controller.tune import Progress, RichProgress, TuneLimits, run_tune
    from metrics.observation import Slo
    from search.tuner import Tuner

    _positive("--slo-ttft-ms", slo_ttft_ms)
    _positive("--slo-tpot-ms", slo_tpot_ms)
    _positive("--time-budget", time_budget)
    if price_per_hour is not None and not (math.isfinite(price_per_hour) and price_per_hour >= 0):
        raise BadInput(f"--price-per-hour {price_per_hour!r}: must be a number >= 0")
    if model not in MODELS:
        raise BadInput(f"--model {model}: choose one of {', '.join(MODELS)}")
    if metrics_url and prometheus_url:
        raise BadInput("--metrics-url and --prometheus-url: give one, not both")
    try:
        slo = Slo(ttft_p99_s=slo_ttft_ms / 1e3, tpot_p99_s=slo_tpot_ms / 1e3)
        limits = TuneLimits(max_trials=max_trials, time_budget_s=time_budget)
        plan = WindowPlan(
            warmup_s=warmup_s,
            window_s=window_s,
            max_window_s=max(max_window_s, window_s),
            min_requests=min_requests,
        )
        shape = RequestShape(
            prompt_tokens=LengthDist.parse(prompt_tokens),
            output_tokens=LengthDist.parse(output_tokens),
            trace=load_trace(trace) if trace else None,
            model=served_model,
            seed=seed,
        )
    except (ValueError, OSError) as e:
        raise BadInput(str(e)) from None
    out_dir = out or Path("slotune-out") / time.strftime("%Y%m%d-%H%M%S")
    if storage is None:
        out_dir.mkdir(parents=True, exist_ok=True)
        storage = str(out_dir / "study.journal")
    slots = max_slots or DEFAULT_SLOTS[model]
    started = time.monotonic()
    setup = None
    try:
        setup, hw, hw_note, searched = _prepare_or_exit(
            address=address,
            app_name=app_name,
            deployment=deployment,
            url=url,
            metrics_url=metrics_url,
            prometheus_url=prometheus_url,
            prefix=metrics_prefix,
            slo=slo,
            model=model,
            slots=slots,
            price=price_per_hour,
            shape=shape,
            quiet=quiet,
        )
        a = searched["analysis"]
        tuner = Tuner(
            space=searched["space"],
            slo=slo,
            storage=storage,
            study_name=study_name,
            seed_knobs=searched["seeds"],
            model_tpot_s=searched["roofline"].step_time_s,
            seed=seed,
        )
        target = RayServeTarget(
            url=setup.url, app_name=setup.app, slo=slo, reader=setup.reader, plan=plan, shape=shape
        )
        base = CurveReport(
            slo=slo,
            trials=(),
            predicted=searched["predicted"],
            model=MODELS[model] if app_name is None else f"{app_name} ({MODELS[model]} assumed)",
            hardware=hw.name,
            hardware_detail={
                "source": hw_note,
                "memory_bandwidth_gb_s": round(hw.mem_bandwidth / 1e9, 1),
                "bf16_peak_tflops": round(hw.peak_flops.get("bf16", math.nan) / 1e12, 2),
                "device": setup.device,
            },
            usd_per_hour=price_per_hour,
            knee_batch=a.knee_batch,
            ridge_flops_per_byte=round(a.ridge_flops_per_byte, 1),
            predicted_batch=searched["seed_batch"],
            meta={
                "command": "slotune " + " ".join(sys.argv[1:]),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "app": setup.app,
                "url": setup.url,
                "metrics": setup.reader_desc,
                "storage": storage,
                "study": study_name,
                "window": f"warm-up {plan.warmup_s:g} s, {plan.window_s:g}-{plan.max_window_s:g}"
                f" s, aiming at {plan.min_requests} requests",
                "load": f"closed loop at each trial's max_concurrency; prompt {prompt_tokens}, "
                f"output {output_tokens} tokens",
                "setup_s": round(time.monotonic() - started, 1),
            },
        )
        progress = Progress() if quiet else RichProgress(slo)
        outcome = run_tune(
            target=target, tuner=tuner, base=base, limits=limits, out_dir=out_dir, progress=progress
        )
    finally:
        if setup is not None and setup.started_ray:
            _shutdown_local()
    _finish(outcome, out_dir, quiet)


class SetupFailed(RuntimeError):
    """Starting, attaching or deploying failed (exit 1 with the reason)."""


def _prepare_or_exit(**kw: Any) -> tuple[Setup, Any, str, dict[str, Any]]:
    try:
        return _prepare(**kw)
    except SetupFailed as e:
        typer.echo(f"slotune: error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("slotune: interrupted during set-up; nothing was tuned", err=True)
        raise typer.Exit(130) from None


def _prepare(**kw: Any) -> tuple[Setup, Any, str, dict[str, Any]]:
    """Start or attach, deploy if needed, calibrate, and plan the search."""
    from serving.deploy import DeployError, deploy_app

    app = kw["app_name"]
    slo = kw["slo"]
    context = round(kw["shape"].prompt_tokens.mean + kw["shape"].output_tokens.mean / 2)
    device = "cpu"
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # torch is a dependency; be explicit anyway
        pass
    started = False
    if kw["address"] is None and app is None:
        if not kw["quiet"]:
            print("slotune: starting a local Ray and Serve (127.0.0.1) ...", file=sys.stderr)
        metrics_port, _ = start_local_ray()
        started = True
        metrics_url = kw["metrics_url"] or f"http://127.0.0.1:{metrics_port}/metrics"
    else:
        attach_ray(kw["address"])
        metrics_url = kw["metrics_url"]
    hw, hw_note = hardware_spec(device, quiet=kw["quiet"])
    searched = plan_search(
        model=kw["model"],
        hardware=hw,
        slo=slo,
        price=kw["price"],
        max_slots=kw["slots"],
        context=context,
    )
    if app is None:
        app = "slotune"
        first = searched["seeds"][0]
        if not kw["quiet"]:
            print(
                f"slotune: deploying the built-in {kw['model']!r} model on {device} ...",
                file=sys.stderr,
            )
        try:
            deploy_app(
                model=kw["model"],
                max_batch_size=first.max_batch_size,
                max_ongoing_requests=first.max_concurrency,
                slo=slo,
                max_slots=kw["slots"],
                max_queued_requests=-1,
                name=app,
                device=device,
                torch_threads=max(1, min(4, (os.cpu_count() or 2) - 1)),
            )
        except (DeployError, ValueError) as e:
            raise SetupFailed(f"deploying the built-in model failed: {e}") from e
    else:
        check_deployment(app, kw["deployment"])
    reader, desc = make_reader(
        slo=slo,
        app=app,
        metrics_url=metrics_url,
        prometheus_url=kw["prometheus_url"],
        prefix=kw["prefix"],
    )
    setup = Setup(
        app=app,
        url=kw["url"] or serve_url(app),
        reader=reader,
        reader_desc=desc,
        started_ray=started,
        device=device,
    )
    return setup, hw, hw_note, searched


def _shutdown_local() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _finish(outcome: Any, out_dir: Path, quiet: bool) -> None:
    op = outcome.report.operating_point()
    lines = [f"report: {out_dir / 'report.html'}", f"stopped: {outcome.stop_reason}"]
    if op is not None:
        cost = op["usd_per_million_tokens"]
        lines.append(
            f"operating point: max_batch_size={op['max_batch_size']} "
            f"max_concurrency={op['max_concurrency']}: {op['goodput_rps']:.2f} req/s within "
            f"SLO, {op['tokens_per_s']:.0f} tokens/s, p99 TTFT {op['p99_ttft_ms']:.0f} ms, "
            f"p99 TPOT {op['p99_tpot_ms']:.1f} ms"
            + (f", ${cost:.3g} per million tokens" if cost == cost else "")
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


def export(
    study: str = typer.Argument(..., help="Study storage: a journal file or an Optuna URL."),
    study_name: str = typer.Option(None, "--study", help="Study name (if it holds several)."),
    out: Path = typer.Option(None, "--out", help="Default: the storage file's folder."),
) -> None:
    """Rebuild curve.csv, curve.json, curve.png and report.html from a stored study."""
    from controller.report import write_report
    from controller.tune import report_from_study

    if "://" not in study and not Path(study).exists():
        raise BadInput(f"STUDY {study}: no such file (give a journal file or an Optuna URL)")
    try:
        report = report_from_study(study, study_name)
    except (ValueError, KeyError) as e:
        raise BadInput(str(e)) from None
    out_dir = out or (Path(study).parent if "://" not in study else Path("slotune-out/export"))
    paths = write_report(report, out_dir)
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")
    if report.chosen is None:
        raise NoFeasiblePoint(f"the study's {len(report.trials)} trials hold no feasible point")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
    app.command("export")(export)
