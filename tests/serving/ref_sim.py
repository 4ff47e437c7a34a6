"""The simulator loop as it was before the scheduler went lean: the reference.

A test oracle only (tests/serving/test_sim.py): one Python arrival at a time, the
reference scheduler (tests/serving/ref_scheduler.py) building every decode entry.
serving/sim/simulator.py must return exactly the same result for the same seed.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from metrics.observation import Slo
from serving.scheduler.plan import RequestTiming, SchedulerConfig, SeqRequest
from serving.sim.observation import observation_from_timings
from serving.sim.result import SimConfig, SimResult
from serving.sim.simulator import _NOISE_BLOCK, StepTimeFn, _lognormal_sigma
from serving.sim.workload import Workload
from tests.serving.ref_scheduler import RefScheduler


def ref_simulate(
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

    sched = RefScheduler(
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

    def admit(i: int) -> None:
        sched.add(
            SeqRequest(request_id=str(i), prompt_len=pl[i], max_tokens=ol[i], arrival_s=arr[i])
        )

    t = 0.0
    i = 0
    steps = 0
    busy = 0.0
    run_area = wait_area = 0.0  # requests running and waiting, integrated over the window
    noise = np.empty(0)
    k = 0
    while t < end_s:
        while i < n and arr[i] <= t:
            if in_flight < max_concurrency:
                admit(i)
                in_flight += 1
            elif len(queue) < cfg.queue_limit:
                queue.append(i)
            elif arr[i] >= cfg.warmup_s:
                rejected += 1
            i += 1
        if not sched.has_work:
            if i >= n:
                break
            t = arr[i]
            continue
        plan = sched.schedule(now_s=t)
        if k >= len(noise):
            noise = (
                rng.lognormal(-sigma * sigma / 2, sigma, size=_NOISE_BLOCK)
                if sigma
                else (np.ones(_NOISE_BLOCK))
            )
            k = 0
        dt = step_time(plan) * slowdown * float(noise[k])
        k += 1
        if not (math.isfinite(dt) and dt > 0):
            raise ValueError(f"step_time returned {dt!r} for a plan: must be > 0 seconds")
        span = min(t + dt, end_s) - max(t, cfg.warmup_s)
        if span > 0:
            run_area += sched.num_running * span
            wait_area += sched.num_waiting * span
        t += dt
        busy += dt
        steps += 1
        if steps > cfg.max_steps:
            raise RuntimeError(f"simulation exceeded max_steps={cfg.max_steps}")
        for f in sched.update(plan, {}, now_s=t):
            in_flight -= 1
            if cfg.warmup_s <= t <= end_s:
                timings.append(f.timing)
        while queue and in_flight < max_concurrency:
            admit(queue.popleft())
            in_flight += 1
    obs = observation_from_timings(
        timings,
        slo=slo,
        start_s=cfg.warmup_s,
        end_s=end_s,
        rejected=rejected,
        confidence=cfg.confidence,
        running=run_area / cfg.window_s,
        waiting=wait_area / cfg.window_s,
    )
    return SimResult(
        observation=obs,
        timings=tuple(timings),
        steps=steps,
        busy_s=busy,
        sim_s=t,
        slowdown=slowdown,
    )
