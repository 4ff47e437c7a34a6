"""Deploy the completion server and turn its knobs in place, through Serve's declarative path.

A plain ``serve.run(Dep.options(...).bind())`` restarts the replica on every
call (Ray gives it a random code version) and kills in-flight streams. The
declarative path (what ``serve deploy``, KubeRay and the dashboard's
``PUT /api/serve/applications/`` send) pins the code version to the import
path + runtime env + args; with those unchanged, a new ``user_config`` or
``max_ongoing_requests`` is a lightweight update: the running replica's
``reconfigure`` is called and nothing restarts. In process (the embedded cluster has no
dashboard) we reach that path the way the dashboard does, through Ray's private
controller client (serving/app/ray_private.py, the one module that uses it).

``apply_config`` replaces the whole set of declaratively deployed apps, so
every call here reads the live set and changes only the one app it names.

Each replica publishes the live config it applied (serving/app/server.py writes it to
Ray's internal KV in ``reconfigure``); :func:`update_knobs` waits until every
running replica reports the new version, so "returned" means "applied".
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from metrics.observation import Slo
from serving.app import ray_private
from serving.app.config import (
    DEFAULT_MAX_ONGOING_REQUESTS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEPLOYMENT_NAME,
    REPLICA_ENV_VARS,
    LiveConfig,
    ServerArgs,
)
from serving.app.replicas import (
    POLL_S,
    DeployError,
    ReplicaState,
    read_replica_pids,
    read_replica_states,
    wait_applied,
)

logger = logging.getLogger(__name__)

IMPORT_PATH = "serving.app.server:app"
# How long a deploy waits for its replicas to serve. A GPU replica loads a checkpoint
# onto the GPU and, before it serves, compiles FlexAttention and captures a CUDA graph for
# every batch bucket (serving/engine/device_decode.py ``warm_up``): minutes, not seconds.
DEPLOY_TIMEOUT_S = {"cpu": 120.0, "cuda": 900.0}
DEFAULT_APP_NAME = "slotune"
# The replica's Ray resources as its deployment declares them (serving/app/server.py). A
# config's ray_actor_options replaces that whole dict, not key by key (Ray 2.60,
# serve/_private/application_state.py override_deployment_info), so a GPU replica's
# options repeat num_cpus beside num_gpus.
REPLICA_ACTOR_OPTIONS: dict[str, float] = {"num_cpus": 0}


def _client() -> Any:
    """The Serve controller client; starts Serve (loopback HTTP) if it is not running."""
    return ray_private.serve_client(start=True)


def _declarative_apps(client: Any) -> dict[str, dict[str, Any]]:
    """Name -> config of every app deployed through the declarative path."""
    return ray_private.declarative_app_configs(client)


def _apply(client: Any, name: str, app_config: dict[str, Any]) -> None:
    apps = _declarative_apps(client)
    apps[name] = app_config
    ray_private.deploy_apps(client, list(apps.values()))


def _with_replica_env(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    env = dict(runtime_env or {})
    env["env_vars"] = {**REPLICA_ENV_VARS, **(env.get("env_vars") or {})}
    return env


def actor_options(args: ServerArgs) -> dict[str, float] | None:
    """The deployment's ``ray_actor_options`` for a replica built with ``args``: None on
    the CPU (the deployment's own, :data:`REPLICA_ACTOR_OPTIONS`, apply); one GPU on CUDA.

    Ray sets CUDA_VISIBLE_DEVICES of an actor with ``num_gpus=1`` to the one GPU it gave
    it, so inside the replica that GPU is ``cuda:0`` whichever it is: ``cuda:N`` for N > 0
    names a device the replica cannot see, and is refused rather than quietly mapped to
    the GPU Ray chose (which GPUs Ray may give is set by CUDA_VISIBLE_DEVICES where Ray
    starts).
    """
    kind, _, index = args.device.partition(":")
    if kind != "cuda":
        return None
    if index not in ("", "0"):
        raise ValueError(
            f"device={args.device!r}: a replica placed by Ray (num_gpus=1) sees only its own "
            "GPU, as cuda:0; give 'cuda' (or 'cuda:0') and let Ray choose the GPU"
        )
    return {**REPLICA_ACTOR_OPTIONS, "num_gpus": 1}


def app_config(
    *,
    name: str,
    route_prefix: str,
    args: ServerArgs,
    live: LiveConfig,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    num_replicas: int = 1,
    runtime_env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of a Serve config file's ``applications`` (deploy/serve-config.yaml;
    deploy/serve-config-gpu.yaml on CUDA).

    The deployment's ``max_ongoing_requests`` is ``live.max_ongoing_requests``
    (:data:`DEFAULT_MAX_ONGOING_REQUESTS` when None). ``runtime_env`` gets ``env_vars``
    :data:`REPLICA_ENV_VARS` under the caller's own. On CUDA each replica reserves one
    GPU (:func:`actor_options`).
    """
    if not isinstance(max_queued_requests, int) or not (
        max_queued_requests == -1 or max_queued_requests >= 1
    ):
        raise ValueError(
            f"max_queued_requests={max_queued_requests!r}: must be -1 (unbounded) or >= 1"
        )
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r}: must be an integer >= 1")
    if not route_prefix.startswith("/"):
        raise ValueError(f"route_prefix={route_prefix!r}: must start with '/'")
    live.check_fits(args)
    placement = actor_options(args)
    if live.max_ongoing_requests is None:
        live = replace(live, max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS)
    limit = live.max_ongoing_requests
    assert limit is not None
    queued = None if max_queued_requests == -1 else max_queued_requests
    live = replace(live, max_queued_requests=queued)
    serve_ongoing = serve_limit(limit, queued)
    deployment: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "num_replicas": num_replicas,
        "max_ongoing_requests": serve_ongoing,
        "max_queued_requests": -1,
    }
    if placement is not None:
        deployment["ray_actor_options"] = placement
    deployment["user_config"] = live.to_user_config()
    return {
        "name": name,
        "route_prefix": route_prefix,
        "import_path": IMPORT_PATH,
        "runtime_env": _with_replica_env(runtime_env),
        "args": args.to_args(),
        "deployments": [deployment],
    }


