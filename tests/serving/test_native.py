"""The compiled simulator modules (setup.py's COMPILED, serving/native.py): used only while
they match their sources, and giving the results of the pure-Python sources bit for bit."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serving import native

ROOT = Path(__file__).resolve().parents[2]
EXT = importlib.machinery.EXTENSION_SUFFIXES[0]


def _compiled() -> tuple[str, ...]:
    """setup.py's COMPILED, read without running setup.py."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMPILED":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py defines no COMPILED")


COMPILED = _compiled()


def _fake_tree(tmp_path: Path, *, built: bool = True, record: bool = True) -> Path:
    """A project root with the compiled modules' sources, an extension file for each (when
    ``built``) and the build record of those sources (when ``record``)."""
    for p in COMPILED:
        src = tmp_path / p
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {p}\n")
        if built:
            src.with_name(src.name[: -len(".py")] + EXT).write_bytes(b"")
    if record:
        rec = tmp_path / native.RECORD
        rec.write_text(json.dumps({"sources": native.source_hashes(COMPILED, tmp_path)}))
    return tmp_path


def test_a_build_that_matches_its_sources_is_used(tmp_path) -> None:
    root = _fake_tree(tmp_path)
    assert native.decide(root, {}) == (True, "compiled (mypyc)")


def test_no_build_means_the_sources(tmp_path) -> None:
    root = _fake_tree(tmp_path, built=False, record=False)
    use, why = native.decide(root, {})
    assert not use and "not compiled" in why


def test_an_edited_source_makes_every_module_come_from_source(tmp_path) -> None:
    root = _fake_tree(tmp_path)
    (root / "serving/scheduler/scheduler.py").write_text("# edited\n")
    use, why = native.decide(root, {})
    assert not use and "serving/scheduler/scheduler.py" in why and "make venv" in why


def test_the_environment_can_ask_for_the_sources(tmp_path) -> None:
    root = _fake_tree(tmp_path)
    assert native.decide(root, {native.PURE_ENV: "1"}) == (False, f"{native.PURE_ENV}=1")


def test_a_partial_build_or_a_lost_record_is_not_used(tmp_path) -> None:
    root = _fake_tree(tmp_path)
    (root / ("serving/sim/simulator" + EXT)).unlink()
    use, why = native.decide(root, {})
    assert not use and "serving/sim/simulator.py" in why
    root2 = _fake_tree(tmp_path / "b", record=False)
    use, why = native.decide(root2, {})
    assert not use and native.RECORD in why


def test_make_rebuilds_when_a_compiled_source_changes() -> None:
    """The venv stamp depends on every compiled source, so `make test` rebuilds."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = re.search(r"^NATIVE_SRC\s*:=(.*)$", text, re.M)
    stamp = re.search(r"^\$\(VENV\)/\.installed:(.*)$", text, re.M)
    assert listed is not None and stamp is not None
    assert "$(NATIVE_SRC)" in stamp.group(1)
    assert {*COMPILED, "setup.py", "serving/native.py"} <= set(listed.group(1).split())


def test_an_extension_the_record_does_not_list_is_not_used(tmp_path) -> None:
    root = _fake_tree(tmp_path)
    stray = root / "serving/planted.py"
    stray.write_text("# not compiled by setup.py\n")
    stray.with_name("planted" + EXT).write_bytes(b"")
    use, why = native.decide(root, {})
    assert not use and "serving/planted.py" in why


def test_every_compiled_module_sits_in_a_package_the_guard_searches() -> None:
    assert {p.split("/")[0] for p in COMPILED} <= set(native.PACKAGES)


def _have_compiler() -> bool:
    return any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.mark.skipif(not _have_compiler(), reason="no C compiler: the build is pure Python")
def test_this_checkout_runs_the_compiled_build() -> None:
    """`make venv` compiled the modules and they match the sources (else: run it)."""
    if os.environ.get(native.PURE_ENV) == "1":
        pytest.skip(f"{native.PURE_ENV}=1")
    st = native.status()
    assert st["compiled"], st["why"]
    import serving.scheduler.scheduler

    assert serving.scheduler.scheduler.__file__.endswith(
        tuple(importlib.machinery.EXTENSION_SUFFIXES)
    )


_FINGERPRINT = r"""
import json, sys
from controller.sim.decode_run import DecodeRunStepTime
from controller.sim.scenarios import SCENARIOS
from controller.sim.target import SimTarget
from serving import native
from serving.sim.simulator import simulate

out = {"status": native.status(), "runs": []}
CASES = (("cpu-small", [(1, 1), (8, 16), (64, 64)]), ("h100-8b", [(32, 32), (256, 512)]))
for name, knobs in CASES:
    target = SimTarget(SCENARIOS[name])
    cfg = target.sim_config
    for b, c in knobs:
        for fn in (DecodeRunStepTime(target), target.step_time):
            r = simulate(max_batch_size=b, max_concurrency=c, workload=target.workload,
                         step_time=fn, config=cfg, slo=target.slo, seed=7)
            out["runs"].append([name, b, c, repr(r.observation), r.steps, r.sim_s.hex(),
                                r.busy_s.hex(), [repr(t) for t in r.timings[:50]],
                                len(r.timings)])
json.dump(out, sys.stdout)
"""


def _fingerprints(pure: bool) -> dict:
    env = dict(os.environ)
    env.pop(native.PURE_ENV, None)
    if pure:
        env[native.PURE_ENV] = "1"
    p = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return json.loads(p.stdout)


@pytest.mark.slow
def test_compiled_and_pure_python_give_the_same_windows_bit_for_bit() -> None:
    compiled = _fingerprints(pure=False)
    if not compiled["status"]["compiled"]:
        pytest.skip(f"no compiled build: {compiled['status']['why']}")
    pure = _fingerprints(pure=True)
    assert pure["status"] == {"compiled": False, "why": f"{native.PURE_ENV}=1"}
    assert len(compiled["runs"]) == 10
    assert compiled["runs"] == pure["runs"]
