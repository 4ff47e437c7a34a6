"""The running replicas of a Serve app as they report themselves, and the wait for an update.

Each replica publishes the live config it applied (serving/app/server.py writes it to Ray's
internal KV in ``reconfigure``); Serve's controller lists the running replicas.
:func:`wait_applied` polls both until every running replica reports a config version,
so an update that "returned" has been applied. Used by :mod:`serving.app.deploy`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from serving.app import ray_private
from serving.app.config import DEPLOYMENT_NAME, KV_NAMESPACE

POLL_S = 0.1


class DeployError(RuntimeError):
    """The application failed to deploy or to apply an update; the message says why."""


@dataclass(frozen=True, kw_only=True)
class ReplicaState:
    """One running replica as it reports itself (pid and the knobs it applied)."""

    replica_id: str
    pid: int
    max_batch_size: int
    max_ongoing_requests: int
    version: str
    live: dict[str, Any]


def enum_value(v: Any) -> str:
    """Serve's details hold str enums (``ApplicationStatus.RUNNING``); compare their values."""
    return str(getattr(v, "value", v))


def running_replicas(client: Any, app_name: str) -> tuple[str, str, list[dict[str, Any]]]:
    details = ray_private.serve_details(client)
    app = details.get("applications", {}).get(app_name)
    if app is None:
        return "NOT_STARTED", "", []
    dep = app.get("deployments", {}).get(DEPLOYMENT_NAME, {})
    replicas = [r for r in dep.get("replicas", []) if enum_value(r.get("state")) == "RUNNING"]
    return enum_value(app.get("status")), str(app.get("message", "")), replicas


def read_state(app_name: str, replica_id: str) -> dict[str, Any] | None:
    raw = ray_private.kv_get(f"{app_name}/{replica_id}", namespace=KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


def read_replica_states(client: Any, app_name: str) -> list[ReplicaState]:
    """The running replicas of the app, each as it last reported itself."""
    _, _, replicas = running_replicas(client, app_name)
    out = []
    for r in replicas:
        st = read_state(app_name, r["replica_id"])
        if st is None:
            continue
        out.append(
            ReplicaState(
                replica_id=r["replica_id"],
                pid=int(st["pid"]),
                max_batch_size=int(st["live"]["max_batch_size"]),
                max_ongoing_requests=int(st["max_ongoing_requests"]),
                version=str(st["live"].get("version", "")),
                live=st["live"],
            )
        )
    return out


def read_replica_pids(client: Any, app_name: str) -> list[int]:
    """Process ids of the app's running replicas (as Serve's controller reports them)."""
    _, _, replicas = running_replicas(client, app_name)
    return sorted(int(r["pid"]) for r in replicas if r.get("pid") is not None)


def wait_applied(
    client: Any, app_name: str, version: str, num_replicas: int, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    status, message = "NOT_STARTED", ""
    while time.monotonic() < deadline:
        status, message, replicas = running_replicas(client, app_name)
        if status == "DEPLOY_FAILED":
            raise DeployError(f"app {app_name!r} failed to deploy: {message}")
        if status == "RUNNING" and len(replicas) == num_replicas:
            states = [read_state(app_name, r["replica_id"]) for r in replicas]
            if all(s is not None and s["live"].get("version") == version for s in states):
                return
        time.sleep(POLL_S)
    raise DeployError(
        f"app {app_name!r}: config version {version} not applied on {num_replicas} "
        f"replica(s) within {timeout_s} s (status {status}: {message or 'no message'})"
    )
