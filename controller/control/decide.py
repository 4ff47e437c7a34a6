"""One tick of production control, decided: ``decide(signals, state, policy) -> Decision``.

Pure: no I/O and no clock (a window's own end time is "now"), so every rule below is tested
by tables of cases (tests/controller/test_control_decide.py). The loop that reads windows,
acts and records lives in :mod:`controller.control.loop`.

Each tick has one of three outcomes:

- ``inconclusive``: a window too thin or too doubtful to judge (fewer than
  ``min_requests`` completions, a p99 verdict still insufficient, a NaN, stale metrics, a
  read error, a window that spans a rollout or a replica restart or began before the last
  change took effect, a window not newer than the last one decided). It **holds**: the
  limits stay, it is not a failure, and loosening waits for a fresh stabilization window
  once data returns. (Flagger counts no data as a failure and rolls a canary with no
  traffic back; Dynamo's planner reads NaN at zero traffic and never scales down: neither.)
  One kind is read, not dropped: a window with its requests whose p99 verdict is left
  insufficient though its p99 is measured (it lies near the SLO, or the tail has too few
  samples to bound). Its p99 joins the level of the knobs (3. below), the windows' spread
  and the burn, and the level may tighten on it; it never loosens.
- ``violated``: either p99 judged over its SLO.
- ``met``: both judged within.

What it does, in order:

1. **Drift**: the deployment runs knobs other than those slotune last wrote (a person,
   GitOps, an operator resubmitting its config), or a setting slotune derives from them
   changed alone (``Signals.drift``: Serve's limit beside slotune's own admission key):
   pause and say so, never fight; ``--ack`` adopts the live knobs (:func:`acknowledge`), or
   for a derived setting has slotune write its own again (controller/control/loop.py).
2. **Burn → rollback**: over the last ``burn_window_s`` the share of requests that missed
   the SLO exceeds ``burn_rate`` times the error budget (1 - the SLO's quantile): re-apply
   the last known-good knobs at once and latch ``degraded`` until acknowledged (Argo
   Rollouts' abort). Only smaller ones: knobs larger than those running were good under
   another load (a step up in traffic burns the budget too), and going back up is never
   the remedy; without smaller known-good knobs it latches and goes on as below.
   While degraded it may tighten, never loosen.
3. **Tighten fast**: at once on a violated window, or when the knobs' level reaches
   ``tighten_at`` of an SLO: the mean p99 share of the conclusive windows at these knobs in
   the last ``stabilization_s`` whose answers are of the newest window's length (within
   ``LOAD_SHIFT``, 1.5x: windows of another load leave it), once there are
   ``near_windows`` of them (one window alone
   is within the noise of a p99 near the operating point, and a window under it does not
   undo the ones over: two in a row over 95% ratcheted a simulated day's batch down where
   p99 hardly moved with it). TPOT trouble lowers the batch limit (by ``decrease`` or
   deeper, from the batch that ran: controller/control/steps.py) and the admission limit
   with it at the same headroom; TTFT trouble alone lowers the admission limit toward the
   batch limit (shedding at the door). Once they meet, TTFT is queueing for the batch, and a
   smaller batch would serve fewer and queue more: with the TPOT level of these knobs (the
   mean of ``near_windows`` or more) under ``loosen_below``, the batch goes up at once as far
   as the curve keeps TPOT under it; otherwise it holds (more replicas are needed). A TPOT
   level over the band cuts the batch even while TTFT is over. A level (not a violated
   window) holds where the batch ran more than ``max_step`` under its limit with nothing
   queueing for it: the load holds the batch there, and a cut would shed it while the SLO
   is met.
   **The TPOT band and the windows' spread**: where the limit holds the batch (it runs
   full, or requests queue for it), the spread of p99 TPOT from window to window at one
   batch is read from successive windows (policy.py: ``window_spread``). Where it would put more
   than 1 - ``attainment`` of the windows over the SLO at a level of ``tighten_at``, the
   TPOT band (``tighten_at`` and ``loosen_below`` alike) is lowered to the level that keeps
   ``attainment`` of them within (``tpot_band``). A level over the lowered band but under
   ``tighten_at`` cuts only where the curve predicts a cut of ``max_step`` brings it under the
   band's floor; a queueing raise waits until the spread is known.
4. **Loosen slowly**: only once every conclusive window of the last ``stabilization_s`` met
   both SLOs under ``loosen_below`` of them with demand queueing at the limit (requests
   refused for want of room, or waiting: arrivals beyond what the limit admits, not
   completions, which the limit itself caps); then by ``increase`` or ``increase_share`` of
   the batch each tick the calm lasts, to no batch whose p99 TPOT the curve predicts over
   the TPOT band's ``loosen_below`` of the SLO (so a loosening stops short of the
   tightening threshold: no limit cycle). (HPA keeps the highest recommendation of the
   last 300 s before scaling down; AIMD adds 1 and multiplies by 0.9.) A raise, this or a
   queueing one, is on trial until its level is pooled: a window over the TPOT band before
   that goes back to the knobs before it, and no raise reaches that batch for
   ``stabilization_s``.
5. Otherwise **hold** (within the tolerance band between ``loosen_below`` and
   ``tighten_at``, or met without queueing: more room would not be used).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from controller.backends.serve_autoscaling import Scaling, shrinks_fleet
from controller.control.gauges import holds_the_batch, queued, running_batch
from controller.control.outliers import outliers
from controller.control.policy import (
    SPREAD_MIN,
    SPREAD_PAIRS,
    Policy,
    answer_tokens,
    same_load,
    tpot_band,
    window_spread,
)
from controller.control.steps import cut_to, loosen_to, raise_cap, step_down
from controller.control.verdicts import left_undecided, share_of_slo
from metrics.observation import Observation, Verdict
from search.space import Knobs


class Outcome(str, enum.Enum):
    MET = "met"
    VIOLATED = "violated"
    INCONCLUSIVE = "inconclusive"


class Action(str, enum.Enum):
    HOLD = "hold"
    TIGHTEN = "tighten"
    LOOSEN = "loosen"
    ROLLBACK = "rollback"
    PAUSE = "pause"


def _below(a: Knobs, b: Knobs) -> bool:
    """``a`` admits no more than ``b`` on either limit, and less on one."""
    return (
        a.max_batch_size <= b.max_batch_size and a.max_concurrency <= b.max_concurrency and a != b
    )


@dataclass(frozen=True, kw_only=True)
class State:
    """What the controller remembers between ticks (persisted: controller/control/store.py)."""

    knobs: Knobs  # what slotune last wrote (or found when it started)
    last_good: Knobs | None = None  # the latest knobs a window met the SLO comfortably on
    degraded: str = ""  # why an SLO burn latched ("" when not)
    rolled_back: bool = False  # the latch went back to known-good knobs (else none were smaller)
    calm_since: float | None = None  # since when every conclusive window allowed loosening
    last_change_s: float = -math.inf  # when slotune last changed the knobs
    last_end_s: float = -math.inf  # the end of the newest window decided
    # (window end, completed, missed the SLO) of the windows within the burn window
    burn: tuple[tuple[float, int, int], ...] = ()
    # (window end, p99 TTFT, p99 TPOT as shares of the SLO, mean answer tokens) of the
    # windows judged at these knobs (conclusive, or undecided with a measured p99) in the
    # last stabilization_s (or near_windows windows' time, if longer), of the load now
    # running (answers within LOAD_SHIFT of the newest's length): their mean is the level a
    # near tightening reads
    level: tuple[tuple[float, float, float, float], ...] = ()
    # the relative differences of successive windows' p99 TPOT shares at unchanged knobs, the
    # last SPREAD_PAIRS: the windows' spread, which sets the TPOT band (tpot_band)
    spread: tuple[float, ...] = ()
    bound_end_s: float = -math.inf  # the end of the newest window its limit held the batch in
    # the knobs before the last raise, while the raise is on trial (until near_windows windows
    # at the raised knobs give their level), and (batch, until when) no raise may reach: a
    # raise whose trial read over the TPOT band
    raised_from: Knobs | None = None
    ceiling: tuple[int, float] | None = None
    ticks: int = 0
    holds: int = 0
    rollbacks: int = 0


@dataclass(frozen=True, kw_only=True)
class Signals:
    """One tick's input: the window's Observation, and what the loop saw around it."""

    observation: Observation
    live: Knobs | None = None  # the knobs the deployment runs now (None: not readable)
    fault: str = ""  # the window spans a rollout or replica restart, or could not be read
    scaling: Scaling | None = None  # Serve's autoscaler, when it moves the replica count
    # a setting slotune derives from the knobs, changed by someone else (the knobs cannot
    # show it: Serve's limit beside slotune's own admission key); "" when none
    drift: str = ""


@dataclass(frozen=True, kw_only=True)
class Decision:
    outcome: Outcome
    action: Action
    knobs: Knobs  # the knobs to run from now on (the state's, unless acting)
    reason: str
    state: State
    predicted_tpot_s: float = math.nan  # for a loosening: the curve's p99 TPOT at the new batch
    # (tighten at, loosen below, spread): the TPOT band the tick steered by (tpot_band); NaN
    # where it decided before reading one (a pause, an inconclusive window, a rollback)
    tpot_band: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    outliers: tuple[str, ...] = ()  # replicas much slower than the rest (reported, see below)

    @property
    def changes(self) -> bool:
        return self.action in (Action.TIGHTEN, Action.LOOSEN, Action.ROLLBACK)


def acknowledge(state: State, live: Knobs | None) -> State:
    """An operator's ``--ack``: clear the degraded latch and adopt the live knobs (after a
    drift pause); loosening waits a fresh stabilization window."""
    knobs = live or state.knobs
    level = state.level if knobs == state.knobs else ()  # other knobs: no window at them yet
    return replace(
        state,
        degraded="",
        rolled_back=False,
        knobs=knobs,
        calm_since=None,
        level=level,
        raised_from=None if knobs != state.knobs else state.raised_from,
    )


def _inconclusive_why(sig: Signals, state: State, policy: Policy) -> str:
    o = sig.observation
    if sig.fault:
        return sig.fault
    if o.stale:
        return f"stale metrics ({o.note or 'the newest sample is too old'})"
    if not o.end_s > state.last_end_s:
        return f"the window ending {o.end_s:.0f} is not newer than the last one decided"
    if o.start_s < state.last_change_s:
        return "the window began before the last change took effect"
    if o.completed < policy.min_requests:
        return f"{o.completed} requests completed (< {policy.min_requests} for a p99 verdict)"
    return ""


def decide(signals: Signals, state: State, policy: Policy) -> Decision:
    """The tick's outcome and action (see the module doc), with any outlier replica named
    in its reason: the decision itself is the fleet's, on the p99 across replicas."""
    d = _decide(signals, state, policy)
    slow = outliers(signals.observation, policy)
    if not slow:
        return d
    note = "; outlier: " + ", ".join(what for _, what in slow)
    return replace(d, reason=d.reason + note, outliers=tuple(r for r, _ in slow))


