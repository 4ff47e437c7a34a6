"""The roofline-seeded, SLO-constrained Optuna tuner (ask/tell; the controller owns the loop).

Per trial the controller calls :meth:`Tuner.propose` (a :class:`Knobs` to apply), measures
one window, and calls :meth:`Tuner.report` with the Observation; :meth:`Tuner.should_stop`
applies :mod:`search.stop_rule`. Proposals come, in order of priority, from the seed, the
roofline guide (:mod:`search.guide`), re-measurement of the incumbent until it is declared
(:mod:`search.remeasure`, :mod:`search.evidence`), then Optuna's sampler with both latency
constraints (docs/search.md). Every proposal is an Optuna trial, so the sampler learns from
all of them and optuna-dashboard shows the study, its objective named ``goodput``.

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
from search.points import observation_attrs, summarize
from search.remeasure import ceiling, doubtful, open_best
from search.space import Knobs, SearchSpace
from search.stop_rule import PointSummary, StopRule, incumbent, stop_reason

logger = logging.getLogger(__name__)

SAMPLERS = ("gp", "tpe", "random")
PHASES = ("seed", "guided", "remeasure", "sampler", "external")
CONSTRAINT_NAMES = ("ttft_p99_minus_slo_s", "tpot_p99_minus_slo_s")
METRIC_NAME = "goodput"  # the study's one objective (maximised), requests/s within the SLO
_GUIDE_DONE = "slotune_guide_done"


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
    ) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler={sampler!r}: choose one of {SAMPLERS}")
        self.space = space
        self.slo = slo
        self.stop_rule = stop_rule or StopRule()
        self.declare_gain = declare_gain
        self.seed_knobs = [space.clip(k) for k in seed_knobs]
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
        self.study = optuna.create_study(
            study_name=study_name,
            storage=open_storage(storage),
            direction="maximize",
            sampler=make_sampler(sampler, seed=seed, n_startup_trials=n_startup_trials),
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
        return [
            summarize(
                k,
                [t.user_attrs for t in ts],
                values=[t.value or 0.0 for t in ts],
                numbers=[t.number for t in ts],
                slo=self.slo,
            )
            for k, ts in groups.items()
        ]

    def _finished(self) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))

    def _phase_count(self, phase: str) -> int:
        return sum(1 for t in self._finished() if t.user_attrs.get("phase") == phase)

    # -- ask ---------------------------------------------------------------------------

    def _next_fixed(self, points: list[PointSummary]) -> tuple[Knobs, str] | None:
        if self.seed_knobs and self._phase_count("seed") == 0:
            return self.seed_knobs[0], "seed"
        # Re-measure before declaring. The best point that could still be declared (it met
        # the SLO in at least as many windows as not) is measured again at once when little
        # is left above it: its goodput is within `declare_gain` of the throughput measured
        # at the nearest larger batch not proven feasible (a ceiling under a saturating
        # load) or of what the guide's models predict at the largest batch they put within
        # the SLO (`Guide.ceiling`, the lower of the two; only once the point was measured
        # feasible or something is declared), or there is no guidance. Otherwise guidance
        # goes on and the re-measurement waits until it is over.
        rule = self.stop_rule
        declared = incumbent(
            points, confirmations=rule.confirmations, larger_batch_within=rule.larger_batch_within
        )
        best = open_best(points, confirmations=rule.confirmations)
        if best is not None and (declared is None or best.goodput_rps > declared.goodput_rps):
            top = ceiling(points, best)
            if self._guide is not None and (best.feasible or declared is not None):
                model_top = self._guide.ceiling(points, best)
                if math.isfinite(model_top) and not model_top >= top:
                    top = model_top
            if self._guide is None or (
                math.isfinite(top) and best.goodput_rps >= (1 - self.declare_gain) * top
            ):
                return best.knobs, "remeasure"
        if self._guide is not None:
            if not self.study.user_attrs.get(_GUIDE_DONE):
                k = self._guide.propose(points, self.seed_knobs[0], self._phase_count("guided"))
                if k is not None:
                    return k, "guided"
                self.study.set_user_attr(_GUIDE_DONE, True)
        else:
            done = self._phase_count("seed")
            if done < len(self.seed_knobs):
                return self.seed_knobs[done], "seed"
        if best is not None and (declared is None or best.goodput_rps > declared.goodput_rps):
            return best.knobs, "remeasure"
        if self._guide is not None:
            again = doubtful(
                points, declared or best, slo=self.slo, max_measurements=rule.confirmations
            )
            if again is not None:
                return again.knobs, "remeasure"
        return None

    def propose(self) -> Knobs:
        """The knobs to measure next (the same ones again until they are reported)."""
        if self._pending is not None:
            return self._knobs_of_trial(self._pending)
        points = self.points()
        fixed = self._next_fixed(points)
        if fixed is not None:
            knobs, phase = fixed
            self.study.enqueue_trial(
                self.space.params_from_knobs(knobs), user_attrs={"phase": phase}
            )
        else:
            knobs, phase = None, "sampler"
        trial = self.study.ask(self._dists)
        if knobs is None:
            knobs = self.space.knobs_from_params(trial.params)
            trial.set_user_attr("phase", phase)
        trial.set_user_attr("max_batch_size", knobs.max_batch_size)
        trial.set_user_attr("max_concurrency", knobs.max_concurrency)
        self._pending = trial
        logger.info("trial %d (%s): %s", trial.number, phase, knobs)
        return knobs

    def _knobs_of_trial(self, trial: optuna.trial.Trial) -> Knobs:
        ua = trial.user_attrs
        return Knobs(
            max_batch_size=int(ua["max_batch_size"]), max_concurrency=int(ua["max_concurrency"])
        )

    # -- tell --------------------------------------------------------------------------

    def report(self, knobs: Knobs, observation: Observation) -> TunerTrial:
        """Record one measured window of ``knobs`` (proposed or not)."""
        if self._pending is not None and self._knobs_of_trial(self._pending) == knobs:
            trial = self._pending
        else:
            if self._pending is not None:
                self.fail_pending("a different knob was reported")
            self.study.enqueue_trial(
                self.space.params_from_knobs(knobs), user_attrs={"phase": "external"}
            )
            trial = self.study.ask(self._dists)
            trial.set_user_attr("max_batch_size", knobs.max_batch_size)
            trial.set_user_attr("max_concurrency", knobs.max_concurrency)
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
        """The incumbent: the knob with the best pooled goodput among those declared
        (``stop_rule.confirmations`` windows whose pooled verdicts are MET, see
        :meth:`PointSummary.declared`); with ``confirmed=False``, one window suffices.
        ``stop_rule.larger_batch_within`` > 0 prefers the largest batch within that
        fraction of the best goodput (:func:`search.stop_rule.incumbent`)."""
        need = self.stop_rule.confirmations if confirmed else 1
        within = self.stop_rule.larger_batch_within
        p = incumbent(self.points(), confirmations=need, larger_batch_within=within)
        return (p.knobs, p) if p is not None else None

    def stop_reason(self) -> str | None:
        return stop_reason(self.points(), len(self._finished()), self.stop_rule)

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
                    observation={k: ua[k] for k in ua if k not in ("phase", "feasible", "reason")},
                )
            )
        return out
