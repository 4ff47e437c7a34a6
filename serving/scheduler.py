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

Cost: a step is O(1) in the decode batch. The scheduler keeps the decoding set
with running sums (its size, its KV tokens), finds the requests that reach
``max_tokens`` by the step they do so (a list per step, a heap of the steps), hands
plans a view of the decoding set rather than a copy, and builds a plan's decode
entries and prefill chunks only when ``plan.decode`` or ``plan.prefill`` is read
(serving/step_plan.py, serving/seq_state.py; the state between steps is in
serving/sched_state.py). Work is per prefill chunk, per admission, per finish and
per token handed to ``update`` (the engine hands one per sequence; the simulator
none), so the simulator runs a batch of hundreds at the cost of a handful.

The simulator's step is the same planning and bookkeeping without the plan object and
the per-request records: ``schedule_totals`` plans the step as ``schedule`` does (both
call ``_plan``) and returns only its totals, and ``update_seqs`` applies it as
``update`` does without tokens (both call ``_prefilled`` and ``_retire``) and returns the
finished requests as their :class:`Seq`, from which ``update`` makes its
:class:`Finished` records. A request is one :class:`Seq` from ``add`` to its finish (no
:class:`SeqRequest` is kept). ``decode_run``/``skip_decode_steps`` (serving/sched_state.py)
let it pass over runs of decode-only steps without planning them.

Times are passed in (seconds on any monotonic clock). TTFT includes queueing:
``first_token_s - arrival_s``; TPOT = ``(last_token_s - first_token_s) /
(generated - 1)`` (None for a single token); queue wait = admission (the
``now_s`` given to the ``schedule`` that admitted it) minus arrival.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping

from serving.sched_state import SchedulerState
from serving.seq_state import Chunk, Seq, build_entries
from serving.step_plan import (
    LEAN_DATA,
    LEAN_STEP,
    DecodeEntry,
    Finished,
    PrefillChunk,
    RequestTiming,
    SchedulerConfig,
    SeqRequest,
    StepPlan,
)

__all__ = [
    "DecodeEntry",
    "Finished",
    "PrefillChunk",
    "RequestTiming",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerState",
    "SeqRequest",
    "StepPlan",
]

logger = logging.getLogger(__name__)

_heappush = heapq.heappush
_heappop = heapq.heappop
_lean_plan = StepPlan.lean


