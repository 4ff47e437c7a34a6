"""The scheduler's state and its requests' book-keeping (serving.scheduler.scheduler plans steps).

:class:`SchedulerState` holds what the continuous-batching scheduler knows between
steps: the FIFO queue, the running set (prefilling, decoding), free KV slots, the
decoding requests by the step at which they reach ``max_tokens``, and the view of the
decoding set the plans take (serving/scheduler/seq.py). It takes requests in
(``validate``, ``add``), out (``abort``, finishing one), changes the batch limit, and
answers questions about its state, among them the simulator's: how many decode-only
steps come next (``decode_run``), which it may pass over at once (``skip_decode_steps``).
:class:`serving.scheduler.scheduler.Scheduler` adds the step (``schedule``, ``update``) on top of
it: the engine and the simulator use that.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from dataclasses import replace
from typing import Any

from serving.scheduler.plan import Finished, SchedulerConfig, SeqRequest, _is_int
from serving.scheduler.seq import Seq

logger = logging.getLogger(__name__)

_heappush = heapq.heappush
_heappop = heapq.heappop


class SchedulerState:
    """A scheduler's state between steps (see module doc)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._max_batch_size = config.max_batch_size
        self._max_len = config.max_len
        self._chunk_budget = config.prefill_chunk
        self._waiting: deque[Seq] = deque()  # queued requests, as sequences not yet admitted
        self._waiting_ids: set[str] = set()
        self._running: dict[str, Seq] = {}  # insertion order = admission order
        self._prefilling: dict[str, Seq] = {}  # running, prompt not fully cached
        self._decoding: dict[str, Seq] = {}  # running, decoding (admission order, see update)
        # The decoding set as plans see it, without copying it every step: a tuple of it
        # as it was, and the sequences added to / removed from it since (append-only
        # lists, replaced when the tuple is rebuilt), see serving/scheduler/seq.py.
        self._dbase: tuple[Seq, ...] = ()
        self._dadds: list[Seq] = []
        self._drems: list[Seq] = []
        self._kv_base = 0  # sum over _decoding of prompt_len + 1 - dec_start (see kv_tokens)
        # The decoding requests by the step of their last token (max_tokens reached), each
        # list in admission order (see _pop_due), and those steps as a min-heap: a finish
        # costs an append and a step with finishes one pop of an int, where a heap of
        # (step, order, seq) entries cost a pop of tuples compared by the dozen per finish.
        # Entries of requests aborted or stopped since stay until their step (see _pop_due).
        self._ends: dict[int, list[Seq]] = {}
        self._end_steps: list[int] = []
        # A decoding request left the set other than by reaching max_tokens (abort, stop
        # id): _ends may hold entries no longer decoding, which update_seqs then skips.
        self._stale = False
        self._step = 0  # updates applied: the index of the next plan
        # (step index, its chunks) of the step planned last, for update_seqs.
        self._pending: tuple[int, list[tuple[Seq, int, int]]] | None = None
        self._admitted = 0
        self._saw_tokens = False  # update got tokens: a skipped step would lose one
        self._free: list[int] = list(range(config.max_slots))  # a min-heap
        self._clock = float("-inf")  # latest time seen, for admission without now_s

    # ---- requests in and out -------------------------------------------------
    def validate(self, prompt_len: object, max_tokens: object) -> tuple[int, int]:
        """Raise ValueError naming the bad value if a request cannot be served; else return
        the two, as the integers they are."""
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
        return prompt_len, max_tokens

    def add(self, req: SeqRequest) -> None:
        """Queue a request; ValueError (naming the value) if it cannot be served."""
        # Read untyped: the values are checked here, and a compiled build (serving/native.py)
        # would check their declared types on reading (TypeError, not this ValueError).
        r: Any = req
        plen: object = r.prompt_len
        mt: object = r.max_tokens
        # The common case in one test (plain ints that fit); anything else the full check.
        if not (
            type(plen) is int
            and type(mt) is int
            and plen >= 1
            and mt >= 1
            and plen + mt <= self._max_len
        ):
            plen, mt = self.validate(plen, mt)
        ids = req.prompt_ids
        if ids is not None and len(ids) != plen:
            raise ValueError(f"prompt_ids has {len(ids)} tokens but prompt_len={plen}")
        rid = req.request_id
        if rid in self._running or rid in self._waiting_ids:
            raise ValueError(f"request_id={rid!r}: already in use")
        self._waiting.append(Seq(rid, plen, mt, req.arrival_s, ids, req.stop_ids))
        self._waiting_ids.add(rid)
        if req.arrival_s > self._clock:
            self._clock = req.arrival_s

    def add_new(
        self, request_id: str, prompt_len: object, max_tokens: object, arrival_s: float
    ) -> None:
        """``add(SeqRequest(...))`` of a request with no prompt ids and no stop ids, in one
        call and without the SeqRequest (the simulator adds thousands a window): the same
        checks and errors."""
        if not (
            type(prompt_len) is int
            and type(max_tokens) is int
            and prompt_len >= 1
            and max_tokens >= 1
            and prompt_len + max_tokens <= self._max_len
        ):
            prompt_len, max_tokens = self.validate(prompt_len, max_tokens)
        if request_id in self._running or request_id in self._waiting_ids:
            raise ValueError(f"request_id={request_id!r}: already in use")
        self._waiting.append(Seq(request_id, prompt_len, max_tokens, arrival_s))
        self._waiting_ids.add(request_id)
        if arrival_s > self._clock:
            self._clock = arrival_s

    def abort(self, request_id: str) -> bool:
        """Drop a request, waiting or running; its slot is free at once."""
        seq = self._running.pop(request_id, None)
        if seq is not None:
            if seq.dec_start >= 0:
                del self._decoding[request_id]
                self._stale = True
                self._drems.append(seq)
                self._kv_base -= seq.plen + 1 - seq.dec_start
            else:
                self._prefilling.pop(request_id, None)
                seq.computed = -1  # a chunk of it planned before is not applied (_prefilled)
            _heappush(self._free, seq.slot)
            return True
        if request_id in self._waiting_ids:
            self._waiting_ids.discard(request_id)
            self._waiting = deque(w for w in self._waiting if w.rid != request_id)
            return True
        return False

    def set_max_batch_size(self, max_batch_size: object) -> None:
        """The running-set limit from the next ``schedule``; ValueError (SchedulerConfig's)
        unless it is an integer in 1..max_slots."""
        value: Any = max_batch_size  # checked by SchedulerConfig, not by a compiled build
        config = replace(self.config, max_batch_size=value)
        if config.max_batch_size != self._max_batch_size:
            logger.info("max_batch_size %d -> %d", self._max_batch_size, config.max_batch_size)
        self.config = config
        self._max_batch_size = config.max_batch_size

    def _release(self, s: Seq) -> None:
        """Take a running request out of the running set and free its slot."""
        rid = s.rid
        del self._running[rid]
        if s.dec_start >= 0:
            del self._decoding[rid]
            self._stale = True  # its entry in _ends stays (see _pop_due)
            self._drems.append(s)
            self._kv_base -= s.plen + 1 - s.dec_start
        else:
            self._prefilling.pop(rid, None)
        _heappush(self._free, s.slot)

    def _pop_due(self, k: int) -> list[Seq]:
        """Take out the requests whose last token is due by step ``k`` (call it when
        ``_end_steps[0] <= k``), ordered by (that step, admission order); those aborted or
        stopped since are among them (callers skip a request no longer decoding).

        A step's list is in admission order as it is: requests start decoding in admission
        order (prefill is FIFO: a request gets a chunk only when every older one got the
        rest of its prompt, so no request completes its prompt before an older one), and
        are appended as they start (tests/serving/test_scheduler.py checks it)."""
        steps = self._end_steps
        due = self._ends.pop(_heappop(steps))
        while steps and steps[0] <= k:  # left from an earlier step: stale, in practice
            due = due + self._ends.pop(_heappop(steps))
        return due

    def _finish(self, s: Seq, reason: str, generated: int, now_s: float) -> Finished:
        self._release(s)
        s.last_token_s = now_s
        s.generated = generated
        return s.finished(reason)

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
        return list(self._running) + [w.rid for w in self._waiting]

    def is_active(self, request_id: str) -> bool:
        return request_id in self._running or request_id in self._waiting_ids

    # ---- runs of decode-only steps (the simulator's fast path) -------------------
    def decode_run(self) -> tuple[int, int, int]:
        """``(steps, batch, kv_tokens)``: the next ``steps`` plans decode the same ``batch``
        sequences and nothing else, the first reading ``kv_tokens`` cached tokens and each
        next one ``batch`` more, and no request finishes in their updates, as long as no
        request is added or aborted meanwhile. ``steps`` is 0 when the next plan prefills
        or admits, nothing decodes, or tokens were handed to ``update`` (an engine)."""
        n = len(self._decoding)
        if (
            not n
            or self._prefilling
            or self._saw_tokens
            or (self._waiting and self._free and len(self._running) < self._max_batch_size)
        ):
            return 0, n, 0
        decoding = self._decoding
        steps = self._end_steps
        while True:  # the first step with a request still decoding: they all have one
            e = steps[0]
            bucket = self._ends[e]
            s = bucket[0]
            if decoding.get(s.rid) is s:
                break
            live = [s for s in bucket if decoding.get(s.rid) is s]  # some were aborted
            if live:
                self._ends[e] = live
                break
            del self._ends[e]
            _heappop(steps)
        k = self._step
        return e - k, n, self._kv_base + n * k

    def skip_decode_steps(self, steps: object, now_s: float) -> None:
        """Apply ``steps`` of the steps ``decode_run`` promises at once, without plans;
        ``now_s`` is when the last of them ended. What they would have returned is
        nothing: no request finishes in them."""
        avail = self.decode_run()[0]
        if not (_is_int(steps) and 1 <= steps <= avail):
            raise ValueError(
                f"steps={steps!r}: only 1..{avail} decode-only steps can be skipped now"
            )
        self._step += steps
        if now_s > self._clock:
            self._clock = now_s
