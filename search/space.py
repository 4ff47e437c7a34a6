"""The search space: the two knobs slotune tunes, and the bounds the roofline proves.

A point is :class:`Knobs` (decode batch limit, admission limit). The space is
log-scaled in both directions and is a box for the sampler: the batch is an
integer on ``[batch_min, batch_max]`` and the admission limit is expressed as a
*headroom* ratio ``max_concurrency / max_batch_size`` on ``[1, headroom_max]``, so
``max_concurrency >= max_batch_size`` holds everywhere in the box.

The bounds come from physics, not taste (:meth:`SearchSpace.from_roofline`):
the KV cache that fits in free memory caps the batch, and the peak roofline is
a lower bound on any real step time, so a batch whose *peak* step time already
exceeds the TPOT SLO is infeasible on every real machine and is left out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from metrics.observation import Slo

logger = logging.getLogger(__name__)

PARAM_BATCH = "max_batch_size"
PARAM_HEADROOM = "concurrency_headroom"
# The staged search (search.stages) samples the admission limit itself, under a batch cap.
PARAM_CONCURRENCY = "max_concurrency"


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """One operating point: at most ``max_batch_size`` sequences per decode step and at
    most ``max_concurrency`` requests in flight (the rest wait in a queue or are rejected)."""

    max_batch_size: int
    max_concurrency: int

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_concurrency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if self.max_concurrency < self.max_batch_size:
            raise ValueError(
                f"max_concurrency={self.max_concurrency} < max_batch_size={self.max_batch_size}:"
                " the admission limit must be at least the batch limit"
            )

    @property
    def headroom(self) -> float:
        return self.max_concurrency / self.max_batch_size

    def as_dict(self) -> dict[str, int]:
        return {"max_batch_size": self.max_batch_size, "max_concurrency": self.max_concurrency}

    def __str__(self) -> str:
        return f"B={self.max_batch_size},C={self.max_concurrency}"


class _RooflineLike(Protocol):
    max_batch_memory: int

    def step_time_s(self, batch: int, context: int | None = None) -> float: ...


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """A log-scaled box of knobs; ``headroom_max`` bounds ``max_concurrency / max_batch_size``."""

    batch_min: int = 1
    batch_max: int
    headroom_max: float = 4.0
    concurrency_max: int | None = None  # absolute cap on max_concurrency (None: batch_max·headroom)

    def __post_init__(self) -> None:
        if not (isinstance(self.batch_min, int) and self.batch_min >= 1):
            raise ValueError(f"batch_min={self.batch_min!r}: must be an integer >= 1")
        if not (isinstance(self.batch_max, int) and self.batch_max >= self.batch_min):
            raise ValueError(
                f"batch_max={self.batch_max!r}: must be an integer >= batch_min={self.batch_min}"
            )
        if not (math.isfinite(self.headroom_max) and self.headroom_max >= 1.0):
            raise ValueError(f"headroom_max={self.headroom_max!r}: must be a finite number >= 1")
        if self.concurrency_max is not None and self.concurrency_max < self.batch_max:
            raise ValueError(
                f"concurrency_max={self.concurrency_max!r}: must be >= batch_max={self.batch_max}"
            )

    @property
    def is_batch_fixed(self) -> bool:
        return self.batch_min == self.batch_max

    def distributions(self) -> dict[str, Any]:
        """Optuna distributions for the box (both log-scaled)."""
        import optuna.distributions as d

        out: dict[str, Any] = {}
        if self.batch_max > self.batch_min:
            out[PARAM_BATCH] = d.IntDistribution(self.batch_min, self.batch_max, log=True)
        if self.headroom_max > 1.0:
            out[PARAM_HEADROOM] = d.FloatDistribution(1.0, self.headroom_max, log=True)
        return out

    def knobs_from_params(self, params: Mapping[str, Any]) -> Knobs:
        b = int(params.get(PARAM_BATCH, self.batch_min))
        b = min(max(b, self.batch_min), self.batch_max)
        h = float(params.get(PARAM_HEADROOM, 1.0))
        h = min(max(h, 1.0), self.headroom_max)
        c = max(b, round(b * h))
        if self.concurrency_max is not None:
            c = max(b, min(c, self.concurrency_max))
        return Knobs(max_batch_size=b, max_concurrency=c)

    def params_from_knobs(self, knobs: Knobs) -> dict[str, Any]:
        """Sampler parameters for a knob (clipped into the box)."""
        k = self.clip(knobs)
        out: dict[str, Any] = {}
        if self.batch_max > self.batch_min:
            out[PARAM_BATCH] = k.max_batch_size
        if self.headroom_max > 1.0:
            out[PARAM_HEADROOM] = min(max(k.headroom, 1.0), self.headroom_max)
        return out

    def clip(self, knobs: Knobs) -> Knobs:
        """The nearest point of the box to ``knobs`` (keeps the headroom ratio)."""
        b = min(max(knobs.max_batch_size, self.batch_min), self.batch_max)
        h = min(max(knobs.headroom, 1.0), self.headroom_max)
        c = max(b, round(b * h))
        if self.concurrency_max is not None:
            c = max(b, min(c, self.concurrency_max))
        return Knobs(max_batch_size=b, max_concurrency=c)

    def contains(self, knobs: Knobs) -> bool:
        return self.clip(knobs) == knobs

    def grid(self, *, batches: list[int] | None = None, headrooms: list[float] | None = None):
        """Every knob of a grid (default: all batches at headroom 1 and the power-of-two
        headrooms), in order of batch then headroom; duplicates dropped."""
        bs = batches or list(range(self.batch_min, self.batch_max + 1))
        hs = headrooms or [1.0]
        seen: set[Knobs] = set()
        out: list[Knobs] = []
        for b in bs:
            for h in hs:
                if not (self.batch_min <= b <= self.batch_max) or h > self.headroom_max:
                    continue
                k = self.clip(Knobs(max_batch_size=b, max_concurrency=max(b, round(b * h))))
                if k not in seen:
                    seen.add(k)
                    out.append(k)
        return out

    @classmethod
    def bounded(
        cls,
        *,
        step_time_s: Callable[[int], float],
        max_batch_memory: int,
        slo: Slo,
        headroom_max: float = 4.0,
        batch_min: int = 1,
    ) -> SearchSpace:
        """The box that the roofline does not rule out.

        ``step_time_s(batch)`` is the *peak* roofline decode step time, a lower bound on
        the real TPOT; batches whose peak step already exceeds ``slo.tpot_p99_s`` are
        infeasible anywhere. ``max_batch_memory`` is the KV-cache capacity in sequences.
        """
        if max_batch_memory < batch_min:
            raise ValueError(
                f"max_batch_memory={max_batch_memory!r}: the KV cache does not hold"
                f" batch_min={batch_min} sequences; use a smaller context or more devices"
            )
        if step_time_s(batch_min) > slo.tpot_p99_s:
            raise ValueError(
                f"tpot_p99_s={slo.tpot_p99_s!r}: below the peak roofline step time"
                f" {step_time_s(batch_min):.4g} s at batch {batch_min}; no batch can meet it"
            )
        lo, hi = batch_min, max_batch_memory  # invariant: step(lo) <= slo
        if step_time_s(hi) <= slo.tpot_p99_s:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if step_time_s(mid) <= slo.tpot_p99_s:
                lo = mid
            else:
                hi = mid
        logger.info(
            "search space: batch %d..%d (KV capacity %d), headroom <= %.2f",
            batch_min,
            lo,
            max_batch_memory,
            headroom_max,
        )
        return cls(batch_min=batch_min, batch_max=lo, headroom_max=headroom_max)

    @classmethod
    def from_roofline(
        cls, roofline: _RooflineLike, slo: Slo, *, headroom_max: float = 4.0
    ) -> SearchSpace:
        """:meth:`bounded` with a ``search.roofline.curve.Roofline``."""
        return cls.bounded(
            step_time_s=lambda b: roofline.step_time_s(b),
            max_batch_memory=int(roofline.max_batch_memory),
            slo=slo,
            headroom_max=headroom_max,
        )
