"""The continuous-batching scheduler: pure, deterministic, no torch, no clock.

One engine step is three verbs (vLLM v1 ``EngineCore.step``)::

    plan = scheduler.schedule(now_s=t0)       # who runs this step, in which KV slot
    sampled = executor.execute(plan)          # the model (or a simulated step time)
    finished = scheduler.update(plan, sampled, now_s=t1)

The simulator (serving/sim/simulator.py) swaps the executor and keeps this scheduler;
its step is ``schedule_totals`` + ``update_seqs``, the same planning and book-keeping
without the plan object and the per-request records.

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

Cost: a step is O(1) in the decode batch; work is per prefill chunk, per admission,
per finish and per token handed to ``update`` (docs/serving.md "Scheduler").

Times are passed in (seconds on any monotonic clock). TTFT includes queueing:
``first_token_s - arrival_s``; TPOT = ``(last_token_s - first_token_s) /
(generated - 1)`` (None for a single token); queue wait = admission (the
``now_s`` given to the ``schedule`` that admitted it) minus arrival.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping

from serving.scheduler.plan import (
    LEAN_DATA,
    LEAN_STEP,
    Finished,
    StepPlan,
)
from serving.scheduler.seq import Chunk, Seq, build_entries
from serving.scheduler.state import SchedulerState

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
        n, kv, used, count = self.schedule_totals(now_s)
        k, chunks = self._pending  # type: ignore[misc]
        adds = self._dadds
        rems = self._drems
        dview = (self._dbase, adds, len(adds), rems, len(rems))
        return _lean_plan((n, kv, used, count, k, build_entries, (dview, chunks)))

    def schedule_totals(self, now_s: float | None = None) -> tuple[int, int, int, int]:
        """Plan the next step, ``schedule``'s planning (admissions, chunks; ``schedule``
        calls it), and return its totals without the plan: ``(decode_batch, kv_tokens,
        prefill_tokens, prefill_count)``, what ``schedule(now_s).totals()`` gives. The
        chunks are kept for ``update_seqs`` (the simulator's step: ``schedule_totals`` +
        ``update_seqs`` read nothing else of a plan)."""
        if now_s is not None and now_s > self._clock:
            self._clock = now_s
        budget = self._chunk_budget
        chunks: list[Chunk] = []
        prefilling = self._prefilling
        if prefilling:
            for s in prefilling.values():  # admission order: the oldest prompt first
                start = s.computed
                length = s.plen - start
                if length > budget:
                    length = budget
                chunks.append((s, start, length))
                budget -= length
                if budget == 0:
                    break
        waiting = self._waiting
        free = self._free
        if budget and waiting and free:
            running = self._running
            # Admit while there is budget, a waiting request, a free slot and room in the
            # running set: each admission takes one of the last three.
            room = self._max_batch_size - len(running)
            if len(free) < room:
                room = len(free)
            if len(waiting) < room:
                room = len(waiting)
            if room > 0:
                clock = self._clock
                waiting_ids = self._waiting_ids
                order = self._admitted
                append = chunks.append
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
                    append((s, 0, length))
                    budget -= length
                    room -= 1
                    if not (budget and room):
                        break
                self._admitted = order
        k = self._step
        self._pending = (k, chunks)
        if len(self._dadds) + len(self._drems) > len(self._dbase) + 16:
            self._rebase()  # amortised O(1) per change: the lists stay shorter than the set
        n = len(self._decoding)
        return n, self._kv_base + n * k, self._chunk_budget - budget, len(chunks)

    def _rebase(self) -> None:
        """A new tuple of the decoding set for plans' views; empty change lists."""
        self._dbase = tuple(self._decoding.values())
        self._dadds = []
        self._drems = []

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
        if not sampled:  # update_seqs of this plan's chunks, as records
            self._pending = (k, lean[LEAN_DATA][1])
            return [s.finished("length") for s in self.update_seqs(now_s)]
        if now_s > self._clock:
            self._clock = now_s
        firsts = self._prefilled(lean[LEAN_DATA][1], now_s)
        self._saw_tokens = True
        return self._update_with_tokens(sampled, k, firsts, now_s)

    def update_seqs(self, now_s: float) -> list[Seq]:
        """``update(plan, {}, now_s)`` of the step planned last (by ``schedule_totals`` or
        ``schedule``), without the plan or any tokens, returning the finished requests as
        their :class:`Seq` (``last_token_s`` and ``generated`` set; ``Seq.finished`` and
        ``Seq.timing`` make the records ``update`` returns) instead of Finished records:
        the simulator's step, which builds a record only for what it reports (``update``
        without tokens is this, then the records).

        The end of step ``k`` without tokens: advance the prompts by the step's chunks,
        finish the decoding requests that reach ``max_tokens``, start the completed
        prompts decoding (or finish those that wanted one token), step on."""
        k = self._step
        pending = self._pending
        if pending is None or pending[0] != k:
            raise ValueError(f"update_seqs at step {k}: schedule the step first")
        self._pending = None
        if now_s > self._clock:
            self._clock = now_s
        chunks = pending[1]
        firsts: list[Seq] = self._prefilled(chunks, now_s) if chunks else []
        # Without tokens nothing stops early, and the finishes come in this order: _pop_due
        # yields the decode batch's by (step, order) and all its live entries are for step
        # k (a request is finished in the update of the step it reaches max_tokens, and
        # skip_decode_steps never skips one), then the prompts' come in chunk order.
        end_steps = self._end_steps
        if end_steps and end_steps[0] <= k:
            decoding = self._decoding
            running = self._running
            free = self._free
            kv_base = self._kv_base
            # Decoding requests reaching max_tokens: _pop_due's common case inlined.
            done = self._ends.pop(_heappop(end_steps))
            if end_steps and end_steps[0] <= k:
                done = done + self._pop_due(k)
            if self._stale:  # some were aborted or stopped since: keep the live ones
                done = [s for s in done if decoding.get(s.rid) is s]
            for s in done:
                # _release of a decoding request, inlined: one call less per request.
                rid = s.rid
                del running[rid]
                del decoding[rid]
                d = s.dec_start
                kv_base -= s.plen + 1 - d
                _heappush(free, s.slot)
                s.last_token_s = now_s
                s.generated = k - d + 2
            self._drems += done
            self._kv_base = kv_base
        else:
            done = []
        if firsts:  # _start_decoding, inlined: one call less per request
            d = k + 1
            decoding = self._decoding
            dadds = self._dadds
            kv_base = self._kv_base
            ends = self._ends
            for s in firsts:
                mt = s.max_tokens
                if mt == 1:  # never decoded (not in the decoding set's KV sum)
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

    def _prefilled(self, chunks: list[Chunk], now_s: float) -> list[Seq]:
        """Advance the prompts by the step's chunks; the sequences whose prompt it completed
        (they sample their first token), in chunk order."""
        prefilling = self._prefilling
        firsts: list[Seq] = []
        for s, start, length in chunks:
            # Else aborted since (abort sets computed to -1): a chunk of a prompt is planned
            # only while it prefills, and it leaves the running set otherwise only once its
            # prompt is done.
            if s.computed == start:
                end = s.computed = start + length
                if end == s.plen:
                    del prefilling[s.rid]
                    s.first_token_s = now_s
                    firsts.append(s)
        return firsts

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

    def resolve(self, k: int, sampled: Mapping[str, int], now_s: float) -> list[Finished]:
        """Hand in the tokens of step ``k`` after its ``update`` took None for them (an
        engine that launches step ``k + 1`` before it has step ``k``'s tokens: the device
        path's overlap). Call it before step ``k + 1``'s ``update``. Each token takes its
        place; a request whose first token this is gets ``now_s`` as its first-token time
        (the token reached the host now, not at the ``update``); one that sampled a stop id
        finishes now with reason "stop", and its entry in step ``k + 1``'s plan is ignored
        like an aborted request's. Requests that finished in step ``k``'s ``update``
        (``max_tokens`` reached) or were aborted since are skipped: the caller completes
        their records. Returns the finished, in the order of ``sampled``."""
        running = self._running
        done: list[Finished] = []
        for rid, tok in sampled.items():
            s = running.get(rid)
            if s is None or s.tokens is None:
                continue
            d = s.dec_start
            if d == k + 1:
                idx = 0  # its prompt's last chunk ran in step k
                s.first_token_s = now_s
            elif 0 <= d <= k:
                idx = k - d + 1
            else:
                continue
            toks = s.tokens
            if idx >= len(toks) or toks[idx] is not None:
                continue
            toks[idx] = tok
            if tok in s.stop_ids:
                done.append(self._finish(s, "stop", idx + 1, now_s))
        return done

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
