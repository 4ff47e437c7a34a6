"""``slotune serve``: start Ray locally, deploy the completion server, print its URLs.

Ray is started with only what serving needs (no dashboard, a bounded object
store, metrics exported every second on ``--metrics-port``), always a new cluster of
its own, on loopback and with token auth (serving.app.cluster); Serve's HTTP proxy
binds loopback. The command blocks until Ctrl-C (or ``--for`` seconds), then
shuts Serve and Ray down.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import typer

from controller.cli.flags import slo_from_ms
from controller.cli.paths import checkpoint_dir
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
    device: str = typer.Option(
        "cpu", help="cpu | cuda: on cuda each replica reserves one GPU (Ray picks which)."
    ),
    num_replicas: int | None = typer.Option(
        None, "--num-replicas", help="Replicas (default: 1 on cpu, one per visible GPU on cuda)."
    ),
    checkpoint: str | None = typer.Option(None, help="Local HF-layout checkpoint directory."),
    served_model_name: str | None = typer.Option(
        None,
        "--served-model-name",
        help="The model id /v1/models reports and requests name (default: the checkpoint"
        " folder's name, else slotune-<model>).",
    ),
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
    from serving.app.deploy import actor_options

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
    if checkpoint is not None:
        checkpoint = checkpoint_dir("--checkpoint", checkpoint)
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
            served_model_name=served_model_name,
        )
        actor_options(args)  # a device a Ray-placed replica cannot see is refused here
        live = LiveConfig(
            max_batch_size=max_batch_size,
            ttft_p99_s=slo.ttft_p99_s,
            tpot_p99_s=slo.tpot_p99_s,
            max_ongoing_requests=max_ongoing_requests,
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    replicas = replica_count(num_replicas, device)
    try:
        live.check_fits(args)
    except ValueError:  # the same check, said in the flags' words
        raise BadInput(
            f"--max-batch-size {max_batch_size}: must be <= --max-slots {max_slots}"
        ) from None

    import ray
    from ray import serve as ray_serve

    from serving.app.cluster import start_local_ray
    from serving.app.deploy import deploy_app

    # Replicas ask for no CPU (serving/app/server.py), so num_cpus never holds them back;
    # on cuda, Ray is told the GPUs torch counted, so it can place one replica on each
    # even where its own detection would find none.
    cluster = start_local_ray(
        num_cpus=num_cpus,
        metrics_port=metrics_port,
        http_port=port,
        host=LOOPBACK,
        num_gpus=visible_gpus() if args.device.startswith("cuda") else None,
    )
    try:
        t0 = time.monotonic()
        deploy_app(
            args,
            live,
            name=app_name,
            max_queued_requests=max_queued_requests,
            num_replicas=replicas,
        )
        url = f"http://{LOOPBACK}:{port}"
        typer.echo(
            f"serving {args.served_name} on {replicas} x {args.device} "
            f"in {time.monotonic() - t0:.1f} s"
        )
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


def visible_gpus() -> int:
    """The GPUs torch sees in this process (CUDA_VISIBLE_DEVICES applies; 0 without CUDA).
    torch is imported only here: a CPU serve never loads it in the CLI."""
    import torch

    return torch.cuda.device_count()


def replica_count(given: int | None, device: str) -> int:
    """``--num-replicas``, else its default: one on the CPU; on CUDA one per visible GPU,
    since each replica reserves a whole GPU (serving.app.deploy.actor_options), so more
    than are visible would never be placed."""
    if given is not None and given < 1:
        raise BadInput(f"--num-replicas {given}: must be an integer >= 1")
    if not device.startswith("cuda"):
        return given or 1
    gpus = visible_gpus()
    if gpus == 0:
        raise BadInput(
            f"--device {device}: torch sees no GPU here (torch.cuda.device_count() is 0); "
            "give --device cpu, or run where CUDA is"
        )
    if given is not None and given > gpus:
        raise BadInput(
            f"--num-replicas {given}: each replica on --device {device} takes a GPU and "
            f"{gpus} are visible; give at most {gpus}"
        )
    return given or gpus


def _block(run_for: float) -> None:
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait(run_for if run_for > 0 else None)
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