def serve_limit(admission: int, queued: int | None) -> int:
    """Serve's ``max_ongoing_requests`` for a replica admitting ``admission`` and queueing
    ``queued`` itself (None: unbounded, so Serve's router queues and the two limits are
    one); bounded, Serve only hands requests over, up to the refusal margin beyond."""
    if queued is None:
        return admission
    return admission + queued + refusal_margin(admission)


def refusal_margin(limit: int) -> int:
    """Places Serve may hand a replica beyond its admission limit and queue, so that a
    burst the replica must refuse reaches it (and gets its JSON 429) rather than wait in
    Serve's router: at least 8, and the limit itself for large limits."""
    return max(8, limit)


def deploy_app(
    args: ServerArgs,
    live: LiveConfig,
    *,
    name: str = DEFAULT_APP_NAME,
    route_prefix: str = "/",
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    num_replicas: int = 1,
    runtime_env: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Deploy (or update) the completion server app and wait until it serves.

    ``args`` build the replicas (a change rebuilds them); ``live`` is applied in place
    (``live.version`` is replaced by a fresh nonce, which every replica must report
    before this returns). Ray must be initialised; Serve is started on loopback if it is
    not running. ``timeout_s`` None: :data:`DEPLOY_TIMEOUT_S` for the replica's device.
    """
    if timeout_s is None:
        timeout_s = DEPLOY_TIMEOUT_S["cuda" if args.device.startswith("cuda") else "cpu"]
    live = replace(live, version=uuid.uuid4().hex[:12])
    cfg = app_config(
        name=name,
        route_prefix=route_prefix,
        args=args,
        live=live,
        max_queued_requests=max_queued_requests,
        num_replicas=num_replicas,
        runtime_env=runtime_env,
    )
    client = _client()
    _apply(client, name, cfg)
    logger.info("deploying app %r: %s", name, cfg)
    wait_applied(client, name, live.version, num_replicas, timeout_s)


def update_knobs(
    *,
    max_batch_size: int,
    max_ongoing_requests: int,
    slo: Slo | None = None,
    max_queued_requests: int | None = None,
    app_name: str = DEFAULT_APP_NAME,
    timeout_s: float = 60.0,
) -> None:
    """Apply the batch limit, the admission limit (and the SLO) in place; wait until applied.

    No replica restarts and in-flight streams continue: only ``user_config``,
    ``max_ongoing_requests`` and ``max_queued_requests`` change. ``slo=None``
    and ``max_queued_requests=None`` keep the current values.
    """
    client = _client()
    apps = _declarative_apps(client)
    if app_name not in apps:
        raise DeployError(
            f"app {app_name!r} was not deployed through the declarative path "
            f"(deployed: {sorted(apps)}); deploy it with serving.app.deploy.deploy_app first"
        )
    cfg = apps[app_name]
    dep = next(d for d in cfg["deployments"] if d["name"] == DEPLOYMENT_NAME)
    old = LiveConfig.from_user_config(dep.get("user_config") or {"max_batch_size": 1})
    slo = slo or old.slo
    live = LiveConfig(
        max_batch_size=max_batch_size,
        ttft_p99_s=slo.ttft_p99_s,
        tpot_p99_s=slo.tpot_p99_s,
        max_ongoing_requests=max_ongoing_requests,
        version=uuid.uuid4().hex[:12],
    )
    new = app_config(
        name=app_name,
        route_prefix=cfg.get("route_prefix", "/"),
        args=ServerArgs.from_args(cfg.get("args")),
        live=live,
        max_queued_requests=(
            (-1 if old.max_queued_requests is None else old.max_queued_requests)
            if max_queued_requests is None
            else max_queued_requests
        ),
        num_replicas=dep.get("num_replicas", 1),
        runtime_env=cfg.get("runtime_env"),
    )
    # The code version is the import path + runtime_env + args, and a change of the
    # replica's ray_actor_options restarts it too: send back exactly what is deployed
    # (validated above), not it with today's defaults, env and placement filled in, or an
    # app deployed by an older slotune or a hand-written config would restart.
    new_dep = new["deployments"][0]
    for src, dst, key in (
        (cfg, new, "args"),
        (cfg, new, "runtime_env"),
        (dep, new_dep, "ray_actor_options"),
    ):
        if key in src:
            dst[key] = src[key]
        else:
            dst.pop(key, None)
    _apply(client, app_name, new)
    wait_applied(client, app_name, live.version, new["deployments"][0]["num_replicas"], timeout_s)


def delete_app(name: str = DEFAULT_APP_NAME, *, timeout_s: float = 60.0) -> None:
    """Remove the app (and only it) from the declarative set; wait until it is gone."""
    client = _client()
    apps = _declarative_apps(client)
    if name not in apps:
        return
    del apps[name]
    ray_private.deploy_apps(client, list(apps.values()))
    deadline = time.monotonic() + timeout_s
    while name in ray_private.serve_details(client).get("applications", {}):
        if time.monotonic() > deadline:
            raise DeployError(f"app {name!r} still present after {timeout_s} s")
        time.sleep(POLL_S)


def replica_states(app_name: str = DEFAULT_APP_NAME) -> list[ReplicaState]:
    """The running replicas of the app, each as it last reported itself."""
    return read_replica_states(_client(), app_name)


def replica_pids(app_name: str = DEFAULT_APP_NAME) -> list[int]:
    """Process ids of the app's running replicas (as Serve's controller reports them)."""
    return read_replica_pids(_client(), app_name)
