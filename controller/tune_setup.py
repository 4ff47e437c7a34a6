"""Where ``slotune tune`` runs: start a local Ray or attach to one, deploy the built-in
model or check the given deployment, and pick the metrics source of its windows.

:func:`prepare` does all of it before the first trial and returns a :class:`Prepared`:
the :class:`Setup` it attached to or started, the calibrated hardware and the planned
search (:class:`controller.tune_plan.SearchPlan`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controller.errors import BadInput
from controller.tune_plan import SearchPlan, hardware_spec, plan_search

if TYPE_CHECKING:
    from controller.backends.actuator import Actuator
    from controller.targets import RequestShape
    from controller.windows import WindowReader
    from metrics.observation import Slo
    from search.roofline.hardware import HardwareSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Where the deployment is and how to read it (what the run attached to or started)."""

    app: str
    url: str  # HTTP base of the app
    reader: WindowReader
    reader_desc: str
    started_ray: bool
    device: str
    actuator: Actuator  # how knob changes reach the deployment (controller/backends/)


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


def make_reader(
    *, slo: Slo, app: str, metrics_url: str | None, prometheus_url: str | None, prefix: str
) -> tuple[WindowReader, str]:
    from controller.windows import PromQLWindow, ScrapeWindow
    from metrics.sources import PromQLSource, ScrapeSource

    sel = {"application": app}
    try:
        if prometheus_url:
            src = PromQLSource(prometheus_url, slo=slo, prefix=prefix, selector=sel)
            return PromQLWindow(src), f"Prometheus {prometheus_url}"
        url = metrics_url or ray_metrics_url()
        src = ScrapeSource(url, slo=slo, prefix=prefix, selector=sel)
        return ScrapeWindow(src), f"scrape {url}"
    except ValueError as e:
        raise BadInput(f"metrics source: {e}") from None


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


class SetupFailed(RuntimeError):
    """Starting, attaching or deploying failed (exit 1 with the reason)."""


