"""A sampler that searches one integer parameter inside the current stage's range.

The staged search (:mod:`search.stages`) keeps one distribution for the admission limit
over the whole study, so every trial shares it and a GP or TPE sampler learns from all of
them; within a stage only part of that range is reachable (the batch cap bounds it).
:class:`StageSampler` wraps any Optuna sampler and hands it the parameter's distribution
narrowed to the stage's bounds, for relative and independent sampling alike; trials
outside the bounds still inform the model. It uses only ``optuna.samplers.BaseSampler``'s
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
        if self._param in space:
            d = self._narrowed(space[self._param])
            if d.single():  # nothing to search: the independent path returns it
                del space[self._param]
            else:
                space[self._param] = d
        return space

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return self._base.sample_relative(study, trial, search_space)

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
