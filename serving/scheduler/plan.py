"""The scheduler's types: its capacity, a request, one step's plan, a finished request.

:class:`StepPlan` is what ``Scheduler.schedule`` returns and the executor runs. The
scheduler builds it *lean*: the decode batch size, the KV tokens it reads and the
prompt tokens and chunks it prefills are integers computed in O(1), and the
per-sequence :class:`DecodeEntry` and :class:`PrefillChunk` tuples are materialised
only when someone reads ``plan.decode`` or ``plan.prefill`` (the torch executor does;
the simulator never does). A materialised entry is the same whenever it is read,
before or after ``update``: it is derived from per-sequence facts that do not change
while the sequence decodes, and from each chunk's start and length fixed at
``schedule`` (see serving/scheduler/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard


def _is_int(v: object) -> TypeGuard[int]:
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


# A lean plan's facts, as the scheduler hands them to StepPlan.lean (a plain tuple: it is
# built once per step on the hot path): the counts the step-time functions read, the step
# index, and how to build the entries when they are read.
LEAN_DECODE_BATCH, LEAN_KV_TOKENS, LEAN_PREFILL_TOKENS, LEAN_PREFILL_COUNT = 0, 1, 2, 3
LEAN_STEP, LEAN_BUILD, LEAN_DATA = 4, 5, 6
LeanFacts = tuple[
    int,  # decode batch
    int,  # KV tokens its entries read
    int,  # prompt tokens prefilled
    int,  # prefill chunks
    int,  # the scheduler's step index
    Callable[[Any, bool], "tuple[DecodeEntry, ...] | tuple[PrefillChunk, ...]"],
    Any,  # what the builder reads (the scheduler's own view of the plan)
]

_new = object.__new__
_set = object.__setattr__


class StepPlan:
    """Who runs in one step: ``decode`` entries and ``prefill`` chunks (immutable).

    Build one by hand with ``StepPlan(decode=(...), prefill=(...))``; the scheduler
    builds lean ones (:meth:`lean`): their counts are known at once and both entry
    tuples are built on first access of ``decode`` or ``prefill``.
    """

    __slots__ = ("_decode", "_prefill", "_lean")
    # Set through object.__setattr__ (the plan is immutable). Any: the entry tuples (None
    # until built) and the LeanFacts (None: built by hand), read at constant indices.
    _decode: Any
    _prefill: Any
    _lean: Any

    def __init__(
        self,
        *,
        decode: tuple[DecodeEntry, ...] = (),
        prefill: tuple[PrefillChunk, ...] = (),
    ) -> None:
        _set(self, "_decode", tuple(decode))
        _set(self, "_prefill", tuple(prefill))
        _set(self, "_lean", None)

    @classmethod
    def lean(cls, facts: LeanFacts) -> StepPlan:
        """A plan of known counts whose entries ``facts[LEAN_BUILD](facts, prefill)`` builds
        when first read (the decode entries with ``prefill`` False, the chunks with True; the
        builder must return the same entries whenever it is called)."""
        plan = _new(cls)
        _set(plan, "_decode", None)
        _set(plan, "_prefill", None)
        _set(plan, "_lean", facts)
        return plan

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"StepPlan is immutable: cannot set {name!r}")

    @property
    def decode(self) -> tuple[DecodeEntry, ...]:
        d = self._decode
        if d is None:
            lean = self._lean
            d = lean[LEAN_BUILD](lean, False)
            _set(self, "_decode", d)
        return d

    @property
    def prefill(self) -> tuple[PrefillChunk, ...]:
        p = self._prefill
        if p is None:
            lean = self._lean
            p = lean[LEAN_BUILD](lean, True)
            _set(self, "_prefill", p)
        return p

    @property
    def step(self) -> int:
        """The scheduler's step index (-1: built by hand)."""
        lean = self._lean
        return -1 if lean is None else lean[LEAN_STEP]

    @property
    def decode_batch(self) -> int:
        lean = self._lean
        return len(self._decode) if lean is None else lean[LEAN_DECODE_BATCH]  # type: ignore[arg-type]

    @property
    def kv_tokens(self) -> int:
        """Cached tokens the decode entries read: sum of (position + 1)."""
        lean = self._lean
        if lean is None:
            return sum(e.position + 1 for e in self.decode)
        return lean[LEAN_KV_TOKENS]

    @property
    def prefill_tokens(self) -> int:
        lean = self._lean
        if lean is None:
            return sum(c.length for c in self.prefill)
        return lean[LEAN_PREFILL_TOKENS]

    @property
    def prefill_count(self) -> int:
        """Prefill chunks in the step (``len(plan.prefill)``, without building them)."""
        lean = self._lean
        return len(self.prefill) if lean is None else lean[LEAN_PREFILL_COUNT]

    def totals(self) -> tuple[int, int, int, int]:
        """``(decode_batch, kv_tokens, prefill_tokens, prefill_count)`` in one call: what a
        step-time function reads (O(1) for the scheduler's plans)."""
        lean = self._lean
        if lean is None:
            return self.decode_batch, self.kv_tokens, self.prefill_tokens, len(self.prefill)
        return lean[0], lean[1], lean[2], lean[3]

    @property
    def is_empty(self) -> bool:
        return self.decode_batch == 0 and self.prefill_count == 0

    def sampling_ids(self) -> list[str]:
        """Requests that sample a token this step (decode entries, final chunks)."""
        return [e.request_id for e in self.decode] + [c.request_id for c in self.prefill if c.last]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return self.decode == other.decode and self.prefill == other.prefill

    def __hash__(self) -> int:
        return hash((self.decode, self.prefill))

    def __repr__(self) -> str:
        return f"StepPlan(decode={self.decode!r}, prefill={self.prefill!r})"


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


