"""Start the local Ray cluster (and Serve) that slotune runs on: loopback only, token auth on.

The seam between "which Ray do we run on, and how is it secured" and "what do we deploy
on it" (serving.app.deploy). What listens where, and why, is in docs/serving.md
"Security"; the Ray 2.60 source behind each choice is cited where it is made.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from serving.app import ray_private

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# Process environment for a Ray driver on a small machine; Ray's processes inherit it
# (docs/serving.md "CPU settings"):
# - no usage stats; metrics exported every second (the minimum);
# - OMP_WAIT_POLICY=PASSIVE: spinning torch threads starve the other processes on
#   a few shared cores (a replica's own policy is ServerArgs.omp_wait_policy);
# - RAY_worker_niceness=0: Ray renices every worker process (replicas, the HTTP
#   proxy) to 15 by default, so any ordinary process on the machine takes the CPU
#   from the replica first; an SLO-serving replica whose latency the tuner measures
#   must compete on equal terms;
# - RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0: request handlers run on the
#   replica's main event loop, which saves a cross-thread hop per streamed event
#   (the handlers never block: the engine steps in its own thread);
# - Serve's proxy callback: the proxy stamps each request's arrival, where the replica
#   starts its TTFT clock (serving/app/front_door.py; a Serve internal, hence ray_private).
RAY_ENV_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_metrics_report_interval_ms": "1000",
    "OMP_WAIT_POLICY": "PASSIVE",
    "RAY_worker_niceness": "0",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    ray_private.PROXY_CALLBACK_ENV: ray_private.PROXY_CALLBACK,
}


def ray_env_defaults() -> None:
    """Set :data:`RAY_ENV_DEFAULTS` where the user has not set them (before ``ray.init``)."""
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


# Where a Ray driver or worker finds its token, in Ray's order of precedence
# (src/ray/rpc/authentication/authentication_token_loader.cc, TryLoadTokenFromSources):
# the RAY_AUTH_TOKEN variable, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token.
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def default_token_path() -> Path:
    """Ray's default token file (ray/_private/authentication/authentication_token_setup.py)."""
    return Path.home() / ".ray" / "auth_token"


def token_source() -> str | None:
    """Which of Ray's token sources would supply this process's token, or None if none would."""
    if os.environ.get(TOKEN_ENV):
        return f"${TOKEN_ENV}"
    if os.environ.get(TOKEN_PATH_ENV):
        return f"${TOKEN_PATH_ENV} ({os.environ[TOKEN_PATH_ENV]})"
    if default_token_path().is_file():
        return str(default_token_path())
    return None


def read_token() -> str | None:
    """This process's Ray token, from the first of Ray's sources that has one (None: none).

    What an HTTP client of the dashboard sends as ``Authorization: Bearer <token>``
    (ray/_private/authentication/http_token_authentication.py, which also accepts
    ``X-Ray-Authorization``). Surrounding whitespace is stripped as Ray's loader does.
    """
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    for path in (os.environ.get(TOKEN_PATH_ENV), default_token_path()):
        if path and Path(path).is_file():
            return Path(path).read_text().strip() or None
    return None


def _private_token() -> Path:
    """A fresh 256-bit token in a 0600 file inside a new 0700 directory, removed at exit.

    Ray's own default (``ray.init`` with no token) writes ~/.ray/auth_token with the
    process umask, 0644 under the usual 022, and keeps it after the cluster is gone.
    """
    tmp = Path(tempfile.mkdtemp(prefix="slotune-ray-auth-"))  # mkdtemp: mode 0700
    path = tmp / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    atexit.register(_remove_token, tmp)
    return path


