"""The command lines of deploy/k8s/: the canary Job's script runs (with `ray` and `slotune`
stood in for) and publishes exactly the canary's curve, or nothing when the canary fails;
every `slotune` command line in the manifests and docs/deploy.md parses with the real CLI."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from tests.deploy.manifests import ROOT, one

# What the stand-ins do: `ray` logs its arguments; `slotune` logs them, writes a curve.json
# under --out and exits with $STUB_RC.
RAY_STUB = '#!/bin/sh\necho "ray $*" >> "$STUB_LOG"\n'
SLOTUNE_STUB = """#!/bin/sh
printf '%s\\n' "$@" > "$STUB_ARGV"
out=""
prev=""
for a in "$@"; do
  if [ "$prev" = "--out" ]; then out="$a"; fi
  prev="$a"
done
mkdir -p "$out"
cp "$STUB_CURVE" "$out/curve.json"
exit "$STUB_RC"
"""
# Indented JSON as controller/report/files.py writes it, with what YAML would trip on.
CURVE = {
    "slo": {"ttft_p99_s": 1.0, "tpot_p99_s": 0.1},
    "note": "a: b # c\n- d 'e' \"f\" {g} [h] | > & * ! %",
    "trials": [{"max_batch_size": 24, "max_concurrency": 32}, {"nested": [1, 2.5, None]}],
    "empty": {},
}


def _tune() -> dict[str, Any]:
    return one("Job", "slotune-canary")["spec"]["template"]["spec"]["initContainers"][0]


def _run(tmp_path: Path, rc: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    tune = _tune()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ray", RAY_STUB), ("slotune", SLOTUNE_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps(CURVE, indent=2) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {e["name"]: e["value"] for e in tune["env"]}
    env |= {
        "OUT_DIR": str(out),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_LOG": str(tmp_path / "ray.log"),
        "STUB_ARGV": str(tmp_path / "argv"),
        "STUB_CURVE": str(curve),
        "STUB_RC": str(rc),
    }
    assert tune["command"] == ["/bin/bash", "-c"]
    assert "$(" not in tune["args"][0]  # the kubelet would expand $(VAR) itself
    r = subprocess.run(
        ["bash", "-c", tune["args"][0]], env=env, capture_output=True, text=True, timeout=30
    )
    return r, out


def test_canary_publishes_the_curve_as_the_configmap_the_controller_mounts(tmp_path: Path) -> None:
    r, out = _run(tmp_path, 0)
    assert r.returncode == 0, r.stderr
    (cm,) = list(yaml.safe_load_all((out / "slotune-curve.yaml").read_text()))
    assert cm["apiVersion"] == "v1" and cm["kind"] == "ConfigMap"
    assert cm["metadata"]["name"] == "slotune-curve"
    assert set(cm["data"]) == {"curve.json"}
    assert cm["data"]["curve.json"] == json.dumps(CURVE, indent=2) + "\n"  # byte for byte
    ray = (tmp_path / "ray.log").read_text().splitlines()
    assert ray[0].startswith("ray start --address=slotune-head-svc:6379 --num-cpus=0 --num-gpus=0")
    assert ray[-1] == "ray stop"


@pytest.mark.parametrize("rc", [1, 3, 4])
def test_a_failed_canary_publishes_nothing_and_fails_the_job(tmp_path: Path, rc: int) -> None:
    r, out = _run(tmp_path, rc)
    assert r.returncode == rc
    assert not (out / "slotune-curve.yaml").exists()
    assert "no curve published" in r.stderr
    assert (tmp_path / "ray.log").read_text().splitlines()[-1] == "ray stop"  # left the cluster


def _command(name: str) -> Any:
    from controller.cli.main import app

    return typer.main.get_command(app).commands[name]


def test_canary_tune_flags_are_real_and_target_the_rayservice(tmp_path: Path) -> None:
    r, _ = _run(tmp_path, 0)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[0] == "tune"
    params = _command("tune").make_context("tune", argv[1:]).params  # NoSuchOption if not
    assert params["address"] == "slotune-head-svc:6379"
    assert params["app_name"] == "slotune"
    assert params["actuator"] == "serve"
    assert params["dashboard_url"] == "http://slotune-head-svc:8265"
    assert params["url"] == "http://slotune-serve-svc:8000"
    assert params["prometheus_url"] == "http://prometheus-operated.monitoring.svc:9090"
    assert params["metrics_prefix"] == "ray_"
    # the SLO of deploy/prometheus/rules.yml and of the controller's defaults
    assert (params["slo_ttft_ms"], params["slo_tpot_ms"]) == (1000.0, 100.0)


def test_controller_flags_are_real() -> None:
    (c,) = one("Deployment", "slotune-control")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", "serving") for a in c["args"]]
    assert args[0] == "control"
    params = _command("control").make_context("control", args[1:]).params
    assert params["namespace"] == "serving" and params["rayservice"] == "slotune"
    assert params["metrics_port"] == 9108 and params["interval_s"] == 60.0


def test_documented_slotune_commands_parse() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    commands = [
        shlex.split(m.group(1).replace("\\\n", " "))
        for m in re.finditer(r"-- slotune ((?:[^\n]|\\\n)+)", text)
    ]
    assert any("--ack" in c for c in commands)
    for c in commands:
        c = [a.replace("$NS", "serving") for a in c]
        _command(c[0]).make_context(c[0], c[1:])