# The scheduler's hot path builds these frozen dataclasses by filling the instance dict:
# the same objects (equality, hash, repr, immutability after construction) for about a
# third of what the generated __init__ costs, which stores each field through
# object.__setattr__. The engine's scheduler builds a Finished (and its RequestTiming)
# per finished request; the simulator builds no Finished, and a RequestTiming only when
# a result's timings are read (serving/sim/simulator.py).


_NO_STOP: frozenset[int] = frozenset()


def new_request(request_id: str, prompt_len: int, max_tokens: int, arrival_s: float) -> SeqRequest:
    """``SeqRequest(request_id=..., prompt_len=..., max_tokens=..., arrival_s=...)`` (no
    prompt ids, no stop ids), at half the cost of the generated ``__init__``."""
    r = _new(SeqRequest)
    d = r.__dict__
    d["request_id"] = request_id
    d["prompt_len"] = prompt_len
    d["max_tokens"] = max_tokens
    d["arrival_s"] = arrival_s
    d["prompt_ids"] = None
    d["stop_ids"] = _NO_STOP
    return r


def new_chunk(
    request_id: str, slot: int, start: int, length: int, last: bool, token_ids: tuple | None
) -> PrefillChunk:
    c = _new(PrefillChunk)
    d = c.__dict__
    d["request_id"] = request_id
    d["slot"] = slot
    d["start"] = start
    d["length"] = length
    d["last"] = last
    d["token_ids"] = token_ids
    return c


def new_timing(
    request_id: str,
    arrival_s: float,
    admitted_s: float,
    first_token_s: float,
    last_token_s: float,
    prompt_tokens: int,
    generated_tokens: int,
) -> RequestTiming:
    t = _new(RequestTiming)
    d = t.__dict__
    d["request_id"] = request_id
    d["arrival_s"] = arrival_s
    d["admitted_s"] = admitted_s
    d["first_token_s"] = first_token_s
    d["last_token_s"] = last_token_s
    d["prompt_tokens"] = prompt_tokens
    d["generated_tokens"] = generated_tokens
    return t


def new_finished(
    request_id: str,
    reason: str,
    output_ids: tuple[int, ...],
    arrival_s: float,
    admitted_s: float,
    first_token_s: float,
    last_token_s: float,
    prompt_tokens: int,
    generated_tokens: int,
) -> Finished:
    f = _new(Finished)
    d = f.__dict__
    d["request_id"] = request_id
    d["reason"] = reason
    d["timing"] = new_timing(
        request_id,
        arrival_s,
        admitted_s,
        first_token_s,
        last_token_s,
        prompt_tokens,
        generated_tokens,
    )
    d["output_ids"] = output_ids
    return f
