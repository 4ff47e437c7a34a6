"""Deploying the completion server and changing its knobs in place.

Pure checks of the config files and the config builder first; then, on the
session Ray cluster, the no-restart property (same replica pid, an in-flight
stream survives a knob change) and admission control (503 beyond the queue).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.app import DEPLOYMENT_NAME, LiveConfig, ServerArgs
from serving.deploy import IMPORT_PATH, app_config

ROOT = Path(__file__).resolve().parents[2]


def _serve_schema():
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema


def test_serve_config_file_is_what_deploy_app_builds() -> None:
    raw = yaml.safe_load((ROOT / "deploy/serve-config.yaml").read_text())
    schema = _serve_schema().model_validate(raw)
    (app,) = raw["applications"]
    assert app["import_path"] == IMPORT_PATH == schema.applications[0].import_path
    (dep,) = app["deployments"]
    assert dep["name"] == DEPLOYMENT_NAME
    args = ServerArgs.from_args(app["args"])
    live = LiveConfig.from_user_config(dep["user_config"])
    assert live.max_ongoing_requests == dep["max_ongoing_requests"]
    built = app_config(
        name=app["name"],
        route_prefix=app["route_prefix"],
        args=args,
        live=live,
        max_ongoing_requests=dep["max_ongoing_requests"],
        max_queued_requests=dep["max_queued_requests"],
        num_replicas=dep["num_replicas"],
    )
    assert built == app


def test_rayservice_embeds_a_valid_serve_config() -> None:
    docs = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    assert docs["kind"] == "RayService"
    inner = yaml.safe_load(docs["spec"]["serveConfigV2"])
    schema = _serve_schema().model_validate(inner)
    app = schema.applications[0]
    assert app.import_path == IMPORT_PATH
    ServerArgs.from_args(app.args)
    LiveConfig.from_user_config(app.deployments[0].user_config)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_ongoing_requests": 0}, "max_ongoing_requests=0"),
        ({"max_queued_requests": 0}, "max_queued_requests=0"),
        ({"num_replicas": 0}, "num_replicas=0"),
        ({"route_prefix": "v1"}, "route_prefix='v1'"),
        ({"live": LiveConfig(max_batch_size=65)}, "max_batch_size=65"),
    ],
)
def test_app_config_rejects_bad_knobs(kwargs: dict[str, object], fragment: str) -> None:
    base: dict[str, object] = {
        "name": "a",
        "route_prefix": "/",
        "args": ServerArgs(max_slots=64),
        "live": LiveConfig(max_batch_size=8),
        "max_ongoing_requests": 4,
        "max_queued_requests": -1,
    }
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        app_config(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: LiveConfig(max_batch_size=0), "max_batch_size=0"),
        (lambda: LiveConfig(max_batch_size=True), "max_batch_size=True"),
        (lambda: LiveConfig(max_batch_size=4, ttft_slo_s=-1), "ttft_slo_s=-1"),
        (lambda: LiveConfig.from_user_config({"max_batch_size": 4, "x": 1}), "'x'"),
        (lambda: ServerArgs(model="huge"), "model='huge'"),
        (lambda: ServerArgs(device="tpu"), "device='tpu'"),
        (lambda: ServerArgs(torch_threads=0), "torch_threads=0"),
        (lambda: ServerArgs.from_args({"modle": "tiny"}), "'modle'"),
    ],
)
def test_configs_name_the_bad_value(make, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        make()


def test_config_round_trips() -> None:
    live = LiveConfig(max_batch_size=4, ttft_slo_s=0.5, max_ongoing_requests=3, version="v1")
    assert LiveConfig.from_user_config(live.to_user_config()) == live
    args = ServerArgs(model="small", max_slots=16, checkpoint=None)
    assert ServerArgs.from_args(args.to_args()) == args
    assert args.served_name == "slotune-small"
