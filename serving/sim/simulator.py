"""Discrete-event simulator of one serving engine: the real scheduler, a virtual clock.

The executor is swapped, not the scheduler: each step is planned by
:class:`serving.scheduler.scheduler.Scheduler` exactly as the engine plans it, its
duration comes from a step-time function handed in (``StepPlan -> seconds``; the
controller hands in the roofline's, so serving/ never imports search/), and the virtual
clock advances by it. In front of the engine sits the admission limit of the deployment
(Ray Serve's ``max_ongoing_requests``): at most ``max_concurrency`` requests in flight;
an arrival beyond it waits in a bounded queue (``queue_limit``) or is rejected and
counted. The load is open (Poisson, or a trace), or the canary's closed loop through a
serving path (:class:`~serving.sim.workload.ClosedLoop`): one client per admission slot,
whose arrivals are made as their requests finish.

Noise is the simulator's, not the step-time function's: a per-step lognormal jitter
(``step_noise_cv``) and a per-run slowdown (``window_noise_cv``: a noisy neighbour for
the whole window). A run measures the requests that finish in
``[warmup_s, warmup_s + window_s]`` and returns the same :class:`Observation` a
deployment yields: exact percentiles and three-way SLO verdicts from the per-request
samples (:mod:`metrics.samples`). Deterministic under a seed. The window's configuration
and result types (:class:`SimConfig`, :class:`SimResult`) live in serving/sim/result.py.

A step-time function may offer ``step_totals`` (seconds from a plan's totals) and
``decode_run`` (seconds of a run of decode-only steps, vectorised): the simulator then
takes its fast paths, with the same results bit for bit (docs/serving.md "Simulator").
"""

from __future__ import annotations

import array
import bisect
import gc
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from metrics.observation import Slo
from serving.scheduler.plan import SchedulerConfig, StepPlan
from serving.scheduler.scheduler import Scheduler
from serving.scheduler.seq import Seq
from serving.sim.observation import SEQ_TIMES, observation_from_timings
from serving.sim.result import SimConfig, SimResult
from serving.sim.workload import Workload

logger = logging.getLogger(__name__)


StepTimeFn = Callable[[StepPlan], float]

# Step noise is drawn in blocks as needed: the same numbers whatever the block (nothing
# else is drawn after it), and a window of a thousand steps draws a thousand or so.
_NOISE_BLOCK = 512
_MIN_RUN = 4  # decode-only steps worth one vectorised call of the step-time function
# ... when the step time of a plan's totals is offered too: shorter runs are timed by it.
_MIN_VECTOR = 24
# Arrivals turned away while full are passed over by a bisect among the next _NEAR first
# (a step sees a dozen or so at a saturating load), then among all.
_NEAR = 64
# A closed loop's lengths are drawn in blocks of this many requests, as they are sent.
_LENGTH_BLOCK = 1024


def _lognormal_sigma(cv: float) -> float:
    return math.sqrt(math.log1p(cv * cv))


def _through_path(door: list[float], work: list[float], free: float) -> list[float]:
    """When requests reaching the front door at ``door`` (in time order) reach the engine
    through a path that works ``work[k]`` on the k-th, one at a time, first free at ``free``."""
    out = []
    for d, w in zip(door, work, strict=True):
        free = (d if d > free else free) + w
        out.append(free)
    return out


def _work(rng: np.random.Generator, mean_s: float, n: int) -> list[float]:
    """``n`` times the serving path works on a request: exponential, of mean ``mean_s``."""
    return rng.exponential(mean_s, n).tolist() if mean_s > 0 else [0.0] * n


