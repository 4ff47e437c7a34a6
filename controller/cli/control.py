"""``slotune control``: keep a live deployment's batch and admission limits at the operating
point as its traffic changes (controller/control/). Passive: it reads windows from
Prometheus (``--prometheus-url``; ``--metrics-url`` scrapes an endpoint instead), decides
each tick, and acts through the actuator (``--actuator``, as ``slotune tune``)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from controller.cli.flags import at_least, http_url, slo_from_ms
from controller.cli.paths import input_file
from controller.errors import BadInput
from metrics.observation import DEFAULT_SLO, Slo

if TYPE_CHECKING:
    from controller.control.policy import Policy

log = logging.getLogger(__name__)


def _default_state(app: str) -> Path:
    from search.calibrate.device import cache_root

    return cache_root() / "control" / f"{app}.json"


def _share(flag: str, v: float) -> None:
    if not (math.isfinite(v) and 0 < v < 1):
        raise BadInput(f"{flag} {v!r}: must be a share of the SLO in (0, 1)")


def _policy(
    slo: Slo,
    curve: Path | None,
    max_batch: int | None,
    tighten_at: float | None,
    loosen_below: float | None,
    stabilization_s: float | None,
    min_requests: int | None,
    attainment: float | None = None,
) -> Policy:
    """The control policy of the flags: bounded by ``--curve`` or ``--max-batch``."""
    from controller.control.policy import Policy, policy_from_curve

    try:
        given = dict(
            tighten_at=tighten_at,
            loosen_below=loosen_below,
            stabilization_s=stabilization_s,
            min_requests=min_requests,
            attainment=attainment,
        )
        knobs = {k: v for k, v in given.items() if v is not None}  # else the Policy's
        if curve is not None:
            input_file("--curve", curve)
            try:
                report = json.loads(curve.read_text())
            except (OSError, ValueError) as e:
                raise BadInput(f"--curve {curve}: not a readable curve.json ({e})") from None
            if max_batch is not None:
                knobs["batch_max"] = max_batch
            return policy_from_curve(report, slo=slo, **knobs)
        elif max_batch is not None:
            return Policy(slo=slo, batch_max=max_batch, **knobs)  # type: ignore[arg-type]
        else:
            raise BadInput(
                "give --curve (a canary's curve.json) or --max-batch: the controller never "
                "raises the batch limit past a bound"
            )
    except ValueError as e:
        if isinstance(e, BadInput):
            raise
        raise BadInput(f"control policy: {e}") from None


def control(
    app: str = typer.Option(..., "--app", help="The Serve application to control."),
    actuator: str = typer.Option(
        "serve",
        "--actuator",
        help="How changes reach it: serve, serve-llm, kuberay (the RayService CR), embedded, none.",
    ),
    rayservice: str = typer.Option(
        None, "--rayservice", help="kuberay: the RayService whose serveConfigV2 is changed."
    ),
    namespace: str = typer.Option(
        None, "--namespace", help="kuberay: its namespace [the pod's own, else default]."
    ),
    deployment: str = typer.Option(None, "--deployment", help="The deployment within the app."),
    batch_knob: str = typer.Option(None, "--batch-knob", help="The batch limit's config path."),
    dashboard_url: str = typer.Option(None, "--dashboard-url", help="Ray's dashboard (REST)."),
    prometheus_url: str = typer.Option(None, "--prometheus-url", help="A Prometheus server."),
    metrics_url: str = typer.Option(None, "--metrics-url", help="Scrape this /metrics instead."),
    metrics_prefix: str = typer.Option(None, "--metrics-prefix", help="e.g. ray_ (Ray's port)."),
    metrics_profile: str = typer.Option(
        None, "--metrics-profile", help="slotune, vllm, sglang (detected when not given)."
    ),
    curve: Path = typer.Option(
        None, "--curve", help="A canary's curve.json: bounds and the curve to predict on."
    ),
    max_batch: int = typer.Option(None, "--max-batch", help="Upper bound of the batch limit."),
    slo_ttft_ms: float = typer.Option(
        DEFAULT_SLO.ttft_p99_s * 1e3, "--slo-ttft-ms", help="p99 TTFT SLO (ms)."
    ),
    slo_tpot_ms: float = typer.Option(
        DEFAULT_SLO.tpot_p99_s * 1e3, "--slo-tpot-ms", help="p99 TPOT SLO (ms)."
    ),
    interval_s: float = typer.Option(60.0, "--interval", help="Seconds a tick (its window)."),
    stabilization_s: float = typer.Option(
        None, "--stabilization", help="Seconds of calm queueing before loosening [300]."
    ),
    tighten_at: float = typer.Option(
        None, "--tighten-at", help="Lower at this share of the SLO [0.95]."
    ),
    loosen_below: float = typer.Option(
        None, "--loosen-below", help="Raise only under this share [0.9]."
    ),
    min_requests: int = typer.Option(
        None, "--min-requests", help="Fewer in a window: inconclusive, hold [100]."
    ),
    attainment: float = typer.Option(
        None,
        "--attainment",
        help="Share of windows to keep within the TPOT SLO: the band is lowered for the "
        "windows' measured spread [0.95].",
    ),
    state: Path = typer.Option(None, "--state", help="State file (default: the user cache)."),
    audit: Path = typer.Option(None, "--audit", help="Audit log (default: beside the state)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Recommend; never apply."),
    ack: bool = typer.Option(False, "--ack", help="Clear the degraded latch, adopt live knobs."),
    max_ticks: int = typer.Option(None, "--max-ticks", help="Stop after this many ticks."),
    metrics_port: int = typer.Option(
        None, "--metrics-port", help="Serve the controller's own /metrics on this port."
    ),
    metrics_host: str = typer.Option(
        "127.0.0.1", "--metrics-host", help="...on this address (0.0.0.0 in a pod)."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No line per tick on stderr."),
) -> None:
    """Keep the batch and admission limits at the operating point on live traffic: tighten at
    once when p99 nears the SLO, loosen slowly, hold on missing data, roll back on SLO burn."""
    from controller.backends.actuator import ActuatorError, ActuatorUnavailable
    from controller.backends.registry import ACTUATORS, APPLY_TIMEOUT_S, make_actuator
    from controller.control.decide import acknowledge
    from controller.control.loop import ControlFailed, LoopConfig, ack_path, run_control
    from controller.control.store import Lease, LeaseHeld, load_state, save_state
    from controller.tune_setup import make_reader

    slo = slo_from_ms(slo_ttft_ms, slo_tpot_ms)
    for flag, url in (
        ("--prometheus-url", prometheus_url),
        ("--metrics-url", metrics_url),
        ("--dashboard-url", dashboard_url),
    ):
        http_url(flag, url)
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise BadInput(f"--interval {interval_s!r}: must be a number of seconds > 0")
    stab = stabilization_s
    if stab is not None and not (math.isfinite(stab) and stab >= 0):
        raise BadInput(f"--stabilization {stab!r}: must be a number of seconds >= 0")
    if actuator not in ACTUATORS:
        raise BadInput(f"--actuator {actuator}: choose one of {', '.join(ACTUATORS)}")
    if (rayservice is not None or namespace is not None) and actuator != "kuberay":
        raise BadInput(f"--rayservice/--namespace: only for --actuator kuberay, not {actuator}")
    if actuator == "kuberay" and rayservice is None:
        raise BadInput("--actuator kuberay: give --rayservice, the RayService to change")
    for flag, share in (("--tighten-at", tighten_at), ("--loosen-below", loosen_below)):
        if share is not None:
            _share(flag, share)
    if attainment is not None and not (math.isfinite(attainment) and 0.5 < attainment < 1):
        raise BadInput(f"--attainment {attainment!r}: must be a share of windows in (0.5, 1)")
    at_least("--min-requests", min_requests, 1)
    at_least("--max-ticks", max_ticks, 1)
    at_least("--max-batch", max_batch, 1)
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise BadInput(f"--metrics-port {metrics_port}: must be in 0..65535")
    state_path = state or _default_state(app)
    audit_path = audit or state_path.with_suffix(".audit.jsonl")
    policy = (
        None
        if ack
        else _policy(
            slo,
            curve,
            max_batch,
            tighten_at,
            loosen_below,
            stabilization_s,
            min_requests,
            attainment,
        )
    )

    try:
        act = make_actuator(
            actuator, app=app, deployment=deployment, batch_knob=batch_knob,
            dashboard_url=dashboard_url, slo=slo, rayservice=rayservice, namespace=namespace,
        )  # fmt: skip
    except (ActuatorError, ActuatorUnavailable, ValueError) as e:
        raise BadInput(f"--actuator {actuator}: {e}") from None

    if ack:
        try:
            with Lease(state_path):
                saved = load_state(state_path)
                if saved is None:
                    raise BadInput(f"--ack: no controller state at {state_path}")
                try:
                    live = act.current()
                except (ActuatorError, ActuatorUnavailable) as e:
                    raise BadInput(f"--ack: the live knobs cannot be read to adopt: {e}") from None
                save_state(acknowledge(saved, live), state_path)
            typer.echo(f"slotune control: acknowledged ({state_path})", err=True)
        except LeaseHeld:
            ack_path(state_path).write_text("ack\n")
            typer.echo(
                "slotune control: acknowledged; the running controller takes it at its next tick",
                err=True,
            )
        return

    reader, what = make_reader(
        slo=slo,
        app=app,
        metrics_url=metrics_url,
        prometheus_url=prometheus_url,
        prefix=metrics_prefix,
        profile=metrics_profile,
        under_ray=False,
    )
    if type(reader).__name__ == "ClientWindow":
        raise BadInput(
            "slotune control sends no load: give --prometheus-url or --metrics-url (a "
            "deployment's metrics), not the client profile"
        )
    exporter = None
    if metrics_port is not None:
        from metrics.exporter import ControllerExporter

        exporter = ControllerExporter()
        try:
            port = exporter.serve(metrics_port, addr=metrics_host)
        except OSError as e:
            raise BadInput(f"--metrics-host/--metrics-port: {e}") from None
        typer.echo(f"slotune control: metrics on http://{metrics_host}:{port}/metrics", err=True)
    say = (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    say(f"slotune control: {app} via {act.name}, windows from {what}; state {state_path}")
    cluster_lease = None
    if actuator == "kuberay":
        from controller.control.kube_lease import KubeLease, lease_name

        # outlives a tick: its window, an apply that waits for every replica, and a retry
        try:
            cluster_lease = KubeLease(
                lease_name(rayservice),
                act.namespace,  # type: ignore[attr-defined]
                duration_s=3 * interval_s + APPLY_TIMEOUT_S,
            )
        except ActuatorError as e:
            raise BadInput(f"--actuator kuberay: {e}") from None
    try:
        run_control(
            reader=reader,
            actuator=act,
            policy=policy,  # type: ignore[arg-type]  # set unless --ack, which returned
            state_path=state_path,
            audit_path=audit_path,
            config=LoopConfig(interval_s=interval_s, dry_run=dry_run, max_ticks=max_ticks),
            exporter=exporter,
            cluster_lease=cluster_lease,
            say=say,
        )
    except LeaseHeld as e:
        print(f"slotune control: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    except (ControlFailed, ValueError) as e:
        print(f"slotune control: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    finally:
        if exporter is not None:
            exporter.close()


def register(app: typer.Typer) -> None:
    app.command("control")(control)
