"""A Ray Serve app whose decode batching is Serve's own ``@serve.batch``: what a team that
runs its own torch deployment might write, and what slotune tunes with ``--actuator serve``.

``import_path: deploy.examples.serve_batch.app:app`` names :func:`app`, an application
builder: the config's ``args`` (model size, seed, torch threads) build the replica; the
deployment's ``user_config`` is applied in place by ``BatchedLM.reconfigure``.

The convention slotune relies on (README.md here):

- ``reconfigure(self, config)`` reads ``config["max_batch_size"]`` (required) and
  ``config["batch_wait_timeout_s"]`` (optional) and hands them to the batch handler's
  ``set_max_batch_size`` / ``set_batch_wait_timeout_s``, which ``@serve.batch`` adds to
  the function it decorates (ray/serve/batching.py ``batch``; the queue reads the new limit
  when it forms its next batch, ``_BatchQueue.wait_for_batch``);
- ``max_ongoing_requests`` is the deployment option. Both are lightweight updates on
  Serve's declarative path: the replica is reconfigured, not restarted.

Routes: ``POST /v1/completions`` (OpenAI completions; SSE when ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /stats`` (batch sizes Serve formed and rows per
decode step, recent window; pid and replica id), ``POST /stats/reset``.

Decoding is a ``@serve.batch`` async generator: Serve hands it the requests queued (up to
the limit, waiting at most ``batch_wait_timeout_s`` for more), and each step yields one list
with a token per request of the batch (``StopIteration`` for finished ones). With one batch
at a time (``max_concurrent_batches=1``) a request that arrives while a batch decodes waits
for that whole batch to finish: static batching, Serve's semantics, not continuous batching.
"""

# No `from __future__ import annotations` here, unlike the rest of the house: Serve ships
# the @serve.ingress class to the replica by value (cloudpickle; the module's name
# `BatchedLM` is the Deployment, not the class), and a pickled function keeps only the
# globals its code uses. A route's string annotation ("CompletionRequest") would then
# not resolve in the replica and FastAPI would misread the body (seen: a 400 "Field
# required (body)" on every request). Evaluated annotations travel with the function.

import asyncio
import logging
import os
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from deploy.examples.serve_batch.protocol import (
    MODEL_ID,
    ApiError,
    CompletionRequest,
    Job,
    chunk,
    sse,
    to_job,
    usage,
)
from deploy.examples.serve_batch.tokens import token_text

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 8  # until the first reconfigure
# Serve's default is 10 ms. Here requests reach the replica tens of ms apart through the
# proxy (2 shared cores): with 10 ms a closed loop of 8 clients formed batches of 1-3,
# with 100 ms full ones (bench/serve_batch_curve.py --batch-wait-s). A lone request waits
# this long for company unless its batch is already full.
DEFAULT_BATCH_WAIT_TIMEOUT_S = 0.1
STATS_WINDOW = 2048  # batches and steps kept for GET /stats

api = FastAPI(title="serve-batch example")


@api.exception_handler(RequestValidationError)
async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    err = ApiError(f"{first.get('msg', 'invalid request')} ({param})", param=param)
    return JSONResponse(err.body(), status_code=err.status)


