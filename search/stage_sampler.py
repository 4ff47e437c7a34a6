"""A sampler that searches one integer parameter inside the current stage's range.

The staged search (:mod:`search.stages`) keeps one distribution for the admission limit
over the whole study, so every trial shares it and a GP or TPE sampler learns from all of
them; within a stage only part of that range is reachable (the batch cap bounds it).
:class:`StageSampler` wraps any Optuna sampler and hands it the parameter's distribution
narrowed to the stage's bounds, for relative and independent sampling alike; trials
outside the bounds still inform the model. Where a completed trial lies outside the bounds
(or they hold one value) the relative sampler gets the whole distribution, and a value it
picks outside the bounds is replaced by an independent one within them (the other
parameters stay relative). Optuna 5.1's GPSampler needs both: it warm-starts its
acquisition search at the best trial's parameters and fails an assertion
(optuna/_gp/optim_mixed.py, ``_discrete_line_search``) when they lie outside the
distribution it was given, and its constraint models, cached from the previous trial, fail
when the relative space loses a dimension (optuna/_gp/gp.py, ``fit_kernel_params``).
It uses only ``optuna.samplers.BaseSampler``'s
public interface (optuna/samplers/_base.py, Optuna 5.1), the way Optuna's own
``PartialFixedSampler`` (optuna/samplers/_partial_fixed.py) wraps a base sampler to fix
parameters: fixing is not enough here, the parameter is searched, within bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState


class StageSampler(optuna.samplers.BaseSampler):
    """Delegates to ``base``, with ``param`` (an integer parameter) narrowed to the bounds
    last given to :meth:`narrow` (none: its own distribution)."""

    def __init__(self, base: optuna.samplers.BaseSampler, param: str) -> None:
        self._base = base
        self._param = param
        self._bounds: tuple[int, int] | None = None

    def narrow(self, low: int, high: int) -> None:
        if not 1 <= low <= high:
            raise ValueError(f"bounds=({low!r}, {high!r}): need 1 <= low <= high")
        self._bounds = (low, high)

    def _narrowed(self, dist: BaseDistribution) -> BaseDistribution:
        if self._bounds is None or not isinstance(dist, IntDistribution):
            return dist
        lo = min(max(self._bounds[0], dist.low), dist.high)
        hi = max(min(self._bounds[1], dist.high), lo)
        return IntDistribution(lo, hi, log=dist.log, step=dist.step)

    def reseed_rng(self) -> None:
        self._base.reseed_rng()

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        space = dict(self._base.infer_relative_search_space(study, trial))
        if self._bounds is not None and self._param in space:
            d = self._narrowed(space[self._param])
            # The space keeps its dimensions (GPSampler's constraint models, cached between
            # trials, fail when one goes); narrowed only where nothing measured lies outside
            # (else sample_relative moves the value into the bounds).
            if isinstance(d, IntDistribution) and not d.single() and not self._outside(study, d):
                space[self._param] = d
        return space

    def _outside(self, study: optuna.Study, d: IntDistribution) -> bool:
        """Whether a completed trial's value of the parameter lies outside ``d``."""
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            v = t.params.get(self._param)
            if v is not None and not d.low <= v <= d.high:
                return True
        return False

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        params = dict(self._base.sample_relative(study, trial, search_space))
        if self._bounds is not None and self._param in params:
            d = self._narrowed(search_space[self._param])
            if isinstance(d, IntDistribution) and not d.low <= params[self._param] <= d.high:
                params[self._param] = self.sample_independent(study, trial, self._param, d)
        return params

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        if param_name == self._param:
            param_distribution = self._narrowed(param_distribution)
            if param_distribution.single():
                return param_distribution.to_external_repr(param_distribution.low)  # type: ignore[attr-defined]
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._base.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._base.after_trial(study, trial, state, values)
