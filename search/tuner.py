"""The roofline-seeded, SLO-constrained Optuna tuner (ask/tell; the controller owns the loop).

Per trial the controller calls :meth:`Tuner.propose` (a :class:`Knobs` to apply), measures
one window, and calls :meth:`Tuner.report` with the Observation; :meth:`Tuner.should_stop`
applies :mod:`search.stop_rule`. Proposals come, in order of priority, from the seed, the
roofline guide (:mod:`search.guide`), re-measurement of the incumbent until it is declared
(:mod:`search.remeasure`, :mod:`search.evidence`), then Optuna's sampler with both latency
constraints (docs/search.md). With ``costs`` (:class:`search.stages.KnobCosts`) saying the
batch limit restarts replicas or cannot be changed, :meth:`Tuner.proposal` also says which
batch cap to hold and when it changes (:mod:`search.stager`). Every proposal is an Optuna
trial, so the sampler learns from all of them and optuna-dashboard shows the study, its
objective named ``goodput``.

Storage: a plain path is a JournalStorage file, a URL (``sqlite:///x.db``) goes to Optuna
as is, None keeps the study in memory. On opening an existing study, trials a killed
controller left RUNNING are marked FAIL and the search resumes: all tuner state is derived
from the stored trials.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from metrics.observation import Observation, Slo
from search.guide import Guide
from search.objective import evaluate
from search.points import observation_attrs, summarize_all
from search.proposals import next_fixed
from search.space import Knobs, SearchSpace
from search.stager import Stager
from search.stages import ChangeSummary, KnobCosts, Proposal, StageState, change_summary
from search.stop_rule import PointSummary, StopRule, incumbent, stop_reason

logger = logging.getLogger(__name__)

SAMPLERS = ("gp", "tpe", "random")
PHASES = ("seed", "guided", "remeasure", "climb", "sampler", "external", "cap")
CONSTRAINT_NAMES = ("ttft_p99_minus_slo_s", "tpot_p99_minus_slo_s")
METRIC_NAME = "goodput"  # the study's one objective (maximised), requests/s within the SLO
_GUIDE_DONE = "slotune_guide_done"
# A trial's user attributes that are the tuner's bookkeeping, not its window's observation.
_NOT_OBSERVED = ("phase", "feasible", "reason", "stage", "batch_cap", "batch_change")
_NOT_OBSERVED += ("change_cost_s",)


@dataclass(frozen=True, kw_only=True)
class TunerTrial:
    """One trial as the tuner stored it in the study: its knobs, phase, state and verdict."""

    number: int
    knobs: Knobs
    phase: str
    state: str  # "complete" | "fail" | "running"
    goodput_rps: float = math.nan
    constraints: tuple[float, float] | None = None
    feasible: bool = False
    reason: str = ""
    observation: dict[str, Any] = field(default_factory=dict)
    batch_cap: int | None = None  # staged search: the engine batch limit it ran under
    change_cost_s: float = 0.0  # seconds the loop reported for changing knobs (a restart)


def open_storage(storage: str | None) -> Any:
    """None: in memory; ``scheme://...``: an Optuna storage URL; else a JournalStorage file."""
    if storage is None:
        return None
    if "://" in storage:
        return storage
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(storage))


def make_sampler(
    name: str, *, seed: int | None, n_startup_trials: int
) -> optuna.samplers.BaseSampler:
    if name == "gp":
        return optuna.samplers.GPSampler(
            seed=seed, n_startup_trials=n_startup_trials, warn_independent_sampling=False
        )
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler={name!r}: choose one of {SAMPLERS}")


