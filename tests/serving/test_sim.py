"""The simulator: the engine's scheduler on a virtual clock; deterministic; admission limit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from metrics.observation import Observation, Slo, Verdict
from serving.scheduler.plan import StepPlan
from serving.sim.result import SimConfig
from serving.sim.simulator import simulate
from serving.sim.workload import ClosedLoop, LengthDist, Workload

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)
FIXED = Workload(
    rate_rps=20.0,
    prompt=LengthDist(kind="fixed", mean=32),
    output=LengthDist(kind="fixed", mean=16),
)
QUIET = SimConfig(
    max_slots=64,
    max_len=256,
    prefill_chunk=64,
    warmup_s=2.0,
    window_s=30.0,
    step_noise_cv=0.0,
    window_noise_cv=0.0,
)


def const(dt: float):
    return lambda plan: dt


def run(**kw):
    args = dict(
        max_batch_size=8,
        max_concurrency=8,
        workload=FIXED,
        step_time=const(0.01),
        config=QUIET,
        slo=SLO,
        seed=1,
    )
    args.update(kw)
    return simulate(**args)


def test_tpot_is_the_step_time_when_steps_are_constant() -> None:
    r = run()
    o = r.observation
    assert o.completed > 300
    # Every step takes 10 ms, and each decode step emits one token per sequence.
    assert o.tpot.p50 == pytest.approx(0.01) and o.tpot.p99 == pytest.approx(0.01)
    # First token: one 32-token prefill chunk, i.e. at least one step after arrival.
    assert o.ttft.p50 >= 0.01
    assert o.tpot_verdict.verdict is Verdict.MET and o.ttft_verdict.verdict is Verdict.MET
    assert o.generated_tokens == 16 * o.completed
    assert o.start_s == 2.0 and o.end_s == 32.0 and o.source == "sim"


def test_deterministic_under_a_seed_and_seeds_differ() -> None:
    noisy = SimConfig(**{**QUIET.__dict__, "step_noise_cv": 0.1, "window_noise_cv": 0.05})
    wl = Workload(rate_rps=30.0)
    a = run(config=noisy, workload=wl, seed=3).observation
    b = run(config=noisy, workload=wl, seed=3).observation
    c = run(config=noisy, workload=wl, seed=4).observation
    assert a == b
    assert (a.completed, a.tpot.p99) != (c.completed, c.tpot.p99)


def test_admission_limit_rejects_and_bounds_the_batch() -> None:
    seen: list[int] = []

    def step(plan: StepPlan) -> float:
        seen.append(plan.decode_batch + len([c for c in plan.prefill if c.start == 0]))
        return 0.02 + 0.001 * plan.decode_batch

    heavy = Workload(
        rate_rps=500.0,
        prompt=LengthDist(kind="fixed", mean=16),
        output=LengthDist(kind="fixed", mean=32),
    )
    r = run(max_batch_size=4, max_concurrency=6, workload=heavy, step_time=step)
    assert r.observation.rejected > 1000
    assert max(seen) <= 4  # never more than max_batch_size sequences in a step
    queued = run(
        max_batch_size=4,
        max_concurrency=6,
        workload=heavy,
        step_time=step,
        config=SimConfig(**{**QUIET.__dict__, "queue_limit": 50}),
    )
    # Under sustained overload a full queue rejects as much, and its wait shows up in
    # TTFT (counted from arrival): here it costs every request its TTFT SLO.
    assert queued.observation.rejected <= r.observation.rejected
    assert queued.observation.ttft.p50 > 10 * r.observation.ttft.p50
    assert queued.observation.slo_met < r.observation.slo_met


def test_more_batch_more_throughput_until_the_step_time_catches_up() -> None:
    def step(plan: StepPlan) -> float:
        return 0.01 + 0.002 * plan.decode_batch + 0.0001 * plan.prefill_tokens

    heavy = Workload(
        rate_rps=400.0,
        prompt=LengthDist(kind="fixed", mean=32),
        output=LengthDist(kind="fixed", mean=16),
    )
    tp = [
        run(max_batch_size=b, max_concurrency=b, workload=heavy, step_time=step).observation
        for b in (2, 8, 32)
    ]
    assert tp[0].throughput_rps < tp[1].throughput_rps < tp[2].throughput_rps
    assert tp[0].tpot.p50 < tp[1].tpot.p50 < tp[2].tpot.p50


def test_trace_arrivals_are_replayed() -> None:
    wl = Workload(
        rate_rps=None, trace=(0.0, 0.5, 1.0, 1.5), prompt=FIXED.prompt, output=FIXED.output
    )
    r = run(workload=wl)
    # 4 arrivals per 2 s over a 30 s window: about 60 requests, none rejected.
    assert 55 <= r.observation.completed <= 61 and r.observation.rejected == 0


def test_too_few_requests_give_an_insufficient_verdict() -> None:
    wl = Workload(rate_rps=1.0, prompt=FIXED.prompt, output=FIXED.output)
    o = run(workload=wl).observation
    assert o.completed < 100
    assert o.tpot_verdict.verdict is Verdict.INSUFFICIENT
    assert not o.feasible


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_batch_size": 0}, "max_batch_size=0"),
        ({"max_concurrency": 4}, "max_concurrency=4"),
        ({"step_time": const(0.0)}, "step_time returned 0.0"),
    ],
)
def test_bad_arguments_are_named(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(**kw)


def test_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="window_s=0"):
        SimConfig(max_slots=4, window_s=0)
    with pytest.raises(ValueError, match="kind='zipf'"):
        LengthDist(kind="zipf", mean=8)
    with pytest.raises(ValueError, match="rate_rps=0"):
        Workload(rate_rps=0)


def _roofline_like(plan: StepPlan) -> float:
    """A step time that depends on everything the plan carries (as the roofline's does)."""
    return max(
        2e-3 + 1e-5 * plan.decode_batch + 2e-7 * plan.kv_tokens,
        1e-3 + 3e-6 * plan.prefill_tokens + 1e-4 * len(plan.prefill) + 4e-5 * plan.decode_batch,
    )


class RooflineLike:
    """The same step time, with the vectorised form for runs of decode-only plans."""

    def __init__(self) -> None:
        self.calls = 0
        self.run_steps = 0

    def __call__(self, plan: StepPlan) -> float:
        self.calls += 1
        return _roofline_like(plan)

    def decode_run(self, batch: int, kv_tokens: np.ndarray) -> np.ndarray:
        self.run_steps += len(kv_tokens)
        return np.maximum(
            2e-3 + 1e-5 * batch + 2e-7 * kv_tokens,  # [m]
            1e-3 + 3e-6 * 0 + 1e-4 * 0 + 4e-5 * batch,
        )


def _totals_like(b: int, kv: int, ptok: int, nchunks: int) -> float:
    """_roofline_like of a plan of these totals (what it reads of a plan)."""
    return max(2e-3 + 1e-5 * b + 2e-7 * kv, 1e-3 + 3e-6 * ptok + 1e-4 * nchunks + 4e-5 * b)


class TotalsLike(RooflineLike):
    """... and the step time of a plan's totals, so that no step needs a plan."""

    def __init__(self) -> None:
        super().__init__()
        self.totals_calls = 0

    def step_totals(self):
        def fn(b: int, kv: int, ptok: int, nchunks: int) -> float:
            self.totals_calls += 1
            return _totals_like(b, kv, ptok, nchunks)

        return fn


EQUIV_CASES = {
    "saturated-noisy": dict(
        max_batch_size=16,
        max_concurrency=16,
        workload=Workload(rate_rps=400.0),
        config=SimConfig(max_slots=32, max_len=4096, warmup_s=1.0, window_s=6.0),
    ),
    "queue-and-headroom": dict(
        max_batch_size=8,
        max_concurrency=20,
        workload=Workload.preset("short", rate_rps=150.0),
        config=SimConfig(
            max_slots=8, max_len=2048, prefill_chunk=64, queue_limit=30, warmup_s=1.0, window_s=5.0
        ),
    ),
    "queue-full-for-long": dict(  # arrivals queued and turned away while it is full
        max_batch_size=4,
        max_concurrency=4,
        workload=Workload.preset("short", rate_rps=300.0),
        config=SimConfig(
            max_slots=4, max_len=2048, prefill_chunk=64, queue_limit=5, warmup_s=1.0, window_s=5.0
        ),
    ),
    "light-load-single-stream": dict(
        max_batch_size=1,
        max_concurrency=1,
        workload=Workload.preset("chat", rate_rps=2.0),
        config=SimConfig(max_slots=4, max_len=4096, warmup_s=2.0, window_s=20.0),
    ),
    "trace-no-noise": dict(
        max_batch_size=4,
        max_concurrency=6,
        workload=Workload(
            rate_rps=None, trace=(0.0, 0.01, 0.02, 0.5), prompt=FIXED.prompt, output=FIXED.output
        ),
        config=QUIET,
    ),
}


@pytest.mark.parametrize(
    "runs", [False, True, "totals"], ids=["step-by-step", "decode-runs", "totals"]
)
@pytest.mark.parametrize("seed", [0, 7, 12345])
@pytest.mark.parametrize("case", sorted(EQUIV_CASES))
def test_identical_to_the_step_by_step_reference(case: str, seed: int, runs: object) -> None:
    """The lean scheduler, the arrival handling, the runs of decode-only steps and the
    steps timed by their totals change nothing: the same result, bit for bit, as the
    plain loop over the reference scheduler (tests/serving/ref_sim.py), which calls the
    step time for every plan."""
    from tests.serving.ref_sim import ref_simulate

    fn = TotalsLike() if runs == "totals" else RooflineLike() if runs else _roofline_like
    fast = simulate(**EQUIV_CASES[case], step_time=fn, slo=SLO, seed=seed)
    ref = ref_simulate(**EQUIV_CASES[case], step_time=_roofline_like, slo=SLO, seed=seed)
    if isinstance(fn, TotalsLike):
        assert fn.calls == 0  # no plan was timed
        assert fn.totals_calls + fn.run_steps >= fast.steps
    elif runs:
        assert isinstance(fn, RooflineLike)
        assert fn.calls + fn.run_steps >= fast.steps  # every step was timed, once
        if case == "light-load-single-stream":
            assert fn.calls < fast.steps / 4  # ... most of them in runs
    assert fast.steps == ref.steps and fast.steps > 100
    assert fast.timings == ref.timings
    _same_observation(fast.observation, ref.observation, exact=runs is False)
    assert (fast.busy_s, fast.sim_s, fast.slowdown) == (ref.busy_s, ref.sim_s, ref.slowdown)


def _same_observation(a: Observation, b: Observation, *, exact: bool) -> None:
    """The same window; the running and waiting gauges, integrated over runs of steps
    where the reference adds step by step, to rounding unless ``exact``."""
    gauges = ("running", "waiting")
    if exact:
        assert a == b
        return
    assert replace(a, running=0.0, waiting=0.0) == replace(b, running=0.0, waiting=0.0)
    for g in gauges:
        assert getattr(a, g) == pytest.approx(getattr(b, g), rel=1e-9, abs=1e-12), g


def test_running_and_waiting_are_the_engine_s_means_over_the_window() -> None:
    """The gauges a scrape of the engine would average: the batch runs full and the
    admitted requests beyond it wait (B=8, admission 20, saturated); a single stream runs
    exactly while a request is in the engine."""
    full = simulate(**EQUIV_CASES["queue-and-headroom"], step_time=_roofline_like, slo=SLO)
    o = full.observation
    assert 7.5 <= o.running <= 8.0 and o.waiting >= 10.0, (o.running, o.waiting)
    assert o.running + o.waiting <= 20.0 + 1e-9  # no more in the engine than it admits
    case = EQUIV_CASES["light-load-single-stream"]
    one = simulate(**case, step_time=_roofline_like, slo=SLO, seed=4)
    cfg = case["config"]
    lo, hi = cfg.warmup_s, cfg.warmup_s + cfg.window_s
    inside = sum(max(0.0, min(t.last_token_s, hi) - max(t.admitted_s, lo)) for t in one.timings)
    longest = max(t.last_token_s - t.admitted_s for t in one.timings)
    assert one.observation.waiting == 0.0 and 0.0 < one.observation.running < 1.0
    # the requests finished in the window, plus at most the one still running at its end
    assert inside <= one.observation.running * cfg.window_s + 1e-9
    assert one.observation.running * cfg.window_s <= inside + longest + 1e-9


def test_deterministic_with_a_roofline_like_step_and_rejections() -> None:
    args = dict(EQUIV_CASES["saturated-noisy"], step_time=_roofline_like, slo=SLO)
    a, b = simulate(**args, seed=5), simulate(**args, seed=5)
    assert a.observation.rejected > 0
    assert a == b
    assert simulate(**args, seed=6).timings != a.timings


def _plain_observation(timings, *, slo, confidence):
    """observation_from_timings as it was written before it went to arrays: the oracle."""
    import bisect
    import math
    from collections import Counter

    from metrics.names import TPOT_BUCKETS, TTFT_BUCKETS
    from metrics.observation import Observation, Percentiles
    from metrics.samples import exact_quantile, verdict_from_samples

    ttft = [t.ttft_s for t in timings]
    tpot = [x for x in (t.tpot_s for t in timings) if x is not None]
    met = sum(
        1
        for t in timings
        if t.ttft_s <= slo.ttft_p99_s and (t.tpot_s is None or t.tpot_s <= slo.tpot_p99_s)
    )

    def pct(x):
        if not x:
            return Percentiles()
        return Percentiles(
            p50=exact_quantile(x, 0.5), p90=exact_quantile(x, 0.9), p99=exact_quantile(x, 0.99)
        )

    def binned(x, layout, threshold):
        # each request in the first bucket whose bound is >= it (Prometheus's le)
        bounds = sorted({*layout, threshold})
        counts = Counter(bisect.bisect_left(bounds, v) for v in x)
        if counts and min(counts) > 0:  # the empty bucket below the lowest request
            counts[min(counts) - 1] = 0
        return tuple(((bounds + [math.inf])[i], n) for i, n in sorted(counts.items()))

    q = slo.quantile
    return Observation(
        start_s=1.0,
        end_s=7.0,
        completed=len(timings),
        slo_met=met,
        rejected=3,
        overloaded=3,  # the simulator refuses only for want of room
        generated_tokens=sum(t.generated_tokens for t in timings),
        ttft=pct(ttft),
        tpot=pct(tpot),
        ttft_verdict=verdict_from_samples(ttft, slo.ttft_p99_s, q=q, confidence=confidence),
        tpot_verdict=verdict_from_samples(tpot, slo.tpot_p99_s, q=q, confidence=confidence),
        source="sim",
        ttft_hist=binned(ttft, TTFT_BUCKETS, slo.ttft_p99_s),
        tpot_hist=binned(tpot, TPOT_BUCKETS, slo.tpot_p99_s),
    )


def test_observation_equals_the_plain_per_request_computation() -> None:
    from serving.sim.observation import observation_from_timings

    r = simulate(**EQUIV_CASES["saturated-noisy"], step_time=_roofline_like, slo=SLO, seed=3)
    single = Workload(rate_rps=200.0, output=LengthDist(kind="fixed", mean=1))
    one_token = simulate(
        **{**EQUIV_CASES["saturated-noisy"], "workload": single},
        step_time=_roofline_like,
        slo=SLO,
        seed=3,
    )
    tight = Slo(ttft_p99_s=float(np.median([t.ttft_s for t in r.timings])), tpot_p99_s=0.004)
    cases = [list(r.timings), list(one_token.timings), list(r.timings)[:7], []]
    assert len(cases[0]) > 100 and all(t.generated_tokens == 1 for t in cases[1])
    for timings in cases:
        for slo in (SLO, tight):
            got = observation_from_timings(
                timings, slo=slo, start_s=1.0, end_s=7.0, rejected=3, confidence=0.9
            )
            assert repr(got) == repr(_plain_observation(timings, slo=slo, confidence=0.9))
            assert type(got.generated_tokens) is int


def test_the_garbage_collector_is_left_as_it_was() -> None:
    import gc

    assert gc.isenabled()
    run()
    assert gc.isenabled()
    gc.disable()
    try:
        run()
        assert not gc.isenabled()
        with pytest.raises(ValueError):
            run(max_concurrency=0)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError):
        run(step_time=const(-1.0))
    assert gc.isenabled()


