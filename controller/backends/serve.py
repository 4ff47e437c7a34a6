"""The ``serve`` actuator: any Ray Serve deployment, through Serve's public REST API only.

It changes exactly two fields of the app's declarative config: the deployment's
``max_ongoing_requests`` (the admission limit) and one key path for the batch limit
(``--batch-knob``, default ``user_config.max_batch_size``: the deployment's
``reconfigure`` receives it), writes the whole declarative set back, and waits until every
replica runs the new config (controller/backends/serve_rest.py says how that is known).
A change that would restart replicas (controller/backends/knob_path.py) is refused with
nothing sent.

With Serve's autoscaler on, the admission limit and the autoscaler's
``target_ongoing_requests`` move together (:func:`target_for`); :func:`predicted_replicas`
and :meth:`ServeActuator.scaling` tell what replica count Serve's default policy settles at
(docs/controller.md, "With Serve's autoscaler").
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from controller.backends.actuator import (
    ActuatorError,
    ActuatorUnavailable,
    ApplyCost,
    Fleet,
    KnobEffects,
)
from controller.backends.knob_path import KnobPath, get_path, restarting_changes, set_path
from controller.backends.serve_rest import (
    ServeRest,
    dashboard_url_of_cluster,
    declarative_apps,
    deployment_details,
    fleet_of,
)
from serving.app.cluster import read_token

if TYPE_CHECKING:
    from search.space import Knobs

log = logging.getLogger(__name__)

DEFAULT_BATCH_KNOB = "user_config.max_batch_size"


def pick_deployment(
    details: dict[str, Any],
    app: str,
    deployment: str | None,
    *,
    prefix: str = "",
    role: str = "one",
) -> str:
    """``deployment`` if the app has it, else the app's only deployment whose name starts
    with ``prefix`` (ActuatorError listing them when there are several or none, asking to
    name ``role`` with --deployment)."""
    apps = details.get("applications") or {}
    if app not in apps:
        raise ActuatorError(f"--app {app}: no such application (running: {sorted(apps) or 'none'})")
    names = sorted(apps[app].get("deployments") or {})
    if deployment is not None:
        if deployment not in names:
            raise ActuatorError(f"--deployment {deployment}: not in app {app!r} (it has {names})")
        return deployment
    matching = [n for n in names if n.startswith(prefix)]
    if len(matching) != 1:
        raise ActuatorError(f"app {app!r} has deployments {names}: name {role} with --deployment")
    return matching[0]


# The user_config key slotune's own app reads its admission limit from
# (serving.app.config.LiveConfig.max_ongoing_requests); kept equal to the deployment's.
ADMISSION_KEY = "max_ongoing_requests"

# -- Serve's autoscaler -----------------------------------------------------------------

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


def with_knobs(
    app_cfg: dict[str, Any],
    *,
    deployment: str,
    batch_path: KnobPath,
    batch: int,
    max_ongoing_requests: int,
    effective_user_config: Any = None,
    target_ongoing_requests: float | None = None,
) -> dict[str, Any]:
    """A copy of one app's declarative config with the batch value at ``batch_path`` and
    the deployment's ``max_ongoing_requests`` set (and, where the deployment's
    ``user_config`` has a ``max_ongoing_requests`` key, as slotune's own app does, that key
    too; and ``autoscaling_config.target_ongoing_requests`` when given, which needs the
    entry to declare an ``autoscaling_config``: :func:`declared_autoscaling`); nothing
    else changes.

    The deployment's override entry is added if the config has none. A ``user_config``
    override replaces the code's whole ``user_config``, so when the entry has none it
    starts from ``effective_user_config`` (what the replicas run now) before the key is set.
    """
    new = copy.deepcopy(app_cfg)
    deps = new.setdefault("deployments", [])
    entry = next((d for d in deps if d.get("name") == deployment), None)
    if entry is None:
        entry = {"name": deployment}
        deps.append(entry)
    entry["max_ongoing_requests"] = max_ongoing_requests
    if target_ongoing_requests is not None:
        auto = entry.get("autoscaling_config")
        if not isinstance(auto, dict):
            raise ActuatorError(
                f"deployment {deployment!r} declares no autoscaling_config in the app config: "
                "its target_ongoing_requests cannot be changed without a restart"
            )
        auto["target_ongoing_requests"] = target_ongoing_requests
    parts = batch_path.parts
    if batch_path.scope == "app":
        return set_path(new, parts, batch)
    if parts[0] == "user_config" and entry.get("user_config") is None:
        entry["user_config"] = copy.deepcopy(effective_user_config) if len(parts) > 1 else None
    i = deps.index(entry)
    deps[i] = set_path(entry, parts, batch)
    user_config = deps[i].get("user_config")
    if isinstance(user_config, dict) and ADMISSION_KEY in user_config:
        # slotune's own app admits in the replica, up to this user_config key: it follows
        # the deployment's limit, or the replica would keep refusing above the old one.
        deps[i] = set_path(deps[i], ("user_config", ADMISSION_KEY), max_ongoing_requests)
    return new


def replace_app(apps: list[dict[str, Any]], new_app: dict[str, Any]) -> list[dict[str, Any]]:
    """The declarative set with the app of ``new_app``'s name replaced; every other app is
    sent back as it was (a PUT deletes apps it does not list)."""
    names = [a.get("name") for a in apps]
    if new_app.get("name") not in names:
        raise ActuatorError(f"app {new_app.get('name')!r} is not in the declarative set {names}")
    return [new_app if a.get("name") == new_app.get("name") else a for a in apps]


class ServeActuator:
    """Knobs of one deployment of a Serve app, changed live through the dashboard's REST API."""

    name = "serve"

    def __init__(
        self,
        *,
        app: str,
        deployment: str | None = None,
        batch_knob: str | None = None,
        dashboard_url: str | None = None,
        rest: ServeRest | None = None,
        apply_timeout_s: float = 120.0,
    ) -> None:
        self.app = app
        self.batch_path = KnobPath.parse(batch_knob or self.default_batch_knob())
        self.rest = rest or ServeRest(
            dashboard_url or dashboard_url_of_cluster(), token=read_token()
        )
        self.apply_timeout_s = apply_timeout_s
        self.deployment = pick_deployment(self.rest.details(), app, deployment)
        # The admission limit per unit of autoscaler target, read once from the deployment
        # as first seen with autoscaling on (limit_per_target): every later target is
        # limit / this, so the operator's ratio does not drift with rounding or the floor.
        self._limit_per_target: float | None = None
        self._warned_limit: int | None = None

    def default_batch_knob(self) -> str:
        return DEFAULT_BATCH_KNOB

    # -- reading ------------------------------------------------------------------

    def _app_config(self, details: dict[str, Any]) -> dict[str, Any]:
        cfg = (details.get("applications") or {}).get(self.app, {}).get("deployed_app_config")
        if cfg is None:
            raise ActuatorError(
                f"app {self.app!r} was not deployed from a config (serve deploy, KubeRay, "
                "PUT /api/serve/applications/): Serve's REST API cannot change it"
            )
        return cfg

    def _batch_now(self, details: dict[str, Any]) -> Any:
        if self.batch_path.scope == "app":
            return get_path(self._app_config(details), self.batch_path.parts, None)
        dep = deployment_details(details, self.app, self.deployment)
        return get_path(dep.get("deployment_config") or {}, self.batch_path.parts, None)

    def current(self) -> Knobs | None:
        from search.space import Knobs

        try:
            details = self.rest.details()
            dep = deployment_details(details, self.app, self.deployment)
            batch = self._batch_now(details)
            ongoing = (dep.get("deployment_config") or {}).get("max_ongoing_requests")
            return Knobs(max_batch_size=batch, max_concurrency=ongoing)
        except (ActuatorError, ValueError, TypeError) as e:  # informational
            log.warning("could not read the knobs of %s/%s: %s", self.app, self.deployment, e)
            return None

    def scaling(self) -> Scaling | None:
        """Serve's autoscaler for this deployment as it runs now; None without autoscaling."""
        details = self.rest.details()
        dep = deployment_details(details, self.app, self.deployment)
        auto = effective_autoscaling(dep)
        if auto is None:
            return None
        app_cfg = (details.get("applications") or {}).get(self.app, {}).get("deployed_app_config")
        policy = (auto.get("policy") or {}).get("policy_function", SERVE_DEFAULT_POLICY)
        return Scaling(
            target_ongoing_requests=float(
                auto.get("target_ongoing_requests") or SERVE_DEFAULT_TARGET
            ),
            min_replicas=int(auto.get("min_replicas", 1)),
            max_replicas=int(auto.get("max_replicas", 1)),
            current_replicas=int(dep.get("target_num_replicas") or 0),
            follows_admission=bool(app_cfg)
            and declared_autoscaling(app_cfg, self.deployment) is not None,
            # an application-level autoscaling_policy replaces the deployments' own
            default_policy=policy == SERVE_DEFAULT_POLICY
            and not (app_cfg or {}).get("autoscaling_policy"),
        )

    def fleet(self) -> Fleet:
        dep = deployment_details(self.rest.details(), self.app, self.deployment)
        running = [str(r.get("actor_id")) for r in dep.get("replicas") or []]
        return fleet_of(dep, dead=self.rest.dead_actors(running))

    # -- changing -----------------------------------------------------------------

    def allowed_restarts(self, batch_changes: bool) -> frozenset[str]:
        """Config paths whose change may restart replicas (none: refuse any restart)."""
        return frozenset()

    def plan(
        self, old: dict[str, Any], details: dict[str, Any], knobs: Knobs, batch: int
    ) -> tuple[dict[str, Any], bool]:
        """(``old``, the app's declared config, with ``batch`` and the knobs' admission limit,
        and with Serve's autoscaler on, the target that keeps the operator's limit per
        target (:meth:`_target_with`); whether that restarts replicas); ActuatorError,
        before anything is sent, when it would restart them where that is not allowed."""
        dep = deployment_details(details, self.app, self.deployment)
        limit = int(knobs.max_concurrency)
        new = with_knobs(
            old,
            deployment=self.deployment,
            batch_path=self.batch_path,
            batch=batch,
            max_ongoing_requests=limit,
            effective_user_config=(dep.get("deployment_config") or {}).get("user_config"),
            target_ongoing_requests=self._target_with(old, dep, limit),
        )
        batch_changes = self._batch_now(details) != batch
        allowed = self.allowed_restarts(batch_changes)
        bad = restarting_changes(old, new, allowed=allowed)
        if bad:
            what = ", ".join(f"{p} ({e})" for p, e in bad)
            raise ActuatorError(
                f"refusing to change app {self.app!r}: {what} would restart replicas or is not "
                f"known to be live; nothing was changed (--batch-knob {self.batch_path})"
            )
        restarts = any(e != "live" for _, e in restarting_changes(old, new))
        return new, restarts

    def _target_with(
        self, app_cfg: dict[str, Any], dep: dict[str, Any], limit: int
    ) -> float | None:
        """The autoscaler target to write with admission limit ``limit`` (None: none to
        write: no autoscaling, or one the app config does not declare)."""
        auto = effective_autoscaling(dep)
        if auto is None:
            return None
        target = float(auto.get("target_ongoing_requests") or SERVE_DEFAULT_TARGET)
        if self._limit_per_target is None:
            ongoing = (dep.get("deployment_config") or {}).get("max_ongoing_requests") or limit
            self._limit_per_target = limit_per_target(float(ongoing), target)
        if declared_autoscaling(app_cfg, self.deployment) is None:
            # Autoscaling from the code (or num_replicas: auto without a mapping): moving
            # its target would restart replicas (declared_autoscaling). The limit moves
            # alone, as without autoscaling; say so once, and for each limit that leaves
            # the target without the headroom Ray asks for.
            if self._warned_limit is None or (
                limit != self._warned_limit and limit < MIN_LIMIT_PER_TARGET * target
            ):
                log.warning(
                    "%s/%s autoscales but its app config declares no autoscaling_config: "
                    "target_ongoing_requests stays %.3g while max_ongoing_requests goes to %d "
                    "(Ray asks for a limit 20-50%% above the target); declare "
                    "autoscaling_config in the deployment's entry to have slotune move both",
                    self.app,
                    self.deployment,
                    target,
                    limit,
                )
                self._warned_limit = limit
            return None
        return target_for(limit, ratio=self._limit_per_target)

    def write(
        self, details: dict[str, Any], rebuild: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> None:
        """Declare ``rebuild(the app's declared config)`` as the app's config: here the
        whole declarative set, through Serve's REST API (a subclass writes where its
        platform declares it, re-reading and rebuilding when the write races another)."""
        new = rebuild(self._app_config(details))
        self.rest.put(details, replace_app(declarative_apps(details), new))

    def _in_effect(
        self, knobs: Knobs, batch: int, dep: dict[str, Any], target: float | None = None
    ) -> bool:
        cfg = dep.get("deployment_config") or {}
        if cfg.get("max_ongoing_requests") != int(knobs.max_concurrency):
            return False
        if target is not None:
            now = (effective_autoscaling(dep) or {}).get("target_ongoing_requests")
            if now is None or not math.isclose(float(now), target):
                return False
        if self.batch_path.scope == "app":
            return True
        return get_path(cfg, self.batch_path.parts, None) == batch

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost:
        t0 = time.monotonic()
        batch = int(knobs.max_batch_size if batch_cap is None else batch_cap)
        details = self.rest.details()
        old = self._app_config(details)
        new, restarts = self.plan(old, details, knobs, batch)
        dep_before = deployment_details(details, self.app, self.deployment)
        target = None  # the autoscaler target written with the limit, if any
        if effective_autoscaling(dep_before) is not None:
            auto = declared_autoscaling(new, self.deployment) or {}
            target = auto.get("target_ongoing_requests")
        if new == old:
            dep = self.rest.wait(self.app, self.deployment, lambda d: True, timeout_s=30.0)
            if self._in_effect(knobs, batch, dep, target):
                return ApplyCost(seconds=time.monotonic() - t0, changed=False)
        before = {r[0] for r in fleet_of(dep_before)}
        self.write(details, lambda cfg: self.plan(cfg, details, knobs, batch)[0])
        log.info(
            "applied %s (batch %d, autoscaler target %s) to %s/%s (restart: %s)",
            knobs,
            batch,
            target,
            self.app,
            self.deployment,
            restarts,
        )

        def done(dep: dict[str, Any]) -> bool:
            if not self._in_effect(knobs, batch, dep, target):
                return False
            # A restart replaces every replica: none of those from before may remain.
            return not restarts or not before & {r[0] for r in fleet_of(dep)}

        self.rest.wait(self.app, self.deployment, done, timeout_s=self.apply_timeout_s)
        return ApplyCost(seconds=time.monotonic() - t0, restarted=restarts)

    def effects(self) -> KnobEffects:
        if self.batch_path.scope == "app":  # refused at apply: never applied
            return KnobEffects(live=frozenset({"max_concurrency"}))
        return KnobEffects(live=frozenset({"max_batch_size", "max_concurrency"}))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "actuator": self.name,
            "app": self.app,
            "deployment": self.deployment,
            "batch_knob": str(self.batch_path),
            "admission_knob": "max_ongoing_requests",
            "dashboard": self.rest.base_url,
        }
        try:
            scaling = self.scaling()
        except (ActuatorError, ActuatorUnavailable) as e:  # informational
            log.warning("could not read the autoscaler of %s/%s: %s", self.app, self.deployment, e)
            out["autoscaling"] = "unknown"
        else:
            if scaling is not None:
                out["autoscaling"] = asdict(scaling)
        return out