class Tuner:
    """Ask/tell search of :class:`Knobs` under an :class:`Slo` (see the module doc)."""

    def __init__(
        self,
        *,
        space: SearchSpace,
        slo: Slo,
        storage: str | None = None,
        study_name: str = "slotune",
        seed_knobs: Sequence[Knobs] = (),
        model_tpot_s: Callable[[int], float] | None = None,
        sampler: str = "gp",
        seed: int | None = None,
        stop_rule: StopRule | None = None,
        n_startup_trials: int = 4,
        guide_aim: float = 0.97,
        declare_gain: float = 0.05,
        guide_options: dict[str, Any] | None = None,
        costs: KnobCosts | None = None,
        applied_batch_cap: int | None = None,
    ) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler={sampler!r}: choose one of {SAMPLERS}")
        self.space = space
        self.slo = slo
        self.stop_rule = stop_rule or StopRule()
        self.declare_gain = declare_gain
        self.costs = costs or KnobCosts()
        self.seed_knobs = [space.clip(k) for k in seed_knobs]
        if self.costs.staged:  # seeds on the batch line (search.stages)
            self.seed_knobs = [
                Knobs(max_batch_size=k.max_batch_size, max_concurrency=k.max_batch_size)
                for k in self.seed_knobs
            ]
        self._guide = (
            Guide(
                model_tpot_s=model_tpot_s,
                space=space,
                slo=slo,
                aim=guide_aim,
                **(guide_options or {}),
            )
            if model_tpot_s is not None and self.seed_knobs
            else None
        )
        self._dists = space.distributions()
        base = make_sampler(sampler, seed=seed, n_startup_trials=n_startup_trials)
        self._stager: Stager | None = None
        if self.costs.staged:  # search.stages: the admission limit under a batch cap
            self._stager = Stager(
                space=space,
                slo=slo,
                costs=self.costs,
                rule=self.stop_rule,
                guide=self._guide,
                seeds=self.seed_knobs,
                applied_batch_cap=applied_batch_cap,
                base_sampler=base,
            )
            self._dists, base = self._stager.distributions(), self._stager.sampler
        self.study = optuna.create_study(
            study_name=study_name,
            storage=open_storage(storage),
            direction="maximize",
            sampler=base,
            load_if_exists=True,
        )
        with warnings.catch_warnings():  # experimental in Optuna, stable in use
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study.set_metric_names([METRIC_NAME])  # optuna-dashboard shows "goodput"
        self._pending: optuna.trial.Trial | None = None
        self._fail_interrupted()

    # -- persistence -------------------------------------------------------------------

    def _fail_interrupted(self) -> None:
        """Trials left RUNNING (or enqueued, never run) by a killed controller: FAIL."""
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            trial = self.study.ask(self._dists)  # pops the waiting one
            self.study.tell(trial, state=TrialState.FAIL)
            logger.warning("trial %d was enqueued but never run: marked FAIL", t.number)
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(t.number, state=TrialState.FAIL)
            logger.warning("trial %d was interrupted (RUNNING on resume): marked FAIL", t.number)

    # -- state derived from the stored trials ------------------------------------------

    def _knobs_of(self, t: optuna.trial.FrozenTrial) -> Knobs:
        ua = t.user_attrs
        if "max_batch_size" in ua and "max_concurrency" in ua:
            return Knobs(
                max_batch_size=int(ua["max_batch_size"]),
                max_concurrency=int(ua["max_concurrency"]),
            )
        return self.space.knobs_from_params(t.params)

    def points(self) -> list[PointSummary]:
        """One pooled summary per distinct knob measured (completed trials only)."""
        groups: dict[Knobs, list[optuna.trial.FrozenTrial]] = {}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            groups.setdefault(self._knobs_of(t), []).append(t)
        windows = {
            k: [(t.user_attrs, t.value or 0.0, t.number) for t in ts] for k, ts in groups.items()
        }
        return summarize_all(windows, slo=self.slo)

    def _finished(self) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))

    def _phase_count(self, phase: str) -> int:
        return sum(1 for t in self._finished() if t.user_attrs.get("phase") == phase)

    # -- ask ---------------------------------------------------------------------------

    def _next_fixed(
        self, points: list[PointSummary], stage: StageState | None = None
    ) -> tuple[Knobs, str] | None:
        """:func:`search.proposals.next_fixed`; in a stage (:mod:`search.stages`) only the
        knobs reachable under its cap, guided within it."""
        guide, done_key, ok = self._guide, _GUIDE_DONE, None
        in_stage = self._finished()
        stager = self._stager
        if stage is not None and stager is not None:
            guide = stager.guide_at(stage.cap)
            done_key = f"{_GUIDE_DONE}:{stage.stage}"
            in_stage = [t for t in in_stage if t.user_attrs.get("stage") == stage.stage]

            def ok(k: Knobs) -> bool:
                return stager.reachable(k, stage)

        nxt = next_fixed(
            points,
            rule=self.stop_rule,
            slo=self.slo,
            declare_gain=self.declare_gain,
            guide=guide,
            seeds=self.seed_knobs,
            seeds_done=self._phase_count("seed"),
            guided_done=sum(1 for t in in_stage if t.user_attrs.get("phase") == "guided"),
            guide_over=bool(self.study.user_attrs.get(done_key)),
            reachable=ok,
        )
        if nxt.guide_done:
            self.study.set_user_attr(done_key, True)
        return (nxt.knobs, nxt.phase) if nxt.knobs is not None else None

    def propose(self) -> Knobs:
        """The knobs to measure next (the same ones again until they are reported)."""
        return self.proposal().knobs

    def proposal(self) -> Proposal:
        """:meth:`propose` with what to apply: under a staged search (``costs``) the batch
        cap to hold and whether that changes it (:class:`search.stages.Proposal`)."""
        if self._pending is not None:
            return self._proposal_of(self._pending)
        points = self.points()
        stager, stage, fixed = self._stager, None, None
        if stager is not None:
            stage, first = stager.begin(points, self.study, len(self._finished()))
            fixed = (first, "cap") if first is not None else None
        fixed = fixed or self._next_fixed(points, stage)
        if fixed is not None:
            knobs, phase = fixed
            self.study.enqueue_trial(self._params(knobs), user_attrs={"phase": phase})
        else:
            knobs, phase = None, "sampler"
        if stager is not None and stage is not None:
            stager.ask_ready(stage)
        trial = self.study.ask(self._dists)
        if knobs is None:
            if stager is not None and stage is not None:
                knobs = stager.knobs_of(trial.params, stage)
            else:
                knobs = self.space.knobs_from_params(trial.params)
            trial.set_user_attr("phase", phase)
        trial.set_user_attr("max_batch_size", knobs.max_batch_size)
        trial.set_user_attr("max_concurrency", knobs.max_concurrency)
        if stager is not None and stage is not None:
            stager.mark(trial, stage)
        self._pending = trial
        logger.info("trial %d (%s): %s", trial.number, phase, knobs)
        return self._proposal_of(trial)

    def _params(self, knobs: Knobs) -> dict[str, Any]:
        if self._stager is not None:
            return self._stager.params(knobs)
        return self.space.params_from_knobs(knobs)

    def _proposal_of(self, trial: optuna.trial.Trial) -> Proposal:
        ua, knobs = trial.user_attrs, self._knobs_of_trial(trial)
        if self._stager is not None:
            cap, change = self._stager.batch_cap(ua), bool(ua.get("batch_change", False))
        else:  # live: a change is cheap, but say so all the same
            cap = knobs.max_batch_size
            prev = [
                int(t.user_attrs["max_batch_size"])
                for t in self.study.get_trials(deepcopy=False)
                if t.number < trial.number and "max_batch_size" in t.user_attrs
            ]
            change = not prev or prev[-1] != cap
        return Proposal(
            knobs=knobs,
            batch_cap=cap,
            batch_change=change,
            phase=str(ua.get("phase", "")),
            stage=int(ua.get("stage", 0)),
        )

    def change_summary(self) -> ChangeSummary:
        """How often the batch limit changed and the reported cost of it (for the report)."""
        attrs = [
            t.user_attrs
            for t in self.study.get_trials(deepcopy=False)
            if t.state != TrialState.WAITING
        ]
        return change_summary(attrs, mode=self.costs.batch)

    def _cap_attr(self, ua: dict[str, Any]) -> int | None:
        return self._stager.batch_cap(ua) if self._stager is not None else None

    def _knobs_of_trial(self, trial: optuna.trial.Trial) -> Knobs:
        ua = trial.user_attrs
        return Knobs(
            max_batch_size=int(ua["max_batch_size"]), max_concurrency=int(ua["max_concurrency"])
        )

    # -- tell --------------------------------------------------------------------------

    def report(
        self, knobs: Knobs, observation: Observation, *, change_cost_s: float | None = None
    ) -> TunerTrial:
        """Record one measured window of ``knobs`` (proposed or not); ``change_cost_s``:
        the seconds applying it took beyond a live update (a replica restart), summed by
        :meth:`change_summary` for the report."""
        if change_cost_s is not None and not (math.isfinite(change_cost_s) and change_cost_s >= 0):
            raise ValueError(f"change_cost_s={change_cost_s!r}: must be a number of seconds >= 0")
        if self._pending is not None and self._knobs_of_trial(self._pending) == knobs:
            trial = self._pending
        else:
            if self._pending is not None:
                self.fail_pending("a different knob was reported")
            self.study.enqueue_trial(self._params(knobs), user_attrs={"phase": "external"})
            trial = self.study.ask(self._dists)
            trial.set_user_attr("max_batch_size", knobs.max_batch_size)
            trial.set_user_attr("max_concurrency", knobs.max_concurrency)
            if self._stager is not None:
                self._stager.mark_external(trial, knobs, self.study)
        if change_cost_s is not None:
            trial.set_user_attr("change_cost_s", float(change_cost_s))
        ev = evaluate(observation, self.slo)
        for name, value in zip(CONSTRAINT_NAMES, ev.constraints, strict=True):
            trial.set_constraint(name, value)
        attrs = observation_attrs(observation)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("feasible", ev.feasible)
        trial.set_user_attr("reason", ev.reason)
        self.study.tell(trial, ev.value)
        self._pending = None
        logger.info(
            "trial %d: %s goodput %.3f rps, feasible=%s %s",
            trial.number,
            knobs,
            ev.value,
            ev.feasible,
            ev.reason,
        )
        return TunerTrial(
            number=trial.number,
            knobs=knobs,
            phase=str(trial.user_attrs.get("phase", "")),
            state="complete",
            goodput_rps=ev.value,
            constraints=ev.constraints,
            feasible=ev.feasible,
            reason=ev.reason,
            observation=attrs,
            batch_cap=self._cap_attr(trial.user_attrs),
            change_cost_s=float(change_cost_s or 0.0),
        )

    def fail_pending(self, reason: str) -> None:
        """The proposed trial could not be measured (e.g. the deployment failed): FAIL it."""
        if self._pending is None:
            return
        self._pending.set_user_attr("reason", reason)
        self.study.tell(self._pending, state=TrialState.FAIL)
        logger.warning("trial %d failed: %s", self._pending.number, reason)
        self._pending = None

    # -- results -----------------------------------------------------------------------

    def best(self, *, confirmed: bool = True) -> tuple[Knobs, PointSummary] | None:
        """The incumbent: among the knobs declared (``stop_rule.confirmations`` windows
        whose pooled verdicts are MET, see :meth:`PointSummary.declared`; with
        ``confirmed=False``, one window suffices), the largest batch within
        ``stop_rule.larger_batch_within`` of the best pooled goodput (0: the best itself;
        :func:`search.stop_rule.incumbent`)."""
        need = self.stop_rule.confirmations if confirmed else 1
        within = self.stop_rule.larger_batch_within
        p = incumbent(self.points(), confirmations=need, larger_batch_within=within)
        return (p.knobs, p) if p is not None else None

    def stop_reason(self) -> str | None:
        points, n = self.points(), len(self._finished())
        why = stop_reason(points, n, self.stop_rule)
        if self._stager is not None:  # a stage's first trials; a cap still to move to
            return self._stager.stops(why, points, self.study, n)
        return why

    def should_stop(self) -> bool:
        return self.stop_reason() is not None

    def trials(self) -> list[TunerTrial]:
        """Every trial so far, in order (for reports)."""
        out = []
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.WAITING:
                continue
            ua = t.user_attrs
            cons = t.constraints
            out.append(
                TunerTrial(
                    number=t.number,
                    knobs=self._knobs_of(t),
                    phase=str(ua.get("phase", "")),
                    state=t.state.name.lower(),
                    goodput_rps=float(t.value) if t.value is not None else math.nan,
                    constraints=(
                        tuple(cons[n] for n in CONSTRAINT_NAMES)  # type: ignore[arg-type]
                        if all(n in cons for n in CONSTRAINT_NAMES)
                        else None
                    ),
                    feasible=bool(ua.get("feasible", False)),
                    reason=str(ua.get("reason", "")),
                    observation={k: ua[k] for k in ua if k not in _NOT_OBSERVED},
                    batch_cap=self._cap_attr(ua),
                    change_cost_s=float(ua.get("change_cost_s", 0.0)),
                )
            )
        return out
