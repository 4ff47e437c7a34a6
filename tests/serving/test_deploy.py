"""Deploying the completion server and changing its knobs in place.

Pure checks of the config files and the config builder first; then, on the
session Ray cluster, the no-restart property (same replica pid, an in-flight
stream survives a knob change) and admission control (503 beyond the queue).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from metrics.observation import Slo
from serving.app.config import DEPLOYMENT_NAME, REPLICA_ENV_VARS, LiveConfig, ServerArgs
from serving.app.deploy import (
    IMPORT_PATH,
    REPLICA_ACTOR_OPTIONS,
    actor_options,
    app_config,
    refusal_margin,
)

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = ("deploy/serve-config.yaml", "deploy/serve-config-gpu.yaml")


def _serve_schema():
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=["serve-config", "serve-config-cuda"])
def test_serve_config_file_is_what_deploy_app_builds(path: str) -> None:
    raw = yaml.safe_load((ROOT / path).read_text())
    schema = _serve_schema().model_validate(raw)
    (app,) = raw["applications"]
    assert app["import_path"] == IMPORT_PATH == schema.applications[0].import_path
    (dep,) = app["deployments"]
    assert dep["name"] == DEPLOYMENT_NAME
    args = ServerArgs.from_args(app["args"])
    live = LiveConfig.from_user_config(dep["user_config"])
    assert live.max_ongoing_requests is not None and live.max_queued_requests is not None
    # Serve hands the replica its admission limit + queue + margin and never queues itself
    assert dep["max_ongoing_requests"] == live.max_ongoing_requests + live.max_queued_requests + (
        refusal_margin(live.max_ongoing_requests)
    )
    assert dep["max_queued_requests"] == -1
    built = app_config(
        name=app["name"],
        route_prefix=app["route_prefix"],
        args=args,
        live=live,
        max_queued_requests=live.max_queued_requests,
        num_replicas=dep["num_replicas"],
    )
    assert built == app


def test_the_gpu_serve_config_is_the_cpu_one_with_the_replica_on_a_gpu() -> None:
    cpu, gpu = (yaml.safe_load((ROOT / p).read_text()) for p in SERVE_CONFIGS)
    (dep,) = gpu["applications"][0]["deployments"]
    assert gpu["applications"][0]["args"]["device"] == "cuda"
    assert dep.pop("ray_actor_options") == {**REPLICA_ACTOR_OPTIONS, "num_gpus": 1}
    gpu["applications"][0]["args"]["device"] = "cpu"
    assert gpu == cpu


def test_a_cuda_replica_reserves_one_gpu_and_a_cpu_one_keeps_the_deployments_options() -> None:
    from serving.app.server import CompletionServer

    base = {
        "name": "a",
        "route_prefix": "/",
        "live": LiveConfig(max_batch_size=8, max_ongoing_requests=4),
        "num_replicas": 2,
    }
    (cpu,) = app_config(**base, args=ServerArgs())["deployments"]
    assert "ray_actor_options" not in cpu  # the deployment's own apply
    # what the CUDA entry repeats beside num_gpus, since it replaces the deployment's whole
    assert CompletionServer.ray_actor_options == REPLICA_ACTOR_OPTIONS
    for device in ("cuda", "cuda:0"):
        cfg = app_config(**base, args=ServerArgs(device=device))
        (dep,) = cfg["deployments"]
        assert dep["ray_actor_options"] == {"num_cpus": 0, "num_gpus": 1}
        assert dep["num_replicas"] == 2 and cfg["args"]["device"] == device
        # the rest is the CPU entry's
        assert {k: v for k, v in dep.items() if k != "ray_actor_options"} == cpu
    assert actor_options(ServerArgs()) is None


def test_a_gpu_index_a_ray_placed_replica_cannot_see_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device='cuda:1': .*give 'cuda' \(or 'cuda:0'\)"):
        app_config(
            name="a",
            route_prefix="/",
            args=ServerArgs(device="cuda:1"),
            live=LiveConfig(max_batch_size=8),
        )


def test_rayservice_embeds_a_valid_serve_config() -> None:
    docs = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    assert docs["kind"] == "RayService"
    inner = yaml.safe_load(docs["spec"]["serveConfigV2"])
    schema = _serve_schema().model_validate(inner)
    app = schema.applications[0]
    assert app.import_path == IMPORT_PATH
    ServerArgs.from_args(app.args)
    LiveConfig.from_user_config(app.deployments[0].user_config)


def test_replica_env_reaches_every_config_and_the_callers_env_wins() -> None:
    base = {
        "name": "a",
        "route_prefix": "/",
        "args": ServerArgs(),
        "live": LiveConfig(max_batch_size=8, max_ongoing_requests=4),
        "max_queued_requests": -1,
    }
    assert app_config(**base)["runtime_env"] == {"env_vars": REPLICA_ENV_VARS}
    mine = {"working_dir": ".", "env_vars": {"RAY_worker_niceness": "5", "X": "1"}}
    env = app_config(**base, runtime_env=mine)["runtime_env"]
    assert env["working_dir"] == "."
    assert env["env_vars"] == {**REPLICA_ENV_VARS, "RAY_worker_niceness": "5", "X": "1"}
    assert mine["env_vars"] == {"RAY_worker_niceness": "5", "X": "1"}  # not mutated
    # What update_knobs sends back must hash to the same code version: idempotent.
    again = app_config(**base, runtime_env=app_config(**base)["runtime_env"])
    assert again["runtime_env"] == app_config(**base)["runtime_env"]
    raw = yaml.safe_load((ROOT / "deploy/serve-config.yaml").read_text())
    assert raw["applications"][0]["runtime_env"]["env_vars"] == REPLICA_ENV_VARS
    kuberay = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    inner = yaml.safe_load(kuberay["spec"]["serveConfigV2"])
    assert inner["applications"][0]["runtime_env"]["env_vars"] == REPLICA_ENV_VARS


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_queued_requests": 0}, "max_queued_requests=0"),
        ({"num_replicas": 0}, "num_replicas=0"),
        ({"route_prefix": "v1"}, "route_prefix='v1'"),
        ({"live": LiveConfig(max_batch_size=65)}, "max_batch_size=65: must be <= max_slots=64"),
    ],
)
def test_app_config_rejects_bad_knobs(kwargs: dict[str, object], fragment: str) -> None:
    base: dict[str, object] = {
        "name": "a",
        "route_prefix": "/",
        "args": ServerArgs(max_slots=64),
        "live": LiveConfig(max_batch_size=8, max_ongoing_requests=4),
        "max_queued_requests": -1,
    }
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        app_config(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: LiveConfig(max_batch_size=0), "max_batch_size=0"),
        (lambda: LiveConfig(max_batch_size=True), "max_batch_size=True"),
        (lambda: LiveConfig(max_batch_size=4, ttft_p99_s=-1), "ttft_p99_s=-1"),
        (lambda: LiveConfig(max_batch_size=4, tpot_p99_s=True), "tpot_p99_s=True"),
        (lambda: LiveConfig(max_batch_size=4, max_ongoing_requests=0), "max_ongoing_requests=0"),
        (lambda: LiveConfig.from_user_config({"max_batch_size": 4, "x": 1}), "'x'"),
        (lambda: ServerArgs(model="huge"), "model='huge'"),
        (lambda: ServerArgs(device="tpu"), "device='tpu'"),
        (lambda: ServerArgs(torch_threads=0), "torch_threads=0"),
        (lambda: ServerArgs(stream_interval_s=2), "stream_interval_s=2"),
        (lambda: ServerArgs(stream_events_per_s=-1), "stream_events_per_s=-1"),
        (lambda: ServerArgs(stream_events_per_s=False), "stream_events_per_s=False"),
        (lambda: ServerArgs(omp_wait_policy="spin"), "omp_wait_policy='spin'"),
        (lambda: ServerArgs(served_model_name=""), "served_model_name='': must be a non-empty"),
        (lambda: ServerArgs(served_model_name="my model"), "served_model_name='my model'"),
        (lambda: ServerArgs(served_model_name="m\t"), "without whitespace"),
        (lambda: ServerArgs.from_args({"modle": "tiny"}), "'modle'"),
    ],
)
def test_configs_name_the_bad_value(make, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        make()


def test_knob_update_sends_back_the_deployed_args_and_env_verbatim(monkeypatch) -> None:
    """The code version is import path + runtime_env + args: an app deployed without
    today's defaults (an older slotune, a hand-written config) must not get them filled
    in by a knob update, or its replica would restart."""
    import serving.app.deploy as deploy

    old_args = {"model": "tiny", "max_slots": 8}  # no stream_events_per_s, no max_len
    deployed = {
        "name": "old",
        "route_prefix": "/old",
        "import_path": IMPORT_PATH,
        "args": dict(old_args),
        "deployments": [
            {"name": DEPLOYMENT_NAME, "num_replicas": 1, "user_config": {"max_batch_size": 2}}
        ],
    }  # and no runtime_env at all
    sent: dict = {}
    monkeypatch.setattr(deploy, "_client", lambda: object())
    monkeypatch.setattr(deploy, "_declarative_apps", lambda c: {"old": deployed})
    monkeypatch.setattr(deploy, "_apply", lambda c, name, cfg: sent.update(cfg))
    monkeypatch.setattr(deploy, "wait_applied", lambda *a, **k: None)
    deploy.update_knobs(max_batch_size=4, max_ongoing_requests=4, app_name="old")
    assert sent["args"] == old_args and "runtime_env" not in sent
    assert sent["deployments"][0]["user_config"]["max_batch_size"] == 4
    assert sent["deployments"][0]["max_ongoing_requests"] == 4
    # With them deployed, they go back as they are.
    deployed["runtime_env"] = {"env_vars": {"X": "1"}}
    deploy.update_knobs(max_batch_size=3, max_ongoing_requests=3, app_name="old")
    assert sent["runtime_env"] == {"env_vars": {"X": "1"}} and sent["args"] == old_args
    # A replica's ray_actor_options restart it too: a GPU app deployed without today's
    # placement (or with a hand-written one) gets back what it has, nothing filled in.
    deployed["args"] = {**old_args, "device": "cuda"}
    deploy.update_knobs(max_batch_size=3, max_ongoing_requests=3, app_name="old")
    assert "ray_actor_options" not in sent["deployments"][0]
    deployed["deployments"][0]["ray_actor_options"] = {"num_cpus": 4, "num_gpus": 1}
    deploy.update_knobs(max_batch_size=3, max_ongoing_requests=3, app_name="old")
    assert sent["deployments"][0]["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}


def test_omp_wait_policy_is_set_for_the_process(monkeypatch, caplog) -> None:
    from serving.app.config import set_omp_wait_policy

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert set_omp_wait_policy(None) == "PASSIVE"  # unset: the shared-machine default
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert set_omp_wait_policy(None) == "ACTIVE"  # None keeps what the operator set
    assert set_omp_wait_policy("passive") == "PASSIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    # torch is loaded in this process already: say the policy may come too late.
    assert "may not apply" in caplog.text


def test_config_round_trips() -> None:
    live = LiveConfig(max_batch_size=4, ttft_p99_s=0.5, max_ongoing_requests=3, version="v1")
    assert LiveConfig.from_user_config(live.to_user_config()) == live
    args = ServerArgs(model="small", max_slots=16, checkpoint=None)
    assert ServerArgs.from_args(args.to_args()) == args
    assert args.served_name == "slotune-small"
    named = ServerArgs(model="small", served_model_name="org/my-llama-8b")
    assert ServerArgs.from_args(named.to_args()) == named
    assert named.served_name == "org/my-llama-8b"
    # a checkpoint serves under its folder's name, not the preset's
    assert ServerArgs(checkpoint="/models/Llama-3.1-8B-Instruct/").served_name == (
        "Llama-3.1-8B-Instruct"
    )
    assert ServerArgs(checkpoint="/m/x", served_model_name="y").served_name == "y"


# -- on the session Ray cluster ---------------------------------------------------------

APP = "t-deploy"
PREFIX = "/t-deploy"


@pytest.fixture(scope="module")
def deployed(ray_cluster):
    from serving.app.deploy import delete_app, deploy_app

    deploy_app(
        ServerArgs(model="tiny", max_slots=8, max_len=1024),  # long streams: still in flight
        LiveConfig(max_batch_size=4, max_ongoing_requests=8),  # while a knob update lands
        name=APP,
        route_prefix=PREFIX,
        max_queued_requests=16,
    )
    yield ray_cluster.http_url + PREFIX
    delete_app(APP)


def _stats(base: str) -> dict:
    r = httpx.get(base + "/stats", timeout=30)
    r.raise_for_status()
    return r.json()


def _stream(base: str, body: dict, out: list, first: threading.Event) -> None:
    """Read one SSE completion into ``out`` (status, then events); set ``first`` on the first."""
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    out.append(data if data == "[DONE]" else json.loads(data))
                    first.set()
    first.set()


@pytest.mark.ray
def test_knob_update_is_in_place_and_in_flight_streams_survive(deployed: str) -> None:
    from serving.app.deploy import replica_pids, replica_states, update_knobs

    pids = replica_pids(APP)
    assert len(pids) == 1
    # In flight when the update lands, with margin: the tiny model with the C kernels
    # decodes 1,000 tokens in ~1.2 s and an update takes ~0.4 s (measured here), so
    # six long streams run in two waves of the batch limit 4 (the second is queued).
    n, max_tokens = 6, 1000
    outs: list[list] = [[] for _ in range(n)]
    firsts = [threading.Event() for _ in range(n)]
    threads = [
        threading.Thread(
            target=_stream,
            args=(
                deployed,
                {"prompt": f"fox {i}", "max_tokens": max_tokens, "temperature": 0},
                o,
                f,
            ),
            daemon=True,
        )
        for i, (o, f) in enumerate(zip(outs, firsts, strict=True))
    ]
    for t in threads:
        t.start()
    assert any(f.wait(60) for f in firsts)
    update_knobs(
        app_name=APP,
        max_batch_size=2,
        max_ongoing_requests=5,
        slo=Slo(ttft_p99_s=0.5, tpot_p99_s=0.05),
    )
    after = _stats(deployed)
    # The update was applied while streams were still generating.
    assert after["running"] >= 1, f"streams ended before the update landed: {after}"
    assert after["max_batch_size"] == 2 and after["max_ongoing_requests"] == 5
    assert after["live"]["ttft_p99_s"] == 0.5
    for t in threads:
        t.join(120)
    for out in outs:  # every stream, in flight or queued at the update, completed
        assert out[0] == 200
        events = out[1:]
        assert events[-1] == "[DONE]"
        finals = [e for e in events[:-1] if e["choices"][0]["finish_reason"] is not None]
        assert [e["choices"][0]["finish_reason"] for e in finals] in (["length"], ["stop"])
    assert replica_pids(APP) == pids  # no restart
    (state,) = replica_states(APP)
    assert (state.pid, state.max_batch_size, state.max_ongoing_requests) == (pids[0], 2, 5)


@pytest.mark.ray
def test_excess_requests_get_a_json_429_with_retry_after_and_limits_hold(deployed: str) -> None:
    """Admission 1, queue 1, a burst of 6: every request is served in full or refused at
    once with an OpenAI-style body and Retry-After; the replica never holds more than its
    limits (polled throughout); nothing is dropped."""
    from serving.app.deploy import replica_pids, update_knobs

    pids = replica_pids(APP)
    update_knobs(app_name=APP, max_batch_size=1, max_ongoing_requests=1, max_queued_requests=1)
    n = 6
    answers: list[httpx.Response | None] = [None] * n
    peak = {"admitted": 0, "queued": 0}
    done = threading.Event()

    def post(i: int) -> None:
        answers[i] = httpx.post(
            deployed + "/v1/completions",
            json={"prompt": f"load {i}", "max_tokens": 300, "temperature": 0},
            timeout=120,
        )

    def watch() -> None:
        while not done.is_set():
            st = _stats(deployed)
            peak["admitted"] = max(peak["admitted"], st["admitted"])
            peak["queued"] = max(peak["queued"], st["queued"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    done.set()
    watcher.join(30)
    statuses = [a.status_code if a is not None else None for a in answers]
    assert set(statuses) <= {200, 429}, statuses  # every request answered
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    for a in answers:
        assert a is not None
        if a.status_code == 200:  # admitted requests complete in full
            assert 1 <= a.json()["usage"]["completion_tokens"] <= 300
        else:
            err = a.json()["error"]
            assert err["code"] == "overloaded" and "queue" in err["message"]
            assert int(a.headers["retry-after"]) >= 1
    assert peak["admitted"] <= 1 and peak["queued"] <= 1, peak
    update_knobs(app_name=APP, max_batch_size=4, max_ongoing_requests=8, max_queued_requests=16)
    assert replica_pids(APP) == pids


@pytest.mark.ray
@pytest.mark.slow
def test_changing_args_does_restart_the_replica(deployed: str) -> None:
    """The control for the no-restart checks: a heavyweight change gives a new pid."""
    from serving.app.deploy import deploy_app, replica_pids

    pids = replica_pids(APP)
    deploy_app(
        ServerArgs(model="tiny", max_slots=8, seed=1),  # seed is in the args: a new version
        LiveConfig(max_batch_size=4, max_ongoing_requests=8),
        name=APP,
        route_prefix=PREFIX,
        max_queued_requests=16,
    )
    new = replica_pids(APP)
    assert len(new) == 1 and new != pids


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--port", "0"], "--port 0"),
        (["--port", "9000", "--metrics-port", "9000"], "both 9000"),
        (["--model", "huge"], "model='huge'"),
        (["--max-batch-size", "65", "--max-slots", "64"], "--max-batch-size 65"),
        (["--slo-ttft-ms", "-1"], "--slo-ttft-ms -1"),
        (["--stream-interval", "5"], "stream_interval_s=5"),
        (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint /nonexistent/ckpt: no such folder"),
        (["--served-model-name", "my model"], "served_model_name='my model'"),
        (["--device", "cuda:1"], "device='cuda:1'"),
        (["--num-replicas", "0"], "--num-replicas 0"),
    ],
)
def test_slotune_serve_rejects_bad_flags_before_starting_ray(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("slotune: error:") and fragment in err and "\n" not in err
