"""`slotune tune` end to end on deployments that are not slotune's own (issue 18):

- (b) the ``@serve.batch`` example (deploy/examples/serve_batch), deployed as a
  declarative config through Serve's REST API on the session cluster, tuned with the
  ``serve`` actuator and the ``client`` metrics profile to a feasible point, with no
  replica restart;
- (c) a stand-in server that exports vLLM-named metrics in vLLM's bucket layout, tuned with
  ``--actuator none --metrics-profile vllm``: measured over client concurrency and only
  recommended.

Bounded: a few trials of a few seconds each, loopback only.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.vllm_standin import StandinConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "serve_batch" / "serve_config.yaml"
APP = "e2e-serve-batch"


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from controller.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    return int(e.value.code or 0), cap.out, cap.err


def _rest(cluster):
    from controller.backends.serve_rest import ServeRest
    from serving.app.cluster import read_token

    return ServeRest(cluster.dashboard_url, token=read_token())


def _put_app(cluster, app: dict[str, Any] | None) -> None:
    """Our app in (or, with None, out of) the declarative set, every other app kept: what
    `serve deploy` sends."""
    from controller.backends.serve_rest import declarative_apps

    rest = _rest(cluster)
    try:
        details = rest.details()
        apps = [a for a in declarative_apps(details) if a.get("name") != APP]
        rest.put(details, apps + ([app] if app is not None else []))
    finally:
        rest.close()


def _example_app() -> dict[str, Any]:
    (app,) = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["applications"])
    app.update(name=APP, route_prefix=f"/{APP}")
    app["args"]["d_model"] = 256  # lighter: this is about the backend, not speed
    (dep,) = app["deployments"]
    dep["max_ongoing_requests"] = 4
    dep["user_config"] = {"max_batch_size": 2, "batch_wait_timeout_s": 0.05}
    return app


def _deployment(cluster) -> dict[str, Any]:
    rest = _rest(cluster)
    try:
        return rest.details()["applications"][APP]["deployments"]["BatchedLM"]
    finally:
        rest.close()


@pytest.fixture(scope="module")
def serve_batch_app(ray_cluster):
    _put_app(ray_cluster, _example_app())
    deadline = time.monotonic() + 180
    while True:
        try:
            dep = _deployment(ray_cluster)
            if dep.get("status") == "HEALTHY" and dep.get("replicas"):
                break
        except KeyError:
            pass
        assert time.monotonic() < deadline, "the example did not become healthy in 180 s"
        time.sleep(0.5)
    try:
        yield ray_cluster
    finally:
        _put_app(ray_cluster, None)


@pytest.mark.ray
@pytest.mark.slow
def test_serve_batch_example_is_tuned_through_rest(serve_batch_app, tmp_path: Path, capsys):
    before = {(r["replica_id"], r["pid"]) for r in _deployment(serve_batch_app)["replicas"]}
    out = tmp_path / "out"
    argv = [
        "tune",
        "--app",
        APP,
        "--actuator",
        "serve",
        "--batch-knob",
        "user_config.max_batch_size",
        "--metrics-profile",
        "client",
        "--max-batch",
        "8",
        "--slo-ttft-ms",
        "4000",
        "--slo-tpot-ms",
        "200",
        "--prompt-tokens",
        "16",
        "--output-tokens",
        "8",
        "--max-trials",
        "5",
        "--time-budget",
        "240",
        # two windows pool the ~300 requests a p99 verdict needs
        *["--warmup", "1", "--window", "2", "--max-window", "20", "--min-requests", "160"],
        "--out",
        str(out),
        "--quiet",
    ]
    code, stdout, err = _cli(argv, capsys)
    assert code == 0, f"exit {code}: {err[-2000:]}"
    d = json.loads((out / "curve.json").read_text())
    op = d["operating_point"]
    assert op is not None and op["verdict"] == "met"
    assert d["backend"]["actuator"] == "serve" and "client" in d["backend"]["metrics"]
    assert "unseeded" in d["seed_note"]  # no --model-config: the report says why
    for t in d["trials"]:
        assert t["completed"] > 0
    # The knobs reached the example live: the same replica, now on the chosen point.
    dep = _deployment(serve_batch_app)
    assert {(r["replica_id"], r["pid"]) for r in dep["replicas"]} == before
    cfg = dep["deployment_config"]
    assert cfg["user_config"]["max_batch_size"] == op["max_batch_size"]
    assert cfg["max_ongoing_requests"] == op["max_concurrency"]
    assert cfg["user_config"]["batch_wait_timeout_s"] == 0.05  # the other key untouched


@pytest.mark.slow
@pytest.mark.parametrize(
    "vllm_standin",
    [StandinConfig(max_num_seqs=12, step_a_s=0.008, step_b_s=0.002)],
    indirect=True,
)
def test_vllm_standin_is_measured_and_recommended(vllm_standin, tmp_path: Path, capsys):
    out = tmp_path / "out"
    argv = [
        "tune",
        "--actuator",
        "none",
        "--url",
        vllm_standin.url,
        "--metrics-url",
        f"{vllm_standin.url}/metrics",
        "--metrics-profile",
        "vllm",
        "--max-batch",
        "32",
        "--slo-ttft-ms",
        "1000",
        "--slo-tpot-ms",
        "50",  # a vLLM TPOT bucket bound: a clean verdict
        "--prompt-tokens",
        "16",
        "--output-tokens",
        "4",
        "--max-trials",
        "6",
        "--time-budget",
        "200",
        # a p99 verdict needs ~300 requests pooled; the stand-in serves them in seconds
        *["--warmup", "1", "--window", "2", "--max-window", "15", "--min-requests", "300"],
        "--out",
        str(out),
        "--quiet",
    ]
    code, stdout, err = _cli(argv, capsys)
    assert code == 0, f"exit {code}: {err[-2000:]}"
    d = json.loads((out / "curve.json").read_text())
    op = d["operating_point"]
    assert op is not None and op["verdict"] == "met"
    assert op["max_batch_size"] == op["max_concurrency"]  # one knob: client concurrency
    assert d["backend"]["actuator"] == "none" and d["backend"]["applied"] is False
    assert "vllm" in d["backend"]["metrics"] and d["backend"]["batch_limit"] == "fixed"
    html = (out / "report.html").read_text()
    assert "recommendations" in html
    for t in d["trials"]:
        # the server's histograms (vLLM names) and the client saw the same window
        assert t["completed"] > 0 and t["client_completed"] > 0
