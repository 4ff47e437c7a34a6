"""The :class:`Actuator` protocol: read, apply and verify the knobs of one deployment.

A target (controller/targets.py) drives load and measures windows; an actuator is how its
knob changes reach the server: through Serve's REST API, a Serve LLM app's config, slotune's
own embedded cluster, or not at all (a server slotune cannot configure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from controller.backends.serve_autoscaling import Scaling
    from search.space import Knobs

# The replicas serving a deployment, as (replica id, pid, config version) each: the same
# value at both ends of a window means no replica restarted and none changed version
# during it (controller.targets.fleet_fault).
Fleet = tuple[tuple[str, int, str], ...]

# A version that starts with this marks a replica whose version is not settled: the
# deployment was mid-update when the fleet was read, so a window then is no data.
UNSETTLED = "unsettled:"

KNOB_NAMES = ("max_batch_size", "max_concurrency")  # the fields of search.space.Knobs


@dataclass(frozen=True, kw_only=True)
class ApplyCost:
    """What applying one set of knobs cost: wall seconds until in effect, and whether
    replicas restarted for it (a restart reloads weights: the search should know)."""

    seconds: float = 0.0
    restarted: bool = False
    changed: bool = True  # False: the knobs were already in effect, nothing was sent

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"seconds={self.seconds!r}: must be a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class KnobEffects:
    """Which knobs an actuator changes live and which restart replicas (names of
    :data:`KNOB_NAMES`); a knob in neither is not applied at all (a recommendation)."""

    live: frozenset[str] = frozenset()
    restart: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in (*self.live, *self.restart):
            if name not in KNOB_NAMES:
                raise ValueError(f"knob {name!r}: must be one of {KNOB_NAMES}")
        both = self.live & self.restart
        if both:
            raise ValueError(f"knobs {sorted(both)}: cannot be both live and restarting")


class ActuatorError(RuntimeError):
    """A knob change was refused or failed (permanent: the run stops with this message)."""


class ActuatorUnavailable(RuntimeError):
    """The deployment could not be read now (transient: the loop may retry)."""


class ForeignChange(RuntimeError):
    """The deployment runs a setting slotune derives from its knobs, changed by someone else
    (its knobs alone cannot say so): the loop pauses, and ``--ack`` lets slotune write its
    own again."""


@runtime_checkable
class Actuator(Protocol):
    """How knob changes reach one deployment."""

    name: str  # the --actuator value that selects it

    def current(self) -> Knobs | None:
        """The knobs the deployment runs on now (None: unknown or not configurable);
        ForeignChange when it runs something slotune derives from them, changed by someone
        else."""
        ...

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost:
        """Apply ``knobs``; return once every replica runs them (ActuatorError if refused).

        ``batch_cap`` (a staged search under a restarting batch knob) is the batch limit to
        write instead of ``knobs.max_batch_size``, which is then the batch the trial runs
        at; None writes ``knobs.max_batch_size``."""
        ...

    def fleet(self) -> Fleet:
        """The running replicas now (empty when the actuator cannot see them)."""
        ...

    def scaling(self) -> Scaling | None:
        """The deployment's autoscaler now, when one moves its replica count (else None)."""
        ...

    def effects(self) -> KnobEffects:
        """Which knob changes are live and which restart replicas."""
        ...

    def describe(self) -> dict[str, Any]:
        """What this actuator is and what it changes, for the report."""
        ...
