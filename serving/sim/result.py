"""What one simulator window takes and gives (serving/sim/simulator.py runs it): :class:`SimConfig`,
the engine replica and how a window is measured, and :class:`SimResult`, what it measured."""

from __future__ import annotations

import math
from dataclasses import dataclass

from metrics.observation import Observation
from serving.scheduler.plan import RequestTiming
from serving.scheduler.seq import Seq


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One engine replica and how a run is measured."""

    max_slots: int  # KV-cache capacity in sequences
    max_len: int = 4096  # context length of a slot
    prefill_chunk: int = 512  # prompt tokens per step (chunked prefill)
    queue_limit: int = 0  # arrivals beyond max_concurrency that may wait (0: reject)
    warmup_s: float = 10.0
    window_s: float = 60.0
    step_noise_cv: float = 0.05
    window_noise_cv: float = 0.03
    confidence: float = 0.95
    max_steps: int = 2_000_000  # a guard against a step-time function returning ~0

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_len", "prefill_chunk", "max_steps"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if not (isinstance(self.queue_limit, int) and self.queue_limit >= 0):
            raise ValueError(f"queue_limit={self.queue_limit!r}: must be an integer >= 0")
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ValueError(f"warmup_s={self.warmup_s!r}: must be >= 0 seconds")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s={self.window_s!r}: must be > 0 seconds")
        for name in ("step_noise_cv", "window_noise_cv"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v < 1):
                raise ValueError(f"{name}={v!r}: must be in [0, 1)")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence={self.confidence!r}: must be in (0, 1)")

    def denoised(self) -> SimConfig:
        """The same engine without measurement noise (the per-run slowdown), for oracles.
        Per-step jitter stays: it is part of the latency distribution the SLO is about."""
        return SimConfig(**{**self.__dict__, "window_noise_cv": 0.0})


class SimResult:
    """What one window measured (immutable). ``timings``: the :class:`RequestTiming` of
    each request finished inside the window, in finish order, built when first read (the
    tuner reads only the observation; a window finishes hundreds of requests)."""

    __slots__ = ("observation", "steps", "busy_s", "sim_s", "slowdown", "_timings", "_seqs")

    observation: Observation
    steps: int
    busy_s: float  # simulated seconds spent in steps
    sim_s: float  # simulated seconds in all
    slowdown: float  # the per-run noise factor drawn

    def __init__(
        self,
        *,
        observation: Observation,
        timings: tuple[RequestTiming, ...] | None = None,
        steps: int,
        busy_s: float,
        sim_s: float,
        slowdown: float,
        finished: list[Seq] | None = None,
    ) -> None:
        """Give ``timings``, or ``finished``: the finished sequences they are made of."""
        if (timings is None) == (finished is None):
            raise ValueError("give timings or finished, not both")
        for name, v in (
            ("observation", observation),
            ("steps", steps),
            ("busy_s", busy_s),
            ("sim_s", sim_s),
            ("slowdown", slowdown),
            ("_timings", None if timings is None else tuple(timings)),
            ("_seqs", finished),
        ):
            object.__setattr__(self, name, v)

    @property
    def timings(self) -> tuple[RequestTiming, ...]:
        t = self._timings
        if t is None:
            t = tuple([s.timing() for s in self._seqs])
            object.__setattr__(self, "_timings", t)
            object.__setattr__(self, "_seqs", None)
        return t

    def _key(self) -> tuple:
        return (self.observation, self.timings, self.steps, self.busy_s, self.sim_s, self.slowdown)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SimResult):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SimResult is immutable: cannot set {name!r}")

    def __repr__(self) -> str:
        return (
            f"SimResult(observation={self.observation!r}, timings={self.timings!r},"
            f" steps={self.steps!r}, busy_s={self.busy_s!r}, sim_s={self.sim_s!r},"
            f" slowdown={self.slowdown!r})"
        )