class Scheduler(SchedulerState):
    """Continuous batching over a fixed set of KV slots (see module docstring)."""

    # ---- the step --------------------------------------------------------------
    def schedule(self, now_s: float | None = None) -> StepPlan:
        """Decode every prefilled running request; spend the prefill budget FIFO.

        O(1) in the decode batch: its size and KV tokens are running sums, and the
        entries are materialised only when ``plan.decode``/``plan.prefill`` is read."""
        chunks, used = self._plan(now_s)
        k = self._step
        adds = self._dadds
        rems = self._drems
        if len(adds) + len(rems) > len(self._dbase) + 16:  # amortised O(1) per change
            self._rebase()
            adds = self._dadds
            rems = self._drems
        dview = (self._dbase, adds, len(adds), rems, len(rems))
        n = len(self._decoding)
        return _lean_plan(
            (n, self._kv_base + n * k, used, len(chunks), k, build_entries, (dview, chunks))
        )

    def schedule_totals(self, now_s: float) -> tuple[int, int, int, int]:
        """``schedule(now_s).totals()`` without the plan: ``(decode_batch, kv_tokens,
        prefill_tokens, prefill_count)`` of the next step, planned (admissions, chunks)
        exactly as ``schedule`` plans it. Follow it with ``update_seqs`` (the simulator's
        step: it reads nothing else of a plan)."""
        chunks, used = self._plan(now_s)
        if len(self._dadds) + len(self._drems) > len(self._dbase) + 16:
            self._rebase()  # as schedule does: the lists stay shorter than the set
        n = len(self._decoding)
        return n, self._kv_base + n * self._step, used, len(chunks)

    def _rebase(self) -> None:
        """A new tuple of the decoding set for plans' views; empty change lists."""
        self._dbase = tuple(self._decoding.values())
        self._dadds = []
        self._drems = []

    def _plan(self, now_s: float | None) -> tuple[list[Chunk], int]:
        """Plan the next step (both ``schedule`` and ``schedule_totals``): admit waiting
        requests and cut the prefill chunks. Returns the chunks and the prompt tokens they
        prefill; keeps the chunks for ``update_seqs``."""
        if now_s is not None and now_s > self._clock:
            self._clock = now_s
        budget = self._chunk_budget
        chunks: list[Chunk] = []
        for s in self._prefilling.values():  # admission order: the oldest prompt first
            start = s.computed
            length = s.plen - start
            if length > budget:
                length = budget
            chunks.append((s, start, length))
            budget -= length
            if budget == 0:
                break
        waiting = self._waiting
        running = self._running
        free = self._free
        limit = self._max_batch_size
        if budget and waiting and free and len(running) < limit:
            clock = self._clock
            prefilling = self._prefilling
            waiting_ids = self._waiting_ids
            order = self._admitted
            while True:
                s = waiting.popleft()
                rid = s.rid
                waiting_ids.discard(rid)
                at = s.arrival_s
                s.slot = _heappop(free)
                s.admitted_s = clock if clock > at else at
                s.order = order
                order += 1
                running[rid] = s
                prefilling[rid] = s
                length = s.plen
                if length > budget:
                    length = budget
                chunks.append((s, 0, length))
                budget -= length
                if not (budget and waiting and free and len(running) < limit):
                    break
            self._admitted = order
        self._pending = (self._step, chunks)
        return chunks, self._chunk_budget - budget

    def update(
        self, plan: StepPlan, sampled: Mapping[str, int | None], now_s: float
    ) -> list[Finished]:
        """Apply one executed plan: advance prefills, record sampled tokens and times.

        ``sampled`` maps request ids to the token each sampled this step (see
        ``StepPlan.sampling_ids``); a simulation passes an empty mapping. Entries of
        requests aborted since ``schedule`` are ignored. Every ``schedule`` is followed
        by exactly one ``update`` of its plan (a plan from an earlier step is refused).
        The cost is in the prefill chunks, the tokens given and the requests finishing,
        not in the decode batch.
        """
        k = self._step
        lean = plan._lean
        if lean is None or lean[LEAN_STEP] != k:
            raise ValueError(
                f"plan of step {plan.step} given to update at step {k}: apply each plan"
                " from schedule() exactly once, before the next schedule()"
            )
        if now_s > self._clock:
            self._clock = now_s
        firsts = self._prefilled(lean[LEAN_DATA][1], now_s)
        if sampled:
            self._saw_tokens = True
            return self._update_with_tokens(sampled, k, firsts, now_s)
        return [s.finished("length") for s in self._retire(k, firsts, now_s)]

    def update_seqs(self, now_s: float) -> list[Seq]:
        """``update(plan, {}, now_s)`` of the step planned last (by ``schedule_totals`` or
        ``schedule``), without the plan or any tokens, returning the finished requests as
        their :class:`Seq` (``last_token_s`` and ``generated`` set; ``Seq.finished`` and
        ``Seq.timing`` make the records ``update`` returns) instead of Finished records:
        the simulator's step, which builds a record only for what it reports."""
        k = self._step
        pending = self._pending
        if pending is None or pending[0] != k:
            raise ValueError(f"update_seqs at step {k}: schedule the step first")
        self._pending = None
        if now_s > self._clock:
            self._clock = now_s
        return self._retire(k, self._prefilled(pending[1], now_s), now_s)

    def _prefilled(self, chunks: list[Chunk], now_s: float) -> list[Seq]:
        """Advance the prompts by the step's chunks; the sequences whose prompt it completed
        (they sample their first token), in chunk order."""
        running = self._running
        prefilling = self._prefilling
        firsts: list[Seq] = []
        for s, start, length in chunks:
            if running.get(s.rid) is s and s.computed == start:  # else aborted since
                end = s.computed = start + length
                if end == s.plen:
                    del prefilling[s.rid]
                    s.first_token_s = now_s
                    firsts.append(s)
        return firsts

    def _retire(self, k: int, firsts: list[Seq], now_s: float) -> list[Seq]:
        """The end of step ``k`` without tokens: finish the decoding requests that reach
        ``max_tokens``, start the completed prompts decoding (or finish those that wanted
        one token), step on. Returns the finished, in the order ``update`` reports them."""
        # Without tokens nothing stops early, and the finishes come in this order: _pop_due
        # yields the decode batch's by (step, order) and all its live entries are for step
        # k (a request is finished in the update of the step it reaches max_tokens, and
        # skip_decode_steps never skips one), then the prompts' come in chunk order.
        done: list[Seq] = []
        end_steps = self._end_steps
        if end_steps and end_steps[0] <= k:
            decoding = self._decoding
            running = self._running
            drems = self._drems
            free = self._free
            kv_base = self._kv_base
            for s in self._pop_due(k):  # decoding requests reaching max_tokens
                rid = s.rid
                if decoding.get(rid) is not s:
                    continue  # aborted
                # _release of a decoding request, inlined: one call less per request.
                del running[rid]
                del decoding[rid]
                drems.append(s)
                kv_base -= s.plen + 1 - s.dec_start
                _heappush(free, s.slot)
                s.last_token_s = now_s
                s.generated = k - s.dec_start + 2
                done.append(s)
            self._kv_base = kv_base
        if firsts:  # _start_decoding, inlined: one call less per request
            d = k + 1
            decoding = self._decoding
            dadds = self._dadds
            kv_base = self._kv_base
            ends = self._ends
            for s in firsts:
                mt = s.max_tokens
                if mt == 1:  # never decoded
                    self._release(s)
                    s.last_token_s = now_s
                    s.generated = 1
                    done.append(s)
                    continue
                s.dec_start = d
                decoding[s.rid] = s
                dadds.append(s)
                kv_base += s.plen + 1 - d
                e = d + mt - 2
                bucket = ends.get(e)
                if bucket is None:
                    ends[e] = [s]
                    _heappush(end_steps, e)
                else:
                    bucket.append(s)
            self._kv_base = kv_base
        self._step = k + 1
        return done

    def _update_with_tokens(
        self,
        sampled: Mapping[str, int | None],
        k: int,
        firsts: list[Seq],
        now_s: float,
    ) -> list[Finished]:
        """The rest of ``update`` when tokens were handed in (an engine)."""
        # Finished: (0, admission order) for the decode batch, (1, chunk order) for prompts.
        done: list[tuple[tuple[int, int], Finished]] = []
        self._record(sampled, k, firsts, now_s, done)
        end_steps = self._end_steps
        if end_steps and end_steps[0] <= k:
            decoding = self._decoding
            for s in self._pop_due(k):  # decoding requests reaching max_tokens
                if decoding.get(s.rid) is s:
                    g = k - s.dec_start + 2
                    done.append(((0, s.order), self._finish(s, "length", g, now_s)))
        running = self._running
        for i, s in enumerate(firsts):
            if running.get(s.rid) is not s:
                continue  # stopped at its first token
            if s.max_tokens == 1:
                done.append(((1, i), self._finish(s, "length", 1, now_s)))
            else:
                self._start_decoding(s, k)
        self._step = k + 1
        if len(done) > 1:
            done.sort(key=lambda d: d[0])  # decode batch (admission order), then prompts
        return [f for _, f in done]

    def _start_decoding(self, s: Seq, k: int) -> None:
        """``s`` sampled its first token in step ``k``: it decodes from step ``k + 1``."""
        s.dec_start = d = k + 1
        self._decoding[s.rid] = s
        self._dadds.append(s)
        self._kv_base += s.plen + 1 - d
        e = d + s.max_tokens - 2
        bucket = self._ends.get(e)
        if bucket is None:
            self._ends[e] = [s]
            _heappush(self._end_steps, e)
        else:
            bucket.append(s)

    def _record(
        self,
        sampled: Mapping[str, int | None],
        k: int,
        firsts: list[Seq],
        now_s: float,
        done: list[tuple[tuple[int, int], Finished]],
    ) -> None:
        """Store the tokens sampled in step ``k``; finish the requests that hit a stop id."""
        running = self._running
        first_at = {s.rid: i for i, s in enumerate(firsts)}
        for rid, tok in sampled.items():
            s = running.get(rid)
            if s is None:
                continue
            if 0 <= s.dec_start <= k:
                idx = k - s.dec_start + 1  # in this plan's decode batch
            elif s.dec_start < 0 and s.computed >= s.plen:
                idx = 0  # its final prompt chunk ran in this plan
            else:
                continue  # not sampling in this step
            toks = s.tokens
            if toks is None:
                toks = s.tokens = []
            toks.extend([None] * (idx - len(toks)))
            toks.append(tok)
            if tok is not None and tok in s.stop_ids:
                key = (0, s.order) if idx else (1, first_at[rid])
                done.append((key, self._finish(s, "stop", idx + 1, now_s)))
