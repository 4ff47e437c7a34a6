"""The Kubernetes API, through the official ``kubernetes`` client: credentials, namespace,
and what its errors mean to slotune.

In a pod, the ServiceAccount's token and CA (``load_incluster_config``); elsewhere the
kubeconfig (``KUBECONFIG`` or ``~/.kube/config``). An answer of 404 means the object is
gone, 401/403 that the credentials may not do this (both permanent: :class:`ActuatorError`);
a 5xx, 429 or a connection failure is transient (:class:`ActuatorUnavailable`); 409 is an
optimistic-concurrency conflict the caller retries (:func:`is_conflict`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from controller.backends.actuator import ActuatorError, ActuatorUnavailable

# Where a pod finds its own namespace (the ServiceAccount volume Kubernetes mounts).
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
REQUEST_TIMEOUT_S = 10.0


def api_client() -> Any:
    """A ``kubernetes.client.ApiClient`` for this pod's ServiceAccount, else the kubeconfig
    (ActuatorError naming both when neither is there)."""
    from kubernetes import client, config

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        # KUBECONFIG read now: the client reads it once, at import
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
    except config.ConfigException as e:
        raise ActuatorError(
            f"no Kubernetes credentials ({e}): run in a pod with a ServiceAccount, or set "
            "KUBECONFIG to a kubeconfig file"
        ) from None


def default_namespace() -> str:
    """The pod's own namespace in a cluster, else ``default``."""
    try:
        return SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def is_conflict(e: BaseException) -> bool:
    """A 409 from the API server: the object changed since it was read (or already exists)."""
    from kubernetes.client.exceptions import ApiException

    return isinstance(e, ApiException) and e.status == 409


def read_object(
    api: Any, group: str, version: str, namespace: str, plural: str, name: str, *, what: str
) -> dict[str, Any] | None:
    """GET one object through ``CustomObjectsApi`` (any group's resource path); None when
    there is none (404), an error of :func:`kube_error` for any other failure."""
    from kubernetes.client.exceptions import ApiException

    try:
        return api.get_namespaced_custom_object(
            group, version, namespace, plural, name, _request_timeout=REQUEST_TIMEOUT_S
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise kube_error(e, what) from None
    except Exception as e:
        raise kube_error(e, what) from None


def kube_error(e: BaseException, what: str) -> RuntimeError:
    """The slotune error for a failed API call on ``what`` (e.g. ``RayService ns/name``)."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(e, ApiException):
        status = int(e.status or 0)
        reason = _message(e)
        if status == 404:
            return ActuatorError(f"{what}: not found ({reason}); was it deleted?")
        if status in (401, 403):
            return ActuatorError(
                f"{what}: {status} {reason} (the ServiceAccount needs the RBAC of "
                "deploy/k8s/control-rbac.yaml)"
            )
        if status == 429 or status >= 500:
            return ActuatorUnavailable(f"{what}: {status} {reason}")
        return ActuatorError(f"{what}: {status} {reason}")
    return ActuatorUnavailable(f"{what}: {e}")


def _message(e: Any) -> str:
    """The Status message of an ApiException's body, else its reason phrase."""
    import json

    try:
        return str(json.loads(e.body or "").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.reason)
