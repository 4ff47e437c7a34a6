"""Pick an actuator by its ``--actuator`` name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.backends.actuator import Actuator

if TYPE_CHECKING:
    from metrics.observation import Slo

APPLY_TIMEOUT_S = 120.0  # how long an apply may wait for every replica to run the new knobs
ACTUATORS = ("serve", "serve-llm", "kuberay", "none", "embedded")


def make_actuator(
    name: str,
    *,
    app: str | None,
    deployment: str | None = None,
    batch_knob: str | None = None,
    dashboard_url: str | None = None,
    slo: Slo | None = None,
    apply_timeout_s: float = APPLY_TIMEOUT_S,
    rayservice: str | None = None,
    namespace: str | None = None,
) -> Actuator:
    """The actuator ``name`` for ``app`` (ValueError naming the choices if unknown)."""
    if name not in ACTUATORS:
        raise ValueError(f"actuator {name!r}: must be one of {ACTUATORS}")
    if name == "none":
        from controller.backends.none import NoActuator

        return NoActuator()
    if app is None:
        raise ValueError(f"actuator {name!r} needs an app name")
    if name == "embedded":
        from controller.backends.embedded import EmbeddedActuator

        return EmbeddedActuator(app=app, slo=slo, apply_timeout_s=apply_timeout_s)
    if name == "kuberay":
        if rayservice is None:
            raise ValueError("actuator 'kuberay' needs the RayService's name (--rayservice)")
        from controller.backends.kuberay import KubeRayActuator

        return KubeRayActuator(
            app=app,
            rayservice=rayservice,
            namespace=namespace,
            deployment=deployment,
            batch_knob=batch_knob,
            dashboard_url=dashboard_url,
            apply_timeout_s=apply_timeout_s,
        )
    if name == "serve-llm":
        from controller.backends.serve_llm import ServeLLMActuator

        return ServeLLMActuator(
            app=app,
            deployment=deployment,
            batch_knob=batch_knob,
            dashboard_url=dashboard_url,
            apply_timeout_s=apply_timeout_s,
        )
    from controller.backends.serve import ServeActuator

    return ServeActuator(
        app=app,
        deployment=deployment,
        batch_knob=batch_knob,
        dashboard_url=dashboard_url,
        apply_timeout_s=apply_timeout_s,
    )
