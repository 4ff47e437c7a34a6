"""The staged search's bookkeeping in an Optuna study (for ``Tuner`` under ``KnobCosts``).

:mod:`search.stages` decides (pure); :class:`Stager` keeps the decisions in the study so a
resumed search knows them: every trial of a staged search stores its ``stage``, the
``batch_cap`` it ran under and whether that was a ``batch_change``. The sampler searches one
parameter, the admission limit (``search.space.PARAM_CONCURRENCY``), over one distribution
for the whole study, narrowed to the current stage's range by
:class:`search.stage_sampler.StageSampler`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import optuna
from optuna.distributions import IntDistribution
from optuna.trial import TrialState

from metrics.observation import Slo
from search.guide import Guide
from search.space import PARAM_CONCURRENCY, Knobs, SearchSpace
from search.stage_sampler import StageSampler
from search.stages import (
    KnobCosts,
    StageState,
    concurrency_bounds,
    concurrency_max,
    first_cap,
    next_cap,
    reachable,
    realize,
    stage_state,
)
from search.stop_rule import PointSummary, StopRule, stop_reason

logger = logging.getLogger(__name__)


class Stager:
    """Which cap a staged search holds, when it moves, and what each trial stores."""

    def __init__(
        self,
        *,
        space: SearchSpace,
        slo: Slo,
        costs: KnobCosts,
        rule: StopRule,
        guide: Guide | None,
        seeds: Sequence[Knobs],
        applied_batch_cap: int | None,
        base_sampler: optuna.samplers.BaseSampler,
    ) -> None:
        if not costs.staged:
            raise ValueError(f"batch={costs.batch!r}: a Stager is for 'restart' or 'fixed'")
        self.space, self.slo, self.costs, self.rule = space, slo, costs, rule
        self.guide = guide
        self.first = first_cap(space, seeds, costs)
        self.applied_batch_cap = applied_batch_cap
        self.sampler = StageSampler(base_sampler, PARAM_CONCURRENCY)
        hi = concurrency_max(space, costs)
        self._dist = IntDistribution(space.batch_min, hi, log=True)

    def distributions(self) -> dict[str, Any]:
        return {PARAM_CONCURRENCY: self._dist}

    def params(self, knobs: Knobs) -> dict[str, Any]:
        c = min(max(knobs.max_concurrency, self._dist.low), self._dist.high)
        return {PARAM_CONCURRENCY: c}

    def state(self, study: optuna.Study) -> StageState:
        trials = [
            (t.user_attrs, t.state in (TrialState.COMPLETE, TrialState.FAIL))
            for t in study.get_trials(deepcopy=False)
            if t.state != TrialState.WAITING
        ]
        return stage_state(trials, first=self.first)

    def guide_at(self, cap: int) -> Guide | None:
        """The roofline guide within a stage: batches up to the cap, on the batch line."""
        if self.guide is None:
            return None
        box = replace(self.space, batch_max=cap, headroom_max=1.0, concurrency_max=None)
        return replace(self.guide, space=box)

    def move(
        self, points: Sequence[PointSummary], st: StageState, n_finished: int
    ) -> tuple[int, str] | None:
        """The next cap once the current stage is over: it ran ``min_stage_trials`` and
        either ``stage_trials`` or until the stop rule holds; at most ``max_batch_changes``
        moves. None: stay."""
        c = self.costs
        if c.batch != "restart" or st.stage >= c.max_batch_changes:
            return None
        if n_finished >= self.rule.max_trials or st.in_stage < c.min_stage_trials:
            return None
        if st.in_stage < c.stage_trials and stop_reason(points, n_finished, self.rule) is None:
            return None
        return next_cap(
            points,
            cap=st.cap,
            visited=st.visited,
            space=self.space,
            slo=self.slo,
            costs=c,
            rule=self.rule,
            guide=self.guide,
        )

    def begin(
        self, points: Sequence[PointSummary], study: optuna.Study, n_finished: int
    ) -> tuple[StageState, Knobs | None]:
        """The stage the next trial runs in, and its first knob when it opens a new one
        (the new cap itself, at headroom 1)."""
        st = self.state(study)
        move = self.move(points, st, n_finished)
        if move is not None:
            visited = (*st.visited, move[0]) if move[0] not in st.visited else st.visited
            st = replace(st, stage=st.stage + 1, cap=move[0], in_stage=0, visited=visited)
            logger.info("stage %d: %s", st.stage, move[1])
            return st, Knobs(max_batch_size=move[0], max_concurrency=move[0])
        return st, None

    def ask_ready(self, st: StageState) -> None:
        """Narrow the sampler to the stage's admission range before ``study.ask``."""
        bounds = concurrency_bounds(self.space, st.cap, self.costs, settled=st.settled)
        self.sampler.narrow(*bounds)

    def knobs_of(self, params: dict[str, Any], st: StageState) -> Knobs:
        return realize(int(params[PARAM_CONCURRENCY]), st.cap)

    def mark(self, trial: optuna.trial.Trial, st: StageState, cap: int | None = None) -> None:
        """Store the trial's stage, cap and whether it changes the cap."""
        cap = st.cap if cap is None else cap
        before = st.last_cap if st.last_cap is not None else self.applied_batch_cap
        trial.set_user_attr("stage", st.stage)
        trial.set_user_attr("batch_cap", cap)
        trial.set_user_attr("batch_change", self.costs.batch == "restart" and cap != before)

    def mark_external(self, trial: optuna.trial.Trial, knobs: Knobs, study: optuna.Study) -> None:
        """A reported knob nobody proposed: under the current cap if it reaches it, else
        under a cap at its batch (the loop changed it)."""
        st = self.state(study)
        self.mark(trial, st, st.cap if reachable(knobs, st.cap) else knobs.max_batch_size)

    def reachable(self, knobs: Knobs, st: StageState) -> bool:
        return reachable(knobs, st.cap)

    def stops(
        self, why: str | None, points: Sequence[PointSummary], study: optuna.Study, n: int
    ) -> str | None:
        """The stop rule's ``why``, held back while a stage runs its first trials or a
        converged stage still has a cap to move to."""
        if why is None or n >= self.rule.max_trials:
            return why
        st = self.state(study)
        if st.in_stage < self.costs.min_stage_trials or self.move(points, st, n) is not None:
            return None
        return why

    def batch_cap(self, user_attrs: dict[str, Any]) -> int | None:
        """The engine batch limit a trial ran under (None: not applied, ``fixed``)."""
        if self.costs.batch != "restart" or "batch_cap" not in user_attrs:
            return None
        return int(user_attrs["batch_cap"])
