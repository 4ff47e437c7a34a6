"""What changing each knob costs, and the staged search that follows from it (pure).

Today's backends change both knobs live; two do not:

- ``restart``: the admission limit changes live but the engine's batch limit restarts
  the replicas (Ray Serve LLM: ``engine_kwargs.max_num_seqs`` is part of the replica's
  construction, while ``max_ongoing_requests`` is a lightweight update). The search
  holds the batch limit at a *cap* and searches the admission limit live under it;
  it moves the cap rarely (:func:`next_cap`), at most ``max_batch_changes`` times.
- ``fixed``: the batch limit cannot be changed at all (a standalone server): one stage
  at the space's largest batch, no moves; only the admission (client concurrency) varies.

Under a closed-loop load of ``C`` requests in flight and a batch limit (cap) ``K``, the
engine runs ``min(C, K)`` sequences a step and queues the rest, so one admission value
``C`` at cap ``K`` measures the operating point :func:`realize` ``= Knobs(min(C, K), C)``:
below the cap the admission limit *is* the batch, above it it is headroom. Points are
pooled by these effective knobs across caps (the point ``(C, C)`` is the same under any cap
``>= C``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from metrics.observation import Slo
from search.space import Knobs, SearchSpace
from search.stop_rule import PointSummary, StopRule, incumbent

if TYPE_CHECKING:
    from search.guide import Guide

BATCH_MODES = ("live", "restart", "fixed")


@dataclass(frozen=True, kw_only=True)
class KnobCosts:
    """How the batch limit changes: ``live`` (both knobs live: the 2-D search),
    ``restart`` (a change restarts replicas: staged search of the admission limit under a
    cap moved at most ``max_batch_changes`` times) or ``fixed`` (never applied: a 1-D
    search of the admission limit, the batch tied to it). A stage lasts at least
    ``min_stage_trials`` trials and ends after ``stage_trials`` or when the stop rule
    holds; a cap with TPOT slack (best point at the cap, p99 TPOT at most ``slack`` of
    the SLO) goes up by ``up_min``..``up_max``; ``settle`` moves the cap down to the best
    batch once, to search the admission headroom above it as it will be deployed."""

    batch: str = "live"
    max_batch_changes: int = 3
    stage_trials: int = 10
    min_stage_trials: int = 3
    slack: float = 0.9
    up_min: float = 1.5
    up_max: float = 2.0
    settle: bool = True

    def __post_init__(self) -> None:
        if self.batch not in BATCH_MODES:
            raise ValueError(f"batch={self.batch!r}: choose one of {BATCH_MODES}")
        for name in ("max_batch_changes", "stage_trials", "min_stage_trials"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r}: must be an integer >= 0")
        if not 1 <= self.min_stage_trials <= self.stage_trials:
            raise ValueError(
                f"min_stage_trials={self.min_stage_trials!r}: must be in [1, stage_trials="
                f"{self.stage_trials}]"
            )
        if not 0 < self.slack <= 1:
            raise ValueError(f"slack={self.slack!r}: must be in (0, 1]")
        if not (math.isfinite(self.up_max) and 1 < self.up_min <= self.up_max):
            raise ValueError(
                f"up_min={self.up_min!r}, up_max={self.up_max!r}: need 1 < up_min <= up_max"
            )

    @property
    def staged(self) -> bool:
        return self.batch != "live"


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """What to apply for the next trial. ``knobs`` is the operating point it measures
    (effective batch, admission limit = client concurrency); ``batch_cap`` the engine
    batch limit to set (``max_num_seqs``; None: not applied, ``fixed``); ``batch_change``
    whether that differs from the previous trial's (under ``restart``: a replica restart,
    whose seconds go back through ``Tuner.report(..., change_cost_s=)``)."""

    knobs: Knobs
    batch_cap: int | None
    batch_change: bool
    phase: str
    stage: int


@dataclass(frozen=True, kw_only=True)
class ChangeSummary:
    """For the report: how often the batch limit changed and what that cost."""

    mode: str
    batch_changes: int  # trials that changed the batch limit (the first setting included)
    change_cost_s: float  # seconds reported through report(change_cost_s=), summed
    caps: tuple[int, ...]  # the batch caps held, in order (empty: not applied)
    trials_per_cap: tuple[int, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "batch_changes": self.batch_changes,
            "change_cost_s": round(self.change_cost_s, 3),
            "caps": list(self.caps),
            "trials_per_cap": list(self.trials_per_cap),
        }


def realize(concurrency: int, cap: int) -> Knobs:
    """The operating point that admission ``concurrency`` measures under batch cap ``cap``."""
    return Knobs(max_batch_size=min(concurrency, cap), max_concurrency=concurrency)


def reachable(knobs: Knobs, cap: int) -> bool:
    """Whether ``knobs`` can be measured by the admission limit alone under ``cap``."""
    return realize(knobs.max_concurrency, cap) == knobs


def concurrency_bounds(
    space: SearchSpace, cap: int, costs: KnobCosts, *, settled: bool = False
) -> tuple[int, int]:
    """The admission limits searched under ``cap``: the space's smallest batch up to
    ``cap · headroom_max`` (``cap`` when the batch is ``fixed``: its queue is unknown);
    from ``cap`` up once ``settled`` (the cap came down to the best batch: everything
    below it was measured under the higher cap)."""
    hi = cap if costs.batch == "fixed" else math.floor(cap * space.headroom_max)
    if space.concurrency_max is not None:
        hi = min(hi, space.concurrency_max)
    hi = max(space.batch_min, hi)
    return (min(cap, hi) if settled else space.batch_min), hi


def concurrency_max(space: SearchSpace, costs: KnobCosts) -> int:
    """The largest admission limit of any stage (the study's distribution bound)."""
    return concurrency_bounds(space, space.batch_max, costs)[1]


def first_cap(space: SearchSpace, seeds: Sequence[Knobs], costs: KnobCosts) -> int:
    """``fixed``: the space's largest batch; ``restart``: the first seed's (the roofline
    operating point: the peak roofline is optimistic, so the best batch is rarely above
    it and everything below is searched live), else the largest batch."""
    if costs.batch == "restart" and seeds:
        return space.clip(seeds[0]).max_batch_size
    return space.batch_max


def next_cap(
    points: Sequence[PointSummary],
    *,
    cap: int,
    visited: Sequence[int],
    space: SearchSpace,
    slo: Slo,
    costs: KnobCosts,
    rule: StopRule,
    guide: Guide | None = None,
) -> tuple[int, str] | None:
    """The next batch cap once a stage is over, and why; None: keep this one.

    From the best point (declared, else measured feasible once): at the cap with p99 TPOT
    under ``slack · SLO`` and nothing above the cap measured yet, go up (the guide's
    largest batch within the SLO when given, bounded to ``up_min``..``up_max`` times the
    cap); below the cap (TPOT- or TTFT-limited there) and ``settle``, go down to its
    batch once, to search the headroom above it. Nothing feasible: no move helps
    (every batch below the cap was reachable live)."""
    if costs.batch != "restart":
        return None
    best = incumbent(points, confirmations=rule.confirmations) or incumbent(points)
    if best is None:
        return None
    b = best.knobs.max_batch_size
    if b >= cap:
        slack = math.isfinite(best.tpot_p99_s) and best.tpot_p99_s <= costs.slack * slo.tpot_p99_s
        above = any(p.knobs.max_batch_size > cap for p in points)
        if not slack or above or cap >= space.batch_max:
            return None
        lo, hi = math.ceil(cap * costs.up_min), math.floor(cap * costs.up_max)
        want = lo
        if guide is not None:
            wide = replace(guide, space=replace(space, headroom_max=1.0, concurrency_max=None))
            target = wide.target_batch(points)
            if target is not None:
                want = min(max(target, lo), hi)
        new = min(space.batch_max, max(want, cap + 1))
        if new in visited:
            return None
        return new, f"best point at the cap {cap} has TPOT slack: cap up to {new}"
    if costs.settle and space.headroom_max > 1.0 and b not in visited:
        return b, f"best batch {b} is below the cap {cap}: cap down to it, search admission"
    return None


@dataclass(frozen=True, kw_only=True)
class StageState:
    """Where the staged search stands, derived from the stored trials (so it resumes)."""

    stage: int  # index of the current stage (0: the first cap)
    cap: int  # the batch cap held in it
    in_stage: int  # finished trials at this stage
    visited: tuple[int, ...]  # caps held so far, in order
    last_cap: int | None  # the batch cap of the latest trial (None: no trial yet)

    @property
    def settled(self) -> bool:
        """The cap came down from a higher one (to the best batch, :func:`next_cap`)."""
        return self.cap < max(self.visited)


def stage_state(trials: Sequence[tuple[Mapping[str, Any], bool]], *, first: int) -> StageState:
    """From each trial's ``(user_attrs, finished)`` in trial order (``first``: the cap of
    stage 0 when no trial has one)."""
    stage, cap, last = 0, first, None
    visited: list[int] = []
    counts: dict[int, int] = {}
    for attrs, finished in trials:
        if "batch_cap" not in attrs:
            continue
        stage, cap = int(attrs.get("stage", 0)), int(attrs["batch_cap"])
        last = cap
        if cap not in visited:
            visited.append(cap)
        counts[stage] = counts.get(stage, 0) + int(finished)
    return StageState(
        stage=stage,
        cap=cap,
        in_stage=counts.get(stage, 0),
        visited=tuple(visited) or (cap,),
        last_cap=last,
    )


def change_summary(trials: Sequence[Mapping[str, Any]], *, mode: str) -> ChangeSummary:
    """The batch changes and their reported cost over every trial's ``user_attrs``."""
    caps: list[int] = []
    per: list[int] = []
    changes, cost = 0, 0.0
    prev: object = None
    for a in trials:
        if "batch_change" in a:
            changes += int(bool(a["batch_change"]))
        else:  # live: a change of the batch limit between consecutive trials
            b = a.get("max_batch_size")
            changes += int(prev is not None and b != prev)
            prev = b
        c = a.get("change_cost_s")
        cost += float(c) if isinstance(c, (int, float)) and math.isfinite(c) else 0.0
        if "batch_cap" in a and mode != "fixed":
            cap = int(a["batch_cap"])
            if not caps or caps[-1] != cap:
                caps.append(cap)
                per.append(0)
            per[-1] += 1
    return ChangeSummary(
        mode=mode,
        batch_changes=changes,
        change_cost_s=cost,
        caps=tuple(caps),
        trials_per_cap=tuple(per),
    )
