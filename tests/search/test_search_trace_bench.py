"""bench/search_trace.py: the per-seed trajectories agree with search_efficiency's counts,
and the declarable band states, per batch near the oracle, the truth and the seeds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_trace_matches_the_benchmark_and_prints_one_json_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _load("search_trace", monkeypatch)
    assert trace.main(["--scenario", "h100-8b", "--seeds", "2", "--band", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["scenario"] == "h100-8b" and len(out["slotune_trials"]) == 2
    # One printed row per trial, numbered from 1, the seed's trial count in its header.
    for seed, n in enumerate(out["slotune_trials"]):
        i = lines.index(f"seed {seed}: {n} trials")
        rows = lines[i + 1 : i + 1 + n]
        assert [int(r.split()[0]) for r in rows] == list(range(1, n + 1))
        assert rows[0].split()[1] == "seed"
    # The same counts as the benchmark's own slotune runs (same windows, same truth).
    se = sys.modules["search_efficiency"]
    bench = se.Bench("h100-8b", 4)
    _, og = bench.oracle()
    assert [se.run_strategy(bench, "slotune", s, 30, og)[0] for s in range(2)] == out[
        "slotune_trials"
    ]
    b0 = out["oracle_knobs"]["max_batch_size"]
    assert [r["batch"] for r in out["band"]] == list(range(b0 - 1, b0 + 3))
    for r in out["band"]:
        assert 0 <= r["declared_after_two"] <= 2
        assert r["within_5pct"] <= r["truly_feasible"]
