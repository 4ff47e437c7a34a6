"""The Ray Serve deployment: an OpenAI-compatible completion server over the engine.

``import_path: serving.app.server:app`` (deploy/serve-config.yaml, KubeRay) names
:func:`app`, an application builder: the config's ``args`` become
:class:`ServerArgs` (changing them rebuilds the replica) and the deployment's
``user_config`` becomes :class:`LiveConfig`, applied in place by
``reconfigure`` (batch limit and SLO thresholds, no restart); both live in
serving/app/config.py.

Routes (relative to the route prefix):

- ``POST /v1/completions``: OpenAI completions, SSE with ``stream: true``.
- ``POST /v1/chat/completions``: OpenAI chat completions (the checkpoint's chat template,
  else the plain one of serving/model/tokenizer.py), SSE with ``stream: true``. Which
  request fields are honoured, accepted at their default only, or ignored:
  serving/app/openai_fields.py.
- ``GET /v1/models``: the one served model.
- ``GET /health``: 200 while the engine's step loop is alive.
- ``GET /stats``: engine stats, pid, the applied live config, and what the process
  runs with (torch threads, OMP_WAIT_POLICY, the engine thread's niceness) (JSON).

The completion routes' per-request flow (body limits, parsing, tokenizing, admission,
generation, streaming, request metrics) is serving/app/completions.py's. Admission is
the replica's (serving/app/admission.py): the live ``max_ongoing_requests`` in the
engine (the user_config's, else the deployment's own, read live),
``max_queued_requests`` waiting, and beyond that a 429 with ``Retry-After`` at once.
The private Ray names this uses go through serving/app/ray_private.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.app import openai_api as oa
from serving.app import ray_private
from serving.app.admission import Admission
from serving.app.completions import CompletionHandler, json_error
from serving.app.config import (
    DEFAULT_MAX_ONGOING_REQUESTS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEPLOYMENT_NAME,
    KV_NAMESPACE,
    LiveConfig,
    ServerArgs,
    set_omp_wait_policy,
)
from serving.app.serve_metrics import GaugeRefresher, ServeMetrics

logger = logging.getLogger(__name__)


@serve.deployment(
    name=DEPLOYMENT_NAME,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS,
    max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS,
    graceful_shutdown_timeout_s=5,
    health_check_period_s=5,
)
class CompletionServer:
    """One replica: an :class:`serving.engine.async_engine.AsyncEngine` behind OpenAI routes."""

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        self.args = ServerArgs.from_args(args)
        set_omp_wait_policy(self.args.omp_wait_policy)  # before torch loads OpenMP
        from serving.engine.async_engine import AsyncEngine
        from serving.model.config import ModelConfig

        self.live = LiveConfig(max_batch_size=min(8, self.args.max_slots))
        self.created = int(time.time())
        self.pid = os.getpid()
        self._metrics: ServeMetrics | None = None  # made on first use: see `metrics`
        self._metrics_lock = threading.Lock()
        self.gauges: GaugeRefresher | None = None
        self.engine = AsyncEngine(
            model_config=ModelConfig.from_name(self.args.model),
            max_slots=self.args.max_slots,
            max_batch_size=self.live.max_batch_size,
            device=self.args.device,
            checkpoint=self.args.checkpoint,
            max_len=self.args.max_len,
            seed=self.args.seed,
            num_threads=self.args.torch_threads,  # Ray set OMP_NUM_THREADS=1: be explicit
            events_per_s=self.args.stream_events_per_s or None,  # 0: no budget
        )
        # Until a user_config sets the replica's own limit (and after one that does not),
        # the deployment's max_ongoing_requests is the admission limit.
        self.admission = Admission(default_limit=deployment_max_ongoing_requests)
        self.completions = CompletionHandler(
            engine=self.engine,
            args=self.args,
            admission=self.admission,
            metrics=lambda: self.metrics,
            front_door=ray_private.proxy_stamps_arrival(),
        )
        self.engine.on_finish = self.completions.on_finish
        self.engine.start()
        ctx = serve.get_replica_context()
        self._kv_key = f"{ctx.app_name}/{ctx.replica_tag}"  # serving/app/replicas.py reads it
        self._publish()
        logger.info("replica %s up: pid %d, %s", ctx.replica_tag, self.pid, self.args)

    @property
    def metrics(self) -> ServeMetrics:
        """Created at the first use, normally in the first ``reconfigure`` (Ray calls it
        before any request), so the histogram bounds contain the deployed SLO."""
        with self._metrics_lock:
            if self._metrics is None:
                self._metrics = ServeMetrics(slo=self.live.slo)
                self.gauges = GaugeRefresher(metrics=self._metrics, stats=self.engine.stats)
                self.gauges.start()
            return self._metrics

    # -- live knobs ---------------------------------------------------------

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        live = LiveConfig.from_user_config(user_config)
        live.check_fits(self.args)
        self.engine.set_max_batch_size(live.max_batch_size)
        self.admission.set_limits(limit=live.max_ongoing_requests, queue=live.max_queued_requests)
        self.live = live
        self.metrics.set_slo(live.slo)
        self._publish()
        logger.info("applied live config %s", live)

    def _publish(self) -> None:
        """Record what this replica applied where serving/app/deploy.py can read it."""
        # Ray's context lags inside reconfigure: a replica following the deployment's limit
        # publishes the one before an update that changes both (its /stats is current).
        state = self.state()
        ray_private.kv_put(self._kv_key, json.dumps(state).encode(), namespace=KV_NAMESPACE)

    def state(self) -> dict[str, Any]:
        """Pid, applied live config, and the admission limit in force: the live config's,
        else the deployment's ``max_ongoing_requests``."""
        return {
            "pid": self.pid,
            "replica": serve.get_replica_context().replica_tag,
            "live": self.live.to_user_config(),
            "max_ongoing_requests": self.admission.effective_limit,
            "max_queued_requests": self.live.max_queued_requests,
            "admitted": self.admission.running,
            "queued": self.admission.waiting,
            "args": self.args.to_args(),
        }

    def runtime(self) -> dict[str, Any]:
        """What the replica's process actually runs with (threads, OpenMP, niceness).

        Niceness is per thread on Linux: this is the engine thread's (Ray renices
        its workers to 15 unless ``RAY_worker_niceness=0``; serving/app/deploy.py).
        """
        import torch

        tid = self.engine.native_thread_id
        return {
            # False when RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 reached the replica.
            "user_code_in_separate_thread": ray_private.user_code_in_separate_thread(),
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "engine_thread_niceness": None if tid is None else os.getpriority(os.PRIO_PROCESS, tid),
            # Whether decode attention and RMSNorm run the C kernels (serving.kernels.cpu_kernels).
            "cpu_kernels": self.engine.engine.cpu_kernels,
        }

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "running": s.running,
            "waiting": s.waiting,
            "kv_usage": s.kv_usage,
            "max_batch_size": s.max_batch_size,
            **self.state(),
            "runtime": self.runtime(),
        }

    def check_health(self) -> None:
        """Ray calls this periodically; raising marks the replica unhealthy."""
        thread = getattr(self.engine, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the engine's step loop has stopped")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self.gauges is not None:
                self.gauges.stop()
        with contextlib.suppress(Exception):
            self.engine.stop()
        with contextlib.suppress(Exception):
            ray_private.kv_del(self._kv_key, namespace=KV_NAMESPACE)

    # -- HTTP ---------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        path = path.rstrip("/") or "/"
        method = request.method
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                return json_error(oa.ApiError(f"{method} {path}: use POST", status=405))
            return await self.completions.handle(request, chat=path == "/v1/chat/completions")
        if method != "GET":
            return json_error(oa.ApiError(f"{method} {path}: not allowed", status=405))
        if path == "/v1/models":
            return JSONResponse(oa.models_body(self.args.served_name, created=self.created))
        if path in ("/health", "/healthz"):
            self.check_health()
            return JSONResponse({"status": "ok"})
        if path == "/stats":
            return JSONResponse(self.stats())
        return json_error(oa.ApiError(f"no route {path}", status=404, type="not_found"))


def deployment_max_ongoing_requests() -> int:
    """The ``max_ongoing_requests`` of this replica's deployment as Serve runs it now.

    Read at each use, never cached: a lightweight update of ``max_ongoing_requests``
    alone does not call the replica's ``reconfigure`` (the user_config is unchanged);
    Serve's ``ReplicaBase.reconfigure`` stores the new deployment config and then replaces
    the replica context with one holding it (``_set_internal_replica_context``,
    ray/serve/_private/replica.py, Ray 2.60), so a fresh read sees the new limit once the
    update is done (and the old one while the user's ``reconfigure`` of the same update
    runs).
    """
    return ray_private.replica_max_ongoing_requests(serve.get_replica_context())


def app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for ``import_path: serving.app.server:app``; ``args`` → ServerArgs."""
    server_args = ServerArgs.from_args(args)  # fail early, in the build task
    return CompletionServer.bind(server_args.to_args())