def test_timings_are_built_when_read_and_compare_as_values() -> None:
    args = dict(EQUIV_CASES["saturated-noisy"], step_time=TotalsLike(), slo=SLO, seed=2)
    a, b = simulate(**args), simulate(**args)
    assert a == b and hash(a) == hash(b)  # timings built on the way
    t = a.timings
    assert t is a.timings and len(t) == a.observation.completed > 100
    assert t[0].request_id.isdigit() and t[0].first_token_s >= t[0].arrival_s
    with pytest.raises(AttributeError):
        a.steps = 3  # type: ignore[misc]


# -- the canary's closed loop (ClosedLoop) ------------------------------------------------


def closed(gap_s: float = 0.0, path_s: float = 0.0) -> Workload:
    return Workload(
        rate_rps=None,
        prompt=FIXED.prompt,
        output=FIXED.output,
        closed=ClosedLoop(gap_s=gap_s, path_s=path_s),
    )


def test_a_closed_loop_serves_its_clients_one_gap_apart() -> None:
    # 10 ms steps: a request's 16 tokens take ~16-17 steps in the engine, then 40 ms on
    # the way back and out again: each of the 8 clients cycles in ~0.2 s, ~40 req/s.
    r = run(workload=closed(gap_s=0.04))
    o = r.observation
    assert o.rejected == 0  # one client per admission slot: none is ever turned away
    assert 8 / (0.17 + 0.04) <= o.throughput_rps <= 8 / (0.16 + 0.04)
    assert o.ttft.p99 <= 0.021  # the gap is outside the TTFT: one step and a wait for it
    assert r.observation == run(workload=closed(gap_s=0.04)).observation  # deterministic


