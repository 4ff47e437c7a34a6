"""Issue 17 item 1: nothing slotune starts listens beyond loopback, but one port Ray fixes.

Every listening TCP socket of the Ray processes a run started (the process tree of the
driver: GCS, raylet, agents, Serve controller, proxy, replicas) must be on loopback. The
one exception Ray 2.60 gives no setting for: each Serve replica's inter-deployment gRPC
server binds ``[::]:0`` (ray/serve/_private/replica.py, ``_on_initialized``). It must
then refuse a call that carries no token (docs/serving.md "Security").
"""

from __future__ import annotations

import os

import grpc
import pytest

from tests.reliability.ray_procs import Listener, child_env, listeners, start_serve, stop


def _refuses_without_token(port: int) -> grpc.StatusCode | None:
    """The status of an unauthenticated call to a replica's gRPC port (None: it answered)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return None


def _check(found: list[Listener]) -> None:
    names = {x.name for x in found}
    assert "raylet" in names and any("gcs_server" in n for n in names), found  # saw Ray
    assert any(x.name.startswith("ray::ServeReplica") for x in found), found
    for x in found:
        if x.loopback:
            continue
        assert x.name.startswith("ray::ServeReplica"), f"{x} listens beyond loopback"
        assert _refuses_without_token(x.port) == grpc.StatusCode.UNAUTHENTICATED, x


def test_loopback_switch_is_the_ray_flag_it_was_written_against() -> None:
    import ray
    from ray._private import ray_constants

    from serving.app.cluster import keep_loopback

    assert ray.__version__ == "2.60.0"  # keep_loopback sets a private flag: re-read on upgrade
    keep_loopback()
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


@pytest.mark.ray
def test_the_embedded_cluster_and_its_app_listen_on_loopback_only(ray_cluster) -> None:
    """The session cluster is started as ``slotune tune`` starts its embedded one."""
    import ray

    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import delete_app, deploy_app

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    deploy_app(ServerArgs(model="tiny"), LiveConfig(max_batch_size=2), name="listeners")
    try:
        _check(listeners(os.getpid()))
    finally:
        delete_app("listeners")


@pytest.mark.ray
@pytest.mark.slow
def test_slotune_serve_listens_on_loopback_only() -> None:
    proc, out = start_serve(child_env(), run_for_s=120)
    try:
        assert "loopback, token auth" in out
        _check(listeners(proc.pid))
    finally:
        stop(proc)
    assert proc.returncode == 0
