"""The per-request flow of ``POST /v1/completions`` and ``POST /v1/chat/completions``.

:class:`CompletionHandler` runs one request through: read the body (refused past the
size limit before it is read), parse it (serving/app/openai_request.py), tokenize the
prompt (refused by its character count first; long ones off the event loop), admit it
(serving/app/admission.py: a 429 with ``Retry-After`` beyond the queue), generate, then
stream it as SSE or collect it into one body (serving/app/openai_api.py,
serving/app/text_output.py), recording every outcome in the replica's metrics. The Ray
Serve deployment that routes requests here is serving/app/server.py.

Every bad request is a 4xx with an OpenAI-style JSON error body. A request's TTFT and
queue wait run from its arrival at the deployment's front door: Serve's HTTP proxy, which
stamps it before routing (serving/app/front_door.py), so time in Serve's proxy and router
and in the replica's admission queue is in them. Without a stamp they run from the
replica's own arrival (the handler's first line), and ``slotune_arrival_clock_total``
says which clock each request got. A streamed request with a stamp has its TTFT observed
by the proxy when the first chunk leaves it (the response's ``TTFT_HANDOFF_HEADER``;
serving/app/front_door.py), so the replica leaves it out of ``slotune_ttft_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from metrics import names
from serving.app import openai_api as oa
from serving.app import openai_request as oreq
from serving.app.admission import Admission, Overloaded, Ticket
from serving.app.config import ServerArgs
from serving.app.front_door import TTFT_HANDOFF_HEADER, front_door_arrival
from serving.app.serve_metrics import ServeMetrics
from serving.app.text_output import TextOutput
from serving.scheduler.plan import RequestTiming

logger = logging.getLogger(__name__)

# Prompts of more characters than this are tokenized in a worker thread, not on the loop
# that streams every other request's tokens.
TOKENIZE_INLINE_CHARS = 4096
# A prompt of more characters than (context x the tokenizer's longest token x this) is too
# long whatever normalization removes: refused without tokenizing it.
PROMPT_CHARS_SLACK = 4


def json_error(e: oa.ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def request_stop_ids(req: oreq.CompletionRequest, *, eos_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end ``req``: every EOS id of the model unless ``ignore_eos``, and its
    ``stop_token_ids`` (vLLM's ``ignore_eos`` leaves ``stop_token_ids`` in force)."""
    eos = frozenset() if req.ignore_eos else eos_ids
    return eos | frozenset(req.stop_token_ids)