def test_a_busy_serving_path_caps_the_rate_and_its_queue_is_in_the_ttft() -> None:
    # The path works 50 ms on each request, one at a time: at most 20 req/s get through,
    # whatever the engine could do (40 req/s above), and the clients queue at the path.
    r8 = run(workload=closed(path_s=0.05)).observation
    assert r8.rejected == 0
    assert r8.throughput_rps == pytest.approx(20.0, rel=0.05)
    r16 = run(workload=closed(path_s=0.05), max_batch_size=16, max_concurrency=16).observation
    assert r16.throughput_rps == pytest.approx(20.0, rel=0.05)  # more clients: no more
    # ... only more waiting before the first token: ~(clients in the path) x 50 ms
    assert r8.ttft.p50 >= 0.05 and r16.ttft.p50 > r8.ttft.p50 + 0.2
    # a noisy neighbour slows the path with the engine
    slow = SimConfig(**{**QUIET.__dict__, "window_noise_cv": 0.2})
    s = run(workload=closed(path_s=0.05), config=slow, seed=5)
    assert s.observation.throughput_rps == pytest.approx(20.0 / s.slowdown, rel=0.05)


def test_a_closed_loop_has_no_rate_and_bad_gaps_are_refused() -> None:
    with pytest.raises(ValueError, match="closed loop has neither"):
        Workload(rate_rps=10.0, closed=ClosedLoop(gap_s=0.01))
    with pytest.raises(ValueError, match="path_s=-1"):
        ClosedLoop(path_s=-1)
    with pytest.raises(ValueError, match="gap_s=nan"):
        ClosedLoop(gap_s=float("nan"))
    with pytest.raises(ValueError, match="no arrival times"):
        closed().arrivals(np.random.default_rng(0), 10.0)


