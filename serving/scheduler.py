"""The continuous-batching scheduler: pure, deterministic, no torch, no clock.

One engine step is three verbs (vLLM v1 ``EngineCore.step``)::

    plan = scheduler.schedule(now_s=t0)       # who runs this step, in which KV slot
    sampled = executor.execute(plan)          # the model (or a simulated step time)
    finished = scheduler.update(plan, sampled, now_s=t1)

The simulator (serving/sim.py) swaps the executor and keeps this scheduler.

Policy
------
- A request waits in FIFO order until it is *admitted*: it gets a KV slot when
  a slot is free, the running set is smaller than ``max_batch_size``, and the
  step still has prefill budget. Running = admitted and not finished
  (prefilling or decoding); ``max_batch_size`` bounds it.
- Every step decodes one token for every running request whose prompt is fully
  prefilled, and spends at most ``prefill_chunk`` prompt tokens on prefills
  (chunked prefill, Sarathi-style): the oldest partially prefilled request
  first, then newly admitted ones. A long prompt is split over several steps,
  so a prefill delays the decode batch by at most one chunk per step and never
  stalls it indefinitely.
- The final chunk of a prompt samples the first generated token; each decode
  entry samples one more. A request finishes when it has ``max_tokens`` tokens
  or samples one of its ``stop_ids``; its slot is freed in that ``update``.
- ``set_max_batch_size`` takes effect at the next ``schedule``. Shrinking it
  never drops in-flight requests: they keep decoding until they finish, and
  new requests wait until the running set is below the new limit.
- ``abort`` frees the request's slot at once. A plan that still names an
  aborted request is harmless: ``update`` ignores entries it no longer knows.

Positions: a decode entry feeds the last sampled token at cache position
``position = prompt_len + generated - 1`` and attends to positions
``0..position``, so it reads ``position + 1`` cached tokens. ``StepPlan.kv_tokens``
sums that over the decode entries (the roofline's ``B · ctx`` term); prefill
cost is ``StepPlan.prefill_tokens``.

Times are passed in (seconds on any monotonic clock). TTFT includes queueing:
``first_token_s - arrival_s``; TPOT = ``(last_token_s - first_token_s) /
(generated - 1)`` (None for a single token); queue wait = admission (the
``now_s`` given to the ``schedule`` that admitted it) minus arrival.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Capacity of one engine.

    max_slots: KV-cache slots (sequences that can hold a cache at once).
    max_batch_size: running-set limit (the tuning knob), 1..max_slots.
    max_len: context length of a slot: prompt + max_tokens must fit.
    prefill_chunk: prompt tokens prefilled per step, over all requests.
    """

    max_slots: int
    max_batch_size: int
    max_len: int
    prefill_chunk: int = 256

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_batch_size", "max_len", "prefill_chunk"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if self.max_batch_size > self.max_slots:
            raise ValueError(
                f"max_batch_size={self.max_batch_size}: must be at most max_slots={self.max_slots}"
            )
        if self.max_len < 2:
            raise ValueError(f"max_len={self.max_len}: must be at least 2")


@dataclass(kw_only=True)
class SeqRequest:
    """One generation request as the scheduler sees it.

    ``prompt_ids`` is optional (the simulator has none); when given its length
    must equal ``prompt_len`` and the plan carries the ids to the executor.
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float
    prompt_ids: tuple[int, ...] | None = None
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, kw_only=True)
class DecodeEntry:
    """Feed ``token`` (the last sampled one; None in a simulation) at ``position``."""

    request_id: str
    slot: int
    position: int
    token: int | None


@dataclass(frozen=True, kw_only=True)
class PrefillChunk:
    """Prefill prompt positions ``start .. start+length-1`` into ``slot``.

    ``last`` is True when the chunk ends the prompt: its final logits sample
    the request's first token.
    """

    request_id: str
    slot: int
    start: int
    length: int
    last: bool
    token_ids: tuple[int, ...] | None


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    decode: tuple[DecodeEntry, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()

    @property
    def decode_batch(self) -> int:
        return len(self.decode)

    @property
    def kv_tokens(self) -> int:
        """Cached tokens the decode entries read: sum of (position + 1)."""
        return sum(e.position + 1 for e in self.decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    def sampling_ids(self) -> list[str]:
        """Requests that sample a token this step (decode entries, final chunks)."""
        return [e.request_id for e in self.decode] + [c.request_id for c in self.prefill if c.last]


@dataclass(frozen=True, kw_only=True)
class RequestTiming:
    """What one finished request measured; seconds on the engine's clock."""

    request_id: str
    arrival_s: float
    admitted_s: float
    first_token_s: float
    last_token_s: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.generated_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.generated_tokens - 1)

    @property
    def queue_wait_s(self) -> float:
        return self.admitted_s - self.arrival_s


