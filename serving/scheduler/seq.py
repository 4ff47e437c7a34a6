"""A request as the scheduler keeps it, and a lean plan's entries built from it.

A :class:`Seq` is made when a request is queued and is the scheduler's only object for
it until it finishes: its own facts are copied from the :class:`SeqRequest` (the
simulator's ``add_new`` makes none), its admission and finish are recorded on it, and
the :class:`Finished` and :class:`RequestTiming` records are made from it only when
wanted (``Seq.finished`` for the engine's ``update``, ``Seq.timing`` when a simulated
result's timings are read).

:func:`build_entries` turns a lean plan's data (the decoding set's view
:data:`DecodeView` and the chunks as ``(seq, start, length)``) into the
:class:`DecodeEntry` and :class:`PrefillChunk` tuples when the plan's ``decode`` or
``prefill`` is first read; a plan's entries are the same whenever they are built
(docs/serving.md "Scheduler").
"""

from __future__ import annotations

import math
from typing import Any

from serving.scheduler.plan import (
    _NO_STOP,
    LEAN_DATA,
    LEAN_STEP,
    DecodeEntry,
    Finished,
    PrefillChunk,
    RequestTiming,
    new_chunk,
    new_finished,
    new_timing,
)


class Seq:
    """A request from the moment it is queued: its own facts (id, lengths, arrival, prompt
    and stop ids; no :class:`SeqRequest` is kept, and the simulator makes none), then its
    slot, admission time and order once admitted, then its finish. While it decodes, its
    position and generated count follow from the step index alone: at step ``k`` it has
    ``1 + k - dec_start`` tokens and feeds the last one at position
    ``prompt_len + k - dec_start``. So a step costs nothing per decoding sequence, and a
    plan's decode entries can be built whenever they are read.

    ``slot``, ``admitted_s`` and ``order`` are set when it is admitted, ``last_token_s``
    and ``generated`` when it finishes (unset before: nothing reads them earlier)."""

    # Set when admitted / when it finishes (see above): declared, not set in __init__.
    slot: int
    admitted_s: float
    order: int
    last_token_s: float
    generated: int

    __slots__ = (
        "rid",
        "plen",
        "max_tokens",
        "arrival_s",
        "prompt_ids",
        "stop_ids",
        "slot",
        "admitted_s",
        "order",
        "computed",
        "dec_start",
        "tokens",
        "first_token_s",
        "last_token_s",
        "generated",
    )

    def __init__(
        self,
        rid: str,
        plen: int,
        max_tokens: int,
        arrival_s: float,
        prompt_ids: tuple[int, ...] | None = None,
        stop_ids: frozenset[int] = _NO_STOP,
    ) -> None:
        self.rid = rid
        self.plen = plen
        self.max_tokens = max_tokens
        self.arrival_s = arrival_s
        self.prompt_ids = prompt_ids
        self.stop_ids = stop_ids
        self.computed = 0  # prompt tokens already in the cache
        self.dec_start = -1  # the step index of its first decode (-1: still prefilling)
        # Sampled tokens by sample index (None: none given for that one; None: none at all).
        self.tokens: list[int | None] | None = None
        self.first_token_s = math.nan

    def finished(self, reason: str) -> Finished:
        """Its :class:`Finished` record (after it finished: ``last_token_s``, ``generated``)."""
        toks = self.tokens
        return new_finished(
            self.rid,
            reason,
            () if toks is None else tuple(t for t in toks if t is not None),
            self.arrival_s,
            self.admitted_s,
            self.first_token_s,
            self.last_token_s,
            self.plen,
            self.generated,
        )

    def timing(self) -> RequestTiming:
        """Its :class:`RequestTiming` (after it finished)."""
        return new_timing(
            self.rid,
            self.arrival_s,
            self.admitted_s,
            self.first_token_s,
            self.last_token_s,
            self.plen,
            self.generated,
        )

    def entry(self, k: int) -> DecodeEntry:
        """Its decode entry in the plan of step ``k``."""
        i = k - self.dec_start
        toks = self.tokens
        return DecodeEntry(
            request_id=self.rid,
            slot=self.slot,
            position=self.plen + i,
            token=toks[i] if toks is not None and i < len(toks) else None,
        )

    def chunk(self, start: int, length: int) -> PrefillChunk:
        """Its prefill chunk of prompt positions ``start .. start+length-1``."""
        ids = self.prompt_ids
        return new_chunk(
            self.rid,
            self.slot,
            start,
            length,
            start + length == self.plen,
            None if ids is None else tuple(ids[start : start + length]),
        )


Chunk = tuple[Seq, int, int]  # (sequence, start, length): a prefill chunk as planned
# The decoding set when a plan was made: (a tuple of it as it was at some earlier step,
# the append-only lists of sequences added to and removed from it since, and how many of
# each had been appended then). The scheduler appends in O(1) and rebuilds the tuple once
# the lists outgrow it, so a step never copies the set; a plan whose entries are read
# replays its prefix of the lists (a sequence is added once and removed once: each
# admission makes a new Seq).
DecodeView = tuple[tuple[Seq, ...], list[Seq], int, list[Seq], int]


def decoding_seqs(view: DecodeView) -> tuple[Seq, ...]:
    """The decoding sequences a view names, in the set's order (admission order)."""
    base, adds, n_adds, rems, n_rems = view
    if not n_adds and not n_rems:
        return base
    gone = set(rems[:n_rems])  # Seq hashes by identity
    return tuple([s for s in base if s not in gone] + [s for s in adds[:n_adds] if s not in gone])


def build_entries(
    lean: tuple[Any, ...], prefill: bool
) -> tuple[DecodeEntry, ...] | tuple[PrefillChunk, ...]:
    """A lean plan's decode entries, or its prefill chunks (the builder StepPlan calls)."""
    dview, chunks = lean[LEAN_DATA]
    if prefill:
        return tuple(s.chunk(start, length) for s, start, length in chunks)
    k = lean[LEAN_STEP]
    return tuple(s.entry(k) for s in decoding_seqs(dview))
