"""The Ray Serve deployment: an OpenAI-compatible completion server over the engine.

``import_path: serving.app.server:app`` (deploy/serve-config.yaml, KubeRay) names
:func:`app`, an application builder: the config's ``args`` become
:class:`ServerArgs` (changing them rebuilds the replica) and the deployment's
``user_config`` becomes :class:`LiveConfig`, applied in place by
``reconfigure`` (batch limit and SLO thresholds, no restart); both live in
serving/app/config.py.

Routes (relative to the route prefix):

- ``POST /v1/completions``: OpenAI completions, SSE with ``stream: true``.
- ``POST /v1/chat/completions``: OpenAI chat completions (the plain chat template of
  serving/model/tokenizer.py), SSE with ``stream: true``. Which request fields are
  honoured, accepted at their default only, or ignored: serving/app/openai_request.py.
- ``GET /v1/models``: the one served model.
- ``GET /health``: 200 while the engine's step loop is alive.
- ``GET /stats``: engine stats, pid, the applied live config, and what the process
  runs with (torch threads, OMP_WAIT_POLICY, the engine thread's niceness) (JSON).

Every bad request is a 4xx with an OpenAI-style JSON error body, decided cheaply: a
body over the size limit is a 413 from its ``Content-Length`` (or as soon as it has
streamed past the limit) before it is read; a prompt too long for the context by its
character count is refused before it is tokenized; large prompts are tokenized off the
event loop. Admission is the replica's (serving/app/admission.py): the live
``max_ongoing_requests`` in the engine, ``max_queued_requests`` waiting, and beyond
that a 429 with ``Retry-After`` at once. A request's TTFT and queue wait run from its
arrival (its body read), so time in the admission queue is in them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from metrics import names
from serving.app import openai_api as oa
from serving.app import openai_request as oreq
from serving.app.admission import Admission, Overloaded, Ticket
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
from serving.app.text_output import TextOutput
from serving.scheduler.plan import RequestTiming

logger = logging.getLogger(__name__)


# Prompts of more characters than this are tokenized in a worker thread, not on the loop
# that streams every other request's tokens.
TOKENIZE_INLINE_CHARS = 4096
# A prompt of more characters than (context x the tokenizer's longest token x this) is too
# long whatever normalization removes: refused without tokenizing it.
PROMPT_CHARS_SLACK = 4


def _json_error(e: oa.ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


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
        self.engine.on_finish = self._on_finish
        self.tokenizer = self.engine.tokenizer
        context = self.engine.engine.scheduler.config.max_len
        self.max_request_bytes = self.args.request_bytes_limit(context)
        self.max_prompt_chars = context * self.tokenizer.max_token_chars * PROMPT_CHARS_SLACK
        self.admission = Admission()
        self.eos_id: int | None = getattr(self.tokenizer, "eos_id", None)
        self.engine.start()
        ctx = serve.get_replica_context()
        self._kv_key = f"{ctx.app_name}/{ctx.replica_tag}".encode()
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
        from ray.experimental import internal_kv

        state = self.state()  # the live config's limit: Ray's context lags inside reconfigure
        internal_kv._internal_kv_put(
            self._kv_key, json.dumps(state).encode(), namespace=KV_NAMESPACE
        )

    def state(self) -> dict[str, Any]:
        """Pid, applied live config, and the admission limit in force: the live config's
        (the replica admits), else Ray's ``max_ongoing_requests`` (Serve admits)."""
        ctx = serve.get_replica_context()
        limit = self.live.max_ongoing_requests
        return {
            "pid": self.pid,
            "replica": ctx.replica_tag,
            "live": self.live.to_user_config(),
            "max_ongoing_requests": (
                ctx._deployment_config.max_ongoing_requests if limit is None else limit
            ),
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
        from ray.serve._private import constants

        tid = self.engine.native_thread_id
        return {
            # False when RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 reached the replica.
            "user_code_in_separate_thread": constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
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
            from ray.experimental import internal_kv

            internal_kv._internal_kv_del(self._kv_key, namespace=KV_NAMESPACE)

    def _on_finish(self, timing: Any) -> None:
        try:
            self.metrics.record_finish(timing)
        except Exception:
            logger.exception("could not record metrics for %s", timing)

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
                return _json_error(oa.ApiError(f"{method} {path}: use POST", status=405))
            return await self._completions(request, chat=path == "/v1/chat/completions")
        if method != "GET":
            return _json_error(oa.ApiError(f"{method} {path}: not allowed", status=405))
        if path == "/v1/models":
            return JSONResponse(oa.models_body(self.args.served_name, created=self.created))
        if path in ("/health", "/healthz"):
            self.check_health()
            return JSONResponse({"status": "ok"})
        if path == "/stats":
            return JSONResponse(self.stats())
        return _json_error(oa.ApiError(f"no route {path}", status=404, type="not_found"))

    async def _completions(self, request: Request, *, chat: bool) -> Response:
        try:
            raw = await self._read_body(request)
            arrival = self.engine.engine.clock()  # the engine's clock: its TTFT starts here
            body = oa.parse_json_body(raw)
            del raw
            parse = oreq.parse_chat_request if chat else oreq.parse_completion_request
            req = parse(body, served_model=self.args.served_name)
            prompt_ids = await self._prompt_ids(req)
            max_tokens = req.max_tokens
            if max_tokens is None:  # chat without a limit: what the context leaves
                max_tokens = max(1, self.engine.engine.scheduler.config.max_len - len(prompt_ids))
            try:
                self.engine.validate(prompt_ids, max_tokens)
            except ValueError as e:
                raise oa.ApiError(str(e), param="prompt") from None
            stop_ids = self._stop_ids(req)
            self._check_min_tokens(req.min_tokens, max_tokens, stop_ids)
        except oa.ApiError as e:
            self.metrics.record_rejected(
                names.REASON_BAD_REQUEST if e.status != 413 else names.REASON_TOO_LARGE
            )
            return _json_error(e)
        try:
            ticket = await self.admission.acquire()
        except Overloaded as e:
            self.metrics.record_rejected(names.REASON_OVERLOADED)
            err = oa.ApiError(str(e), status=429, type="server_overloaded", code="overloaded")
            return _json_error(err, headers={"Retry-After": str(e.retry_after_s)})
        except BaseException as e:  # the client left while queued: accepted, not completed
            self._record_aborted(e, arrival, None, 0)
            raise
        job = _Job(
            req=req,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            cid=oa.new_completion_id(chat=chat),
            arrival=arrival,
            stop_ids=stop_ids,
        )
        if req.stream:
            return StreamingResponse(self._stream(job, ticket), media_type=oa.SSE_MEDIA_TYPE)
        try:
            return await self._complete(job)
        finally:
            ticket.release()

    def _stop_ids(self, req: oreq.CompletionRequest) -> frozenset[int]:
        """The ids that end ``req``: the tokenizer's EOS unless ``ignore_eos``, and its
        ``stop_token_ids`` (vLLM's ``ignore_eos`` leaves ``stop_token_ids`` in force)."""
        eos = () if req.ignore_eos or self.eos_id is None else (self.eos_id,)
        return frozenset(eos + req.stop_token_ids)

    def _check_min_tokens(self, min_tokens: int, max_tokens: int, stop_ids: frozenset[int]) -> None:
        if min_tokens > max_tokens:
            raise oa.ApiError(
                f"min_tokens={min_tokens}: must be at most max_tokens={max_tokens}",
                param="min_tokens",
            )
        vocab = self.engine.engine.config.vocab_size
        if min_tokens and sum(1 for t in stop_ids if t < vocab) >= vocab:
            raise oa.ApiError(
                "min_tokens: every token id is a stop id, so no token could be sampled "
                "before min_tokens",
                param="min_tokens",
            )

    def _output(self, job: _Job) -> TextOutput:
        return TextOutput(
            decode=self.tokenizer.decode,
            stop_ids=job.stop_ids,
            stop=job.req.stop,
            include_stop_str=job.req.include_stop_str_in_output,
            min_tokens=job.req.min_tokens,
        )

    def _record_stop_string(self, job: _Job, output: TextOutput, first: float | None) -> None:
        """A stop string ended the request: the engine request was aborted, so the engine
        reports no timing; record the handler's view of it (first and last token as the
        handler got them; no queue wait) as a completed request."""
        now = self.engine.engine.clock()
        timing = RequestTiming(
            request_id=job.cid,
            arrival_s=job.arrival,
            admitted_s=math.nan,
            first_token_s=now if first is None else first,
            last_token_s=now,
            prompt_tokens=len(job.prompt_ids),
            generated_tokens=output.tokens,
        )
        self._on_finish(timing)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) past ``max_request_bytes`` before it is read: from its
        ``Content-Length``, or as soon as a chunked upload streams past the limit."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            digits = declared.lstrip("0") or "0"
            if not (digits.isascii() and digits.isdigit()):
                raise oa.ApiError(f"Content-Length {declared[:40]!r}: not a byte count")
            if len(digits) > 18 or int(digits) > limit:  # 18 digits: int() stays cheap
                raise _too_large(int(digits) if len(digits) <= 18 else 10**18, limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
        except ClientDisconnect:  # nobody reads the answer; Serve counts a 4xx, not a 5xx
            raise oa.ApiError("the client disconnected before its body arrived") from None
        return b"".join(chunks)

    async def _prompt_ids(self, req: oreq.CompletionRequest) -> list[int]:
        """Token ids of the prompt; a text too long for the context by its length alone is
        refused untokenized, and a long one is tokenized in a worker thread."""
        context = self.engine.engine.scheduler.config.max_len
        if not isinstance(req.prompt, str):
            if len(req.prompt) >= context:  # before each id is checked, on the loop
                raise oa.ApiError(
                    f"prompt: {len(req.prompt)} token ids cannot fit the context of "
                    f"{context} tokens with any output",
                    param="prompt",
                )
            return list(req.prompt)
        n = len(req.prompt)
        if n > self.max_prompt_chars:
            raise oa.ApiError(
                f"prompt: {n} characters cannot fit the context of {context} tokens",
                param="prompt",
            )
        try:
            if n <= TOKENIZE_INLINE_CHARS:
                return list(self.tokenizer.encode(req.prompt))
            return list(await asyncio.to_thread(self.tokenizer.encode, req.prompt))
        except (ValueError, TypeError) as e:  # UnicodeError is a ValueError
            raise oa.ApiError(f"prompt: cannot be tokenized ({e})", param="prompt") from None

    def _generate(self, job: _Job, *, flush_interval_s: float):
        """Lists of token ids as the engine thread hands them over: the first at once,
        then at most one list per ``flush_interval_s``, the end at once."""
        return self.engine.generate_chunks(
            job.prompt_ids,
            max_tokens=job.max_tokens,
            temperature=job.req.temperature,
            request_id=job.cid,
            stop_ids=job.stop_ids,
            flush_interval_s=flush_interval_s,
            arrival_s=job.arrival,
            min_tokens=job.req.min_tokens,
        )

    async def _complete(self, job: _Job) -> Response:
        output = self._output(job)
        text = ""
        # aclosing: a cancelled request (client gone) or one a stop string ended aborts
        # the engine request and frees its KV slot at once. Nothing is sent before the
        # end: the engine thread holds the tokens (inf) and wakes this handler only to
        # finish (or, with stop strings, the handler reads as they come).
        interval = self.args.stream_interval_s if job.req.stop else math.inf
        gen = self._generate(job, flush_interval_s=interval)
        clock, first = self.engine.engine.clock, None
        try:
            async with contextlib.aclosing(gen) as chunks:
                async for chunk in chunks:
                    first = first or clock()
                    text += output.push(chunk)
                    if output.stopped == "string":
                        break
        except BaseException as e:
            self._record_aborted(e, job.arrival, first, output.tokens)
            raise
        if output.stopped == "string":
            self._record_stop_string(job, output, first)
        tail, finish = output.finish(job.max_tokens)
        body = oa.completion_body(
            completion_id=job.cid,
            model=self.args.served_name,
            text=text + tail,
            finish=finish,
            created=int(time.time()),
            usage_=oa.usage(len(job.prompt_ids), output.tokens),
            chat=job.req.chat,
        )
        return JSONResponse(body)

    def _record_aborted(
        self, e: BaseException, arrival: float, first: float | None, tokens: int
    ) -> None:
        """A request accepted (admitted or queued) that ended before completing: counted
        with what it got (the engine reports only requests that finish)."""
        reason = (
            names.REASON_CLIENT_DISCONNECT
            if isinstance(e, (asyncio.CancelledError, GeneratorExit))
            else names.REASON_ERROR
        )
        ttft = None if first is None else first - arrival
        try:
            self.metrics.record_aborted(reason=reason, ttft_s=ttft, generated_tokens=tokens)
        except Exception:
            logger.exception("could not record the aborted request")

    async def _stream(self, job: _Job, ticket: Ticket) -> AsyncIterator[bytes]:
        # aclosing: a cancelled request (client gone) or one a stop string ended aborts
        # the engine request and frees its KV slot at once. The engine thread paces the
        # stream (one hand-over per stream_interval_s after the first token), so every
        # chunk that reaches this handler goes out as one event.
        gen = self._generate(job, flush_interval_s=self.args.stream_interval_s)
        clock, first = self.engine.engine.clock, None
        output = self._output(job)
        req, cid = job.req, job.cid

        async def timed(chunks: AsyncIterator[list[int]]) -> AsyncIterator[list[int]]:
            nonlocal first
            async for chunk in chunks:
                first = first or clock()
                yield chunk

        try:
            async with contextlib.aclosing(gen) as chunks:
                async for event in oa.sse_completion_stream(
                    timed(chunks),
                    output=output,
                    completion_id=cid,
                    model=self.args.served_name,
                    max_tokens=job.max_tokens,
                    prompt_tokens=len(job.prompt_ids),
                    chat=req.chat,
                    include_usage=req.include_usage,
                    continuous_usage=req.continuous_usage,
                    interval_s=0.0,
                    # tokens that end inside a character: the next one at once, so
                    # pacing never holds text (the first included) past its interval
                    on_incomplete=lambda: self.engine.flush_next(cid),
                ):
                    if output.stopped == "string" and event.endswith(oa.SSE_DONE):
                        self._record_stop_string(job, output, first)
                    yield event
        except BaseException as e:
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                logger.info("request %s cancelled (client gone)", cid)
            self._record_aborted(e, job.arrival, first, output.tokens)
            raise
        finally:
            ticket.release()


@dataclass(frozen=True, kw_only=True)
class _Job:
    """An admitted request, as the handlers run it."""

    req: oreq.CompletionRequest
    prompt_ids: list[int]
    max_tokens: int  # req.max_tokens, or what the context leaves (chat without a limit)
    cid: str
    arrival: float  # engine clock
    stop_ids: frozenset[int]


def _too_large(size: int, limit: int) -> oa.ApiError:
    return oa.ApiError(
        f"request body of {size} bytes is over this server's limit of {limit} bytes",
        status=413,
        code="request_too_large",
    )


def app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for ``import_path: serving.app.server:app``; ``args`` → ServerArgs."""
    server_args = ServerArgs.from_args(args)  # fail early, in the build task
    return CompletionServer.bind(server_args.to_args())
