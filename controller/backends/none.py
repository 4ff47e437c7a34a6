"""The ``none`` actuator: a server whose configuration slotune cannot change.

A standalone vLLM or SGLang server, say. Nothing is applied: the admission limit is the
load generator's concurrency, the batch limit is a recommendation for whoever restarts the
server. No Ray cluster is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from controller.backends.actuator import ApplyCost, Fleet, KnobEffects

if TYPE_CHECKING:
    from search.space import Knobs


class NoActuator:
    """Applies nothing; every knob is a recommendation."""

    name = "none"

    def current(self) -> Knobs | None:
        return None

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost:
        return ApplyCost(seconds=0.0, restarted=False, changed=False)

    def fleet(self) -> Fleet:
        return ()

    def scaling(self) -> None:
        return None  # no autoscaler

    def effects(self) -> KnobEffects:
        return KnobEffects()

    def describe(self) -> dict[str, Any]:
        return {
            "actuator": self.name,
            "applied": False,
            "note": (
                "knobs are recommendations, not applied: the server's configuration is not "
                "slotune's to change; the admission limit was the load's concurrency"
            ),
        }
