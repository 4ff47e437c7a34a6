"""The two RayServices (CPU, GPU) serve the app of deploy/serve-config.yaml: their
serveConfigV2 pass Ray Serve's own schema and slotune's, and differ only where they must."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from serving.app.config import LiveConfig, ServerArgs
from tests.deploy.manifests import DEPLOY, load_all

CPU, GPU = DEPLOY / "kuberay/rayservice.yaml", DEPLOY / "kuberay/rayservice-gpu.yaml"
# What the cluster's app sizes differently from the local serve-config.yaml: the model,
# its KV slots and threads, the limits and the replica's CPUs. Nothing else may differ.
SIZING_ARGS = {"model", "max_slots", "torch_threads"}
SIZING_DEPLOYMENT = {"max_ongoing_requests", "ray_actor_options"}
SIZING_USER_CONFIG = {"max_batch_size", "max_ongoing_requests", "max_queued_requests"}


def _rs(path: Any) -> dict[str, Any]:
    (rs,) = load_all(path)
    assert rs["apiVersion"] == "ray.io/v1" and rs["kind"] == "RayService"
    return rs


def _serve(path: Any) -> dict[str, Any]:
    return yaml.safe_load(_rs(path)["spec"]["serveConfigV2"])


def _diff(a: Any, b: Any, at: tuple = ()) -> dict[tuple, tuple[Any, Any]]:
    """Every leaf where ``a`` and ``b`` differ: path -> (a's, b's); a missing key is None."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: dict[tuple, tuple[Any, Any]] = {}
        for k in a.keys() | b.keys():
            out |= _diff(a.get(k), b.get(k), (*at, k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = {}
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out |= _diff(x, y, (*at, i))
        return out
    return {} if a == b else {at: (a, b)}


def test_gpu_serve_config_differs_only_in_the_gpu_fields() -> None:
    app = ("applications", 0)
    dep = (*app, "deployments", 0)
    assert _diff(_serve(CPU), _serve(GPU)) == {
        (*app, "args", "device"): ("cpu", "cuda"),
        (*dep, "ray_actor_options", "num_gpus"): (None, 1),
    }


def test_gpu_cluster_gives_the_replica_a_gpu() -> None:
    cpu, gpu = _rs(CPU)["spec"]["rayClusterConfig"], _rs(GPU)["spec"]["rayClusterConfig"]
    assert cpu["rayVersion"] == gpu["rayVersion"]
    # the head is the same apart from the image (a CUDA torch build)
    assert _diff(cpu["headGroupSpec"], gpu["headGroupSpec"]) == {
        ("template", "spec", "containers", 0, "image"): ("slotune:latest", "slotune:cuda")
    }
    (group,) = gpu["workerGroupSpecs"]
    (c,) = group["template"]["spec"]["containers"]
    assert c["image"] == "slotune:cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == group["rayStartParams"]["num-gpus"] == "1"
    dep = _serve(GPU)["applications"][0]["deployments"][0]
    opts, gpus = dep["ray_actor_options"], int(group["rayStartParams"]["num-gpus"])
    assert opts["num_gpus"] * dep["num_replicas"] <= gpus * group["replicas"]
    assert opts["num_cpus"] <= int(c["resources"]["limits"]["cpu"])


def _fields(model: Any) -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        out |= {name, f.alias} - {None}
    return out


# ids: not "gpu", which tests/conftest.py reads as the gpu marker and skips without CUDA
@pytest.mark.parametrize("path", [CPU, GPU], ids=["rayservice", "rayservice-gpu"])
def test_serve_config_passes_ray_serves_schema_and_slotunes(path: Any) -> None:
    from ray.serve.schema import (
        DeploymentSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    raw = _serve(path)
    schema = ServeDeploySchema.model_validate(raw)
    # Serve's models ignore unknown keys: a misspelt one would pass unseen
    assert set(raw) <= _fields(ServeDeploySchema)
    for app in raw["applications"]:
        assert set(app) <= _fields(ServeApplicationSchema)
        for dep in app["deployments"]:
            assert set(dep) <= _fields(DeploymentSchema)
            assert set(dep.get("ray_actor_options", {})) <= _fields(RayActorOptionsSchema)
    (app,) = schema.applications
    args = ServerArgs.from_args(app.args)
    (dep,) = app.deployments
    live = LiveConfig.from_user_config(dep.user_config)
    live.check_fits(args)
    assert live.max_ongoing_requests is not None and live.max_queued_requests is not None
    # Serve lets through admission + queue and more; the replica answers 429 itself
    assert dep.max_ongoing_requests > live.max_ongoing_requests + live.max_queued_requests
    assert dep.max_queued_requests == -1


def test_schema_check_catches_a_misspelt_key() -> None:
    from ray.serve.schema import DeploymentSchema

    dep = _serve(CPU)["applications"][0]["deployments"][0]
    assert not {*dep, "max_ongoing_request"} <= _fields(DeploymentSchema)


def test_rayservice_serves_the_app_of_serve_config_yaml() -> None:
    local = yaml.safe_load((DEPLOY / "serve-config.yaml").read_text())["applications"]
    for path in (CPU, GPU):
        (a,), (b,) = local, _serve(path)["applications"]
        for key in ("name", "route_prefix", "import_path", "runtime_env"):
            assert a[key] == b[key], (path.name, key)
        assert set(a) == set(b)
        # the same args, apart from the device and the cluster's sizing
        assert set(a["args"]) == set(b["args"])
        for k in set(a["args"]) - SIZING_ARGS - {"device"}:
            assert a["args"][k] == b["args"][k], (path.name, k)
        (da,), (db,) = a["deployments"], b["deployments"]
        assert da["name"] == db["name"]
        for k in (set(da) | set(db)) - SIZING_DEPLOYMENT - {"user_config"}:
            assert da[k] == db[k], (path.name, k)
        ua, ub = da["user_config"], db["user_config"]
        assert set(ua) == set(ub)
        for k in set(ua) - SIZING_USER_CONFIG:  # the SLO the replicas judge slo_met by
            assert ua[k] == ub[k], (path.name, k)
