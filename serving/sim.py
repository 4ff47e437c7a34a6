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

Speed. The scheduler costs O(1) per step whatever the decode batch (see
serving/scheduler.py), arrivals a full server turns away are counted in one
bisect, and, when the step-time function also offers
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
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from metrics.observation import Observation, Percentiles, Slo
from metrics.samples import exact_quantile, verdict_from_samples
from serving.scheduler import RequestTiming, Scheduler, SchedulerConfig, SeqRequest, StepPlan
from serving.workload import Workload

logger = logging.getLogger(__name__)

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
    while i < len(arr) and arr[i] <= upto and len(queue) < limit:
        queue.append(i)
        i += 1
    j = bisect.bisect_right(arr, upto, i)
    return j, j - max(i, min(j, first_counted))


def _decode_run_times(
    t: float, busy: float, dts: np.ndarray, stop_s: float
) -> tuple[int, float, float, float]:
    """Advance the clock over a run of steps lasting ``dts`` [m] seconds, stopping before
    the first step that would start at or after ``stop_s`` (the window's end, or an
    arrival that would be admitted). Returns (steps taken, when the last one started,
    new clock, new busy time), summed one step after another as the step-by-step loop
    sums them."""
    if not bool(np.all(np.isfinite(dts) & (dts > 0))):
        bad = dts[~(np.isfinite(dts) & (dts > 0))][0]
        raise ValueError(f"step_time returned {float(bad)!r} for a plan: must be > 0 seconds")
    clock = np.cumsum(np.concatenate(([t], dts)))  # [m+1]: step j runs clock[j]..clock[j+1]
    took = max(1, min(len(dts), int(np.searchsorted(clock[:-1], stop_s, side="left"))))
    busy_end = np.cumsum(np.concatenate(([busy], dts[:took])))[-1]
    return took, float(clock[took - 1]), float(clock[took]), float(busy_end)


def observation_from_timings(
    timings: list[RequestTiming],
    *,
    slo: Slo,
    start_s: float,
    end_s: float,
    rejected: int,
    confidence: float,
    source: str = "sim",
) -> Observation:
    """The Observation of a window from per-request timings (exact quantiles, verdicts)."""
    ttft = [t.ttft_s for t in timings]
    tpot = [x for x in (t.tpot_s for t in timings) if x is not None]
    met = sum(
        1
        for t in timings
        if t.ttft_s <= slo.ttft_p99_s and (t.tpot_s is None or t.tpot_s <= slo.tpot_p99_s)
    )

    def pct(x: list[float]) -> Percentiles:
        if not x:
            return Percentiles()
        return Percentiles(
            p50=exact_quantile(x, 0.5), p90=exact_quantile(x, 0.9), p99=exact_quantile(x, 0.99)
        )

    q = slo.quantile
    return Observation(
        start_s=start_s,
        end_s=end_s,
        completed=len(timings),
        slo_met=met,
        rejected=rejected,
        generated_tokens=sum(t.generated_tokens for t in timings),
        ttft=pct(ttft),
        tpot=pct(tpot),
        ttft_verdict=verdict_from_samples(ttft, slo.ttft_p99_s, q=q, confidence=confidence),
        tpot_verdict=verdict_from_samples(tpot, slo.tpot_p99_s, q=q, confidence=confidence),
        source=source,
    )


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
    """Run one measurement window of the engine at the given knobs (see module doc)."""
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
    n = len(arrivals)
    arr = arrivals.tolist()
    pl = prompts.tolist()
    ol = outputs.tolist()
    # Arrivals before warmup_s are not counted when rejected: the first index counted.
    first_counted = bisect.bisect_left(arr, cfg.warmup_s)
    limit = max_concurrency
    queue_limit = cfg.queue_limit
    warmup_s = cfg.warmup_s
    max_steps = cfg.max_steps
    add = sched.add
    schedule = sched.schedule
    update = sched.update

    def admit(i: int) -> None:
        add(SeqRequest(request_id=str(i), prompt_len=pl[i], max_tokens=ol[i], arrival_s=arr[i]))

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
        if i < n and arr[i] <= t:
            while i < n and arr[i] <= t and in_flight < limit:
                admit(i)
                in_flight += 1
                i += 1
            if i < n and arr[i] <= t:  # full: queue or turn away every arrival up to t
                i, turned = _queue_or_reject(arr, i, t, queue, queue_limit, first_counted)
                rejected += turned
        if not sched.has_work:
            if i >= n:
                break
            t = arr[i]
            continue
        if run_fn is not None:
            m, batch, kv0 = sched.decode_run()
            if m >= _MIN_RUN:  # a run of decode-only steps: all at once (see module doc)
                while len(noise) - k < m:
                    noise = noise[k:] + draw()
                    k = 0
                kv = kv0 + batch * np.arange(m, dtype=np.int64)  # [m]
                dts = np.asarray(run_fn(batch, kv), dtype=np.float64) * slowdown  # [m]
                dts = dts * np.asarray(noise[k : k + m])  # [m]
                admit_at = arr[i] if in_flight < limit and i < n else math.inf
                took, last_start, t, busy = _decode_run_times(t, busy, dts, min(end_s, admit_at))
                if i < n and arr[i] <= last_start:  # arrivals while full, as each step saw them
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
        if not (dt > 0 and math.isfinite(dt)):
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
                timings.extend(f.timing for f in done)
            while queue and in_flight < limit:
                admit(queue.popleft())
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
