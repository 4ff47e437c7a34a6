"""The ``serve`` actuator: any Ray Serve deployment, through Serve's public REST API only.

It changes exactly two fields of the app's declarative config: the deployment's
``max_ongoing_requests`` (the admission limit) and one key path for the batch limit
(``--batch-knob``, default ``user_config.max_batch_size``: the deployment's
``reconfigure`` receives it), writes the whole declarative set back, and waits until every
replica runs the new config (controller/backends/serve_rest.py says how that is known).
A change that would restart replicas (controller/backends/knob_path.py) is refused with
nothing sent.

With Serve's autoscaler on, the admission limit and the autoscaler's
``target_ongoing_requests`` move together (controller/backends/serve_autoscaling.py);
:meth:`ServeActuator.scaling` tells what replica count Serve's default policy settles at
(docs/controller.md, "With Serve's autoscaler").
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from controller.backends.actuator import (
    ActuatorError,
    ActuatorUnavailable,
    ApplyCost,
    Fleet,
    ForeignChange,
    KnobEffects,
)
from controller.backends.knob_path import KnobPath, get_path, restarting_changes, set_path
from controller.backends.serve_autoscaling import (
    MIN_LIMIT_PER_TARGET,
    SERVE_DEFAULT_POLICY,
    SERVE_DEFAULT_TARGET,
    Scaling,
    declared_autoscaling,
    effective_autoscaling,
    limit_per_target,
    target_for,
)
from controller.backends.serve_rest import (
    ServeRest,
    dashboard_url_of_cluster,
    declarative_apps,
    deployment_details,
    fleet_of,
)
from serving.app.cluster import read_token
from serving.app.deploy import serve_limit

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


# The user_config keys slotune's own app reads its admission limit and its own queue from
# (serving.app.config.LiveConfig): with them, the admission limit is the user_config key and
# Serve's max_ongoing_requests follows it (serving.app.deploy.serve_limit).
ADMISSION_KEY = "max_ongoing_requests"
QUEUE_KEY = "max_queued_requests"


def admission_of(deployment_config: dict[str, Any]) -> Any:
    """The admission limit a deployment runs: slotune's own app admits in the replica, up
    to its ``user_config`` key; any other deployment, up to Serve's ``max_ongoing_requests``."""
    user_config = deployment_config.get("user_config")
    if isinstance(user_config, dict) and ADMISSION_KEY in user_config:
        return user_config[ADMISSION_KEY]
    return deployment_config.get("max_ongoing_requests")


def foreign_serve_limit(deployment_config: dict[str, Any]) -> str:
    """Why slotune's own app runs a Serve ``max_ongoing_requests`` other than the one its
    admission key and queue imply (``serving.app.deploy.serve_limit``), which is how slotune
    writes it: someone edited Serve's limit alone. Empty when it is that one, or for any
    other deployment (Serve's limit is then the admission knob itself)."""
    user_config = deployment_config.get("user_config")
    if not (isinstance(user_config, dict) and ADMISSION_KEY in user_config):
        return ""
    key, queued = user_config[ADMISSION_KEY], user_config.get(QUEUE_KEY)
    serve = deployment_config.get("max_ongoing_requests")
    try:
        want = serve_limit(int(key), None if queued is None else int(queued))
    except (TypeError, ValueError):
        return f"user_config {ADMISSION_KEY}={key!r}, {QUEUE_KEY}={queued!r}: not integers"
    if serve == want:
        return ""
    return (
        f"Serve's max_ongoing_requests is {serve!r} where user_config {ADMISSION_KEY}={key} "
        f"and {QUEUE_KEY}={queued} make it {want}, as slotune writes it"
    )


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
    the admission limit set: the deployment's ``max_ongoing_requests``, or where its
    ``user_config`` has a ``max_ongoing_requests`` key (slotune's own app) that key, with
    Serve's limit following it (``serving.app.deploy.serve_limit``: the key, plus the app's
    own queue and margin when it has one). With ``target_ongoing_requests``, the
    ``autoscaling_config``'s too, which needs the entry to declare one
    (:func:`declared_autoscaling`). Nothing else changes.

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
        # slotune's own app admits in the replica, up to this user_config key, and queues
        # up to its own; Serve hands over up to both and a margin (deploy/serve-config.yaml)
        deps[i] = set_path(deps[i], ("user_config", ADMISSION_KEY), max_ongoing_requests)
        deps[i]["max_ongoing_requests"] = serve_limit(
            max_ongoing_requests, user_config.get(QUEUE_KEY)
        )
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
            cfg = dep.get("deployment_config") or {}
            ongoing = admission_of(cfg)
        except (ActuatorError, ValueError, TypeError) as e:  # informational
            log.warning("could not read the knobs of %s/%s: %s", self.app, self.deployment, e)
            return None
        foreign = foreign_serve_limit(cfg)
        if foreign:
            raise ForeignChange(f"{self.app}/{self.deployment}: {foreign}")
        return Knobs(max_batch_size=batch, max_concurrency=ongoing)

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
            ongoing = admission_of(dep.get("deployment_config") or {}) or limit
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
        if admission_of(cfg) != int(knobs.max_concurrency) or foreign_serve_limit(cfg):
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
