"""Discrete-event simulator of one serving engine: the real scheduler, a virtual clock.

The executor is swapped, not the scheduler (shared/DESIGN.md): each step is
planned by :class:`serving.scheduler.Scheduler` exactly as the engine plans it,
its duration comes from a step-time function handed in (``StepPlan -> seconds``;
the controller hands in the roofline's, so serving/ never imports search/),
and the virtual clock advances by it. In front of the engine sits the admission
limit of the deployment (Ray Serve's ``max_ongoing_requests``): at most
``max_concurrency`` requests in flight; an arrival beyond it waits in a bounded
queue (``queue_limit``) or is rejected and counted.

Noise is the simulator's, not the step-time function's: a per-step lognormal
jitter (``step_noise_cv``) and a per-run slowdown (``window_noise_cv``: a noisy
neighbour for the whole window). A run measures the requests that finish in
``[warmup_s, warmup_s + window_s]`` and returns the same :class:`Observation` a
deployment yields: exact percentiles and three-way SLO verdicts from the
per-request samples (:mod:`metrics.samples`). Deterministic under a seed.

Speed. The scheduler costs O(1) per step whatever the decode batch and builds no
plan entries the simulator does not read (see serving/scheduler.py), arrivals a
full server turns away are counted in one bisect, a request's lengths are read
only when it is admitted, the cyclic garbage collector is paused during a run,
and, when the step-time function also offers
``decode_run(batch, kv_tokens[m]) -> seconds[m]`` (the times of decode-only plans
of ``batch`` sequences reading those KV tokens, equal to calling it on such
plans), a run of decode-only steps between events (the next request to finish,
the next arrival that would be admitted, the window's end) is timed in one
vectorised call and skipped over in the scheduler. Results are the same, bit for
bit, as stepping one plan at a time (tests/serving/test_sim.py checks both paths
against the plain reference loop).
"""

from __future__ import annotations

import bisect
import gc
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from metrics.observation import Observation, Slo
from serving.scheduler import RequestTiming, Scheduler, SchedulerConfig, StepPlan
from serving.sim_observation import observation_from_timings
from serving.workload import Workload

logger = logging.getLogger(__name__)

__all__ = ["SimConfig", "SimResult", "StepTimeFn", "observation_from_timings", "simulate"]

StepTimeFn = Callable[[StepPlan], float]

_NOISE_BLOCK = 4096
_MIN_RUN = 4  # decode-only steps worth one vectorised call of the step-time function


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


@dataclass(frozen=True, kw_only=True)
class SimResult:
    observation: Observation
    timings: tuple[RequestTiming, ...]  # requests finished inside the window
    steps: int
    busy_s: float  # simulated seconds spent in steps
    sim_s: float  # simulated seconds in all
    slowdown: float  # the per-run noise factor drawn


def _lognormal_sigma(cv: float) -> float:
    return math.sqrt(math.log1p(cv * cv))


def _queue_or_reject(
    arr: list[float], i: int, upto: float, queue: deque[int], limit: int, first_counted: int
) -> tuple[int, int]:
    """Arrivals ``i..`` up to time ``upto`` at a server with no room: they wait while the
    queue has room, the rest are turned away (counted from ``first_counted`` on).
    Returns (the next arrival's index, rejections counted)."""
    while arr[i] <= upto and len(queue) < limit:  # arr ends with a sentinel (inf)
        queue.append(i)
        i += 1
    j = bisect.bisect_right(arr, upto, i)
    return j, j - max(i, min(j, first_counted))


def _run_steps(
    base: list[float],
    slowdown: float,
    noise: list[float],
    k: int,
    t: float,
    busy: float,
    stop_s: float,
) -> tuple[int, float, float, float]:
    """Advance the clock over a run of steps of ``base[j] * slowdown * noise[k + j]``
    seconds, stopping before the first step that would start at or after ``stop_s`` (the
    window's end, or an arrival that would be admitted), after one step at least. Returns
    (steps taken, when the last one started, new clock, new busy time), summed one step
    after another as the step-by-step loop sums them."""
    took = 0
    last = t
    for b in base:
        if took and t >= stop_s:
            break
        dt = b * slowdown * noise[k + took]
        if not (dt > 0 and dt < math.inf):
            raise ValueError(f"step_time returned {dt!r} for a plan: must be > 0 seconds")
        last = t
        t += dt
        busy += dt
        took += 1
    return took, last, t, busy