def local_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # torch is a dependency; be explicit anyway
        return "cpu"


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What :func:`prepare` leaves ready for the first trial."""

    setup: Setup
    hardware: HardwareSpec  # calibrated at the replica's torch threads
    hardware_note: str  # where the calibration came from, for the report
    plan: SearchPlan


def prepare(
    *,
    address: str | None,
    app_name: str | None,
    deployment: str | None,
    url: str | None,
    metrics_url: str | None,
    prometheus_url: str | None,
    prefix: str,
    slo: Slo,
    model: str,
    max_slots: int,
    price: float | None,
    shape: RequestShape,
    quiet: bool,
    actuator: str | None = None,
    batch_knob: str | None = None,
    dashboard_url: str | None = None,
) -> Prepared:
    """Start or attach, deploy if needed, calibrate at the replica's thread count, and plan
    the search.

    No ``address`` and no ``app_name``: start a local Ray and deploy the built-in ``model``
    with ``max_slots`` KV slots (the ``embedded`` actuator); ``address`` alone: attach and
    deploy there; ``app_name``: attach to that existing application (``deployment`` within
    it). Attached, knobs go through ``actuator`` (default ``serve``: Serve's REST API at
    ``dashboard_url``, else the attached cluster's dashboard; ``batch_knob`` names the
    batch limit's config path). ``actuator='none'``: no Ray at all, the server at ``url``
    is measured as it is. ``url`` overrides the app's HTTP base, ``metrics_url`` or
    ``prometheus_url`` the metrics source (names carrying ``prefix``); ``shape`` sets the
    context the roofline predicts at."""
    from controller.backends.registry import ACTUATORS

    if actuator is not None and actuator not in ACTUATORS:
        raise BadInput(f"--actuator {actuator}: must be one of {ACTUATORS}")
    context = round(shape.prompt_tokens.mean + shape.output_tokens.mean / 2)
    device = local_device()
    if actuator == "none":
        return _prepare_unmanaged(
            app_name=app_name,
            url=url,
            metrics_url=metrics_url,
            prometheus_url=prometheus_url,
            prefix=prefix,
            slo=slo,
            model=model,
            max_slots=max_slots,
            price=price,
            context=context,
            device=device,
            quiet=quiet,
        )
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import deploy_app
    from serving.app.replicas import DeployError

    app = app_name
    started = False
    if address is None and app is None:
        if actuator not in (None, "embedded"):
            raise BadInput(
                f"--actuator {actuator}: the local Ray slotune starts has no dashboard; "
                "its own app is tuned by the embedded actuator (omit --actuator)"
            )
        if not quiet:
            print("slotune: starting a local Ray and Serve (127.0.0.1) ...", file=sys.stderr)
        metrics_port, _ = start_local_ray()
        started = True
        metrics_url = metrics_url or f"http://127.0.0.1:{metrics_port}/metrics"
    else:
        attach_ray(address)
    name = "embedded" if started else (actuator or "serve")
    rest_url = None
    if name in ("serve", "serve-llm"):
        rest_url = dashboard_url or _cluster_dashboard_url()
    if app is None:
        threads, threads_from = embedded_threads(), "the built-in deployment"
    else:
        check_deployment(app, deployment)
        threads, threads_from = replica_threads(app, serve_details(rest_url))
    hw, hw_note = hardware_spec(device, quiet=quiet, threads=threads)
    hw_note += f"; replica threads from {threads_from}"
    searched = plan_search(
        model=model,
        hardware=hw,
        slo=slo,
        price=price,
        max_slots=max_slots,
        context=context,
    )
    if app is None:
        app = "slotune"
        first = searched.seeds[0]
        if not quiet:
            print(
                f"slotune: deploying the built-in {model!r} model on {device} ...",
                file=sys.stderr,
            )
        try:
            deploy_app(
                ServerArgs(model=model, max_slots=max_slots, device=device, torch_threads=threads),
                LiveConfig(
                    max_batch_size=first.max_batch_size,
                    ttft_p99_s=slo.ttft_p99_s,
                    tpot_p99_s=slo.tpot_p99_s,
                    max_ongoing_requests=first.max_concurrency,
                ),
                name=app,
                max_queued_requests=-1,
            )
        except (DeployError, ValueError) as e:
            raise SetupFailed(f"deploying the built-in model failed: {e}") from e
    reader, desc = make_reader(
        slo=slo,
        app=app,
        metrics_url=metrics_url,
        prometheus_url=prometheus_url,
        prefix=prefix,
    )
    setup = Setup(
        app=app,
        url=url or serve_url(app, serve_details(rest_url)),
        reader=reader,
        reader_desc=desc,
        started_ray=started,
        device=device,
        actuator=_make_actuator(
            name,
            app=app,
            deployment=deployment,
            batch_knob=batch_knob,
            dashboard_url=rest_url,
            slo=slo,
        ),
    )
    return Prepared(setup=setup, hardware=hw, hardware_note=hw_note, plan=searched)


def _cluster_dashboard_url() -> str:
    from controller.backends.actuator import ActuatorError
    from controller.backends.serve_rest import dashboard_url_of_cluster

    try:
        return dashboard_url_of_cluster()
    except ActuatorError as e:
        raise BadInput(f"{e} (or choose --actuator embedded)") from None


def _make_actuator(name: str, **kw: Any) -> Actuator:
    from controller.backends.actuator import ActuatorError, ActuatorUnavailable
    from controller.backends.registry import make_actuator

    try:
        return make_actuator(name, **kw)
    except (ActuatorError, ActuatorUnavailable, ValueError) as e:
        raise BadInput(f"--actuator {name}: {e}") from None


def _prepare_unmanaged(
    *,
    app_name: str | None,
    url: str | None,
    metrics_url: str | None,
    prometheus_url: str | None,
    prefix: str,
    slo: Slo,
    model: str,
    max_slots: int,
    price: float | None,
    context: int,
    device: str,
    quiet: bool,
) -> Prepared:
    """``--actuator none``: a server slotune measures but cannot configure. No Ray: the
    server is ``url``, its metrics ``metrics_url``/``prometheus_url``, else the load
    generator's own records."""
    from controller.backends.none import NoActuator
    from controller.windows import ClientWindow

    if url is None:
        raise BadInput("--actuator none: give --url, the server's HTTP base")
    app = app_name or "server"
    if metrics_url or prometheus_url:
        reader, desc = make_reader(
            slo=slo,
            app=app,
            metrics_url=metrics_url,
            prometheus_url=prometheus_url,
            prefix=prefix,
        )
    else:
        reader, desc = ClientWindow(slo=slo), "the load generator's own records"
    threads = embedded_threads()
    hw, hw_note = hardware_spec(device, quiet=quiet, threads=threads)
    hw_note += "; the server's threads are unknown (assumed as the built-in's)"
    searched = plan_search(
        model=model, hardware=hw, slo=slo, price=price, max_slots=max_slots, context=context
    )
    setup = Setup(
        app=app,
        url=url,
        reader=reader,
        reader_desc=desc,
        started_ray=False,
        device=device,
        actuator=NoActuator(),
    )
    return Prepared(setup=setup, hardware=hw, hardware_note=hw_note, plan=searched)


def shutdown_local() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
