"""The pure decision of one control tick (controller/control/decide.py), by tables."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from controller.control.decide import (
    Action,
    Outcome,
    Signals,
    State,
    acknowledge,
    decide,
)
from controller.control.policy import Policy, tpot_band, window_spread
from metrics.observation import Observation, Slo, SloVerdict, Verdict
from search.space import Knobs

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
POLICY = Policy(slo=SLO, batch_max=64, headroom=1.0, stabilization_s=300.0)
K16 = Knobs(max_batch_size=16, max_concurrency=16)
# the windows' spread already read, and small (1%): the TPOT band as configured
QUIET = (0.01, -0.01, 0.01, -0.01)
NAN = math.nan  # a window's answer length, not known


def _v(verdict: Verdict, share: float, bound: float, n: int) -> SloVerdict:
    return SloVerdict(
        verdict=verdict, threshold_s=bound, estimate_s=share * bound, samples=n, confidence=0.95
    )


def obs(
    end: float,
    *,
    ttft: float = 0.5,
    tpot: float = 0.5,
    vt: Verdict | None = None,
    vp: Verdict | None = None,
    n: int = 500,
    missed: int = 0,
    overloaded: int = 0,
    bad: int = 0,
    window: float = 60.0,
    stale: bool = False,
    running: float = math.nan,
    waiting: float = math.nan,
    answer: float = math.nan,
) -> Observation:
    """A window ending at ``end`` whose p99s are the given shares of their SLOs, its
    answers ``answer`` tokens long on average (NaN: no token count)."""

    def verdict(share: float) -> Verdict:
        return Verdict.MET if share <= 1 else Verdict.VIOLATED

    return Observation(
        start_s=end - window,
        end_s=end,
        completed=n,
        slo_met=n - missed,
        rejected=overloaded + bad,
        overloaded=overloaded,
        ttft_verdict=_v(vt or verdict(ttft), ttft, SLO.ttft_p99_s, n),
        tpot_verdict=_v(vp or verdict(tpot), tpot, SLO.tpot_p99_s, n),
        stale=stale,
        running=running,
        waiting=waiting,
        generated_tokens=round(answer * n) if math.isfinite(answer) else 0,
    )


def tick(o: Observation, state: State | None = None, **kw):
    return decide(Signals(observation=o, **kw), state or State(knobs=K16), POLICY)


# --- one tick: (case, observation and signals, outcome, action, knobs after) -------------
CASES = [
    ("comfortably met, no queue: hold", dict(o=obs(100)), Outcome.MET, Action.HOLD, K16),
    ("in the band: hold", dict(o=obs(100, tpot=0.92)), Outcome.MET, Action.HOLD, K16),
    (
        "TPOT near the SLO once: hold (one window's noise)",
        dict(o=obs(100, tpot=0.97)),
        Outcome.MET,
        Action.HOLD,
        K16,
    ),
    (
        "TPOT violated by 30%: tighten to where p99 ~ B puts it at 90%, by at most 25%",
        dict(o=obs(100, tpot=1.3)),
        Outcome.VIOLATED,
        Action.TIGHTEN,
        Knobs(max_batch_size=12, max_concurrency=12),
    ),
    ("too few requests: hold", dict(o=obs(100, n=40)), Outcome.INCONCLUSIVE, Action.HOLD, K16),
    (
        "a violation judged on thin data elsewhere still counts",
        dict(o=obs(100, tpot=1.5, vt=Verdict.INSUFFICIENT)),
        Outcome.VIOLATED,
        Action.TIGHTEN,
        Knobs(max_batch_size=12, max_concurrency=12),
    ),
    (
        "p99 over the SLO but undecided: hold, never act on a guess",
        dict(o=obs(100, tpot=1.05, vp=Verdict.INSUFFICIENT)),
        Outcome.INCONCLUSIVE,
        Action.HOLD,
        K16,
    ),
    ("stale metrics: hold", dict(o=obs(100, stale=True)), Outcome.INCONCLUSIVE, Action.HOLD, K16),
    (
        "a replica restarted in the window: hold",
        dict(o=obs(100, tpot=1.5), fault="replica r1 restarted during the window"),
        Outcome.INCONCLUSIVE,
        Action.HOLD,
        K16,
    ),
    (
        "NaN p99: hold",
        dict(o=obs(100, tpot=math.nan, vp=Verdict.MET)),
        Outcome.INCONCLUSIVE,
        Action.HOLD,
        K16,
    ),
    (
        "someone else changed the knobs: pause",
        dict(o=obs(100, tpot=1.5), live=Knobs(max_batch_size=32, max_concurrency=32)),
        Outcome.INCONCLUSIVE,
        Action.PAUSE,
        K16,
    ),
    (
        "calm and queueing, but not yet for the stabilization window: hold",
        dict(o=obs(100, overloaded=50)),
        Outcome.MET,
        Action.HOLD,
        K16,
    ),
]


@pytest.mark.parametrize("case,inp,outcome,action,knobs", CASES, ids=[c[0] for c in CASES])
def test_one_tick(case, inp, outcome, action, knobs) -> None:
    inp = dict(inp)
    d = tick(inp.pop("o"), **inp)
    assert (d.outcome, d.action, d.knobs) == (outcome, action, knobs), d.reason
    assert d.state.knobs == knobs
    assert d.reason  # every decision says why


def test_a_small_overshoot_tightens_by_the_decrease_a_large_one_deeper() -> None:
    assert tick(obs(100, tpot=1.02)).knobs.max_batch_size == 14  # x0.9 puts it at 89%
    flat = replace(POLICY, curve=((8, 0.09), (16, 0.1), (32, 0.12)))
    d = decide(Signals(observation=obs(100, tpot=1.3)), State(knobs=K16), flat)
    assert d.knobs.max_batch_size == 12  # a flat curve: no batch >= 12 gets under 90%


def test_a_batch_running_short_of_its_limit_is_cut_from_what_ran() -> None:
    k32 = Knobs(max_batch_size=32, max_concurrency=32)
    # the limit alone: x0.9 of 32 (the overshoot is small)
    assert tick(obs(100, tpot=1.02), State(knobs=k32)).knobs.max_batch_size == 28
    # 20 ran on average: a cut of the limit to 28 would change nothing; from 20 it bites.
    # The batch to run is 17 (20 x 0.9 / 1.02); a limit that binds runs ~0.9 of itself, so
    # the limit that runs 17 is 18 (a limit of 17 would run ~15: a cut 10% deeper than meant)
    d = tick(obs(100, tpot=1.02, running=19.4), State(knobs=k32))
    assert d.knobs.max_batch_size == 18, d.reason
    # a full batch, or no gauge: the limit is what ran
    assert tick(obs(100, tpot=1.02, running=32.0), State(knobs=k32)).knobs.max_batch_size == 28
    # a limit that bound, at 95% of itself: 31 ran, 24 is to run, and the limit that runs
    # 24 at that share is 25
    assert tick(obs(100, tpot=1.3, running=30.5), State(knobs=k32)).knobs.max_batch_size == 25
    # where the batch ran close to the limit, the cut still lowers it
    assert tick(obs(100, tpot=1.02, running=31.5), State(knobs=k32)).knobs.max_batch_size < 32


def test_a_cut_from_what_ran_runs_the_batch_it_aims_at() -> None:
    # 98 ran under 157 (the KV cache, not the limit, held it) at 100.4% of the SLO: the
    # batch to run is 87 (98 x 0.9 / 1.004), and the limit that runs 87 at 0.9 of itself
    # is 96 (a simulated day's cut to 87 ran 78: 20% under what ran, not 10%)
    k157 = Knobs(max_batch_size=157, max_concurrency=157)
    wide = replace(POLICY, batch_max=400)
    d = decide(Signals(observation=obs(100, tpot=1.004, running=97.7)), State(knobs=k157), wide)
    assert d.action is Action.TIGHTEN and d.knobs.max_batch_size == 96, d.reason


def test_waiting_requests_are_demand_queueing_at_the_limit() -> None:
    calm = replace(POLICY, stabilization_s=0.0)
    quiet = decide(Signals(observation=obs(100, tpot=0.5)), State(knobs=K16), calm)
    assert quiet.action is Action.HOLD and "no demand queueing" in quiet.reason
    queue = decide(Signals(observation=obs(100, tpot=0.5, waiting=3.5)), State(knobs=K16), calm)
    assert queue.action is Action.LOOSEN, queue.reason
    # waiting with the batch full is waiting for the limit; with it part empty, for a step
    full = obs(100, tpot=0.5, waiting=3.5, running=15.2)
    assert decide(Signals(observation=full), State(knobs=K16), calm).action is Action.LOOSEN
    light = obs(100, tpot=0.5, waiting=0.4, running=4.1)
    d = decide(Signals(observation=light), State(knobs=K16), calm)
    assert d.action is Action.HOLD and "no demand queueing" in d.reason


def test_one_slow_replica_is_named_not_averaged_away() -> None:
    fleet = (("r1", 0.050, 400), ("r2", 0.052, 400), ("r3", 0.160, 400))
    o = replace(obs(100, tpot=0.6), replica_tpot=fleet)
    d = tick(o)
    assert d.outliers == ("r3",) and d.action is Action.HOLD
    assert "replica r3 p99 TPOT 160 ms, 3.1x the others' 51 ms" in d.reason
    # the decision is still the fleet's: one slow replica is reported, nothing tightened
    assert d.knobs == K16
    # not an outlier: under tighten_at of the SLO, too few requests, or close to the rest
    for quiet in (
        (("r1", 0.030, 400), ("r2", 0.090, 400)),  # 3x, but within 95% of the SLO
        (("r1", 0.050, 400), ("r2", 0.160, 40)),  # 40 requests: no p99 to speak of
        (("r1", 0.090, 400), ("r2", 0.120, 400)),  # 1.33x
    ):
        assert tick(replace(o, replica_tpot=quiet)).outliers == (), quiet


def test_a_loosening_that_would_let_the_autoscaler_drop_replicas_holds() -> None:
    from controller.backends.serve_autoscaling import Scaling

    calm = replace(POLICY, stabilization_s=0.0)
    k = Knobs(max_batch_size=16, max_concurrency=36)
    # two replicas at target 30 (limit 36: ratio 1.2), 30.6 in flight: 14.5 running on each
    # (the batch full) and 1.6 waiting. The loosening to C=37 moves the target to 30.8,
    # and one replica would then hold them all
    two = Scaling(target_ongoing_requests=30.0, min_replicas=1, max_replicas=4, current_replicas=2)
    o = obs(100, tpot=0.5, running=14.5, waiting=1.6)
    d = decide(Signals(observation=o, scaling=two), State(knobs=k), calm)
    assert d.action is Action.HOLD, d.reason
    assert "autoscaler would settle at 1 of 2 replicas for the 31 requests" in d.reason
    # without the autoscaler, or with one slotune does not steer, the same window loosens
    assert decide(Signals(observation=o), State(knobs=k), calm).action is Action.LOOSEN
    apart = replace(two, follows_admission=False)
    loosens = decide(Signals(observation=o, scaling=apart), State(knobs=k), calm)
    assert loosens.action is Action.LOOSEN
    # more in flight: two replicas still needed at the higher target, so it loosens
    busy = obs(100, tpot=0.5, running=15.5, waiting=6.0)
    loosens = decide(Signals(observation=busy, scaling=two), State(knobs=k), calm)
    assert loosens.action is Action.LOOSEN, loosens.reason


def test_near_the_slo_is_judged_on_the_mean_of_the_windows_at_these_knobs() -> None:
    """One window over tighten_at holds (within the noise of a p99 near the SLO); the mean
    share of the windows at the knobs in the last stabilization window (at least
    near_windows of them) tightens, whatever a window between reads."""
    d1 = tick(obs(100, tpot=0.97))
    d2 = tick(obs(200, tpot=0.96), d1.state)
    assert (d1.action, d2.action) == (Action.HOLD, Action.TIGHTEN)
    assert "windows at them its mean needs" in d1.reason and "at 96% of its SLO" in d2.reason
    assert d2.knobs == Knobs(max_batch_size=14, max_concurrency=14)
    assert d2.state.level == ()  # new knobs: their level starts afresh
    between = tick(obs(200, tpot=0.92), d1.state)  # in the band: held, but counted
    assert between.action is Action.HOLD and len(between.state.level) == 2
    assert tick(obs(300, tpot=0.97), between.state).action is Action.TIGHTEN  # mean 95.3%
    lower = tick(obs(200, tpot=0.90), d1.state)
    held = tick(obs(300, tpot=0.96), lower.state)  # mean 94.3%: the level is under it
    assert held.action is Action.HOLD and "mean of their last 3 windows is under" in held.reason
    thin = tick(obs(200, n=10), d1.state)  # inconclusive: neither counts nor resets
    assert tick(obs(300, tpot=0.97), thin.state).action is Action.TIGHTEN
    # a window older than the stabilization window (300 s) leaves the level: 0.91 and 0.96
    # hold, where with 0.99 at 100 s beside them (95.3%) the level would tighten
    late = tick(obs(500, tpot=0.91), tick(obs(100, tpot=0.99)).state)
    d = tick(obs(600, tpot=0.96), late.state)
    assert d.action is Action.HOLD and [x[0] for x in d.state.level] == [500, 600]
    assert tick(obs(400, tpot=0.96), late.state).action is Action.HOLD  # not newer: held


def test_an_undecided_window_with_a_measured_p99_joins_the_level_and_never_loosens() -> None:
    """A window with its requests whose p99 verdict is left insufficient (its estimate near
    the SLO, or too few samples in the tail) is inconclusive, but its p99 joins the level,
    so the level is not read from the windows either side of the band only; it may tighten
    on that level, and never loosens nor raises the batch for queueing."""
    undecided = dict(vp=Verdict.INSUFFICIENT)
    met = tick(obs(100, tpot=0.93))
    # the level 0.93, 0.99: 96% tightens, on the second window, itself undecided
    d = tick(obs(200, tpot=0.99, **undecided), met.state)
    assert (d.outcome, d.action) == (Outcome.INCONCLUSIVE, Action.TIGHTEN), d.reason
    assert d.knobs == Knobs(max_batch_size=14, max_concurrency=14)
    # a thin window (too few requests) still joins nothing: 0.93 and 0.93 around it hold
    held = tick(obs(300, tpot=0.93), tick(obs(200, n=10), met.state).state)
    assert held.action is Action.HOLD, held.reason
    # alone it holds (one window is no level), and says where it stood
    first = tick(obs(100, tpot=1.02, **undecided))
    assert (first.outcome, first.action) == (Outcome.INCONCLUSIVE, Action.HOLD)
    assert "p99 TPOT at 102% of its SLO, undecided on 500 samples" in first.reason
    assert len(first.state.level) == 1
    # calm, with demand queueing for longer than the stabilization window: undecided
    # windows hold (a decided window would loosen: test_waiting_requests_...)
    calm = replace(POLICY, stabilization_s=0.0)
    q = dict(tpot=0.5, ttft=0.97, vt=Verdict.INSUFFICIENT, waiting=4.0, running=16.0)
    s = State(knobs=K16)
    for end in (100, 200, 300):
        d = decide(Signals(observation=obs(end, **q)), s, calm)
        assert d.action is Action.HOLD and d.outcome is Outcome.INCONCLUSIVE, d.reason
        s = d.state
    # TTFT over at B=C with TPOT room is queueing for the batch, and a decided window raises
    # the batch; an undecided one does not
    ttft_hot = dict(tpot=0.5, ttft=0.99, vt=Verdict.INSUFFICIENT, running=16.0, waiting=4.0)
    one = tick(obs(100, **ttft_hot), State(knobs=K16, spread=QUIET))
    two = tick(obs(200, **ttft_hot), one.state)
    assert two.action is Action.HOLD and "undecided on" in two.reason, two.reason
    decided = dict(ttft_hot, vt=Verdict.MET)
    first_met = tick(obs(100, **decided), State(knobs=K16, spread=QUIET))
    raised = tick(obs(200, **decided), first_met.state)
    assert raised.action is Action.LOOSEN, raised.reason
    # no estimate at all: inconclusive as before, and nothing joins the level
    none = tick(obs(100, tpot=math.nan, **undecided))
    assert none.action is Action.HOLD and none.state.level == ()


def test_ttft_alone_sheds_at_the_door_and_never_shrinks_the_batch() -> None:
    k = Knobs(max_batch_size=16, max_concurrency=24)
    d = tick(obs(100, ttft=1.2), State(knobs=k))
    assert d.action is Action.TIGHTEN
    assert d.knobs == Knobs(max_batch_size=16, max_concurrency=21)
    # queueing, TPOT at 50%: serve it, once two windows give the knobs' TPOT level
    d = tick(obs(100, ttft=1.2), State(knobs=K16, spread=QUIET))
    assert d.action is Action.HOLD and d.knobs == K16 and "1 so far" in d.reason, d.reason
    d = tick(obs(160, ttft=1.2, tpot=0.6), d.state)
    assert d.action is Action.LOOSEN and d.knobs == Knobs(max_batch_size=20, max_concurrency=20)
    assert d.predicted_tpot_s == pytest.approx(0.055 * 20 / 16)  # from the level, 55%
    assert not d.state.level  # new knobs: their level starts afresh
    # ... and once the windows' spread is known: before it, the band a raise aims under is not
    d = tick(obs(160, ttft=1.2, tpot=0.6), tick(obs(100, ttft=1.2)).state)
    assert d.action is Action.HOLD and "give their spread (1 so far)" in d.reason, d.reason
    st = State(knobs=K16)
    for end in (100, 160):  # no TPOT room: hold
        d = tick(obs(end, ttft=1.2, tpot=0.92), st)
        assert d.action is Action.HOLD and d.knobs == K16, d.reason
        st = d.state
    assert "more replicas" in d.reason
    d = tick(obs(100, ttft=1.2, tpot=1.2), State(knobs=K16))  # TPOT too: the batch
    assert d.knobs == Knobs(max_batch_size=12, max_concurrency=12)
    # TPOT near its SLO while TTFT is over: one window holds; a level over tighten_at cuts
    # the batch all the same (more windows would be over the TPOT SLO than the band allows,
    # and a larger batch is no remedy)
    d = tick(obs(100, ttft=1.5, tpot=0.99), State(knobs=K16))
    assert d.action is Action.HOLD and d.knobs == K16, d.reason
    d = tick(obs(200, ttft=1.5, tpot=0.99), d.state)
    assert d.action is Action.TIGHTEN and d.knobs.max_batch_size < 16, d.reason


def test_queueing_raises_the_batch_on_the_level_not_on_one_low_window() -> None:
    # TTFT over from queueing at B=C=16; TPOT at 99% then 85%. One window at 85% is under
    # loosen_below (90%), but the knobs' level (92%) is not: raising on the low window alone
    # climbed on the noise to where the level sat at the SLO's edge
    st = tick(obs(100, ttft=1.5, tpot=0.99), State(knobs=K16, spread=QUIET * 3)).state
    held = tick(obs(160, ttft=1.5, tpot=0.85), st)
    assert held.action is Action.HOLD and held.knobs == K16, held.reason
    # a third window at 60% brings the level to 81%: up, predicted from the level
    d = tick(obs(220, ttft=1.5, tpot=0.60), held.state)
    assert d.action is Action.LOOSEN and d.knobs.max_batch_size == 16 + 1, d.reason
    assert d.predicted_tpot_s == pytest.approx(0.1 * (0.99 + 0.85 + 0.60) / 3 * 17 / 16)
    # a window without a TPOT reading raises nothing on the older windows' level (60%)
    low = State(
        knobs=K16, level=((100, 1.5, 0.6, NAN), (160, 1.5, 0.6, NAN)), last_end_s=160, spread=QUIET
    )
    d = tick(replace(obs(220, ttft=1.5), tpot_verdict=None), low)
    assert d.action is Action.HOLD and d.knobs == K16 and "more replicas" in d.reason, d.reason
    assert tick(obs(220, ttft=1.5, tpot=0.6), low).action is Action.LOOSEN  # with one: up


def test_the_level_keeps_only_the_windows_of_the_load_now_running() -> None:
    # 20 s windows at B=C=16 under short answers, TPOT in the band (94%); then answers 2.5x
    # longer: TTFT over from queueing, TPOT at 70%. The windows of the short answers leave
    # the level, and two windows of the long ones raise the batch; pooled with them (a
    # level of 91% over 300 s), it held, saying more replicas were needed
    st = State(knobs=K16, spread=QUIET * 3)
    for end in range(20, 281, 20):
        st = tick(obs(end, tpot=0.94, answer=100, window=20), st).state
    assert len(st.level) == 14

    def longer(answer: float) -> tuple:
        first = tick(obs(300, ttft=3.0, tpot=0.7, answer=answer, window=20), st)
        return first, tick(obs(320, ttft=3.0, tpot=0.7, answer=answer, window=20), first.state)

    first, second = longer(250)
    assert first.action is Action.HOLD and len(first.state.level) == 1, first.reason
    assert "give its TPOT level (1 so far)" in first.reason
    assert second.action is Action.LOOSEN and second.knobs.max_batch_size > 16, second.reason
    assert "TPOT at 70% over its last 2 windows" in second.reason
    # answers 1.2x longer are the same load: its windows stay in the level, and it holds
    first, second = longer(120)
    assert len(first.state.level) == 15 and len(second.state.level) == 15
    assert second.action is Action.HOLD and "more replicas" in second.reason, second.reason
    # a window with no token count is taken to be of the same load
    first, _ = longer(math.nan)
    assert len(first.state.level) == 15


def test_a_raise_that_reads_over_the_band_on_trial_goes_back_and_caps_the_next() -> None:
    # queueing at B=16 with TPOT at 60%: up to 20, predicted at 75%
    st = tick(obs(100, ttft=1.5, tpot=0.6), State(knobs=K16, spread=QUIET)).state
    up = tick(obs(160, ttft=1.5, tpot=0.6), st)
    k20 = Knobs(max_batch_size=20, max_concurrency=20)
    assert up.action is Action.LOOSEN and up.knobs == k20, up.reason
    assert up.state.raised_from == K16
    # the first window at B=20 reads 97%: met, under the SLO, but over the band's top (95%)
    # the raise was predicted well under. Back to B=16 at once, not a second window over
    back = tick(obs(220, ttft=1.5, tpot=0.97), up.state)
    assert (back.action, back.knobs) == (Action.TIGHTEN, K16), back.reason
    assert "on trial after the raise from" in back.reason and back.state.raised_from is None
    assert back.state.ceiling == (20, 220 + POLICY.stabilization_s)
    # queueing again at B=16 at 60%: the raise stops under the batch that read over
    st = tick(obs(280, ttft=1.5, tpot=0.6), back.state).state
    again = tick(obs(340, ttft=1.5, tpot=0.6), st)
    assert again.action is Action.LOOSEN and again.knobs.max_batch_size == 19, again.reason
    # ... at the cap, it holds and says why; once the ceiling's time is over, past it
    at19 = replace(again.state, raised_from=None, level=((340, 1.5, 0.6, NAN),))
    held = tick(obs(400, ttft=1.5, tpot=0.6), at19)
    assert held.action is Action.HOLD and "no raise to it yet" in held.reason, held.reason
    later = replace(held.state, level=((600, 1.5, 0.6, NAN),), last_end_s=600)
    d = tick(obs(660, ttft=1.5, tpot=0.6), later)
    assert d.action is Action.LOOSEN and d.knobs.max_batch_size > 20 and d.state.ceiling is None
    # a window on trial within the band keeps the raise; the next one pools the level, and
    # from there the level decides (95% + 97% pooled is 96%: a near tightening, not a return)
    kept = tick(obs(220, ttft=1.5, tpot=0.93), up.state)
    assert kept.action is Action.HOLD and kept.state.raised_from == K16, kept.reason
    pooled = tick(obs(280, ttft=1.5, tpot=0.99), kept.state)
    assert pooled.action is Action.TIGHTEN and "on trial" not in pooled.reason, pooled.reason
    # a tightening is never on trial: a window over the band after a cut is the level's
    cut = tick(obs(100, tpot=1.3), State(knobs=K16))
    assert cut.action is Action.TIGHTEN and cut.state.raised_from is None
    after = tick(obs(160, tpot=0.97), cut.state)
    assert after.action is Action.HOLD, after.reason


def test_a_calm_loosening_stops_under_a_batch_that_read_over_on_trial() -> None:
    calm = replace(POLICY, stabilization_s=0.0)
    capped = State(knobs=K16, ceiling=(17, 1000.0))
    d = decide(Signals(observation=obs(100, tpot=0.5, overloaded=5)), capped, calm)
    assert d.action is Action.HOLD and "no raise to it yet" in d.reason, d.reason
    d = decide(Signals(observation=obs(1100, tpot=0.5, overloaded=5)), capped, calm)
    assert d.action is Action.LOOSEN and d.knobs.max_batch_size == 17, d.reason
    assert d.state.raised_from == K16 and d.state.ceiling is None


def test_the_window_spread_is_read_from_successive_differences_robustly() -> None:
    assert math.isnan(window_spread((0.1, -0.1, 0.1)))  # too few differences to read it
    # differences of two windows spread 10% each are spread 10% x sqrt(2): their median
    # size is 0.674 x that
    assert window_spread((0.0954, -0.0954, 0.0954, -0.0954)) == pytest.approx(0.1, rel=1e-3)
    # one difference across a change of load does not move it (a median, not a mean)
    assert window_spread((0.0954, -0.0954, 0.0954, -0.0954, 0.8)) == pytest.approx(0.1, rel=1e-3)


def test_the_tpot_band_is_lowered_where_the_windows_spread_wide() -> None:
    assert tpot_band(POLICY, ())[:2] == (0.95, 0.9)  # no spread known yet
    quiet = State(knobs=K16, spread=(0.02, -0.02, 0.02, -0.02))  # 2%: 95% leaves <5% over
    assert tpot_band(POLICY, quiet.spread)[:2] == (0.95, 0.9)
    wide = State(knobs=K16, spread=(0.1431, -0.1431, 0.1431, -0.1431))  # 15%
    at, below, cv = tpot_band(POLICY, wide.spread)
    assert cv == pytest.approx(0.15, rel=1e-3)
    assert at == pytest.approx(1 / (1 + 1.6449 * 0.15), rel=1e-3)  # 80%: 5% of windows over
    assert below == pytest.approx(0.9 * at / 0.95)  # the band keeps its proportions
    stricter = tpot_band(replace(POLICY, attainment=0.99), wide.spread)[0]
    assert stricter == pytest.approx(1 / (1 + 2.3263 * 0.15), rel=1e-3)


def test_windows_that_spread_wide_tighten_at_a_lower_level() -> None:
    """Windows at one batch reading 80-94% of the TPOT SLO (a level of 87%, under
    tighten_at) put one in twenty or more over it: once their spread is known, the band is
    lowered and the level cuts the batch; windows as high but quiet hold."""
    st = State(knobs=K16)
    for i, share in enumerate([0.80, 0.94] * 3):
        d = tick(obs(100 + 60 * i, tpot=share), st)
        st = d.state
        if d.action is not Action.HOLD:
            break
    assert i == 4 and len(st.spread) == 4  # held until four differences gave the spread
    assert d.action is Action.TIGHTEN and d.knobs.max_batch_size < 16, d.reason
    assert d.tpot_band == tpot_band(POLICY, st.spread)  # the band it steered by, for the exporter
    assert d.tpot_band[0] < 0.8 and d.tpot_band[2] == pytest.approx(0.17, abs=0.01)
    assert all(map(math.isnan, tick(obs(100, n=5)).tpot_band))  # inconclusive: none read
    assert "TPOT band" in d.reason and "spread 17%" in d.reason, d.reason
    # where the curve says p99 hardly moves with the batch (here 2% from B=12 to B=16), a
    # smaller batch would keep the level and its spread: hold, not ratchet down
    flat = replace(POLICY, curve=((8, 0.088), (12, 0.090), (16, 0.092)))
    st = State(knobs=K16)
    for i, share in enumerate([0.80, 0.94] * 3):
        d = decide(Signals(observation=obs(100 + 60 * i, tpot=share)), st, flat)
        assert d.action is Action.HOLD, d.reason
        st = d.state
    assert "would not bring it into the band" in d.reason, d.reason
    quiet = [0.86, 0.88, 0.87, 0.88, 0.86, 0.87]
    st = State(knobs=K16)
    for i, share in enumerate(quiet):
        d = tick(obs(100 + 60 * i, tpot=share), st)
        assert d.action is Action.HOLD and d.knobs == K16, d.reason
        st = d.state
    # the spread is the deployment's, not the knobs': it outlives a change of them
    moved = tick(obs(100, tpot=1.2), State(knobs=K16, spread=st.spread))
    assert moved.action is Action.TIGHTEN and moved.state.spread == st.spread


def test_a_level_near_the_slo_with_the_batch_far_under_its_limit_holds() -> None:
    """The batch ran more than max_step (25%) under its limit with nothing queueing for it:
    the load holds the batch, and a cut on a level still under the SLO would shed it. It
    holds there; a violated window still cuts, and so does the same level where the batch
    ran within max_step of the limit or requests queued for it."""
    k157 = Knobs(max_batch_size=157, max_concurrency=157)
    wide = replace(POLICY, batch_max=400)

    def run(shares, **kw):
        st, d = State(knobs=k157, spread=QUIET), None
        for i, share in enumerate(shares):
            d = decide(Signals(observation=obs(100 + 60 * i, tpot=share, **kw)), st, wide)
            st = d.state
        return d

    held = run([0.96, 0.97, 0.98], running=93.0, waiting=5.0)
    assert held.action is Action.HOLD and held.knobs == k157, held.reason
    assert "93 ran under the limit of 157: the load holds the batch" in held.reason
    cut = run([0.96, 1.04], running=93.0, waiting=5.0)
    assert cut.action is Action.TIGHTEN and cut.outcome is Outcome.VIOLATED, cut.reason
    near = run([0.96, 0.97], running=120.0, waiting=5.0)  # within 25% of 157
    assert near.action is Action.TIGHTEN, near.reason
    queueing = run([0.96, 0.97], ttft=1.3, running=93.0, waiting=5.0)
    assert queueing.action is Action.TIGHTEN and queueing.outcome is Outcome.VIOLATED
    assert "p99 TPOT" in queueing.reason, queueing.reason


def test_the_spread_is_read_and_steered_only_where_the_limit_holds_the_batch() -> None:
    """Windows whose batch the load holds under the limit move with the load, and the
    limit does not set their p99: their differences are not the spread, and the band stays
    (a simulated night cut B=124 to 35 on such windows); at the limit they are."""
    for running, lowered in ((8.0, False), (15.0, True)):
        st = State(knobs=K16)
        for i, share in enumerate([0.80, 0.94] * 3):
            d = tick(obs(100 + 60 * i, tpot=share, running=running), st)
            st = d.state
            if d.action is not Action.HOLD:
                break
        assert (d.action is Action.TIGHTEN) is lowered, d.reason
        assert ("TPOT band" in d.reason) is lowered and len(st.spread) == 4 * lowered
    # requests queueing for the batch (waiting, TTFT over at B=C) is the limit holding it too,
    # though a batch that turns over runs short of it (live: 10-12 running under B=15)
    st = State(knobs=K16)
    for i, share in enumerate([0.80, 0.94] * 3):
        d = tick(obs(100 + 60 * i, ttft=1.5, tpot=share, running=11.0, waiting=1.0), st)
        st = d.state
        if d.action is not Action.HOLD:
            break
    assert d.action is Action.TIGHTEN and "TPOT band" in d.reason, d.reason
    # a window under the limit between two at it breaks the pair: no difference across it
    st = State(knobs=K16)
    for i, running in enumerate([15.0, 8.0, 15.0, 15.0]):
        st = tick(obs(100 + 60 * i, tpot=0.8 + 0.02 * i, running=running), st).state
    assert len(st.spread) == 1


def test_windows_that_spread_wide_loosen_only_under_the_lowered_band() -> None:
    calm = replace(POLICY, stabilization_s=0.0)
    wide = (0.1431, -0.1431, 0.1431, -0.1431)  # 15%: the band 76-80%
    o = obs(100, tpot=0.78, overloaded=20)  # under loosen_below, in the lowered band
    assert decide(Signals(observation=o), State(knobs=K16), calm).action is Action.LOOSEN
    d = decide(Signals(observation=o), State(knobs=K16, spread=wide), calm)
    assert d.action is Action.HOLD and "within the tolerance band" in d.reason, d.reason
    low = obs(100, tpot=0.6, overloaded=20)
    d = decide(Signals(observation=low), State(knobs=K16, spread=wide), calm)
    assert d.action is Action.LOOSEN, d.reason
    assert d.predicted_tpot_s <= tpot_band(calm, d.state.spread)[1] * SLO.tpot_p99_s


def test_the_lower_bound_holds_and_says_more_replicas_are_needed() -> None:
    k1 = Knobs(max_batch_size=1, max_concurrency=1)
    d = tick(obs(100, tpot=1.4), State(knobs=k1))
    assert d.action is Action.HOLD and d.knobs == k1 and "replicas" in d.reason


def test_a_tick_step_is_bounded_and_at_least_one() -> None:
    # p99 at 2x the SLO: as deep as max_step allows (x0.75), at least 1
    for b, want in ((2, 1), (10, 8), (100, 75)):
        p = replace(POLICY, batch_max=128)
        d = decide(
            Signals(observation=obs(100, tpot=2.0)),
            State(knobs=Knobs(max_batch_size=b, max_concurrency=b)),
            p,
        )
        assert d.knobs.max_batch_size == want
    coarse = replace(POLICY, decrease=0.1, max_step=0.25)
    d = decide(Signals(observation=obs(100, tpot=2.0)), State(knobs=K16), coarse)
    assert d.knobs.max_batch_size == 12  # x0.1 asked, 25% allowed


def test_loosens_only_after_a_stabilization_window_of_calm_queueing() -> None:
    st = State(knobs=K16)
    actions = []
    for end in range(60, 60 * 7, 60):  # windows of 60 s, calm, demand rejected at the limit
        d = tick(obs(end, tpot=0.5, overloaded=20), st)
        actions.append(d.action)
        st = d.state
    # calm since t=0: held until 300 s of it, then +1 each tick the calm lasts
    assert actions == [Action.HOLD] * 4 + [Action.LOOSEN, Action.LOOSEN]
    assert st.knobs == Knobs(max_batch_size=18, max_concurrency=18)


def test_bad_requests_refused_are_not_demand() -> None:
    """Requests refused as malformed or too large (400, 413) say nothing about room: calm
    windows with only those never loosen, however long the calm."""
    st = State(knobs=K16)
    for end in range(60, 60 * 9, 60):
        d = tick(obs(end, tpot=0.5, bad=40), st)
        assert d.action is Action.HOLD, (end, d.reason)
        st = d.state
    assert st.knobs == K16


@pytest.mark.parametrize(
    "interrupt",
    [
        obs(180, n=10),  # inconclusive
        obs(180, tpot=0.92, overloaded=20),  # in the band
        obs(180, tpot=0.5),  # calm but nothing queued: more room would not be used
        obs(180, tpot=0.5, bad=50),  # refused as bad requests (400, 413): more room won't serve
    ],
)
def test_anything_but_calm_queueing_restarts_the_stabilization_window(interrupt) -> None:
    st = State(knobs=K16)
    for end in (60, 120):
        st = tick(obs(end, overloaded=20), st).state
    st = tick(interrupt, st).state
    got = []
    for end in range(240, 600, 60):
        d = tick(obs(end, overloaded=20), st)
        got.append(d.action)
        st = d.state
    # calm again from 180 s (the window 180-240): 300 s later, at the window ending 480
    assert got == [Action.HOLD] * 4 + [Action.LOOSEN, Action.LOOSEN]


def test_loosening_waits_for_the_curve_to_predict_room() -> None:
    # the canary measured p99 TPOT 50 ms at B=16 and 95 ms at B=17 (a knee): no loosening
    p = replace(POLICY, curve=((16, 0.05), (17, 0.095)), stabilization_s=0.0)
    d = decide(Signals(observation=obs(60, tpot=0.5, overloaded=5)), State(knobs=K16), p)
    assert d.action is Action.HOLD and "predicts" in d.reason
    # a flat curve: loosen, with the prediction recorded
    p = replace(p, curve=((16, 0.05), (32, 0.06)))
    d = decide(Signals(observation=obs(60, tpot=0.5, overloaded=5)), State(knobs=K16), p)
    assert d.action is Action.LOOSEN and d.predicted_tpot_s == pytest.approx(0.0502, abs=1e-3)
    # no curve: p99 TPOT taken to grow with the batch (50 ms x 17/16)
    p = replace(POLICY, stabilization_s=0.0)
    d = decide(Signals(observation=obs(60, tpot=0.5, overloaded=5)), State(knobs=K16), p)
    assert d.predicted_tpot_s == pytest.approx(0.05 * 17 / 16)


def test_burning_the_error_budget_rolls_back_and_latches_until_acked() -> None:
    good = Knobs(max_batch_size=12, max_concurrency=12)
    st = State(knobs=good)
    st = tick(obs(60), st).state  # met comfortably: known good
    assert st.last_good == good
    st = replace(st, knobs=K16)
    # 200 of the burn window's 1000 requests missed (20% > 14.4 x 1%): back to 12 at once
    d = tick(obs(120, tpot=0.8, missed=200), st)
    assert (d.action, d.knobs) == (Action.ROLLBACK, good) and d.state.degraded
    assert d.state.rollbacks == 1
    st = d.state
    # degraded: calm queueing for long does not loosen
    for end in range(180, 1200, 60):
        d = tick(obs(end, overloaded=20), st)
        assert d.action is Action.HOLD and "degraded" in d.reason
        st = d.state
    # but trouble still tightens
    assert tick(obs(1260, tpot=1.5), st).action is Action.TIGHTEN
    st = acknowledge(st, live=None)
    assert not st.degraded and st.knobs == good


def test_a_burn_after_tightening_never_goes_back_up_to_the_old_loads_knobs() -> None:
    # B=32 met under a light load; the load stepped up and the controller is tightening
    big = Knobs(max_batch_size=32, max_concurrency=32)
    st = State(knobs=K16, last_good=big)
    d = tick(obs(60, tpot=1.3, missed=200), st)
    assert d.action is Action.TIGHTEN and d.knobs.max_batch_size == 12
    assert d.state.degraded and "no smaller known-good" in d.state.degraded


def test_burning_with_nothing_known_good_latches_and_acts_on_the_window() -> None:
    # TPOT violated and 30% missed, nothing met before: latched, and tightened as usual
    d = tick(obs(60, tpot=1.3, missed=150))
    assert d.action is Action.TIGHTEN and d.state.degraded and d.state.rollbacks == 0
    # TTFT from queueing at the limit with TPOT at half its SLO: latched, and the batch
    # raised all the same (the remedy for queueing; nothing smaller was known good)
    d = tick(obs(60, ttft=3.0, missed=150), State(knobs=K16, spread=QUIET))
    d = tick(obs(120, ttft=3.0, missed=150), d.state)  # two windows: the knobs' level
    assert d.action is Action.LOOSEN and d.knobs.max_batch_size > 16, d.reason
    assert d.state.degraded and not d.state.rolled_back
    # ... but after a rollback the latch holds the batch until --ack
    back = State(knobs=K16, degraded="SLO burn; back to B=16", rolled_back=True, spread=QUIET)
    d = tick(obs(60, ttft=3.0, missed=150), back)
    d = tick(obs(120, ttft=3.0, missed=150), d.state)
    assert d.action is Action.HOLD and d.knobs == K16, d.reason
    assert len(d.state.level) == 2 and "more replicas" in d.reason


def test_the_burn_window_forgets_old_misses() -> None:
    st = State(knobs=K16)
    # 10% missed in each of two windows: under the 14.4% fast-burn budget, no rollback
    for end in (60, 120):
        d = tick(obs(end, missed=50, tpot=0.8), st)
        assert d.action is Action.HOLD
        st = d.state
    assert [b[0] for b in st.burn] == [60, 120]
    st = tick(obs(1000, tpot=0.8), st).state
    assert [b[0] for b in st.burn] == [1000]


def test_windows_that_are_old_or_span_the_last_change_are_inconclusive() -> None:
    d = tick(obs(100, tpot=1.5))
    assert d.action is Action.TIGHTEN and d.state.last_change_s == 100
    again = tick(obs(100, tpot=1.5), d.state)  # the same window read twice
    assert again.outcome is Outcome.INCONCLUSIVE and again.knobs == d.knobs
    spans = tick(obs(150, tpot=1.5), d.state)  # 90-150: began before the change at 100
    assert spans.outcome is Outcome.INCONCLUSIVE and "before the last change" in spans.reason
    after = tick(obs(170, tpot=1.5), d.state)  # 110-170
    assert after.action is Action.TIGHTEN


def test_drift_pauses_every_tick_until_acked_then_adopts_the_live_knobs() -> None:
    theirs = Knobs(max_batch_size=40, max_concurrency=40)
    st = State(knobs=K16)
    for end in (60, 120):
        d = tick(obs(end, tpot=1.5), st, live=theirs)
        assert d.action is Action.PAUSE and d.knobs == K16
        st = d.state
    st = acknowledge(st, live=theirs)
    d = tick(obs(180, tpot=1.5), st, live=theirs)
    assert d.action is Action.TIGHTEN and d.knobs == Knobs(max_batch_size=30, max_concurrency=30)


def test_a_derived_setting_changed_alone_pauses_with_the_knobs_unchanged() -> None:
    why = "llm/Server: Serve's max_ongoing_requests is 50 where ... make it 96"
    st = State(knobs=K16)
    for end in (60, 120):  # a violation or a calm queue alike: no action while it stands
        d = tick(obs(end, tpot=1.5, overloaded=9), st, drift=why)
        assert (d.outcome, d.action, d.knobs) == (Outcome.INCONCLUSIVE, Action.PAUSE, K16)
        assert d.reason.startswith(why + ": changed by someone else; paused")
        assert d.state.calm_since is None
        st = d.state
    assert tick(obs(180, tpot=1.5), st).action is Action.TIGHTEN  # gone: decided as ever


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(batch_max=0), "batch_max=0"),
        (dict(batch_max=8, batch_min=9), "batch_max=8 < batch_min=9"),
        (dict(loosen_below=0.95), "tolerance band"),
        (dict(decrease=1.0), "decrease=1.0"),
        (dict(headroom=0.5), "headroom=0.5"),
        (dict(burn_rate=0.5), "burn_rate=0.5"),
        (dict(curve=((0, 0.1),)), "curve point"),
        (dict(stabilization_s=math.inf), "stabilization_s=inf"),
    ],
)
def test_a_bad_policy_is_one_line_naming_the_value(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        Policy(**{"slo": SLO, "batch_max": 64, **kw})


def test_a_curve_bounds_the_policy_by_the_canarys_windows_not_productions() -> None:
    from controller.control.policy import policy_from_curve

    def t(b: int, ms: float, role: str) -> dict:
        return {"max_batch_size": b, "p99_tpot_ms": ms, "role": role}

    report = {
        "operating_point": {"max_batch_size": 16, "max_concurrency": 32},
        "trials": [
            t(16, 40.0, "search"),
            t(24, 55.0, "sweep"),
            t(200, 900.0, "production"),
            t(16, 44.0, "production"),
        ],
    }
    p = policy_from_curve(report, slo=SLO)
    assert p.batch_max == 24 and p.headroom == 2.0
    assert p.curve == ((16, 0.04), (24, 0.055))