@dataclass(frozen=True, kw_only=True)
class Finished:
    request_id: str
    reason: str  # "length" | "stop" (OpenAI finish_reason)
    timing: RequestTiming
    output_ids: tuple[int, ...]  # empty in a simulation


@dataclass(kw_only=True)
class _Seq:
    req: SeqRequest
    slot: int
    admitted_s: float
    computed: int = 0  # prompt tokens already in the cache
    generated: int = 0
    last_token: int | None = None
    output: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.req.prompt_len


class Scheduler:
    """Continuous batching over a fixed set of KV slots (see module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._max_batch_size = config.max_batch_size
        self._waiting: deque[SeqRequest] = deque()
        self._waiting_ids: set[str] = set()
        self._running: dict[str, _Seq] = {}  # insertion order = admission order
        self._free: list[int] = list(range(config.max_slots))  # a min-heap
        self._clock = float("-inf")  # latest time seen, for admission without now_s

    # ---- requests in and out -------------------------------------------------
    def validate(self, prompt_len: object, max_tokens: object) -> None:
        """Raise ValueError naming the bad value if a request cannot be served."""
        if not _is_int(prompt_len) or prompt_len < 1:
            raise ValueError(f"prompt length {prompt_len!r}: the prompt must not be empty")
        if not _is_int(max_tokens):
            raise ValueError(f"max_tokens={max_tokens!r}: must be an integer")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: must be at least 1")
        if prompt_len + max_tokens > self.config.max_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_tokens={max_tokens} = "
                f"{prompt_len + max_tokens} exceeds the context length {self.config.max_len}"
            )

    def add(self, req: SeqRequest) -> None:
        """Queue a request; ValueError (naming the value) if it cannot be served."""
        self.validate(req.prompt_len, req.max_tokens)
        if req.prompt_ids is not None and len(req.prompt_ids) != req.prompt_len:
            raise ValueError(
                f"prompt_ids has {len(req.prompt_ids)} tokens but prompt_len={req.prompt_len}"
            )
        if self.is_active(req.request_id):
            raise ValueError(f"request_id={req.request_id!r}: already in use")
        self._waiting.append(req)
        self._waiting_ids.add(req.request_id)
        self._clock = max(self._clock, req.arrival_s)

    def abort(self, request_id: str) -> bool:
        """Drop a request, waiting or running; its slot is free at once."""
        seq = self._running.pop(request_id, None)
        if seq is not None:
            heapq.heappush(self._free, seq.slot)
            return True
        if request_id in self._waiting_ids:
            self._waiting_ids.discard(request_id)
            self._waiting = deque(w for w in self._waiting if w.request_id != request_id)
            return True
        return False

    def set_max_batch_size(self, n: int) -> None:
        if not _is_int(n) or not 1 <= n <= self.config.max_slots:
            raise ValueError(
                f"max_batch_size={n!r}: must be an integer in 1..{self.config.max_slots} "
                "(max_slots)"
            )
        if n != self._max_batch_size:
            logger.info("max_batch_size %d -> %d", self._max_batch_size, n)
        self._max_batch_size = n

    # ---- the step --------------------------------------------------------------
    def schedule(self, now_s: float | None = None) -> StepPlan:
        """Decode every prefilled running request; spend the prefill budget FIFO."""
        if now_s is not None:
            self._clock = max(self._clock, now_s)
        decode = [
            DecodeEntry(
                request_id=rid,
                slot=s.slot,
                position=s.req.prompt_len + s.generated - 1,
                token=s.last_token,
            )
            for rid, s in self._running.items()
            if s.prefilled
        ]
        budget = self.config.prefill_chunk
        prefill: list[PrefillChunk] = []
        for s in self._running.values():
            if budget == 0:
                break
            if not s.prefilled:
                budget -= self._chunk(s, budget, prefill)
        while (
            budget > 0
            and self._waiting
            and self._free
            and len(self._running) < self._max_batch_size
        ):
            req = self._waiting.popleft()
            self._waiting_ids.discard(req.request_id)
            admitted = max(self._clock, req.arrival_s)
            s = _Seq(req=req, slot=heapq.heappop(self._free), admitted_s=admitted)
            self._running[req.request_id] = s
            budget -= self._chunk(s, budget, prefill)
        return StepPlan(decode=tuple(decode), prefill=tuple(prefill))

    @staticmethod
    def _chunk(s: _Seq, budget: int, out: list[PrefillChunk]) -> int:
        start = s.computed
        length = min(s.req.prompt_len - start, budget)
        ids = s.req.prompt_ids
        out.append(
            PrefillChunk(
                request_id=s.req.request_id,
                slot=s.slot,
                start=start,
                length=length,
                last=start + length == s.req.prompt_len,
                token_ids=None if ids is None else tuple(ids[start : start + length]),
            )
        )
        return length

    def update(
        self, plan: StepPlan, sampled: Mapping[str, int | None], now_s: float
    ) -> list[Finished]:
        """Apply one executed plan: advance prefills, record sampled tokens and times.

        ``sampled`` maps request ids to the token each sampled this step (see
        ``StepPlan.sampling_ids``); a simulation passes an empty mapping.
        Entries of requests aborted since ``schedule`` are ignored.
        """
        self._clock = max(self._clock, now_s)
        for c in plan.prefill:
            s = self._running.get(c.request_id)
            if s is not None and s.computed == c.start:
                s.computed = c.start + c.length
        finished: list[Finished] = []
        for rid in plan.sampling_ids():
            s = self._running.get(rid)
            if s is None:
                continue
            tok = sampled.get(rid)
            s.generated += 1
            s.last_token = tok
            if tok is not None:
                s.output.append(tok)
            if s.first_token_s is None:
                s.first_token_s = now_s
            s.last_token_s = now_s
            reason = None
            if tok is not None and tok in s.req.stop_ids:
                reason = "stop"
            elif s.generated >= s.req.max_tokens:
                reason = "length"
            if reason is not None:
                del self._running[rid]
                heapq.heappush(self._free, s.slot)
                finished.append(self._finished(s, reason))
        return finished

    @staticmethod
    def _finished(s: _Seq, reason: str) -> Finished:
        assert s.first_token_s is not None and s.last_token_s is not None
        timing = RequestTiming(
            request_id=s.req.request_id,
            arrival_s=s.req.arrival_s,
            admitted_s=s.admitted_s,
            first_token_s=s.first_token_s,
            last_token_s=s.last_token_s,
            prompt_tokens=s.req.prompt_len,
            generated_tokens=s.generated,
        )
        return Finished(
            request_id=s.req.request_id, reason=reason, timing=timing, output_ids=tuple(s.output)
        )

    # ---- state -----------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV slots held by running requests."""
        return len(self._running) / self.config.max_slots

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def slot_of(self, request_id: str) -> int | None:
        s = self._running.get(request_id)
        return None if s is None else s.slot

    def active_ids(self) -> list[str]:
        """Running then waiting request ids, in admission / arrival order."""
        return list(self._running) + [w.request_id for w in self._waiting]

    def is_active(self, request_id: str) -> bool:
        return request_id in self._running or request_id in self._waiting_ids
