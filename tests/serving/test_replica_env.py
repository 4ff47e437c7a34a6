"""The replica's env travels with the app, not only with a Ray slotune started.

A separate Ray cluster in a child process, started with the opposite settings in
its own environment (workers reniced to 15, handlers in a separate thread), as a
``ray start`` that knows nothing of slotune would: only the ``runtime_env`` that
``serving.app.deploy.app_config`` (and deploy/serve-config.yaml) carries can give the
replica niceness 0 and handlers on its main loop. The proxy stays as the cluster
made it: the env reaches the replica only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, socket
os.environ["RAY_worker_niceness"] = "15"
os.environ["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = "1"
import httpx, ray
from ray import serve
from serving.app.config import LiveConfig, ServerArgs
from serving.app.cluster import start_local_ray
from serving.app.deploy import delete_app, deploy_app

def free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

port = free()
start_local_ray(num_cpus=2, metrics_port=free(), http_port=port)
try:
    deploy_app(ServerArgs(model="tiny"), LiveConfig(max_batch_size=8), name="envcheck")
    runtime = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=30).json()["runtime"]
    from serving.app import ray_private
    client = ray_private.serve_client(start=False)
    (proxy,) = ray_private.serve_details(client)["proxies"].values()
    actor = ray.get_actor(proxy["actor_name"], namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))
    runtime["proxy_niceness"] = os.getpriority(os.PRIO_PROCESS, pid)
    print("RESULT " + json.dumps(runtime))
finally:
    delete_app("envcheck")
    serve.shutdown()
    ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.slow
def test_runtime_env_gives_the_replica_niceness_0_and_the_main_loop_on_any_cluster() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child failed (rc {out.returncode}): {out.stderr[-2000:]}"
    got = json.loads(lines[-1][len("RESULT ") :])
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert got["proxy_niceness"] > base  # the control: the cluster's env reniced the proxy
    assert got["engine_thread_niceness"] == base  # from the app's runtime_env alone
    assert got["user_code_in_separate_thread"] is False
