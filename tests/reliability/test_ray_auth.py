"""Issue 17 items 1 and 7: the cluster slotune starts refuses a driver without its token,
and ``attach_ray`` says that a token was refused instead of "cannot connect".

Three drivers attach to the session cluster at once (a refused one waits ~20 s for Ray's
GCS client to give up): no token, a wrong token, the cluster's token. ``HOME`` points
at an empty directory so no ~/.ray/auth_token of another run takes part.
"""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from tests.reliability.ray_procs import ROOT, child_env

ATTACH = r"""
import sys
import ray
from controller.errors import BadInput
from controller.attach import attach_ray
try:
    attach_ray(sys.argv[1])
except BadInput as e:
    print("REFUSED", e)
else:
    print("ATTACHED", ray.get(ray.remote(lambda: 41 + 1).remote()))
"""


@pytest.mark.ray
def test_the_token_is_private_to_the_run(ray_cluster) -> None:
    path = ray_cluster.local.token_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(path.read_text().strip()) == 64  # 256 bits, hex


@pytest.mark.ray
def test_a_driver_needs_the_cluster_token(ray_cluster, tmp_path) -> None:
    local = ray_cluster.local
    loopback = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HOME": str(tmp_path)}
    envs = {
        "none": child_env(**loopback),
        "wrong": child_env(**loopback, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
        "right": child_env(**local.attach_env(), HOME=str(tmp_path)),
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-c", ATTACH, local.gcs_address],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for k, env in envs.items()
    }
    out = {k: p.communicate(timeout=150)[0] for k, p in procs.items()}
    assert "ATTACHED 42" in out["right"], out["right"]
    for k in ("none", "wrong"):
        assert "REFUSED" in out[k] and "token authentication failed" in out[k], out[k]
        assert "cannot connect" not in out[k]
    assert "RAY_AUTH_MODE is unset, so this driver sent no token" in out["none"]
    assert "the token came from $RAY_AUTH_TOKEN" in out["wrong"]


def test_rays_advice_to_disable_auth_is_not_passed_on(ray_cluster, caplog) -> None:
    """Ray's start-up warning ends "Set RAY_AUTH_MODE=disabled to opt out": advice slotune
    overrides, so its log drops that record (and only that one)."""
    import logging

    from serving.app.cluster import RAY_AUTH_SETUP_LOGGER

    log = logging.getLogger(RAY_AUTH_SETUP_LOGGER)
    with caplog.at_level(logging.WARNING, logger=RAY_AUTH_SETUP_LOGGER):
        log.warning("Token authentication is enabled. Set RAY_AUTH_MODE=disabled to opt out.")
        log.warning("another warning of the same module")
    assert [r.getMessage() for r in caplog.records] == ["another warning of the same module"]
