"""Ray Serve's public REST API on the dashboard: read the live config, write it back, wait.

``GET /api/serve/applications/`` returns ``ServeInstanceDetails`` (ray/serve/schema.py):
per app its ``deployed_app_config`` (the declarative config exactly as submitted) and per
deployment its ``status``, ``deployment_config``, ``target_num_replicas`` and replicas.
``PUT /api/serve/applications/`` takes a ``ServeDeploySchema``: the WHOLE declarative set;
apps it does not list are deleted (ray/dashboard/modules/serve/serve_head.py
``put_all_applications``; ray/serve/_private/application_state.py ``apply_app_configs``).
With token auth the dashboard wants ``Authorization: Bearer <token>``
(ray/_private/authentication/http_token_authentication.py).

When has an update reached every replica? The details carry no per-replica version.
Serve's controller sets a deployment's new target (whose info is what the details show as
``deployment_config``) and flips its status to UPDATING in the same synchronous
``DeploymentState.deploy`` call, and flips it back to HEALTHY only once every replica is
RUNNING at the target version and their count is the target's
(ray/serve/_private/deployment_state.py ``deploy``, ``_set_target_state``,
``check_curr_status``). So one details snapshot showing the new values in
``deployment_config``, status HEALTHY and ``target_num_replicas`` replicas all RUNNING
means the update is done on every replica (:func:`settled`); until Serve has built the
new config the details still show the old values, which never match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from controller.backends.actuator import UNSETTLED, ActuatorError, ActuatorUnavailable, Fleet

log = logging.getLogger(__name__)

APPS_PATH = "/api/serve/applications/"
ACTORS_PATH = "/api/v0/actors"
REDACTED = "<redacted>"  # the dashboard's mask for runtime_env values (runtime_env_redaction.py)
POLL_S = 0.2


def dashboard_url_of_cluster() -> str:
    """The dashboard URL of the Ray cluster this process is attached to, from the public
    ``RayContext.dashboard_url`` (what ``ray.init`` returns; with ``ignore_reinit_error``
    it describes the cluster already attached)."""
    import ray

    if not ray.is_initialized():
        raise ActuatorError("not attached to a Ray cluster: give the dashboard URL")
    url = ray.init(ignore_reinit_error=True).dashboard_url
    if not url:
        raise ActuatorError(
            "the attached Ray cluster runs no dashboard (Serve's REST API lives there): "
            "start it with the dashboard or give --dashboard-url"
        )
    return url if "://" in url else f"http://{url}"


def enum_value(v: Any) -> str:
    return str(getattr(v, "value", v))


def config_version(deployment_config: dict[str, Any]) -> str:
    """A short, stable hash of a deployment's ``deployment_config`` as the details show it."""
    blob = json.dumps(deployment_config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def deployment_details(details: dict[str, Any], app: str, deployment: str) -> dict[str, Any]:
    apps = details.get("applications") or {}
    if app not in apps:
        raise ActuatorError(f"app {app!r} is not on the cluster (it has {sorted(apps) or 'none'})")
    deps = apps[app].get("deployments") or {}
    if deployment not in deps:
        raise ActuatorError(f"app {app!r} has no deployment {deployment!r} (it has {sorted(deps)})")
    return deps[deployment]


def settled(dep: dict[str, Any]) -> bool:
    """Every replica of this deployment runs its current target (module docstring)."""
    running = [r for r in dep.get("replicas") or [] if enum_value(r.get("state")) == "RUNNING"]
    return (
        enum_value(dep.get("status")) == "HEALTHY"
        and len(running) == len(dep.get("replicas") or [])
        and len(running) == int(dep.get("target_num_replicas") or 0)
    )


def fleet_of(dep: dict[str, Any], *, dead: frozenset[str] = frozenset()) -> Fleet:
    """(replica id, pid, version) of the RUNNING replicas; the version is the hash of the
    deployment's config, marked :data:`UNSETTLED` while an update is under way or when a
    replica Serve still counts as RUNNING has an actor id in ``dead`` (Serve notices a
    killed replica only at its next health check, up to ``health_check_period_s`` later)."""
    version = config_version(dep.get("deployment_config") or {})
    if dead & {str(r.get("actor_id")) for r in dep.get("replicas") or []}:
        version = f"{UNSETTLED}REPLICA_DIED:{version}"
    elif not settled(dep):
        version = f"{UNSETTLED}{enum_value(dep.get('status'))}:{version}"
    return tuple(
        sorted(
            (str(r.get("replica_id")), int(r.get("pid") or 0), version)
            for r in dep.get("replicas") or []
            if enum_value(r.get("state")) == "RUNNING"
        )
    )


class ServeRest:
    """A client of one cluster's Serve REST API (httpx, token from Ray's own sources)."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"dashboard url {base_url!r}: must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def details(self) -> dict[str, Any]:
        """``ServeInstanceDetails`` as a dict (ActuatorUnavailable if unreachable)."""
        import httpx

        try:
            r = self._http.get(APPS_PATH)
        except httpx.HTTPError as e:
            raise ActuatorUnavailable(f"GET {self.base_url}{APPS_PATH}: {e}") from e
        if r.status_code in (401, 403):
            raise ActuatorError(
                f"GET {self.base_url}{APPS_PATH}: {r.status_code} {r.text[:120]} "
                "(set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token)"
            )
        if r.status_code != 200:
            raise ActuatorUnavailable(f"GET {APPS_PATH}: {r.status_code} {r.text[:200]}")
        return r.json()

    def dead_actors(self, actor_ids: list[str]) -> frozenset[str]:
        """Those of ``actor_ids`` the cluster's GCS no longer has ALIVE, through the state
        API on the same dashboard (``GET /api/v0/actors``, ray/dashboard/modules/state/
        state_head.py); empty when that cannot be read (then only Serve's view counts)."""
        import httpx

        dead = set()
        for actor_id in actor_ids:
            params = {
                "filter_keys": "actor_id",
                "filter_predicates": "=",
                "filter_values": actor_id,
            }
            try:
                r = self._http.get(ACTORS_PATH, params=params)
                rows = r.json()["data"]["result"]["result"] if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.debug("the state API could not be read: %s", e)
                return frozenset()
            if rows is None:
                return frozenset()
            if rows and all(row.get("state") != "ALIVE" for row in rows):
                dead.add(actor_id)
        return frozenset(dead)

    def put(self, details: dict[str, Any], apps: list[dict[str, Any]]) -> None:
        """Write ``apps`` as the whole declarative set, keeping the instance-wide options
        the details show (proxy location, HTTP/gRPC options, target capacity)."""
        import httpx

        if REDACTED in json.dumps(apps):
            raise ActuatorError(
                "the configs read back hold redacted runtime_env values: writing them back "
                "would replace the real ones; refusing"
            )
        body: dict[str, Any] = {"applications": apps}
        for key in ("proxy_location", "http_options", "grpc_options", "target_capacity"):
            if details.get(key) is not None:
                body[key] = details[key]
        try:
            r = self._http.put(APPS_PATH, json=body)
        except httpx.HTTPError as e:
            raise ActuatorError(f"PUT {self.base_url}{APPS_PATH}: {e}") from e
        if r.status_code != 200:
            raise ActuatorError(f"PUT {APPS_PATH} refused: {r.status_code} {r.text[:300]}")

    def wait(
        self,
        app: str,
        deployment: str,
        done: Callable[[dict[str, Any]], bool],
        *,
        timeout_s: float,
    ) -> dict[str, Any]:
        """Poll until ``done(deployment details)`` and :func:`settled`; returns those
        details. ActuatorError when the app fails to deploy or time runs out."""
        deadline = time.monotonic() + timeout_s
        last = "no details yet"
        while True:
            dep: dict[str, Any] | None = None
            try:
                details = self.details()
                dep = deployment_details(details, app, deployment)
            except ActuatorUnavailable as e:
                last = str(e)
            except ActuatorError as e:  # mid-rebuild the deployment may be briefly absent
                last = str(e)
            if dep is not None:
                app_details = details["applications"][app]
                status = enum_value(app_details.get("status"))
                if "DEPLOY_FAILED" in (status, enum_value(dep.get("status"))):
                    msg = app_details.get("message") or dep.get("message")
                    raise ActuatorError(f"app {app!r} failed to deploy: {str(msg)[:300]}")
                if done(dep) and settled(dep):
                    return dep
                last = f"app {status}, deployment {enum_value(dep.get('status'))}"
            if time.monotonic() > deadline:
                raise ActuatorError(
                    f"app {app!r}: update not in effect on every replica of {deployment!r} "
                    f"within {timeout_s} s ({last})"
                )
            time.sleep(POLL_S)


def declarative_apps(details: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``deployed_app_config`` of every declaratively deployed app, in details order
    (imperative apps, deployed with ``serve.run``, have none and a PUT leaves them be)."""
    out = []
    for app in (details.get("applications") or {}).values():
        cfg = app.get("deployed_app_config")
        if cfg is not None:
            out.append(cfg)
    return out