class CompletionHandler:
    """The completion routes of one replica, over its engine and admission.

    ``metrics`` returns the replica's :class:`ServeMetrics` (made at first use, by the
    deployment: serving/app/server.py); :meth:`on_finish` is the engine's finish hook.
    ``front_door``: whether Serve's proxy stamps arrivals in this cluster (then a request's
    stamp is believed: serving/app/front_door.py).
    """

    def __init__(
        self,
        *,
        engine: Any,
        args: ServerArgs,
        admission: Admission,
        metrics: Callable[[], ServeMetrics],
        front_door: bool = False,
    ) -> None:
        self.front_door = front_door
        # request id -> (seconds from the front door to the replica, whether the proxy
        # observes its TTFT) (the engine's finish hook runs on its thread; a dict's pop and
        # set are atomic)
        self._serve_delays: dict[str, tuple[float, bool]] = {}
        self.engine = engine  # serving.engine.async_engine.AsyncEngine (torch: not imported here)
        self.args = args
        self.admission = admission
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        context = engine.engine.scheduler.config.max_len
        self.max_request_bytes = args.request_bytes_limit(context)
        self.max_prompt_chars = context * self.tokenizer.max_token_chars * PROMPT_CHARS_SLACK

    def on_finish(self, timing: Any) -> None:
        delay, at_proxy = self._serve_delays.pop(timing.request_id, (0.0, False))
        try:
            self.metrics().record_finish(timing, serve_delay_s=delay, ttft_at_proxy=at_proxy)
        except Exception:
            logger.exception("could not record metrics for %s", timing)

    async def handle(self, request: Request, *, chat: bool) -> Response:
        """Answer one completion (``chat``: chat completion) request."""
        arrival, reached, stamped = self._arrival(request)  # engine clock: TTFT starts here
        try:
            raw = await self._read_body(request)
            body = oa.parse_json_body(raw)
            del raw
            if chat:
                req = oreq.parse_chat_request(
                    body,
                    served_model=self.args.served_name,
                    chat_template=self.tokenizer.chat_template,
                )
            else:
                req = oreq.parse_completion_request(body, served_model=self.args.served_name)
            prompt_ids = await self._prompt_ids(req)
            max_tokens = req.max_tokens
            if max_tokens is None:  # chat without a limit: what the context leaves
                max_tokens = max(1, self.engine.engine.scheduler.config.max_len - len(prompt_ids))
            try:
                self.engine.validate(prompt_ids, max_tokens)
            except ValueError as e:
                raise oa.ApiError(str(e), param="prompt") from None
            stop_ids = request_stop_ids(req, eos_ids=self.tokenizer.eos_ids)
            self._check_min_tokens(req.min_tokens, max_tokens, stop_ids)
        except oa.ApiError as e:
            self.metrics().record_rejected(
                names.REASON_BAD_REQUEST if e.status != 413 else names.REASON_TOO_LARGE
            )
            return json_error(e)
        try:
            ticket = await self.admission.acquire()
        except Overloaded as e:
            self.metrics().record_rejected(names.REASON_OVERLOADED)
            err = oa.ApiError(str(e), status=429, type="server_overloaded", code="overloaded")
            return json_error(err, headers={"Retry-After": str(e.retry_after_s)})
        except BaseException as e:  # the client left while queued: accepted, not completed
            self._record_aborted(e, None, None, 0)
            raise
        handoff = self.metrics().handoff if stamped and req.stream else None
        job = _Job(
            req=req,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            cid=oa.new_completion_id(chat=chat),
            arrival=arrival,
            serve_delay_s=reached - arrival,
            stop_ids=stop_ids,
            ttft_at_proxy=handoff is not None,
        )
        self._serve_delays[job.cid] = (job.serve_delay_s, job.ttft_at_proxy)
        if req.stream:
            return StreamingResponse(
                self._stream(job, ticket),
                media_type=oa.SSE_MEDIA_TYPE,
                headers=None if handoff is None else {TTFT_HANDOFF_HEADER: handoff},
            )
        try:
            return await self._complete(job)
        finally:
            ticket.release()

    def _arrival(self, request: Request) -> tuple[float, float, bool]:
        """``(arrival, reached, stamped)``, the first two on the engine's clock: when the
        request reached the deployment (Serve's proxy stamp, believed only with
        ``front_door``; else when it reached this replica), when it reached this replica
        (now), and whether the proxy's stamp was believed."""
        reached = self.engine.engine.clock()
        front = front_door_arrival(
            request.headers, trusted=self.front_door, now_engine=reached, now_wall_ns=time.time_ns()
        )
        try:
            self.metrics().record_arrival_clock(front_door=front is not None)
        except Exception:
            logger.exception("could not count the arrival clock")
        if front is None:
            return reached, reached, False
        return min(front, reached), reached, True

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
        handler got them; no queue wait) as a completed request (:meth:`on_finish`: its
        front-door delay goes with it)."""
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
        self.on_finish(timing)

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
            specials = req.add_special_tokens
            if n <= TOKENIZE_INLINE_CHARS:
                return list(self.tokenizer.encode(req.prompt, add_special_tokens=specials))
            return list(
                await asyncio.to_thread(
                    partial(self.tokenizer.encode, add_special_tokens=specials), req.prompt
                )
            )
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
            self._record_aborted(e, job, first, output.tokens)
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
        self, e: BaseException, job: _Job | None, first: float | None, tokens: int
    ) -> None:
        """A request accepted (admitted or queued) that ended before completing: counted
        with what it got (the engine reports only requests that finish). A client that
        disconnects (Serve cancels the replica's task: ``CancelledError`` in the handler,
        or ``GeneratorExit`` when the stream is closed) is ``client_disconnect``. ``job``:
        None before admission (then it had no token)."""
        if job is not None:
            self._serve_delays.pop(job.cid, None)
        reason = (
            names.REASON_CLIENT_DISCONNECT
            if isinstance(e, (asyncio.CancelledError, GeneratorExit))
            else names.REASON_ERROR
        )
        ttft = None if first is None or job is None else first - job.arrival
        try:
            self.metrics().record_aborted(
                reason=reason,
                ttft_s=ttft,
                generated_tokens=tokens,
                serve_delay_s=0.0 if job is None else job.serve_delay_s,
                ttft_at_proxy=job is not None and job.ttft_at_proxy,
            )
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

        done = False  # its last event went out: completed, whatever the client does next
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
                    if event.endswith(oa.SSE_DONE):
                        done = True
                        if output.stopped == "string":
                            self._record_stop_string(job, output, first)
                    yield event
        except BaseException as e:
            gone = isinstance(e, (asyncio.CancelledError, GeneratorExit))
            if gone and done:
                # closed after its last event: the completion is recorded (the engine's
                # finish hook, or the stop string's record above), not also an abort
                raise
            if gone:
                logger.info("request %s cancelled (client gone)", cid)
            self._record_aborted(e, job, first, output.tokens)
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
    arrival: float  # engine clock: the front door's stamp, else the replica's arrival
    serve_delay_s: float  # from arrival to the replica's own arrival (Serve's proxy, router)
    stop_ids: frozenset[int]
    ttft_at_proxy: bool = False  # streamed with a stamp: the proxy observes its TTFT


def _too_large(size: int, limit: int) -> oa.ApiError:
    return oa.ApiError(
        f"request body of {size} bytes is over this server's limit of {limit} bytes",
        status=413,
        code="request_too_large",
    )
