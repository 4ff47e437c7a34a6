"""Serve's autoscaler as slotune sees it: the admission limit per unit of
``target_ongoing_requests`` the operator set (kept when the limit moves), and the replica
count Serve's default policy settles at (so a change's effect on the fleet is predicted
before it is made). Pure: dicts and numbers in, no I/O. The ``serve`` actuator
(controller/backends/serve.py) writes and reads these fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Ray's guide asks for max_ongoing_requests "~20 to 50% higher than target_ongoing_requests"
# (ray-project/ray doc/source/serve/advanced-guides/advanced-autoscaling.md,
# "max_ongoing_requests"); below the target Serve 2.60 logs "Autoscaling will never happen"
# (ray/serve/_private/application_state.py override_deployment_info). The target is a
# PositiveFloat (ray/serve/config.py AutoscalingConfig), default 2
# (ray/serve/_private/constants.py DEFAULT_TARGET_ONGOING_REQUESTS).
MIN_LIMIT_PER_TARGET = 1.2
MIN_TARGET = 1.0
SERVE_DEFAULT_TARGET = 2.0
# AutoscalingPolicy.policy_function when none is set (ray/serve/_private/constants.py).
SERVE_DEFAULT_POLICY = "ray.serve.autoscaling_policy:default_autoscaling_policy"


def limit_per_target(max_ongoing_requests: float, target_ongoing_requests: float) -> float:
    """The admission limit per unit of autoscaler target the operator configured, raised
    to :data:`MIN_LIMIT_PER_TARGET` (a limit at or under the target starves scaling)."""
    if not (target_ongoing_requests > 0 and max_ongoing_requests > 0):
        raise ValueError(
            f"max_ongoing_requests={max_ongoing_requests!r}, target_ongoing_requests="
            f"{target_ongoing_requests!r}: both must be > 0"
        )
    return max(MIN_LIMIT_PER_TARGET, max_ongoing_requests / target_ongoing_requests)


def target_for(limit: int, *, ratio: float) -> float:
    """The ``target_ongoing_requests`` that goes with admission limit ``limit`` at
    ``ratio`` (:func:`limit_per_target`): ``limit / ratio`` rounded down to 0.001, so it
    never exceeds ``limit / 1.2``; but at least :data:`MIN_TARGET` (which wins only at
    ``limit`` 1, where the target then equals the limit)."""
    if ratio < MIN_LIMIT_PER_TARGET:
        raise ValueError(f"ratio={ratio!r}: must be >= {MIN_LIMIT_PER_TARGET}")
    exact = round(limit / ratio, 9)  # drop float noise: 32 / (32 / 24) is 24, not 24.000...04
    return max(MIN_TARGET, math.floor(exact * 1000) / 1000)


def _check_autoscaler(target: float, min_replicas: int, max_replicas: int, current: int) -> None:
    """ValueError naming the bad value, as Serve's AutoscalingConfig would refuse it."""
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"target_ongoing_requests={target!r}: must be a finite number > 0")
    if not (0 <= min_replicas <= max_replicas and max_replicas >= 1):
        raise ValueError(
            f"min_replicas={min_replicas!r}, max_replicas={max_replicas!r}: "
            "need 0 <= min_replicas <= max_replicas and max_replicas >= 1"
        )
    if current < 0:
        raise ValueError(f"current replicas={current!r}: must be >= 0")


def predicted_replicas(
    *, ongoing_total: float, target: float, min_replicas: int, max_replicas: int, current: int
) -> int:
    """The replica count Serve 2.60's default policy settles at while ``ongoing_total``
    requests (running at replicas plus queued in Serve's routers) stay in flight.

    Ray's rule (ray/serve/autoscaling_policy.py): ``_core_replica_queue_length_policy``
    wants ``current * total / (target * current)`` replicas (``total / target``);
    ``_apply_scaling_factors`` moves ``current`` by ``upscaling_factor`` or
    ``downscaling_factor`` times the difference, rounded up, and at least one down when
    the desired count is lower; ``_apply_delay_logic`` adopts a decision only once it has
    held for ``upscale_delay_s`` / ``downscale_delay_s`` (stepping down through 1 before
    0); the float is rounded up and clipped to ``[min_replicas, max_replicas]``
    (ray/serve/_private/autoscaling_state.py ``get_decision_num_replicas``,
    ``apply_bounds``). From 0 replicas with traffic, ``_get_cold_start_scale_up_replicas``
    starts some at once and the rule above takes over.

    Simplified: this is the fixed point, ``ceil(total / target)`` clipped to the bounds,
    computed with Ray's own arithmetic; the delays (how soon), the factors (how many
    steps; with a factor above 1 Serve may overshoot and swing), ``target_capacity``
    (scales the bounds during a rollout) and ``look_back_period_s`` averaging (the
    ``ongoing_total`` given is taken as the window's) are left out. ``total`` is held
    fixed: more replicas serve faster, which lowers it in practice.
    """
    if not (math.isfinite(ongoing_total) and ongoing_total >= 0):
        raise ValueError(f"ongoing_total={ongoing_total!r}: must be a finite number >= 0")
    _check_autoscaler(target, min_replicas, max_replicas, current)
    if current > 0:  # the policy's own arithmetic, so a float edge rounds as Serve's does
        desired = current * (ongoing_total / (target * current))
    else:
        desired = ongoing_total / target
    return max(min_replicas, min(max_replicas, math.ceil(desired)))


