"""The continuous-batching engine: the pure scheduler plus a torch executor.

:class:`Engine` is synchronous: ``step()`` is one schedule / execute / update
round (serving/scheduler/scheduler.py documents the policy: all prefilled requests decode
every step, prompts are prefilled in chunks of at most ``prefill_chunk`` tokens
per step). :class:`serving.engine.async_engine.AsyncEngine` runs ``Engine.step`` in a
background thread and streams tokens to asyncio consumers. The executor
(serving/engine/executor.py) runs the model for a plan.

Threads: torch's intra-op pool is set with ``torch.set_num_threads``
(``num_threads``; None keeps what the process set). Ray sets ``OMP_NUM_THREADS=1`` in
actors with ``num_cpus <= 1``, so the setting must be explicit somewhere. Choose
``OMP_WAIT_POLICY`` before torch starts its thread pool: PASSIVE on shared cores,
ACTIVE on cores the process has to itself (docs/serving.md "CPU settings"); the engine
warns when more than one thread runs with neither chosen.

Timings use ``clock`` (``time.monotonic`` by default): arrival when a request is
added, admission at the start of the step that first schedules it, and first/
last token at the end of the step that sampled them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from serving.engine.device_decode import Drawn
from serving.engine.executor import TorchExecutor
from serving.model.checkpoint import load_checkpoint
from serving.model.config import ModelConfig
from serving.model.tokenizer import Tokenizer, load_tokenizer
from serving.model.transformer import Transformer
from serving.scheduler.plan import Finished, SchedulerConfig, SeqRequest, StepPlan
from serving.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


DEFAULT_MAX_LEN = 512


def slot_context(config: ModelConfig, max_len: int | None = None) -> int:
    """Tokens one KV slot holds, prompt plus output: ``max_len``, else the engine's default."""
    return max_len or min(config.max_position, DEFAULT_MAX_LEN)


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (None: keep the process's setting); returns the count."""
    if num_threads is not None and (
        not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1
    ):
        raise ValueError(f"num_threads={num_threads!r}: must be a positive integer")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    n = torch.get_num_threads()
    if n < len(os.sched_getaffinity(0)):
        logger.info("torch uses %d of %d CPUs", n, len(os.sched_getaffinity(0)))
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    if n > 1 and policy == "ACTIVE":
        logger.info("OMP_WAIT_POLICY=ACTIVE: fastest on cores this process has to itself")
    elif n > 1 and policy != "PASSIVE":
        logger.warning(
            "OMP_WAIT_POLICY is %s: with other work on these cores, spinning OpenMP "
            "threads can slow decode steps many times over; choose PASSIVE (shared "
            "cores) or ACTIVE (cores this process owns) deliberately",
            policy or "unset",
        )
    return n


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float  # fraction of KV slots held
    max_batch_size: int
    max_slots: int
    steps: int
    generated_tokens: int


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    tokens: dict[str, int]  # request id -> token sampled this step
    finished: list[Finished]
    plan: StepPlan


class Engine:
    """Scheduler + torch executor, synchronous and thread-safe between steps.

    ``add_request``/``abort``/``set_max_batch_size``/``stats`` may be called
    from other threads while ``step`` runs: they take a lock that ``step``
    holds only while scheduling and updating, never while the model runs.
    """

    def __init__(
        self,
        *,
        model_config: ModelConfig | None = None,
        model: Transformer | None = None,
        max_slots: int,
        max_batch_size: int,
        max_len: int | None = None,
        prefill_chunk: int = 256,
        device: str = "cpu",
        checkpoint: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        prepack: bool = True,
        cpu_kernels: bool = True,
        device_decode: bool | None = None,
        cuda_graphs: bool | None = None,
        attention: str | None = None,
        overlap: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``device_decode``: decode steps of fixed shapes (serving/engine/device_decode.py;
        None: on CUDA, where ``cuda_graphs`` None captures them, and ``attention`` None is
        FlexAttention); the CPU's default is the C kernels' path. ``overlap`` (the device
        path only; None: with it): each step is launched before the last one's tokens are
        waited for (see :meth:`step`)."""
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available here")
        if device == "cpu":
            self.num_threads = configure_threads(num_threads)
        if model is not None:  # built by the caller (benchmarks: Transformer.for_timing)
            self.model = model
        elif checkpoint is not None:
            self.model = load_checkpoint(checkpoint, dtype=dtype, device=device)
        elif model_config is not None:
            cfg = model_config if dtype is None else model_config.replace(dtype=dtype)
            self.model = Transformer.random(cfg, seed=seed, device=device)
        else:
            raise ValueError("Engine needs model_config, checkpoint or model")
        self.config = self.model.config
        self.device = torch.device(device)
        # Kernels first: where their small GEMM serves a linear, prepack makes no fp32 copy.
        self.cpu_kernels = self.model.use_cpu_kernels(cpu_kernels)
        self.prepacked = self.model.prepack(prepack)
        max_len = slot_context(self.config, max_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_slots=max_slots,
                max_batch_size=max_batch_size,
                max_len=max_len,
                prefill_chunk=prefill_chunk,
            )
        )
        self.max_len = max_len
        self.model.allocate_cache(max_slots, max_len)
        self.executor = TorchExecutor(
            model=self.model,
            device=self.device,
            max_len=max_len,
            seed=seed,
            device_decode=device_decode,
            cuda_graphs=cuda_graphs,
            attention=attention,
        )
        if self.executor.device_decode is not None:
            t0 = time.monotonic()
            n = self.executor.device_decode.warm_up()
            if n:
                logger.info("captured %d decode graphs in %.1f s", n, time.monotonic() - t0)
        dd = self.executor.device_decode is not None
        self.overlap = dd if overlap is None else overlap
        if self.overlap and not dd:
            raise ValueError("overlap=True needs the device decode path (device_decode)")
        # The step launched and not waited for yet, with what its update finished (see step)
        self._inflight: tuple[StepPlan, Drawn, list[Finished]] | None = None
        self._stop_ids: dict[str, frozenset[int]] = {}  # overlap: to finish records late
        self.tokenizer: Tokenizer = load_tokenizer(checkpoint, vocab_size=self.config.vocab_size)
        self.clock = clock
        self._temps: dict[str, float] = {}
        # request id -> [tokens still to sample before a stop id may be, the stop ids]
        self._min_tokens: dict[str, list] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._steps = 0
        self._generated = 0

    # ---- requests ----------------------------------------------------------------
    def validate(self, prompt_ids: object, max_tokens: object, temperature: object = 0.0) -> None:
        """ValueError naming the bad value if the request cannot be served."""
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt: must not be empty")
        v = self.config.vocab_size
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < v:
                raise ValueError(f"prompt token {t!r}: must be an integer in 0..{v - 1}")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise ValueError(f"temperature={temperature!r}: must be a number")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature={temperature!r}: must be a finite number >= 0")
        self.scheduler.validate(len(prompt_ids), max_tokens)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        request_id: str | None = None,
        stop_ids: Sequence[int] = (),
        arrival_s: float | None = None,
        min_tokens: int = 0,
    ) -> str:
        """Queue a request; returns its id. ValueError on bad input (nothing else changes).

        ``stop_ids`` end the request when sampled; for its first ``min_tokens`` tokens they
        cannot be sampled (their logits are masked, as vLLM's ``min_tokens`` does:
        vllm/v1/sample/logits_processor, ``MinTokensLogitsProcessor``)."""
        self.validate(list(prompt_ids), max_tokens, temperature)
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise ValueError(f"min_tokens={min_tokens!r}: must be an integer >= 0")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = SeqRequest(
            request_id=rid,
            prompt_len=len(prompt_ids),
            max_tokens=max_tokens,
            arrival_s=self.clock() if arrival_s is None else arrival_s,
            prompt_ids=tuple(prompt_ids),
            stop_ids=frozenset(stop_ids),
        )
        banned = tuple(t for t in req.stop_ids if 0 <= t < self.config.vocab_size)
        if min_tokens > 0 and len(banned) >= self.config.vocab_size:
            raise ValueError(f"min_tokens={min_tokens}: every token id is a stop id")
        with self._lock:
            self.scheduler.add(req)
            self._temps[rid] = float(temperature)
            if self.overlap and req.stop_ids:
                self._stop_ids[rid] = req.stop_ids
            if min_tokens > 0 and banned:
                self._min_tokens[rid] = [min_tokens, banned]
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a request; its KV slot is free for the next step."""
        with self._lock:
            self._temps.pop(request_id, None)
            self._min_tokens.pop(request_id, None)
            if not self.scheduler.abort(request_id):
                return False  # a record still in flight may need its stop ids
            self._stop_ids.pop(request_id, None)
            return True

    def abort_all(self) -> list[str]:
        """Drop every request (after a failed step); returns their ids."""
        with self._lock:
            self._inflight = None
            ids = self.scheduler.active_ids()
            for rid in ids:
                self.scheduler.abort(rid)
            self._temps.clear()
            self._min_tokens.clear()
            self._stop_ids.clear()
            return ids

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """The decode batch limit from the next step (1..max_slots, else ValueError)."""
        with self._lock:
            self.scheduler.set_max_batch_size(max_batch_size)

    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler
            return EngineStats(
                running=s.num_running,
                waiting=s.num_waiting,
                kv_usage=s.kv_usage,
                max_batch_size=s.max_batch_size,
                max_slots=s.config.max_slots,
                steps=self._steps,
                generated_tokens=self._generated,
            )

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work or self._inflight is not None

    # ---- the step ------------------------------------------------------------------
    def step(self) -> StepOutput:
        """One schedule / execute / update round.

        With ``overlap`` a call schedules and launches step N, then waits for step N-1's
        tokens (only for them: the device goes on with step N), hands them to the scheduler
        and returns step N-1's output; so the host's work for a step (delivering the last
        one's tokens, scheduling, preparing inputs) runs while the device computes the one
        before it. Step N's decode inputs that step N-1 sampled are taken from its draws on
        the device. A request that sampled a stop id in step N-1 also ran in step N; that
        row is dropped (vLLM's async scheduling makes the same trade)."""
        if self.overlap:
            return self._overlapped_step()
        with self._lock:
            plan = self.scheduler.schedule(now_s=self.clock())
            sampling = plan.sampling_ids()
            temps = {rid: self._temps.get(rid, 0.0) for rid in sampling}
            bans = self._bans_counted(sampling)
        tokens = self.execute(plan, temps, bans) if not plan.is_empty else {}
        with self._lock:
            finished = self.scheduler.update(plan, tokens, now_s=self.clock())
            for f in finished:
                self._temps.pop(f.request_id, None)
                self._min_tokens.pop(f.request_id, None)
            self._steps += 1
            self._generated += len(tokens)
        return StepOutput(tokens=tokens, finished=finished, plan=plan)

    def _overlapped_step(self) -> StepOutput:
        with self._lock:
            plan = self.scheduler.schedule(now_s=self.clock())
            sampling = plan.sampling_ids()
            temps = {rid: self._temps.get(rid, 0.0) for rid in sampling}
            bans = self._bans_counted(sampling)
        prev = self._inflight
        pending = prev[1] if prev is not None else None
        drawn = self.executor.launch(plan, temps, bans, pending) if not plan.is_empty else None
        tokens = pending.wait() if pending is not None else {}  # step N-1 only
        now = self.clock()
        with self._lock:
            finished: list[Finished] = []
            if prev is not None:
                # Tokens of requests that ended meanwhile (a stop id the step before, an
                # abort) are dropped: only the running and those the step's update
                # finished get theirs.
                ended = {f.request_id for f in prev[2]}
                sched = self.scheduler
                tokens = {
                    r: t for r, t in tokens.items() if r in ended or sched.slot_of(r) is not None
                }
                stopped = sched.resolve(prev[0].step, tokens, now)
                finished = self._complete(prev[2], tokens, now) + stopped
                self._generated += len(tokens)
            unknown: dict[str, int | None] = dict.fromkeys(drawn.rows) if drawn else {}
            done_now = self.scheduler.update(plan, unknown, now_s=now)
            self._inflight = (plan, drawn, done_now) if drawn is not None else None
            if drawn is None and done_now:  # nothing sampled: nothing to wait for
                finished += done_now
            for f in finished:
                self._temps.pop(f.request_id, None)
                self._min_tokens.pop(f.request_id, None)
                self._stop_ids.pop(f.request_id, None)
            self._steps += 1
        return StepOutput(tokens=tokens, finished=finished, plan=prev[0] if prev else plan)

    def _bans_counted(self, sampling: Sequence[str]) -> dict[str, tuple[int, ...]] | None:
        """The ``min_tokens`` bans of a step's sampling requests, counted down as the step
        is scheduled: a scheduled sampling row makes one token unless its request ends
        (abort, a failed step), and then the count no longer matters; with overlap the
        tokens themselves arrive a step late."""
        mins = self._min_tokens
        if not mins:
            return None
        bans = {}
        for rid in sampling:
            m = mins.get(rid)
            if m is None:
                continue
            bans[rid] = m[1]
            m[0] -= 1
            if m[0] <= 0:
                del mins[rid]
        return bans

    def _complete(
        self, records: list[Finished], tokens: dict[str, int], now: float
    ) -> list[Finished]:
        """The records a step's ``update`` finished (``max_tokens`` reached) before its
        tokens were known: each gets its last token, the time that token reached the host,
        and reason "stop" if it is a stop id (as the engine without overlap decides)."""
        out = []
        for f in records:
            tok = tokens.get(f.request_id)
            if tok is None:
                out.append(f)
                continue
            t = f.timing
            first = now if t.generated_tokens == 1 else t.first_token_s
            reason = "stop" if tok in self._stop_ids.get(f.request_id, ()) else f.reason
            out.append(
                dataclasses.replace(
                    f,
                    reason=reason,
                    output_ids=(*f.output_ids, tok),
                    timing=dataclasses.replace(t, first_token_s=first, last_token_s=now),
                )
            )
        return out

    def execute(
        self,
        plan: StepPlan,
        temps: dict[str, float],
        bans: dict[str, tuple[int, ...]] | None = None,
    ) -> dict[str, int]:
        """Run the model for one plan (see serving/engine/executor.py); ``bans``: token ids
        each request may not sample this step."""
        return self.executor.execute(plan, temps, bans)

    # ---- conveniences ----------------------------------------------------------------
    def run_until_idle(self, max_steps: int = 1_000_000) -> list[Finished]:
        """Step until no request is left; returns everything that finished."""
        done: list[Finished] = []
        for _ in range(max_steps):
            if not self.has_work:
                break
            done += self.step().finished
        return done

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, **kw: Any) -> list[int]:
        """Generate for one prompt synchronously (the engine must have no other work)."""
        rid = self.add_request(prompt_ids, max_tokens=max_tokens, **kw)
        for f in self.run_until_idle():
            if f.request_id == rid:
                return list(f.output_ids)
        raise RuntimeError(f"request {rid} did not finish")