def _lengths(
    workload: Workload, rng: np.random.Generator, n: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) lengths that fit a slot of ``max_len`` tokens."""
    prompts, outputs = workload.lengths(rng, n)  # [n], [n]
    prompts = np.minimum(prompts, max_len - 1)
    return prompts, np.clip(outputs, 1, max_len - prompts)


def _queue_or_reject(
    arr: Sequence[float], i: int, upto: float, queue: deque[int], limit: int, first_counted: int
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
    closed = workload.closed
    if closed is None:
        arrivals = workload.arrivals(rng, end_s)  # [n]
        prompts, outputs = _lengths(workload, rng, len(arrivals), cfg.max_len)  # [n], [n]
        slowdown = float(rng.lognormal(0.0, _lognormal_sigma(cfg.window_noise_cv)))
        gap = path_s = 0.0
        door: list[float] = []
        side = rng  # (a closed loop's own generator; unused here)
    else:
        # A closed loop (ClosedLoop): every client sends at the start, and again as soon as
        # its request finishes; each request reaches the front door gap_s later and the
        # engine after the path's one-at-a-time work (path_s each, first come first served).
        # Requests finish in time order and the path serves them in that order, so their
        # arrivals at the engine stay in time order as they are added.
        slowdown = float(rng.lognormal(0.0, _lognormal_sigma(cfg.window_noise_cv)))
        gap = closed.gap_s * slowdown  # a noisy neighbour slows the path too
        path_s = closed.path_s * slowdown
        # The path's work per request is exponential (it varies as live: one fixed time
        # made the engine and the path trade the clients all at once where both serve
        # about as many a second), and it and the lengths come as requests finish: from
        # their own generator, so that the step noise's draws, whose timing depends on the
        # path a step takes, do not move them.
        side = np.random.default_rng(int(rng.integers(2**63)))
        door = [gap] * max_concurrency  # [C] at the front door
        arrivals = np.asarray(_through_path(door, _work(side, path_s, max_concurrency), 0.0))
        prompts, outputs = _lengths(workload, side, _LENGTH_BLOCK, cfg.max_len)  # [block] each
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
    kept: list[list[Seq]] = []  # the requests finished inside the window, step by step
    keep = kept.append
    n = len(arrivals)
    # The arrival times as Python reads them, without a float object per arrival made up
    # front (most are only passed over by a bisect): a copy of the array's buffer.
    arr = array.array("d")
    arr.frombytes(np.ascontiguousarray(arrivals, dtype=np.float64).tobytes())
    arr.append(math.inf)  # a sentinel: arr[i] <= t is False past the last arrival
    # When each request reached the front door (its TTFT's start): its arrival at the
    # engine, or in a closed loop before its wait and work on the serving path.
    sent = arr
    path_free = 0.0  # a closed loop's path: when it is free again
    if closed is not None:
        sent = array.array("d", door)
        path_free = arr[len(door) - 1]
    # Lengths are read per admission (at a saturating load most arrivals are turned away):
    # buffer copies, whose items are made when read.
    plen = array.array("q")
    plen.frombytes(np.ascontiguousarray(prompts, dtype=np.int64).tobytes())
    olen = array.array("q")
    olen.frombytes(np.ascontiguousarray(outputs, dtype=np.int64).tobytes())
    # Arrivals before warmup_s are not counted when rejected: the first index counted.
    first_counted = bisect.bisect_left(arr, cfg.warmup_s)
    limit = max_concurrency
    queue_limit = cfg.queue_limit
    warmup_s = cfg.warmup_s
    max_steps = cfg.max_steps
    add = sched.add_new
    bisect_right = bisect.bisect_right
    inf = math.inf
    schedule = sched.schedule
    schedule_totals = sched.schedule_totals
    update = sched.update_seqs
    decode_run = sched.decode_run

    run_fn = getattr(step_time, "decode_run", None)
    # A step time of the plan's totals, without the plan (see module doc).
    totals_of = getattr(step_time, "step_totals", None)
    totals_fn = totals_of() if totals_of is not None else None

    def draw() -> list[float]:
        if not sigma:
            return [1.0] * _NOISE_BLOCK
        return rng.lognormal(-sigma * sigma / 2, sigma, size=_NOISE_BLOCK).tolist()

    t = 0.0
    i = 0
    steps = 0
    busy = 0.0
    # Requests running (holding a place in the batch) and waiting for one, integrated over
    # the window's time: their means are the engine's gauges as a scrape would average them.
    run_area = 0.0
    wait_area = 0.0
    noise: list[float] = []
    k = 0
    # Arrivals up to full_at came while every admission was taken: they are queued or
    # turned away, and that is done once when there is room again (or at the end), not
    # at every step (see the module doc). Only while full: in_flight == limit.
    full_at = -math.inf
    fast = run_fn is not None or totals_fn is not None
    while t < end_s:
        a = arr[i]
        if a <= t:
            if in_flight < limit:
                if a <= full_at:  # those that came while it was full, first
                    if queue_limit:
                        i, turned = _queue_or_reject(
                            arr, i, full_at, queue, queue_limit, first_counted
                        )
                    else:  # _queue_or_reject without a queue: a bisect, near i first
                        hi = i + _NEAR if i + _NEAR < n else n
                        j = bisect_right(arr, full_at, i, hi)
                        if j == hi:
                            j = bisect_right(arr, full_at, hi)
                        turned = j - (i if i >= first_counted else min(j, first_counted))
                        i = j
                    rejected += turned
                # Admit the arrivals up to t while there is room (a bisect finds them).
                hi = i + limit - in_flight
                j = bisect_right(arr, t, i, hi if hi < n else n)
                if j > i:
                    for x in range(i, j):
                        add(str(x), plen[x], olen[x], sent[x])
                    in_flight += j - i
                    i = j
                if arr[i] <= t:  # full: queue or turn away every arrival up to t (later)
                    full_at = t
            else:
                full_at = t
        if not in_flight:  # nothing running or waiting in the engine
            if i >= n:
                break
            t = arr[i]
            continue
        if fast:
            m, batch, kv0 = decode_run()
        else:
            m = 0
        if m:
            # A run of decode-only steps, without planning them (see module doc): a long
            # one timed in one vectorised call, a short one by the totals' step time.
            if m >= _MIN_RUN and run_fn is not None and (totals_fn is None or m >= _MIN_VECTOR):
                kv = kv0 + batch * np.arange(m, dtype=np.int64)  # [m]
                base = np.asarray(run_fn(batch, kv), dtype=np.float64).tolist()  # [m]
            elif totals_fn is not None:
                base = [totals_fn(batch, kv0 + batch * j, 0, 0) for j in range(m)]  # [m]
            else:
                m = 0
            if m:
                while len(noise) - k < m:
                    noise = noise[k:] + draw()
                    k = 0
                stop_s = arr[i] if in_flight < limit and arr[i] < end_s else end_s
                t0 = t
                took, last_start, t, busy = _run_steps(base, slowdown, noise, k, t, busy, stop_s)
                span = (t if t < end_s else end_s) - (t0 if t0 > warmup_s else warmup_s)
                if span > 0:
                    run_area += sched.num_running * span
                    wait_area += sched.num_waiting * span
                if arr[i] <= last_start:  # arrivals while full, as each step saw them
                    full_at = last_start
                took = min(took, max_steps + 1 - steps)
                k += took
                steps += took
                if steps > max_steps:
                    raise RuntimeError(f"simulation exceeded max_steps={max_steps}")
                sched.skip_decode_steps(took, t)
                continue
        if totals_fn is not None:
            nb, nkv, ntok, nchunks = schedule_totals(t)
            base_dt = totals_fn(nb, nkv, ntok, nchunks)  # a plain call: *args costs more
        else:
            base_dt = step_time(schedule(t))
        if k >= len(noise):
            noise = noise[k:] + draw()
            k = 0
        dt = base_dt * slowdown * noise[k]
        k += 1
        if not (dt > 0 and dt < inf):
            raise ValueError(f"step_time returned {dt!r} for a plan: must be > 0 seconds")
        span = (t + dt if t + dt < end_s else end_s) - (t if t > warmup_s else warmup_s)
        if span > 0:
            run_area += sched.num_running * span
            wait_area += sched.num_waiting * span
        t += dt
        busy += dt
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"simulation exceeded max_steps={max_steps}")
        done = update(t)
        if done:
            in_flight -= len(done)
            if warmup_s <= t <= end_s:
                keep(done)
            if closed is not None:  # each client sends its next request
                at_door = t + gap
                m = len(done)
                for e in _through_path([at_door] * m, _work(side, path_s, m), path_free):
                    arr[n] = e
                    arr.append(inf)
                    sent.append(at_door)
                    n += 1
                path_free = arr[n - 1]
                if n > len(plen):
                    more_p, more_o = _lengths(workload, side, _LENGTH_BLOCK, cfg.max_len)
                    plen.frombytes(np.ascontiguousarray(more_p, dtype=np.int64).tobytes())
                    olen.frombytes(np.ascontiguousarray(more_o, dtype=np.int64).tobytes())
            if queue_limit and arr[i] <= full_at:  # the queue as it was before this step
                i, turned = _queue_or_reject(arr, i, full_at, queue, queue_limit, first_counted)
                rejected += turned
            while queue and in_flight < limit:
                j = queue.popleft()
                add(str(j), plen[j], olen[j], sent[j])
                in_flight += 1
    if arr[i] <= full_at:
        i, turned = _queue_or_reject(arr, i, full_at, queue, queue_limit, first_counted)
        rejected += turned
    finished = list(itertools.chain.from_iterable(kept))
    obs = observation_from_timings(
        finished,
        slo=slo,
        start_s=cfg.warmup_s,
        end_s=end_s,
        rejected=rejected,
        confidence=cfg.confidence,
        times=SEQ_TIMES,
        running=run_area / cfg.window_s,
        waiting=wait_area / cfg.window_s,
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
        finished=finished,
        steps=steps,
        busy_s=busy,
        sim_s=t,
        slowdown=slowdown,
    )