@dataclass(frozen=True, kw_only=True)
class Scaling:
    """A deployment's autoscaler as Serve runs it now: its target and bounds, the replica
    count it aims at (``target_num_replicas``), whether slotune moves the target with the
    admission limit (:meth:`ServeActuator.plan`), and whether the policy is Serve's
    default (else :meth:`predict` does not describe it)."""

    target_ongoing_requests: float
    min_replicas: int
    max_replicas: int
    current_replicas: int
    follows_admission: bool = True
    default_policy: bool = True

    def __post_init__(self) -> None:
        _check_autoscaler(
            self.target_ongoing_requests,
            self.min_replicas,
            self.max_replicas,
            self.current_replicas,
        )

    def predict(self, ongoing_total: float) -> int:
        """:func:`predicted_replicas` for this deployment."""
        return predicted_replicas(
            ongoing_total=ongoing_total,
            target=self.target_ongoing_requests,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            current=self.current_replicas,
        )


def shrinks_fleet(
    sc: Scaling | None,
    *,
    running: float,
    waiting: float,
    limit_from: int,
    limit_to: int,
    what: str,
) -> str:
    """Why raising the admission limit from ``limit_from`` to ``limit_to`` (``what``, as
    the reason names the new knobs) would fight Serve's
    autoscaler (empty when it would not): its target moves with the limit, so a higher
    limit is a higher scaling point, and where the requests in flight would then fit on
    fewer replicas, it removes some and the rest absorb their load (Dynamo's planner
    swung 2 <-> 1 that way). Predicted with Serve's default policy, from the window's
    running (per replica) and waiting requests."""
    if sc is None or not (sc.follows_admission and sc.default_policy):
        return ""
    if not (math.isfinite(running) and sc.current_replicas > 0):
        return ""
    total = running * sc.current_replicas + (waiting if math.isfinite(waiting) else 0.0)
    target = sc.target_ongoing_requests * limit_to / limit_from

    def settles(t: float) -> int:
        return predicted_replicas(
            ongoing_total=total,
            target=t,
            min_replicas=sc.min_replicas,
            max_replicas=sc.max_replicas,
            current=sc.current_replicas,
        )

    after = settles(target)
    if after >= min(sc.current_replicas, settles(sc.target_ongoing_requests)):
        return ""  # the loosening itself removes none
    return (
        f"at {what} Serve's autoscaler would settle at {after} of {sc.current_replicas} "
        f"replicas for the {total:.0f} requests in flight (target {target:.1f} a replica)"
    )


def declared_autoscaling(app_cfg: dict[str, Any], deployment: str) -> dict[str, Any] | None:
    """The ``autoscaling_config`` mapping the app config's entry for ``deployment`` holds.

    Only there can its target change live: the app's code version hashes the ``policy`` of
    every entry's ``autoscaling_config`` mapping, None for one without (ray/serve/_private/
    deploy_utils.py ``get_app_code_version``), so adding a mapping to an entry (or
    dropping one) is a new code version, which rebuilds the app and restarts its replicas
    (knob_path.classify)."""
    entry = next((d for d in app_cfg.get("deployments") or [] if d.get("name") == deployment), {})
    auto = entry.get("autoscaling_config")
    return auto if isinstance(auto, dict) else None


def effective_autoscaling(dep: dict[str, Any]) -> dict[str, Any] | None:
    """The autoscaling config a deployment runs, from Serve's details: its
    ``deployment_config`` carries the whole ``autoscaling_config`` when autoscaling is on
    (and then no ``num_replicas``), ``num_replicas: auto`` included, which Serve expands to
    ``AutoscalingConfig.default()`` (min 1, max 100, target 2) under the declared keys
    (ray/serve/schema.py ``_deployment_info_to_schema``;
    ray/serve/_private/application_state.py ``override_deployment_info``)."""
    auto = (dep.get("deployment_config") or {}).get("autoscaling_config")
    return auto if isinstance(auto, dict) else None
