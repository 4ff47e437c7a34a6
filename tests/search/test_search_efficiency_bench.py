"""bench/search_efficiency.py --quick, as CI runs it: the table, then one JSON line whose
figures say slotune beat the baselines on the quick scenario."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "search_efficiency.py"


@pytest.mark.slow
def test_quick_bench_prints_a_table_then_one_json_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("search_efficiency", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look it up there
    spec.loader.exec_module(mod)
    assert mod.main(["--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("scenario") and "slotune" in line for line in lines)
    out = json.loads(lines[-1])
    for key in ("worst_median_trials", "min_ratio_vs_tpe", "min_ratio_vs_grid", "scenarios"):
        assert key in out, key
    (sc,) = out["scenarios"].values()
    st = sc["strategies"]
    assert st["slotune"]["reached"] == st["slotune"]["runs"] == 3
    assert out["worst_median_trials"] == st["slotune"]["median"]
    # Fewer trials than every baseline (the bounds of a censored baseline included).
    for name in ("gp-unseeded", "tpe", "random", "grid"):
        assert st[name]["median"] > st["slotune"]["median"], name