def simulate(
    *,
    max_batch_size: int,
    max_concurrency: int,
    workload: Workload,
    step_time: StepTimeFn,
    config: SimConfig,
    slo: Slo,
    seed: int = 0,
) -> SimResult:
    """Run one measurement window of the engine at the given knobs (see module doc).

    The cyclic garbage collector is paused while it runs and resumed after (if it was
    on): a window allocates thousands of short-lived objects that reference counting
    frees, and the collections their allocation would trigger were ~7 % of a saturated
    window's instructions (valgrind, h100-8b at batch 416)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        return _simulate(
            max_batch_size=max_batch_size,
            max_concurrency=max_concurrency,
            workload=workload,
            step_time=step_time,
            config=config,
            slo=slo,
            seed=seed,
        )
    finally:
        if was_on:
            gc.enable()


def _simulate(
    *,
    max_batch_size: int,
    max_concurrency: int,
    workload: Workload,
    step_time: StepTimeFn,
    config: SimConfig,
    slo: Slo,
    seed: int,
) -> SimResult:
    if not (isinstance(max_batch_size, int) and max_batch_size >= 1):
        raise ValueError(f"max_batch_size={max_batch_size!r}: must be an integer >= 1")
    if not (isinstance(max_concurrency, int) and max_concurrency >= max_batch_size):
        raise ValueError(
            f"max_concurrency={max_concurrency!r}: must be an integer >= max_batch_size"
        )
    cfg = config
    rng = np.random.default_rng(seed)
    end_s = cfg.warmup_s + cfg.window_s
    arrivals = workload.arrivals(rng, end_s)  # [n]
    prompts, outputs = workload.lengths(rng, len(arrivals))  # [n], [n]
    room = cfg.max_len - 1
    prompts = np.minimum(prompts, room)
    outputs = np.clip(outputs, 1, cfg.max_len - prompts)
    slowdown = float(rng.lognormal(0.0, _lognormal_sigma(cfg.window_noise_cv)))
    sigma = _lognormal_sigma(cfg.step_noise_cv)

    sched = Scheduler(
        SchedulerConfig(
            max_slots=cfg.max_slots,
            max_batch_size=min(max_batch_size, cfg.max_slots),
            max_len=cfg.max_len,
            prefill_chunk=cfg.prefill_chunk,
        )
    )
    queue: deque[int] = deque()
    in_flight = 0
    rejected = 0
    timings: list[RequestTiming] = []
    keep = timings.append
    n = len(arrivals)
    arr = arrivals.tolist()
    arr.append(math.inf)  # a sentinel: arr[i] <= t is False past the last arrival
    # Lengths are read per admission: at a saturating load most arrivals are turned away.
    plen = prompts.item
    olen = outputs.item
    # Arrivals before warmup_s are not counted when rejected: the first index counted.
    first_counted = bisect.bisect_left(arr, cfg.warmup_s)
    limit = max_concurrency
    queue_limit = cfg.queue_limit
    warmup_s = cfg.warmup_s
    max_steps = cfg.max_steps
    add = sched.add_new
    schedule = sched.schedule
    update = sched.update
    decode_run = sched.decode_run
    bisect_right = bisect.bisect_right

    run_fn = getattr(step_time, "decode_run", None)

    def draw() -> list[float]:
        if not sigma:
            return [1.0] * _NOISE_BLOCK
        return rng.lognormal(-sigma * sigma / 2, sigma, size=_NOISE_BLOCK).tolist()

    t = 0.0
    i = 0
    steps = 0
    busy = 0.0
    noise: list[float] = []
    k = 0
    empty: dict[str, int | None] = {}
    while t < end_s:
        if arr[i] <= t:
            while arr[i] <= t and in_flight < limit:
                add(str(i), plen(i), olen(i), arr[i])
                in_flight += 1
                i += 1
            if arr[i] <= t:  # full: queue or turn away every arrival up to t
                if queue_limit:
                    i, turned = _queue_or_reject(arr, i, t, queue, queue_limit, first_counted)
                else:  # no queue: _queue_or_reject in short
                    j = bisect_right(arr, t, i)
                    turned = j - max(i, min(j, first_counted))
                    i = j
                rejected += turned
        if not in_flight:  # nothing running or waiting in the engine
            if i >= n:
                break
            t = arr[i]
            continue
        if run_fn is not None:
            m, batch, kv0 = decode_run()
            if m >= _MIN_RUN:  # a run of decode-only steps: all at once (see module doc)
                while len(noise) - k < m:
                    noise = noise[k:] + draw()
                    k = 0
                kv = kv0 + batch * np.arange(m, dtype=np.int64)  # [m]
                base = run_fn(batch, kv)  # [m]
                stop_s = arr[i] if in_flight < limit and arr[i] < end_s else end_s
                took, last_start, t, busy = _run_steps(
                    np.asarray(base, dtype=np.float64).tolist(), slowdown, noise, k, t, busy, stop_s
                )
                if arr[i] <= last_start:  # arrivals while full, as each step saw them
                    i, turned = _queue_or_reject(
                        arr, i, last_start, queue, queue_limit, first_counted
                    )
                    rejected += turned
                took = min(took, max_steps + 1 - steps)
                k += took
                steps += took
                if steps > max_steps:
                    raise RuntimeError(f"simulation exceeded max_steps={max_steps}")
                sched.skip_decode_steps(took, t)
                continue
        plan = schedule(t)
        if k >= len(noise):
            noise = noise[k:] + draw()
            k = 0
        dt = step_time(plan) * slowdown * noise[k]
        k += 1
        if not (dt > 0 and dt < math.inf):
            raise ValueError(f"step_time returned {dt!r} for a plan: must be > 0 seconds")
        t += dt
        busy += dt
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"simulation exceeded max_steps={max_steps}")
        done = update(plan, empty, t)
        if done:
            in_flight -= len(done)
            if warmup_s <= t <= end_s:
                for f in done:
                    keep(f.timing)
            while queue and in_flight < limit:
                j = queue.popleft()
                add(str(j), plen(j), olen(j), arr[j])
                in_flight += 1
    obs = observation_from_timings(
        timings,
        slo=slo,
        start_s=cfg.warmup_s,
        end_s=end_s,
        rejected=rejected,
        confidence=cfg.confidence,
    )
    logger.debug(
        "sim B=%d C=%d: %d steps, %d done, %d rejected",
        max_batch_size,
        max_concurrency,
        steps,
        obs.completed,
        rejected,
    )
    return SimResult(
        observation=obs,
        timings=tuple(timings),
        steps=steps,
        busy_s=busy,
        sim_s=t,
        slowdown=slowdown,
    )