@api.exception_handler(ApiError)
async def _refused(_: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@dataclass(frozen=True, kw_only=True)
class AppArgs:
    """The builder's ``args`` (a change rebuilds the replica). Values may come as strings
    (``serve run ... d_model=256``)."""

    d_model: int = 768
    n_layers: int = 2
    seed: int = 0
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.torch_threads, int) and 1 <= self.torch_threads <= 256):
            raise ValueError(f"torch_threads={self.torch_threads!r}: must be an integer in 1..256")

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "AppArgs":
        args = dict(args or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown app args {unknown}: allowed {sorted(known)}")
        try:
            return cls(**{k: int(v) for k, v in args.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"app args {args!r}: {e}") from e


class BatchStats:
    """Recent batch sizes (as Serve formed them) and rows per decode step, for ``/stats``.
    Touched only on the replica's event loop."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.batches: deque[int] = deque(maxlen=STATS_WINDOW)
        self.steps: deque[int] = deque(maxlen=STATS_WINDOW)
        self.batches_total = 0
        self.tokens_total = 0

    def batch(self, size: int) -> None:
        self.batches.append(size)
        self.batches_total += 1

    def step(self, rows: int) -> None:
        self.steps.append(rows)
        self.tokens_total += rows

    def snapshot(self) -> dict[str, Any]:
        return {
            "batches_total": self.batches_total,
            "tokens_total": self.tokens_total,
            "batch_sizes": _histogram(self.batches),
            "step_rows": _histogram(self.steps),
            "max_batch_seen": max(self.batches, default=0),
        }


def _histogram(values: deque[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def _check_user_config(config: dict[str, Any]) -> tuple[int, float | None]:
    size = config.get("max_batch_size")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ValueError(f"user_config max_batch_size={size!r}: must be an integer >= 1")
    wait = config.get("batch_wait_timeout_s")
    if wait is not None and not (isinstance(wait, (int, float)) and 0 <= wait <= 60):
        raise ValueError(f"user_config batch_wait_timeout_s={wait!r}: must be in 0..60 s")
    return size, None if wait is None else float(wait)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=32)
@serve.ingress(api)
class BatchedLM:
    """One replica: the tiny LM behind OpenAI routes, batched by ``@serve.batch``."""

    def __init__(self, args: AppArgs) -> None:
        # OpenMP reads its wait policy once, when torch loads it: spinning threads starve
        # the other processes on a few shared cores. Ray sets OMP_NUM_THREADS=1 for actors
        # with num_cpus <= 1; the thread count is set explicitly below either way.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import torch

        from deploy.examples.serve_batch.model import LMConfig, TinyLM

        torch.set_num_threads(args.torch_threads)
        self.model = TinyLM(LMConfig(d_model=args.d_model, n_layers=args.n_layers, seed=args.seed))
        self.args = args
        self.stats = BatchStats()
        self.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        self.batch_wait_timeout_s = DEFAULT_BATCH_WAIT_TIMEOUT_S
        self.created = int(time.time())
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        logger.info("replica %s up: pid %d, %s", self.replica_id, os.getpid(), args)

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's ``user_config`` at start and on each change
        (no restart). A bad value raises: Serve then marks the update failed."""
        size, wait = _check_user_config(config)
        self.generate.set_max_batch_size(size)
        self.max_batch_size = size
        if wait is not None:
            self.generate.set_batch_wait_timeout_s(wait)
            self.batch_wait_timeout_s = wait
        logger.info("max_batch_size=%d batch_wait_timeout_s=%s", size, self.batch_wait_timeout_s)

    @serve.batch(
        max_batch_size=DEFAULT_MAX_BATCH_SIZE, batch_wait_timeout_s=DEFAULT_BATCH_WAIT_TIMEOUT_S
    )
    async def generate(self, jobs: list[Job]) -> AsyncIterator[list[Any]]:
        """Decode a batch: yield one list per step, a token id per request of the batch or
        ``StopIteration`` for one already finished (ray/serve/batching.py
        ``_consume_func_generator``). Finished rows leave the tensors, so a step costs
        what the rows still decoding cost."""
        self.stats.batch(len(jobs))
        h, nxt = await asyncio.to_thread(self.model.prefill, [list(j.prompt_ids) for j in jobs])
        active = list(range(len(jobs)))  # request index of each row of h
        emitted = [0] * len(jobs)
        while active:
            out: list[Any] = [StopIteration] * len(jobs)
            keep: list[int] = []  # rows that go on
            for row, (i, tok) in enumerate(zip(active, nxt.tolist(), strict=True)):
                out[i] = tok
                emitted[i] += 1
                if jobs[i].finish_reason(tok, emitted[i]) is None:
                    keep.append(row)
            self.stats.step(len(active))
            yield out
            if not keep:
                return
            nxt, h = await asyncio.to_thread(self.model.step, nxt, h, keep)
            active = [active[r] for r in keep]

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        job = to_job(body)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            with_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._stream(job, cid, created, with_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        text, n, reason = [], 0, None
        async for tok in self.generate(job):
            n += 1
            reason = job.finish_reason(tok, n)
            text.append("" if reason == "stop" else token_text(tok))
            if reason:
                break
        res = chunk(cid, created, text="".join(text), finish_reason=reason)
        return {**res, "usage": usage(len(job.prompt_ids), n)}

    async def _stream(
        self, job: Job, cid: str, created: int, with_usage: bool
    ) -> AsyncIterator[str]:
        n = 0
        try:
            async for tok in self.generate(job):
                n += 1
                reason = job.finish_reason(tok, n)
                text = "" if reason == "stop" else token_text(tok)
                yield sse(chunk(cid, created, text=text, finish_reason=reason))
                if reason:
                    break
        except Exception as e:  # the stream has begun: the error goes in it
            logger.exception("decode failed")
            yield sse({"error": ApiError(f"decode failed: {e}", status=500).body()["error"]})
        if with_usage:
            yield sse({**chunk(cid, created, text=None), "usage": usage(len(job.prompt_ids), n)})
        yield sse("[DONE]")

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {"id": MODEL_ID, "object": "model", "created": self.created, "owned_by": "example"}
        return {"object": "list", "data": [card]}

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/stats")
    async def get_stats(self) -> dict[str, Any]:
        import torch

        return {
            "pid": os.getpid(),
            "replica_id": self.replica_id,
            "max_batch_size": self.max_batch_size,
            "batch_wait_timeout_s": self.batch_wait_timeout_s,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            **self.stats.snapshot(),
        }

    @api.post("/stats/reset")
    async def reset_stats(self) -> dict[str, bool]:
        self.stats.reset()
        return {"reset": True}


def app(args: dict[str, Any]) -> Application:
    """The application builder ``import_path`` names; ``args``: see :class:`AppArgs`."""
    return BatchedLM.bind(AppArgs.from_args(args))
