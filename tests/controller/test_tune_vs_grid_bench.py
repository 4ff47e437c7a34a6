"""bench/tune_vs_grid.py: its flags and the grid they describe (no cluster, no timing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from search.space import Knobs

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tune_vs_grid.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("tune_vs_grid", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_the_default_grid_is_each_batch_at_concurrency_b_then_one_and_a_half_b(bench) -> None:
    args = bench.parse_args([])
    assert args.slo_tpot_ms > 0 and args.slo_ttft_ms > 0 and 0 < args.tune_share <= 1
    grid = bench.grid_points(bench.parse_args(["--grid-batches", "1,2,4", "--max-batch", "8"]))
    assert grid == [
        Knobs(max_batch_size=1, max_concurrency=1),
        Knobs(max_batch_size=2, max_concurrency=2),
        Knobs(max_batch_size=4, max_concurrency=4),
        Knobs(max_batch_size=1, max_concurrency=2),
        Knobs(max_batch_size=2, max_concurrency=3),
        Knobs(max_batch_size=4, max_concurrency=6),
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--grid-batches", "1,32"],  # above --max-batch
        ["--grid-headroom", "0.5"],
        ["--grid-headroom", "3"],  # beyond the tune's headroom bound
        ["--tune-share", "0"],
    ],
)
def test_bad_flags_stop_before_anything_starts(bench, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_the_cpu_is_named_with_its_matmul_flags(bench) -> None:
    cpu = bench.cpu_info()
    assert cpu["model"] and set(cpu["flags"]) <= set(bench.CPU_FLAGS)
