"""The scheduler as it was before it was made O(1) in the decode batch: the reference.

Kept only as a test oracle (tests/serving/test_scheduler_equivalence.py): every
decode entry built per step, every sequence touched per update, easy to read.
serving/scheduler/scheduler.py must plan and finish exactly as this does.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from serving.scheduler.plan import (
    DecodeEntry,
    Finished,
    PrefillChunk,
    RequestTiming,
    SchedulerConfig,
    SeqRequest,
    StepPlan,
)


def _isint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


class RefScheduler:
    """Continuous batching over a fixed set of KV slots, one Python step per sequence."""

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
        if not _isint(prompt_len) or prompt_len < 1:
            raise ValueError(f"prompt length {prompt_len!r}: the prompt must not be empty")
        if not _isint(max_tokens):
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
        if not _isint(n) or not 1 <= n <= self.config.max_slots:
            raise ValueError(
                f"max_batch_size={n!r}: must be an integer in 1..{self.config.max_slots} "
                "(max_slots)"
            )
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