@pytest.mark.parametrize("seed", [0, 7])
def test_a_closed_loop_is_the_same_whichever_path_a_step_takes(seed: int) -> None:
    """Its arrivals come as requests finish; the runs of decode-only steps and the steps
    timed by their totals stop for them as for any arrival: the same result, bit for bit."""
    kw = dict(
        max_batch_size=12,
        max_concurrency=12,
        workload=Workload(
            rate_rps=None,
            prompt=LengthDist.lognormal(mean=64, cv=0.5, lo=8, hi=512),
            output=LengthDist.lognormal(mean=32, cv=0.5, lo=2, hi=256),
            closed=ClosedLoop(gap_s=0.003, path_s=0.0015),
        ),
        config=SimConfig(max_slots=16, max_len=1024, warmup_s=1.0, window_s=6.0),
        slo=SLO,
        seed=seed,
    )
    plain = simulate(step_time=_roofline_like, **kw)
    run_fn, totals_fn = RooflineLike(), TotalsLike()
    runs = simulate(step_time=run_fn, **kw)
    totals = simulate(step_time=totals_fn, **kw)
    assert plain.steps > 100 and plain.observation.completed > 100
    assert run_fn.run_steps > 0 and totals_fn.calls == 0  # both fast paths were taken
    for other in (runs, totals):
        assert other.steps == plain.steps
        assert other.timings == plain.timings
        _same_observation(other.observation, plain.observation, exact=False)
