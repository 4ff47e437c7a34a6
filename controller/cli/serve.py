"""``slotune serve``: start Ray locally, deploy the completion server, print its URLs.

Ray is started with only what serving needs (no dashboard, a bounded object
store, metrics exported every second on ``--metrics-port``), always a new cluster of
its own, on loopback and with token auth (serving.app.cluster); Serve's HTTP proxy
binds loopback. The command blocks until Ctrl-C (or ``--for`` seconds), then
shuts Serve and Ray down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import typer

from controller.cli.flags import slo_from_ms
from controller.errors import BadInput
from metrics.observation import DEFAULT_SLO
from serving.app.config import DEFAULT_STREAM_EVENTS_PER_S, DEFAULT_STREAM_INTERVAL_S

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise BadInput(msg)


def serve(
    model: str = typer.Option("tiny", help="Model preset: tiny | small."),
    max_batch_size: int = typer.Option(8, help="Decode batch limit (live knob)."),
    max_ongoing_requests: int = typer.Option(16, help="Admission limit per replica (live)."),
    max_queued_requests: int = typer.Option(
        64, help="Requests queued beyond the admission limit before a 429 (-1: unbounded)."
    ),
    max_slots: int = typer.Option(64, help="KV-cache slots (the largest possible batch)."),
    slo_ttft_ms: float = typer.Option(
        DEFAULT_SLO.ttft_p99_s * 1e3, "--slo-ttft-ms", help="p99 TTFT SLO, ms (slo_met label)."
    ),
    slo_tpot_ms: float = typer.Option(
        DEFAULT_SLO.tpot_p99_s * 1e3, "--slo-tpot-ms", help="p99 TPOT SLO, ms (slo_met label)."
    ),
    port: int = typer.Option(8000, help="HTTP port of Serve's proxy (on 127.0.0.1)."),
    metrics_port: int = typer.Option(8080, help="Ray's metrics export port (Prometheus)."),
    num_cpus: int = typer.Option(2, help="CPUs Ray may schedule."),
    torch_threads: int = typer.Option(1, help="torch threads in the replica."),
    device: str = typer.Option("cpu", help="cpu | cuda[:N]."),
    checkpoint: str | None = typer.Option(None, help="Local HF-layout checkpoint directory."),
    max_len: int = typer.Option(512, help="Context per request (prompt + output tokens)."),
    app_name: str = typer.Option("slotune", help="Serve application name."),
    stream_interval: float = typer.Option(
        DEFAULT_STREAM_INTERVAL_S,
        help="Hold a request's streamed tokens at most this long, seconds; the first token"
        " and the end go out at once (0: every token).",
    ),
    stream_events_per_s: float = typer.Option(
        DEFAULT_STREAM_EVENTS_PER_S,
        help="Streamed events per second the replica aims at over all requests (0: no budget).",
    ),
    run_for: float = typer.Option(
        0.0, "--for", help="Serve this many seconds, then exit (0: until Ctrl-C)."
    ),
) -> None:
    """Serve the model locally behind an OpenAI-compatible API (Ray Serve)."""
    from serving.app.config import LiveConfig, ServerArgs

    for name, v in (("--port", port), ("--metrics-port", metrics_port)):
        _check(0 < v < 65536, f"{name} {v}: must be a TCP port in 1..65535")
    _check(port != metrics_port, f"--port and --metrics-port are both {port}: use two ports")
    _check(num_cpus >= 1, f"--num-cpus {num_cpus}: must be >= 1")
    _check(run_for >= 0, f"--for {run_for}: must be >= 0 seconds")
    _check(max_ongoing_requests >= 1, f"--max-ongoing-requests {max_ongoing_requests}: >= 1")
    _check(
        max_queued_requests == -1 or max_queued_requests >= 1,
        f"--max-queued-requests {max_queued_requests}: must be -1 or >= 1",
    )
    slo = slo_from_ms(slo_ttft_ms, slo_tpot_ms)
    try:
        args = ServerArgs(
            model=model,
            max_slots=max_slots,
            device=device,
            checkpoint=checkpoint,
            max_len=max_len,
            torch_threads=torch_threads,
            stream_interval_s=stream_interval,
            stream_events_per_s=stream_events_per_s,
        )
        live = LiveConfig(
            max_batch_size=max_batch_size,
            ttft_p99_s=slo.ttft_p99_s,
            tpot_p99_s=slo.tpot_p99_s,
            max_ongoing_requests=max_ongoing_requests,
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    try:
        live.check_fits(args)
    except ValueError:  # the same check, said in the flags' words
        raise BadInput(
            f"--max-batch-size {max_batch_size}: must be <= --max-slots {max_slots}"
        ) from None
    if checkpoint is not None:
        _check(os.path.isdir(checkpoint), f"--checkpoint {checkpoint}: not a directory")

    import ray
    from ray import serve as ray_serve

    from serving.app.cluster import start_local_ray
    from serving.app.deploy import deploy_app

    cluster = start_local_ray(
        num_cpus=num_cpus, metrics_port=metrics_port, http_port=port, host=LOOPBACK
    )
    try:
        t0 = time.monotonic()
        deploy_app(args, live, name=app_name, max_queued_requests=max_queued_requests)
        url = f"http://{LOOPBACK}:{port}"
        typer.echo(f"serving {args.served_name} in {time.monotonic() - t0:.1f} s")
        typer.echo(f"url: {url}/v1  (POST /v1/completions, GET /v1/models, GET /health)")
        typer.echo(f"metrics: http://{LOOPBACK}:{metrics_port}/metrics")
        env = " ".join(f"{k}={v}" for k, v in cluster.attach_env().items())
        typer.echo(f"ray: {cluster.gcs_address} (loopback, token auth); attach with {env}")
        _block(run_for)
    finally:
        try:
            ray_serve.shutdown()
        finally:
            ray.shutdown()


def _block(run_for: float) -> None:
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait(run_for if run_for > 0 else None)
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
