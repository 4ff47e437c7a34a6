"""Every use slotune makes of Ray's PRIVATE interfaces, in one place, pinned to Ray 2.60.0.

Private names change without notice between Ray releases; keeping them here makes an
upgrade one file to re-read, and tests/serving/test_ray_private.py fails first when the
installed Ray is not the one this was written against (:data:`RAY_VERSION`).

Who uses them and why:

- the embedded cluster (slotune starts its own Ray with no dashboard, so Serve's REST API
  is not there): the declarative deploy path as the dashboard's
  ``PUT /api/serve/applications/`` takes it (ray/dashboard/modules/serve/serve_head.py
  ``put_all_applications``: ``ServeControllerClient.deploy_apps``), the live declarative
  configs (``ServeController.get_app_configs``) and Serve's details
  (``ServeControllerClient.get_serve_details``): serving/app/deploy.py, replicas.py;
- replicas publishing what they applied through Ray's internal KV
  (``ray.experimental.internal_kv``, underscored functions): serving/app/server.py writes,
  serving/app/replicas.py reads;
- a replica's own view of its deployment config and Serve's constants
  (``ReplicaContext._deployment_config``, ``ray.serve._private.constants``): server.py;
- the loopback switch of a driver that imported ray already
  (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``): serving/app/cluster.py.
- Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, read by
  ray/serve/_private/constants.py; the proxy calls the function it names once and wraps its
  ASGI app in the Starlette middlewares returned: ray/serve/_private/http_util.py
  ``configure_http_middlewares``): the proxy stamps each request's arrival and records
  the TTFT of streamed responses when their first chunk leaves it
  (serving/app/front_door.py), set for slotune's own cluster by serving/app/cluster.py;
- the address a bare ``ray.init()`` would attach to (``ray._private.utils.read_ray_address``):
  tests/reliability/test_stale_cluster.py's control.

Attached clusters with a dashboard use none of this: controller/backends/ talks to Serve
through its public REST API.
"""

from __future__ import annotations

import os
import sys
from typing import Any

RAY_VERSION = "2.60.0"  # the release every name below was read from


def serve_client(*, start: bool) -> Any:
    """The Serve controller client of the attached cluster (ray/serve/context.py
    ``_get_global_client``); None if Serve does not run, unless ``start``: then Serve is
    started with its HTTP proxy on loopback first."""
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None and start:
        serve.start(http_options={"host": "127.0.0.1"})
        client = _get_global_client()
    return client


def serve_details(client: Any) -> dict[str, Any]:
    """Serve's instance details as a dict (the schema of ``GET /api/serve/applications/``,
    ray/serve/schema.py ``ServeInstanceDetails``), read from the controller directly."""
    return client.get_serve_details()


def declarative_app_configs(client: Any) -> dict[str, dict[str, Any]]:
    """Name -> config dict of every app deployed through the declarative path, exactly as
    it was submitted (``ServeController.get_app_configs``, unset fields left out)."""
    import ray

    configs = ray.get(client._controller.get_app_configs.remote())
    return {name: cfg.model_dump(exclude_unset=True) for name, cfg in configs.items()}


def deploy_apps(client: Any, apps: list[dict[str, Any]]) -> None:
    """Replace the declarative set with ``apps`` (apps not listed are deleted), as the
    dashboard's PUT does (``ServeControllerClient.deploy_apps``); returns at once."""
    from ray.serve.schema import ServeDeploySchema

    client.deploy_apps(ServeDeploySchema.model_validate({"applications": apps}))


def kv_get(key: str, *, namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: bytes, *, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, namespace=namespace)


def kv_del(key: str, *, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=namespace)


def replica_max_ongoing_requests(ctx: Any) -> int:
    """The ``max_ongoing_requests`` of the deployment a replica belongs to, from its
    ``serve.get_replica_context()`` (``ReplicaContext._deployment_config``)."""
    return int(ctx._deployment_config.max_ongoing_requests)


def user_code_in_separate_thread() -> bool:
    """Whether Serve runs this replica's request handlers off its main event loop
    (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`` as ray/serve/_private/constants.py
    read it)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD)


def current_cluster_address() -> str | None:
    """The address in Ray's current-cluster file (``$RAY_TMPDIR/ray/ray_current_cluster``,
    where ``ray start`` writes it), which ``ray.init()`` without ``address="local"``
    attaches to; None without the file (ray/_private/utils.py ``read_ray_address``)."""
    from ray._private.utils import read_ray_address

    return read_ray_address()


def keep_loopback_flag() -> None:
    """Clear ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` in this process if ray was
    imported already (the flag is read from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER on import;
    why: serving.app.cluster.keep_loopback)."""
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


# The variable Serve's proxy reads, at its start, for the import path of a function that
# returns Starlette middlewares to wrap its ASGI app in (ray/serve/_private/constants.py).
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
# slotune's callback, as that variable names it (ray/serve/_private/utils.py
# ``call_function_from_import_path`` takes "module.function" or "module:function").
PROXY_CALLBACK = "serving.app.ray_private:proxy_middlewares"


def proxy_middlewares() -> list[Any]:
    """The callback Serve's proxy calls: the middleware that stamps each request's arrival
    at the proxy and times the first chunk of streamed responses whose replica hands their
    TTFT over (serving.app.front_door.ArrivalStamp), recorded through Ray's metrics from
    the proxy actor (serving.app.serve_metrics.ProxyTtft)."""
    from starlette.middleware import Middleware

    from serving.app.front_door import ArrivalStamp
    from serving.app.serve_metrics import ProxyTtft

    return [Middleware(ArrivalStamp, observe=ProxyTtft().observe)]


def proxy_stamps_arrival() -> bool:
    """Whether this process's environment names slotune's proxy callback; Ray's processes
    share the cluster's environment, so then the proxy stamps arrivals too."""
    return os.environ.get(PROXY_CALLBACK_ENV) == PROXY_CALLBACK
