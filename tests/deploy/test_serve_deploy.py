"""``serve deploy deploy/serve-config.yaml``, Ray's own command line, against a running Ray
(the session cluster, token auth on): the file deploys as it is, the app answers a
completion at the route the file gives, runs the knobs the file declares, and a knob change
by slotune's ``serve`` actuator then lands in place (same replica pid: no restart). Serve's
limit edited alone by someone else is seen (the knobs cannot show it), and slotune's next
write restores the one its knobs imply.

Serve keeps the HTTP port it started with (the session's free port, not the file's 8000:
Ray logs that it cannot change it), so the request goes to the session's proxy."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from controller.backends.actuator import ForeignChange
from controller.backends.serve import ServeActuator, replace_app
from controller.backends.serve_rest import ServeRest, declarative_apps, deployment_details
from search.space import Knobs
from tests.reliability.ray_procs import child_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "serve-config.yaml"


def test_serve_deploy_of_the_config_file_serves_and_takes_knobs_in_place(ray_cluster) -> None:
    from serving.app.cluster import read_token
    from serving.app.deploy import delete_app, replica_pids

    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    (dep,) = app["deployments"]
    name, user = app["name"], dep["user_config"]
    cli = Path(sys.executable).with_name("serve")
    done = subprocess.run(
        [str(cli), "deploy", str(CONFIG), "--address", ray_cluster.dashboard_url],
        env=child_env(**ray_cluster.local.attach_env()),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rest = ServeRest(ray_cluster.dashboard_url, token=read_token())
    try:
        deadline = time.monotonic() + 240
        while True:
            got = rest.details().get("applications", {}).get(name, {})
            if got.get("status") == "RUNNING":
                break
            assert got.get("status") != "DEPLOY_FAILED", got
            assert time.monotonic() < deadline, f"app {name!r} is {got.get('status')} after 240 s"
            time.sleep(1.0)
        act = ServeActuator(app=name, dashboard_url=ray_cluster.dashboard_url)
        url = ray_cluster.http_url + app["route_prefix"].rstrip("/") + "/v1/completions"
        r = httpx.post(url, json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 4
        assert act.current() == Knobs(
            max_batch_size=user["max_batch_size"], max_concurrency=user["max_ongoing_requests"]
        )
        pids = replica_pids(name)
        new = Knobs(max_batch_size=user["max_batch_size"] // 2, max_concurrency=12)
        cost = act.apply(new)
        assert cost.changed and not cost.restarted
        assert act.current() == new and replica_pids(name) == pids
        # someone sets Serve's max_ongoing_requests alone (slotune's key stays 12)
        details = rest.details()
        edited = details["applications"][name]["deployed_app_config"]
        (entry,) = edited["deployments"]
        written = entry["max_ongoing_requests"]
        entry["max_ongoing_requests"] = written + 7
        rest.put(details, replace_app(declarative_apps(details), edited))
        rest.wait(
            name,
            dep["name"],
            lambda d: d["deployment_config"]["max_ongoing_requests"] == written + 7,
            timeout_s=60.0,
        )
        with pytest.raises(ForeignChange, match=f"max_ongoing_requests is {written + 7} where"):
            act.current()
        cost = act.apply(new)  # what slotune writes after --ack: its own limit again
        assert cost.changed and act.current() == new and replica_pids(name) == pids
        cfg = deployment_details(rest.details(), name, dep["name"])["deployment_config"]
        assert cfg["max_ongoing_requests"] == written
    finally:
        rest.close()
        delete_app(name)