def _decide(signals: Signals, state: State, policy: Policy) -> Decision:
    o = signals.observation
    now = o.end_s
    st = replace(state, ticks=state.ticks + 1)
    cur = st.knobs

    steered: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # set once read

    def hold(outcome: Outcome, why: str, **kw: object) -> Decision:
        s = replace(st, holds=st.holds + 1, **kw)  # type: ignore[arg-type]
        return Decision(
            outcome=outcome, action=Action.HOLD, knobs=cur, reason=why, state=s, tpot_band=steered
        )

    def change(
        outcome: Outcome,
        action: Action,
        new: Knobs,
        why: str,
        predicted: float = math.nan,
        **kw: object,
    ) -> Decision:
        # new knobs: their level starts afresh, no window judged at them yet; a raise is on
        # trial until it has one
        kw.setdefault("raised_from", cur if action is Action.LOOSEN else None)
        s = replace(st, knobs=new, last_change_s=now, level=(), **kw)  # type: ignore[arg-type]
        return Decision(
            outcome=outcome,
            action=action,
            knobs=new,
            reason=why,
            state=s,
            predicted_tpot_s=predicted,
            tpot_band=steered,
        )

    # 1. someone else's knobs, or a setting derived from them: pause
    foreign = ""
    if signals.drift:
        foreign = f"{signals.drift}: changed by someone else; paused, not fighting (slotune "
        foreign += "control --ack writes slotune's own again)"
    elif signals.live is not None and signals.live != cur:
        foreign = f"the deployment runs {signals.live} but slotune last wrote {cur}: changed "
        foreign += "by someone else; paused, not fighting (slotune control --ack adopts it)"
    if foreign:
        return Decision(
            outcome=Outcome.INCONCLUSIVE,
            action=Action.PAUSE,
            knobs=cur,
            reason=foreign,
            state=replace(st, calm_since=None),
        )

    why = _inconclusive_why(signals, st, policy)
    undecided, measured = ("", False) if why else left_undecided(o)
    if why or (undecided and not measured):
        why = why or undecided
        return hold(Outcome.INCONCLUSIVE, f"inconclusive, holding {cur}: {why}", calm_since=None)
    # An undecided window with measured p99s joins the level, the spread and the burn, and
    # may tighten on them, never loosen. Dropped, it left the level to the windows either
    # side of the band (a simulated day dropped 12 windows at 95-102% of the TPOT SLO at
    # B=45, read its level at 91-93%, and the next window was 103%).
    st = replace(st, last_end_s=now)
    violated = any(
        v is not None and v.verdict is Verdict.VIOLATED for v in (o.ttft_verdict, o.tpot_verdict)
    )
    outcome = Outcome.VIOLATED if violated else Outcome.INCONCLUSIVE if undecided else Outcome.MET
    ttft_share, tpot_share = share_of_slo(o, policy.slo)
    binds = holds_the_batch(o, cur)

    # 2. the error budget burning: back to the last known-good knobs, latched
    burn = st.burn
    if o.slo_met_known:
        burn = (*burn, (now, o.completed, o.completed - o.slo_met))
    burn = tuple(b for b in burn if b[0] > now - policy.burn_window_s)
    st = replace(st, burn=burn)
    done = sum(b[1] for b in burn)
    missed = sum(b[2] for b in burn)
    budget = policy.burn_rate * (1 - policy.slo.quantile)
    if not st.degraded and done >= policy.min_requests and missed / done > budget:
        burning = (
            f"SLO burn: {missed} of {done} requests missed it in the last "
            f"{policy.burn_window_s:g} s ({missed / done:.1%} > {policy.burn_rate:g} x the "
            f"{1 - policy.slo.quantile:.0%} budget)"
        )
        good = st.last_good
        if good is not None and _below(good, cur):
            why = f"{burning}; back to {good}, the last known good"
            return change(
                outcome,
                Action.ROLLBACK,
                good,
                why,
                degraded=why,
                rolled_back=True,
                calm_since=None,
                rollbacks=st.rollbacks + 1,
            )
        # no smaller known-good knobs to go back to: larger ones were good under another
        # load, and going back up is never the remedy; latch, then act as any window would
        # (tighten on TPOT, raise the batch for TTFT queueing where TPOT has room)
        st = replace(st, degraded=f"{burning}; no smaller known-good knobs than {cur}")

    # 3. tighten at once
    violated_tpot = o.tpot_verdict is not None and o.tpot_verdict.verdict is Verdict.VIOLATED
    violated_ttft = o.ttft_verdict is not None and o.ttft_verdict.verdict is Verdict.VIOLATED
    # Near the SLO is judged on the level of these knobs: the mean share of the windows
    # judged at them in the last stabilization_s (at least near_windows of them), not on one
    # window, which is within the noise of a p99 near the operating point (a simulated
    # day's windows at one batch read +-4%; two in a row over 95% then ratcheted the batch
    # down where p99 hardly moved with it)
    if math.isfinite(ttft_share) and math.isfinite(tpot_share):
        horizon = max(policy.stabilization_s, policy.near_windows * o.window_s)
        # only the windows of the load now running: answers of another length moved p99
        # apart from the knobs (live, a level pooled from a step up at 80-93% held B=10 for
        # three windows into answers twice as long, 8 -> 16 tokens, at TPOT 59-74% and
        # TTFT 374-487% of its SLO)
        tokens = answer_tokens(o)
        level = tuple(
            x
            for x in (*st.level, (now, ttft_share, tpot_share, tokens))
            if x[0] > now - horizon and same_load(x[3], tokens)
        )
        st = replace(st, level=level)
        # The spread of p99 at one batch is read, and steered by, only where the limit held
        # the batch (running at it, or no gauge to tell): where the load holds it under the
        # limit, the windows move with the load, not at random, and the limit is not what
        # sets their p99 (a simulated night's windows at 40 running under B=124 differed by
        # 7%, and a band lowered for that cut the batch to 35 for the day)
        if binds:
            prev = level[-2] if len(level) >= 2 else None  # the window before, same knobs
            if prev is not None and prev[0] == st.bound_end_s and prev[2] > 0:
                diff = 2 * (tpot_share - prev[2]) / (tpot_share + prev[2])
                st = replace(st, spread=(*st.spread, diff)[-SPREAD_PAIRS:])
            st = replace(st, bound_end_s=now)
    # the TPOT band, lowered where the windows' spread would put too many over the SLO
    tighten_tpot, loosen_tpot, spread = (
        tpot_band(policy, st.spread)
        if binds
        else (policy.tighten_at, policy.loosen_below, math.nan)
    )
    steered = (tighten_tpot, loosen_tpot, window_spread(st.spread))
    band = (
        f"; TPOT band {loosen_tpot:.0%}-{tighten_tpot:.0%} for windows spread {spread:.0%}"
        if tighten_tpot < policy.tighten_at
        else ""
    )
    n = len(st.level)
    pooled = n >= policy.near_windows
    mean_ttft = sum(x[1] for x in st.level) / n if pooled else math.nan
    mean_tpot = sum(x[2] for x in st.level) / n if pooled else math.nan
    # A raise on trial: a window at the raised knobs over the TPOT band before their level is
    # pooled goes back to the knobs before it at once, and no raise reaches that batch for
    # stabilization_s. The raise was predicted under the band's floor from a level measured a
    # tick ago; reading over its top, the prediction missed, and waiting for the level cost
    # a second window over (live, B=20 -> 23 was predicted at 88 ms and read 101 and 110 ms)
    raised = st.raised_from
    if raised is not None and (pooled or not _below(raised, cur)):
        st = replace(st, raised_from=None)
    elif raised is not None and math.isfinite(tpot_share) and tpot_share >= tighten_tpot:
        why = (
            f"p99 TPOT at {tpot_share:.0%} of its SLO at {cur} on trial after the raise from "
            f"{raised} (tighten at {tighten_tpot:.0%}{band}): back to {raised}, and no raise "
            f"to B={cur.max_batch_size} for {policy.stabilization_s:g} s"
        )
        ceiling = (cur.max_batch_size, now + policy.stabilization_s)
        return change(outcome, Action.TIGHTEN, raised, why, calm_since=None, ceiling=ceiling)
    st = st if st.ceiling is None or now < st.ceiling[1] else replace(st, ceiling=None)
    cap, capped = raise_cap(st.ceiling, cur.max_batch_size)
    # TPOT near the SLO tightens even while TTFT is judged over from queueing: at a level
    # over the band, that many windows would be over the TPOT SLO (live, at B=15-16 under
    # 24 clients the windows read 84-115 ms at a level of 91-97% while a rule that left TPOT
    # alone under TTFT trouble held them there: one in eight over)
    hot_tpot = o.tpot_verdict is not None and (violated_tpot or mean_tpot >= tighten_tpot)
    hot_ttft = violated_ttft or mean_ttft >= policy.tighten_at
    relief = ""
    far = (
        not binds
        and math.isfinite(o.running)
        and o.running < (1 - policy.max_step) * cur.max_batch_size
    )
    if hot_tpot and not violated_tpot and far:
        # the batch ran over max_step under its limit, nothing queueing for it: the load
        # holds it, and a cut below what runs sheds requests with the SLO met (a simulated
        # day: 93 ran under B=157 at a level of 97%; B=92 shed 2-4% of them for five hours,
        # where a fixed B=152 kept every window within). A violated window still cuts.
        hot_tpot = False
        relief = (
            f"; {o.running:.0f} ran under the limit of {cur.max_batch_size}: the load holds "
            "the batch, and a cut would shed it with the SLO met (a violation still cuts)"
        )
    if hot_tpot and not violated_tpot and mean_tpot < policy.tighten_at:
        # over the band only for the windows' spread: cut only where the curve predicts a
        # cut of max_step brings the level under the band's floor. Where p99 hardly moves
        # with the batch, smaller batches keep the level and the spread, and cuts on them
        # ratchet down (a simulated day: B=66 -> 59 -> 53 -> 47 at 93-94% of the SLO)
        run = running_batch(o, cur.max_batch_size)
        low = max(policy.batch_min, math.ceil(run * (1 - policy.max_step)))
        p99 = mean_tpot * policy.slo.tpot_p99_s
        at_low = policy.predict_tpot_s(run, p99, low) / policy.slo.tpot_p99_s
        if at_low > loosen_tpot:
            hot_tpot = False
            relief = (
                f"; the curve predicts {at_low:.0%} at B={low}, not under {loosen_tpot:.0%}: "
                "a smaller batch would not bring it into the band"
            )
    if not violated_tpot:  # near: the level's share, not this window's
        tpot_share = mean_tpot if hot_tpot else tpot_share
    if not violated_ttft:
        ttft_share = mean_ttft if hot_ttft else ttft_share
    if undecided and not (hot_tpot or (hot_ttft and cur.max_concurrency > cur.max_batch_size)):
        # undecided, no tightening: hold (no loosening, no raise for queueing, on it)
        level = (
            f"the level of {cur} is TTFT {mean_ttft:.0%}, TPOT {mean_tpot:.0%} of the SLO "
            f"over {n} windows"
            if pooled
            else f"{n} of the {policy.near_windows} windows at {cur} its level needs"
        )
        return hold(
            outcome,
            f"inconclusive, holding {cur}: {undecided}; {level}{band}{relief}",
            calm_since=None,
        )
    if relief and not hot_ttft:
        return hold(
            outcome,
            f"met, p99 TPOT at {mean_tpot:.0%} of its SLO over the last {n} windows at {cur}, "
            f"over the band{band}{relief}: holding {cur}",
            calm_since=None,
        )
    near_once = not (violated_tpot or violated_ttft) and (
        tpot_share >= tighten_tpot or ttft_share >= policy.tighten_at
    )
    if near_once and not (hot_tpot or hot_ttft):
        # met, near the SLO, but the knobs' level is not (yet): within the window noise
        what, share, at = (
            ("TPOT", tpot_share, tighten_tpot)
            if tpot_share >= tighten_tpot
            else ("TTFT", ttft_share, policy.tighten_at)
        )
        level = (
            f"the mean of their last {n} windows is under it"
            if pooled
            else f"{n} of the {policy.near_windows} windows at them its mean needs"
        )
        return hold(
            outcome,
            f"met, p99 {what} at {share:.0%} of its SLO (tighten at {at:.0%} "
            f"on the level of {cur}: {level}{band}): holding {cur}",
            calm_since=None,
        )
    if hot_tpot or hot_ttft:
        b, c = cur.max_batch_size, cur.max_concurrency
        if not hot_tpot and c == b:
            # TTFT alone with no admission headroom left: it is queueing for the batch, and
            # a smaller batch would serve fewer and queue more. With the TPOT level of these
            # knobs under loosen_below a larger batch serves the queue: up at once, as far
            # as the curve keeps TPOT under loosen_below (live, longer answers left B=18 at
            # p99 TTFT 240% and TPOT ~55% where B=32 met both); else hold.
            # The level, not one window: raising whenever one window read low climbed on
            # the noise (live, B=10 -> 24 on windows at 73-93% of the TPOT SLO, and B=24
            # then read 101% and 110%)
            p99 = mean_tpot * policy.slo.tpot_p99_s
            why = ""
            # not after a rollback (that latch holds until --ack); a burn that found no
            # smaller known-good knobs does not stop the remedy for queueing (live, that
            # left B=18 at p99 TTFT 240-310% of its SLO where a fixed B=32 met both)
            rolled_back = bool(st.degraded) and st.rolled_back
            if not pooled and math.isfinite(tpot_share):
                return hold(
                    outcome,
                    f"p99 TTFT at {ttft_share:.0%} of its SLO with TPOT within it at {cur}: "
                    f"queueing for the batch; holding until {policy.near_windows} windows at "
                    f"{cur} give its TPOT level ({n} so far)",
                    calm_since=None,
                )
            wait = binds and len(st.spread) < SPREAD_MIN and math.isfinite(tpot_share)
            if wait and mean_tpot <= policy.loosen_below:
                # room under loosen_below, but the band a raise aims under is not known
                # before the windows' spread is: raising on the level alone climbed into
                # windows over the SLO where they spread wide
                return hold(
                    outcome,
                    f"p99 TTFT at {ttft_share:.0%} of its SLO with TPOT within it at {cur}: "
                    f"queueing for the batch; holding until {SPREAD_MIN} differences of "
                    f"windows at a held batch give their spread ({len(st.spread)} so far)",
                    calm_since=None,
                )
            # pooled from here where this window's TPOT is known; without it, no raise on
            # the older windows alone
            if math.isfinite(tpot_share) and mean_tpot <= loosen_tpot and not rolled_back:
                nb = loosen_to(b, p99, policy, loosen_tpot, top=cap)
                why = _shrinks_fleet(signals, cur, policy.knobs(nb)) if nb > b else capped
                if nb > b and not why:
                    new = policy.knobs(nb)
                    predicted = policy.predict_tpot_s(b, p99, nb)
                    why = (
                        f"p99 TTFT at {ttft_share:.0%} of its SLO from queueing at {cur} with "
                        f"TPOT at {mean_tpot:.0%} over its last {n} windows: the curve "
                        f"predicts p99 TPOT {predicted * 1e3:.0f} ms at {new}{band}: {cur} -> {new}"
                    )
                    return change(outcome, Action.LOOSEN, new, why, predicted, calm_since=None)
            return hold(
                outcome,
                f"p99 TTFT at {ttft_share:.0%} of its SLO with TPOT within it at {cur}: "
                "queueing for the batch; holding (more replicas needed, not a smaller batch)"
                + (f"; {why}" if why else ""),
                calm_since=None,
            )
        if not hot_tpot:  # TTFT alone: shed at the door
            new = Knobs(max_batch_size=b, max_concurrency=max(b, step_down(c, policy)))
        else:
            new = policy.knobs(cut_to(o, b, policy, tpot_share, loosen_tpot))
        what = "TPOT" if hot_tpot else "TTFT"
        share = tpot_share if hot_tpot else ttft_share
        at = tighten_tpot if hot_tpot else policy.tighten_at
        if new == cur:
            return hold(
                outcome,
                f"p99 {what} at {share:.0%} of its SLO but {cur} is the lower bound: holding"
                " (more replicas needed)",
                calm_since=None,
            )
        why = f"p99 {what} at {share:.0%} of its SLO (tighten at {at:.0%}{band}): {cur} -> {new}"
        return change(outcome, Action.TIGHTEN, new, why, calm_since=None)

    # met, under tighten_at on both: a known-good point
    st = replace(st, last_good=cur)
    demand = queued(o, cur.max_batch_size)
    calm = ttft_share <= policy.loosen_below and tpot_share <= loosen_tpot
    if st.degraded:
        return hold(
            outcome, f"met; degraded ({st.degraded}): holding {cur} until --ack", calm_since=None
        )
    if not (calm and demand):
        why = (
            f"met (p99 TTFT {ttft_share:.0%}, TPOT {tpot_share:.0%} of the SLO) "
            + ("within the tolerance band" if not calm else "with no demand queueing at the limit")
            + f"{band}: holding {cur}"
        )
        return hold(outcome, why, calm_since=None)
    since = st.calm_since if st.calm_since is not None else o.start_s
    st = replace(st, calm_since=since)
    waited = now - since
    if waited < policy.stabilization_s:
        return hold(
            outcome,
            f"room to grow and demand queueing, for {waited:.0f} s of the "
            f"{policy.stabilization_s:g} s stabilization window: holding {cur}",
        )
    # Calm for the whole stabilization window: up by the step, each tick the calm lasts,
    # to the largest batch of the step the curve predicts under loosen_below of the SLO.
    b = cur.max_batch_size
    if b >= policy.batch_max:
        return hold(outcome, f"room to grow but {cur} is the upper bound: holding")
    p99 = o.tpot_verdict.estimate_s  # type: ignore[union-attr]  # MET: a finite estimate
    step = max(policy.increase, round(b * policy.increase_share))
    nb = loosen_to(b, p99, policy, loosen_tpot, top=b + step if cap is None else min(cap, b + step))
    if nb == b and capped:
        return hold(outcome, f"room to grow, but {capped}: holding {cur}")
    if nb == b:
        predicted = policy.predict_tpot_s(b, p99, b + 1)
        return hold(
            outcome,
            f"the curve predicts p99 TPOT {predicted * 1e3:.0f} ms at B={b + 1} (over "
            f"{loosen_tpot:.0%} of the SLO{band}): holding {cur}",
        )
    predicted = policy.predict_tpot_s(b, p99, nb)
    new = policy.knobs(nb, max(cur.max_concurrency + (nb - b), round(nb * policy.headroom)))
    shrinks = _shrinks_fleet(signals, cur, new)
    if shrinks:
        return hold(outcome, f"room to grow, but {shrinks}: holding {cur}")
    why = (
        f"met under {loosen_tpot:.0%} of the TPOT SLO and {policy.loosen_below:.0%} of the TTFT "
        f"SLO with demand queueing for {waited:.0f} s; predicted p99 TPOT "
        f"{predicted * 1e3:.0f} ms at {new}{band}: {cur} -> {new}"
    )
    return change(outcome, Action.LOOSEN, new, why, predicted)


def _shrinks_fleet(signals: Signals, cur: Knobs, new: Knobs) -> str:
    """Why raising the admission limit from ``cur`` to ``new`` would fight Serve's
    autoscaler, from the window (controller/backends/serve_autoscaling.py); "" if not."""
    o = signals.observation
    return shrinks_fleet(
        signals.scaling,
        running=o.running,
        waiting=o.waiting,
        limit_from=cur.max_concurrency,
        limit_to=new.max_concurrency,
        what=str(new),
    )
