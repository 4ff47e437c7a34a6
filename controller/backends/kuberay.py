"""The ``kuberay`` actuator: a Serve app run by a KubeRay RayService, changed in the CR.

KubeRay keeps the serve config it last submitted in a cache and submits the RayService's
``spec.serveConfigV2`` again whenever that cache is lost (an operator restart, an edit of
the CR, a new RayCluster), which reverts any change made on the cluster alone. So this
actuator writes the knobs into ``spec.serveConfigV2`` itself: a read-modify-write of the
RayService guarded by its ``metadata.resourceVersion`` (a JSON merge patch that carries the
version it read: the API server answers 409 when the object changed since, and the write
is re-read, rebuilt and retried). KubeRay then submits the new config to Serve, an
in-place update for ``user_config`` and ``max_ongoing_requests`` (no RayCluster is
replaced: that happens only for ``rayClusterConfig`` changes).

What the cluster runs is read, and waited on, through Serve's REST API on the RayService's
head service (``<rayservice>-head-svc:8265``, KubeRay's ``GenerateHeadServiceName`` for a
RayService; ``--dashboard-url`` overrides it), as the ``serve`` actuator does: an apply
returns once every replica runs the new knobs.

The config is written back as YAML from the parsed one: comments and layout in
``serveConfigV2`` are not kept (the values are). No Kubernetes API server runs on this
project's machines: the tests run the ``kubernetes`` client against a stand-in that
implements GET and PATCH of one custom resource with resourceVersion conflicts
(tests/fixtures/kube_standin.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import yaml

from controller.backends.actuator import ActuatorError, ActuatorUnavailable, ForeignChange
from controller.backends.knob_path import get_path
from controller.backends.kube import (
    REQUEST_TIMEOUT_S,
    api_client,
    default_namespace,
    is_conflict,
    kube_error,
    read_object,
)
from controller.backends.serve import (
    ServeActuator,
    admission_of,
    foreign_serve_limit,
    replace_app,
)
from controller.backends.serve_rest import deployment_details

if TYPE_CHECKING:
    from search.space import Knobs

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"
CONFLICT_RETRIES = 5


def head_dashboard_url(rayservice: str, namespace: str) -> str:
    """The dashboard on the head service KubeRay keeps for a RayService."""
    return f"http://{rayservice}-head-svc.{namespace}.svc:8265"


def serve_config(cr: dict[str, Any], what: str) -> dict[str, Any]:
    """The RayService's ``spec.serveConfigV2``, parsed (ActuatorError when it has none)."""
    text = (cr.get("spec") or {}).get("serveConfigV2")
    if not isinstance(text, str) or not text.strip():
        raise ActuatorError(f"{what} has no spec.serveConfigV2: nothing slotune can change")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ActuatorError(f"{what}: spec.serveConfigV2 is not YAML ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("applications"), list):
        raise ActuatorError(f"{what}: spec.serveConfigV2 has no 'applications' list")
    return config


def app_of(config: dict[str, Any], app: str, what: str) -> dict[str, Any]:
    for entry in config["applications"]:
        if isinstance(entry, dict) and entry.get("name") == app:
            return entry
    names = [a.get("name") for a in config["applications"] if isinstance(a, dict)]
    raise ActuatorError(f"{what}: serveConfigV2 has no application {app!r} (it has {names})")


def dump_config(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


class KubeRayActuator(ServeActuator):
    """Knobs of one deployment of a RayService's Serve app, written into the CR."""

    name = "kuberay"

    def __init__(
        self,
        *,
        app: str,
        rayservice: str,
        namespace: str | None = None,
        deployment: str | None = None,
        batch_knob: str | None = None,
        dashboard_url: str | None = None,
        api: Any = None,
        apply_timeout_s: float = 120.0,
        **kw: Any,
    ) -> None:
        self.rayservice = rayservice
        self.namespace = namespace or default_namespace()
        self.what = f"RayService {self.namespace}/{rayservice}"
        if api is None:
            from kubernetes import client

            api = client.CustomObjectsApi(api_client())
        self.api = api
        self.app = app
        app_of(serve_config(self._read(), self.what), app, self.what)  # fails early
        super().__init__(
            app=app,
            deployment=deployment,
            batch_knob=batch_knob,
            dashboard_url=dashboard_url or head_dashboard_url(rayservice, self.namespace),
            apply_timeout_s=apply_timeout_s,
            **kw,
        )

    # -- the CR -------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        cr = read_object(
            self.api, GROUP, VERSION, self.namespace, PLURAL, self.rayservice, what=self.what
        )
        if cr is None:
            raise ActuatorError(f"{self.what}: not found; was it deleted?")
        return cr

    def _app_config(self, details: dict[str, Any]) -> dict[str, Any]:
        """The app as the RayService declares it (what KubeRay submits), not as Serve shows."""
        return app_of(serve_config(self._read(), self.what), self.app, self.what)

    def write(
        self, details: dict[str, Any], rebuild: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> None:
        """Patch ``spec.serveConfigV2`` with the app rebuilt from a fresh read, carrying
        that read's resourceVersion; on 409 read, rebuild and try again."""
        for attempt in range(1, CONFLICT_RETRIES + 1):
            cr = self._read()
            config = serve_config(cr, self.what)
            old = app_of(config, self.app, self.what)
            new = rebuild(old)
            if new == old:
                return  # the CR already says so (a retry found our own write)
            config["applications"] = replace_app(config["applications"], new)
            patch = {
                "metadata": {"resourceVersion": cr["metadata"]["resourceVersion"]},
                "spec": {"serveConfigV2": dump_config(config)},
            }
            try:
                self.api.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    self.rayservice,
                    patch,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
                return
            except Exception as e:
                if not is_conflict(e):
                    raise kube_error(e, self.what) from None
                log.info("%s changed since read (attempt %d): retrying", self.what, attempt)
        raise ActuatorUnavailable(
            f"{self.what}: every one of {CONFLICT_RETRIES} writes met a newer version (409)"
        )

    # -- reading ------------------------------------------------------------------

    def _declared_knobs(self, app_cfg: dict[str, Any]) -> tuple[Any, Any]:
        """(batch, admission limit) as serveConfigV2 states them; None where it does not."""
        entry = next(
            (d for d in app_cfg.get("deployments") or [] if d.get("name") == self.deployment), {}
        )
        scope = app_cfg if self.batch_path.scope == "app" else entry
        return get_path(scope, self.batch_path.parts, None), admission_of(entry)

    def current(self) -> Knobs | None:
        """The knobs the RayService declares (a knob it leaves out: the cluster's), once the
        cluster runs them. While the two differ, ActuatorUnavailable: either KubeRay has yet
        to submit someone's edit of the CR, or someone changed the cluster directly; the
        loop holds then (a write now would overwrite one of them), and pauses once the
        cluster runs the CR's other knobs."""
        from search.space import Knobs

        batch, ongoing = self._declared_knobs(self._app_config({}))  # 404: ActuatorError
        try:
            details = self.rest.details()
            dep = deployment_details(details, self.app, self.deployment)
        except ActuatorError as e:  # KubeRay may be rebuilding the cluster: not gone
            raise ActuatorUnavailable(f"{self.what}: the Serve app cannot be read: {e}") from None
        cfg = dep.get("deployment_config") or {}
        if self.batch_path.scope == "app":
            submitted = details["applications"][self.app].get("deployed_app_config") or {}
            live_batch = get_path(submitted, self.batch_path.parts, None)
        else:
            live_batch = get_path(cfg, self.batch_path.parts, None)
        live = Knobs(max_batch_size=live_batch, max_concurrency=admission_of(cfg))
        declared = Knobs(
            max_batch_size=live.max_batch_size if batch is None else batch,
            max_concurrency=live.max_concurrency if ongoing is None else ongoing,
        )
        if live != declared:
            raise ActuatorUnavailable(
                f"{self.what} declares {declared} but the cluster runs {live} (KubeRay has "
                "yet to submit the CR, or someone changed the cluster directly)"
            )
        foreign = foreign_serve_limit(cfg)
        if foreign:
            raise ForeignChange(f"{self.what}: {foreign}")
        return declared

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rayservice": self.rayservice, "namespace": self.namespace}
