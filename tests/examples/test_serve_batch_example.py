"""The ``@serve.batch`` example (deploy/examples/serve_batch): it serves, Serve batches it,
and a declarative ``user_config`` change retunes the batch limit without a restart.

Pure checks of the request handling and the model first; then, on the session Ray
cluster, the app from its own serve_config.yaml (renamed, on its own route prefix, a
smaller model), updated the way ``serve deploy`` and slotune's serve actuator update it.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deploy.examples.serve_batch.app import AppArgs, _check_user_config
from deploy.examples.serve_batch.protocol import ApiError, CompletionRequest, Job, to_job
from deploy.examples.serve_batch.tokens import EOS_ID

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy/examples/serve_batch/serve_config.yaml"
APP = "t-serve-batch-example"
PREFIX = "/t-serve-batch-example"
WAIT_S = 120.0


# -- pure ------------------------------------------------------------------------------


def test_config_file_is_a_valid_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(CONFIG.read_text())
    (app,) = ServeDeploySchema.model_validate(raw).applications
    assert app.import_path == "deploy.examples.serve_batch.app:app"
    assert raw["http_options"]["host"] == "127.0.0.1"
    (dep,) = app.deployments
    assert dep.user_config == {"max_batch_size": 8}
    assert dep.max_ongoing_requests >= dep.user_config["max_batch_size"]
    assert dep.ray_actor_options.num_cpus == 0
    AppArgs.from_args(app.args)


def test_example_imports_nothing_of_slotune() -> None:
    """It stands for someone else's deployment: Ray, FastAPI, torch and itself only."""
    slotune = {"serving", "metrics", "search", "controller"}
    bad = []
    for path in sorted((ROOT / "deploy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in slotune]
    assert not bad, bad


def test_requests_become_jobs_or_4xx() -> None:
    job = to_job(CompletionRequest(prompt="hé", max_tokens=3))
    assert job.prompt_ids == (104, 195, 169)  # UTF-8 bytes
    assert to_job(CompletionRequest(prompt=[1, 2, 256], max_tokens=1)).prompt_ids == (1, 2, 256)
    assert to_job(CompletionRequest(prompt="")).prompt_ids == (EOS_ID,)
    for bad in ({"prompt": [300]}, {"prompt": "x", "model": "gpt-4"}, {"prompt": "x" * 5000}):
        with pytest.raises(ApiError) as e:
            to_job(CompletionRequest(**bad))
        assert 400 <= e.value.status < 500
    j = Job(prompt_ids=(1,), max_tokens=2, ignore_eos=False)
    assert [j.finish_reason(5, 1), j.finish_reason(5, 2), j.finish_reason(EOS_ID, 1)] == [
        None,
        "length",
        "stop",
    ]
    assert Job(prompt_ids=(1,), max_tokens=2, ignore_eos=True).finish_reason(EOS_ID, 1) is None


def test_user_config_convention_is_checked() -> None:
    assert _check_user_config({"max_batch_size": 4}) == (4, None)
    assert _check_user_config({"max_batch_size": 2, "batch_wait_timeout_s": 0.05}) == (2, 0.05)
    for bad in ({}, {"max_batch_size": 0}, {"max_batch_size": True}, {"max_batch_size": "8"}):
        with pytest.raises(ValueError, match="max_batch_size"):
            _check_user_config(bad)
    with pytest.raises(ValueError, match="unknown app args"):
        AppArgs.from_args({"layers": 2})


def test_model_is_fixed_by_its_seed_and_batch_rows_are_independent() -> None:
    import torch

    from deploy.examples.serve_batch.model import LMConfig, TinyLM

    a, b = TinyLM(LMConfig(d_model=32, seed=3)), TinyLM(LMConfig(d_model=32, seed=3))
    h, nxt = a.prefill([[1, 2, 3], [4]])
    assert h.shape == (2, 2, 32) and nxt.shape == (2,)
    assert torch.equal(nxt, b.prefill([[1, 2, 3], [4]])[1])
    nxt2, h2 = a.step(nxt, h, rows=[1])  # the second row alone
    alone_h, alone = a.prefill([[4]])
    assert h2.shape == (2, 1, 32)
    assert torch.equal(nxt2, a.step(alone, alone_h)[0])


# -- on the session Ray cluster ----------------------------------------------------------


def _apply(app_config: dict[str, Any] | None) -> None:
    """Put (or, with None, remove) our app in the declarative set, keeping every other app:
    what ``serve deploy`` and ``PUT /api/serve/applications/`` send (through slotune's
    serving/app/ray_private.py: the test may use slotune, the example may not)."""
    from serving.app import ray_private

    client = ray_private.serve_client(start=False)
    assert client is not None, "Serve is not running on the session cluster"
    apps = ray_private.declarative_app_configs(client)
    apps.pop(APP, None)
    if app_config is not None:
        apps[APP] = app_config
    ray_private.deploy_apps(client, list(apps.values()))


def _config(max_batch_size: int, max_ongoing_requests: int) -> dict[str, Any]:
    raw = yaml.safe_load(CONFIG.read_text())
    app = copy.deepcopy(raw["applications"][0])
    app.update(name=APP, route_prefix=PREFIX)
    app["args"]["d_model"] = 256  # a lighter model: this is about batching, not speed
    (dep,) = app["deployments"]
    dep["max_ongoing_requests"] = max_ongoing_requests
    # a longer wait than the example's 0.1 s: batches fill even on a loaded 2-core machine
    dep["user_config"] = {"max_batch_size": max_batch_size, "batch_wait_timeout_s": 0.2}
    return app


def _wait(what: str, ok: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {WAIT_S} s")


def _running() -> bool:
    from ray import serve

    st = serve.status().applications.get(APP)
    return st is not None and str(getattr(st.status, "value", st.status)) == "RUNNING"


def _stats(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/stats", timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()


async def _one(http: httpx.AsyncClient, base: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": "hello batch",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events: list[Any] = []
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", events[-3:]
    *chunks, usage_chunk, _ = events
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == max_tokens
    texts = [c["choices"][0]["text"] for c in chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert len(texts) == max_tokens and all(len(t) == 1 for t in texts)
    assert reasons == [None] * (max_tokens - 1) + ["length"]
    return {"text": "".join(texts)}


async def _burst(base: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=WAIT_S, trust_env=False) as http:
        return await asyncio.gather(*(_one(http, base, max_tokens) for _ in range(n)))


def _check_batches(base: str, limit: int) -> dict[str, Any]:
    s = _stats(base)
    sizes = {int(k) for k in s["batch_sizes"]}
    assert max(sizes) <= limit, s  # Serve never formed a batch over the limit
    assert limit in sizes, s  # and under a queue of 3x the limit it filled one
    assert max(int(k) for k in s["step_rows"]) <= limit
    return s


@pytest.fixture(scope="module")
def example(ray_cluster) -> Any:
    _apply(_config(max_batch_size=4, max_ongoing_requests=16))
    try:
        _wait(f"app {APP} RUNNING", _running)
        yield ray_cluster.http_url + PREFIX
    finally:
        _apply(None)
        _wait(f"app {APP} deleted", _gone)


def _gone() -> bool:
    from ray import serve

    return APP not in serve.status().applications


@pytest.mark.ray
@pytest.mark.slow
def test_serves_batches_and_retunes_in_place(example: str) -> None:
    base = example
    assert httpx.get(base + "/health", timeout=30, trust_env=False).status_code == 200
    models = httpx.get(base + "/v1/models", timeout=30, trust_env=False).json()
    assert models["data"][0]["id"] == "serve-batch-tiny-gru"
    before = _stats(base)
    assert before["max_batch_size"] == 4 and before["batch_wait_timeout_s"] == 0.2
    assert before["torch_threads"] == 1 and before["omp_wait_policy"] == "PASSIVE"

    asyncio.run(_burst(base, n=12, max_tokens=64))
    _check_batches(base, limit=4)

    async def retune_under_load() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=WAIT_S, trust_env=False) as http:
            inflight = asyncio.create_task(_one(http, base, max_tokens=400))
            await asyncio.sleep(0.3)
            # both knobs are lightweight: user_config (reconfigure) and max_ongoing_requests
            await asyncio.to_thread(_apply, _config(max_batch_size=2, max_ongoing_requests=8))
            await asyncio.to_thread(
                _wait, "max_batch_size=2 applied", lambda: _stats(base)["max_batch_size"] == 2
            )
            return await inflight  # the stream begun before the update finishes whole

    retune = asyncio.run(retune_under_load())
    assert len(retune["text"]) == 400
    after = _stats(base)
    assert (after["pid"], after["replica_id"]) == (before["pid"], before["replica_id"])
    assert _running()

    httpx.post(base + "/stats/reset", timeout=30, trust_env=False).raise_for_status()
    asyncio.run(_burst(base, n=6, max_tokens=64))
    s = _check_batches(base, limit=2)
    assert (s["pid"], s["replica_id"]) == (before["pid"], before["replica_id"])