def _remove_token(tmp: Path) -> None:
    # Ray's processes read the token when they start (and its core worker may re-read it
    # while draining): stop them before the file goes.
    import ray

    try:
        ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def keep_loopback() -> None:
    """Make this process's Ray keep a loopback address as it is, not swap it for the routable one.

    For a new cluster that makes 127.0.0.1 the node's IP, which every Ray listener of
    the node follows (but one: docs/serving.md "Security"); for a driver attaching to
    ``127.0.0.1:PORT`` it keeps the address it dials on loopback.

    ``ray.init(_node_ip_address="127.0.0.1")`` (or ``address="127.0.0.1:PORT"``) alone
    does not do it: ray.init passes the address through
    ``services.resolve_ip_for_localhost``, which swaps loopback for the machine's
    routable address unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false
    (ray/_private/services.py ``get_node_ip_address``). That flag comes from
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when ``ray`` is imported
    (ray/_private/ray_constants.py): the single-machine mode Ray uses on macOS and
    Windows. Ray's own processes inherit the variable; this process may have imported
    ray already, so its copy of the flag is set too (a private name, pinned by
    tests/reliability/test_listeners.py; set in serving/app/ray_private.py).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_private.keep_loopback_flag()


# Ray's own warning on starting a cluster with token auth ends "Set RAY_AUTH_MODE=disabled
# to opt out" (ray/_private/authentication/authentication_token_setup.py): advice slotune
# does not take (it overrides that setting), so it is dropped from this process's log.
RAY_AUTH_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


class _NoOptOutAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "to opt out" not in record.getMessage()


_NO_OPT_OUT = _NoOptOutAdvice()


def secure_local_env() -> Path:
    """Set this process's environment for a loopback-only, token-authenticated local Ray.

    Returns the token file (a new one per call). RAY_AUTH_MODE is unset so that
    ``ray.init`` turns token auth on itself and reloads its config
    (``enable_token_auth_by_default`` in ray/_private/authentication/authentication_token_setup.py):
    setting the variable here would not reach a config Ray read when it was imported.
    A ``disabled`` the user set is overridden, with a warning: slotune never starts Ray
    without authentication.
    """
    ray_env_defaults()
    keep_loopback()
    logging.getLogger(RAY_AUTH_SETUP_LOGGER).addFilter(_NO_OPT_OUT)  # once: a set
    mode = os.environ.pop(AUTH_MODE_ENV, None)
    if mode is not None and mode.lower() != "token":
        logger.warning(
            "%s=%s ignored: the Ray cluster slotune starts always uses token auth",
            AUTH_MODE_ENV,
            mode,
        )
    os.environ.pop(TOKEN_ENV, None)  # it would win over the file (see TOKEN_ENV above)
    path = _private_token()
    os.environ[TOKEN_PATH_ENV] = str(path)
    return path


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice), for a listener about to start."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class LocalRay:
    """The cluster :func:`start_local_ray` started: where its GCS listens, where its token is."""

    gcs_address: str  # 127.0.0.1:PORT
    token_path: Path
    dashboard_url: str | None = None  # http://127.0.0.1:PORT, None without the dashboard

    def attach_env(self) -> dict[str, str]:
        """Environment a driver in another process needs to attach (``ray.init(address=...)``)."""
        return {
            AUTH_MODE_ENV: "token",
            TOKEN_PATH_ENV: str(self.token_path),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 (keep_loopback)
        }


def start_local_ray(
    *,
    num_cpus: int,
    metrics_port: int,
    http_port: int,
    host: str = LOOPBACK,
    dashboard: bool = False,
    num_gpus: int | None = None,
) -> LocalRay:
    """Start a new Ray cluster and Serve in this process, loopback only and token-authenticated.

    Always a new cluster (``address="local"``): never the one RAY_ADDRESS or a
    (possibly stale) ``ray_current_cluster`` file names. A 128 MiB object store, metrics on
    ``127.0.0.1:metrics_port``, Serve's HTTP proxy on ``host:http_port`` without access
    logs. The dashboard (and with it Serve's REST API, ``/api/serve/applications/``, which
    the ``serve`` actuator uses) only when ``dashboard``: on 127.0.0.1 at a free port, token
    auth on like the rest (~1 GB more memory). ``num_gpus``: the GPUs Ray may give replicas
    (None: as many as Ray detects, within CUDA_VISIBLE_DEVICES). Returns what another
    driver needs to attach. If Ray comes up on another IP or Serve does not start, Ray is shut down
    before the error propagates. One local cluster per process: Ray caches the token a
    process has loaded.
    """
    token = secure_local_env()
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    ctx = ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=dashboard,
        dashboard_host=LOOPBACK,
        dashboard_port=free_loopback_port() if dashboard else None,
        object_store_memory=128 << 20,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _node_ip_address=LOOPBACK,
    )
    try:
        node_ip = ray.util.get_node_ip_address()
        if node_ip != LOOPBACK:
            raise RuntimeError(
                f"Ray took node IP {node_ip}, not {LOOPBACK}: its ports would be reachable "
                "from the network; refusing to run"
            )
        serve.start(
            http_options=HTTPOptions(host=host, port=http_port),
            logging_config=LoggingConfig(enable_access_log=False),
        )
    except BaseException:
        ray.shutdown()
        raise
    url = ctx.dashboard_url if dashboard else None  # RayContext: "host:port", no scheme
    cluster = LocalRay(
        gcs_address=ray.get_runtime_context().gcs_address,
        token_path=token,
        dashboard_url=f"http://{url}" if url and "://" not in url else url,
    )
    logger.info("local Ray at %s, token auth, token file %s", cluster.gcs_address, token)
    return cluster
