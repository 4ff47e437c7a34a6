"""Attaching to a running Ray cluster (or starting slotune's own) and reading what Serve
runs there: the applications, their HTTP route, the replicas' torch threads, the metrics
endpoint. Serve is read through its public REST API when a dashboard URL is known, else
in process from the embedded cluster (serving/app/ray_private.py).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from controller.errors import BadInput

log = logging.getLogger(__name__)


def start_local_ray() -> tuple[int, int]:
    """A new Ray + Serve on this machine, loopback only, token auth on (a private token);
    returns (metrics port, HTTP port). Never attaches to a running or stale cluster."""
    from serving.app.cluster import free_loopback_port
    from serving.app.cluster import start_local_ray as start

    metrics_port, http_port = free_loopback_port(), free_loopback_port()
    start(num_cpus=os.cpu_count() or 2, metrics_port=metrics_port, http_port=http_port)
    return metrics_port, http_port


# What Ray's GCS says when a driver's token is missing or wrong (gcs_client.cc, through
# node.py's "Failed to connect to GCS"): ray.init then raises a plain ConnectionError.
_AUTH_REFUSED = ("Unauthenticated", "InvalidAuthToken", "authentication token")


def attach_ray(address: str | None) -> None:
    """Attach this process to a running cluster (``address`` or Ray's ``auto``).

    The token is Ray's own business: RAY_AUTH_MODE=token and one of RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token (Ray turns auth on by itself only for an
    ``auto`` address). A refused token gets its own message, not "cannot connect".
    """
    import ray
    from ray.exceptions import AuthenticationError

    from serving.app.cluster import keep_loopback, ray_env_defaults

    if address and address != "auto":
        _check_reachable(address)
    if ray.is_initialized():
        return
    ray_env_defaults()
    target = address if address and address != "auto" else os.environ.get("RAY_ADDRESS", "")
    if _host(target) in ("127.0.0.1", "localhost", "::1"):
        keep_loopback()  # else ray.init dials the machine's routable IP, where nothing listens
    try:
        ray.init(address=address or "auto", log_to_driver=False)
    except AuthenticationError as e:
        raise BadInput(_auth_message(address, str(e).splitlines()[0])) from None
    except Exception as e:  # ConnectionError, RuntimeError... all mean "cannot attach"
        cause = f"{e} {e.__cause__ or ''}"
        if any(s in cause for s in _AUTH_REFUSED):
            raise BadInput(_auth_message(address, "the cluster refused this driver")) from None
        raise BadInput(
            f"--address {address or 'auto'}: cannot connect to a Ray cluster ({e}); "
            "start one with `ray start --head` or omit --address to run locally"
        ) from None


def _auth_message(address: str | None, what: str) -> str:
    from serving.app.cluster import AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, token_source

    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is None or mode.lower() != "token":
        have = f"{AUTH_MODE_ENV} is {mode or 'unset'}, so this driver sent no token"
    else:
        have = f"the token came from {token_source() or 'nowhere (no token found)'}"
    return (
        f"--address {address or 'auto'}: token authentication failed ({what}; {have}). "
        f"Set {AUTH_MODE_ENV}=token and give that cluster's token in ${TOKEN_ENV}, "
        f"in a file named by ${TOKEN_PATH_ENV}, or in ~/.ray/auth_token"
    )


def _host(address: str) -> str:
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    return hostport.rpartition(":")[0].strip("[]")


def _check_reachable(address: str) -> None:
    """Fail fast on a Ray address nobody listens on (ray.init would retry for minutes)."""
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise BadInput(f"--address {address}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3.0).close()
    except OSError as e:
        raise BadInput(
            f"--address {address}: nothing answers there ({e.strerror or e}); "
            "start a cluster with `ray start --head` or omit --address to run locally"
        ) from None


def serve_details(dashboard_url: str | None) -> dict[str, Any]:
    """Serve's instance details (``ServeInstanceDetails`` as a dict): through the public
    REST API at ``dashboard_url``, or, with None, in process from the embedded cluster
    slotune started (no dashboard there: serving/app/ray_private.py)."""
    if dashboard_url is not None:
        from controller.backends.actuator import ActuatorError, ActuatorUnavailable
        from controller.backends.serve_rest import ServeRest
        from serving.app.cluster import read_token

        rest = ServeRest(dashboard_url, token=read_token())
        try:
            return rest.details()
        except (ActuatorError, ActuatorUnavailable) as e:
            raise BadInput(f"--dashboard-url {dashboard_url}: {e}") from None
        finally:
            rest.close()
    from serving.app.ray_private import serve_client
    from serving.app.ray_private import serve_details as private_details

    client = serve_client(start=False)
    if client is None:
        raise BadInput("no Ray Serve instance runs on this cluster: nothing to tune")
    return private_details(client)


def serve_url(app: str, details: dict[str, Any] | None = None) -> str:
    """http://host:port/prefix of ``app`` from Serve's details (read from the embedded
    cluster when not given)."""
    details = serve_details(None) if details is None else details
    apps = details.get("applications", {})
    if app not in apps:
        raise BadInput(f"--app {app}: no such application (running: {sorted(apps) or 'none'})")
    http = details.get("http_options") or {}
    host = http.get("host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    prefix = apps[app].get("route_prefix") or "/"
    return f"http://{host}:{http.get('port', 8000)}{prefix.rstrip('/')}"


def check_deployment(app: str, deployment: str | None) -> None:
    """BadInput unless ``app`` runs (and has ``deployment``, when named), through Serve's
    public ``serve.status()``. Any deployment will do: the actuator changes its knobs."""
    from ray import serve

    apps = serve.status().applications
    if app not in apps:
        raise BadInput(f"--app {app}: no such application (running: {sorted(apps) or 'none'})")
    deps = apps[app].deployments
    if deployment is not None and deployment not in deps:
        raise BadInput(f"--deployment {deployment}: not in app {app!r} (it has {sorted(deps)})")


def ray_metrics_url() -> str:
    """The metrics export endpoint of the (single) node of the attached cluster."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) != 1:
        raise BadInput(
            f"the cluster has {len(nodes)} nodes: give --metrics-url of the replica's node "
            "or --prometheus-url of a Prometheus that scrapes them all"
        )
    n = nodes[0]
    return f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"


def embedded_threads() -> int:
    """torch threads of the built-in replica: the cores less one for the load and Ray, 1-4."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def replica_threads(app: str, details: dict[str, Any] | None = None) -> tuple[int, str]:
    """The torch thread count the replicas of ``app`` run with (its ``torch_threads``
    app argument, as Serve's details show the deployed config), and where that came from."""
    from serving.app.config import ServerArgs

    default = ServerArgs(model="tiny").torch_threads
    try:
        details = serve_details(None) if details is None else details
        cfg = (details.get("applications", {}).get(app) or {}).get("deployed_app_config") or {}
        args = cfg.get("args") or {}
        if "torch_threads" in args:
            return int(args["torch_threads"]), f"app {app!r} args"
    except Exception as e:  # an informational read: fall back to the app's default
        log.warning("could not read the torch_threads of app %r: %s", app, e)
    return default, f"serving.app.server default (app {app!r} does not say)"


def cluster_dashboard_url() -> str:
    from controller.backends.actuator import ActuatorError
    from controller.backends.serve_rest import dashboard_url_of_cluster

    try:
        return dashboard_url_of_cluster()
    except ActuatorError as e:
        raise BadInput(f"{e} (or choose --actuator embedded)") from None


def shutdown_local() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
