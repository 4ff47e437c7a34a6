"""The ``embedded`` actuator: slotune's own app on the Ray cluster slotune started.

That cluster runs no dashboard, so there is no REST API: knobs go through the declarative
deploy path in process (serving/app/deploy.py ``update_knobs``, over Ray's private client in
serving/app/ray_private.py). Each replica reports the config version it applied
(serving/app/replicas.py), so the fleet carries real per-replica versions.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from controller.backends.actuator import (
    ActuatorError,
    ActuatorUnavailable,
    ApplyCost,
    Fleet,
    KnobEffects,
)

if TYPE_CHECKING:
    from metrics.observation import Slo
    from search.space import Knobs

log = logging.getLogger(__name__)


class EmbeddedActuator:
    """``serving.app.server:app`` deployed by slotune (``user_config`` and
    ``max_ongoing_requests`` in place, no restart)."""

    name = "embedded"

    def __init__(self, *, app: str, slo: Slo | None = None, apply_timeout_s: float = 60.0) -> None:
        self.app = app
        self.slo = slo
        self.apply_timeout_s = apply_timeout_s

    def current(self) -> Knobs | None:
        from search.space import Knobs
        from serving.app.deploy import replica_states

        try:
            states = replica_states(self.app)
        except Exception as e:  # a read for information only
            log.warning("could not read the current knobs of %r: %s", self.app, e)
            return None
        if not states:
            return None
        s = states[0]
        try:
            return Knobs(max_batch_size=s.max_batch_size, max_concurrency=s.max_ongoing_requests)
        except ValueError:
            return None

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost:
        from serving.app.deploy import update_knobs
        from serving.app.replicas import DeployError

        t0 = time.monotonic()
        try:
            update_knobs(
                max_batch_size=int(knobs.max_batch_size if batch_cap is None else batch_cap),
                max_ongoing_requests=int(knobs.max_concurrency),
                slo=self.slo,
                app_name=self.app,
                timeout_s=self.apply_timeout_s,
            )
        except (DeployError, ValueError) as e:
            raise ActuatorError(f"applying {knobs} to app {self.app!r} failed: {e}") from e
        return ApplyCost(seconds=time.monotonic() - t0)

    def fleet(self) -> Fleet:
        """The app's running replicas as they report themselves (id, pid, config version)."""
        from serving.app.deploy import replica_states

        try:
            states = replica_states(self.app)
        except Exception as e:  # Serve's controller unreachable: no verdict on this window
            raise ActuatorUnavailable(f"could not list the replicas of {self.app!r}: {e}") from e
        return tuple(sorted((s.replica_id, s.pid, s.version) for s in states))

    def scaling(self) -> None:
        return None  # no autoscaler

    def effects(self) -> KnobEffects:
        return KnobEffects(live=frozenset({"max_batch_size", "max_concurrency"}))

    def describe(self) -> dict[str, Any]:
        return {"actuator": self.name, "app": self.app}
