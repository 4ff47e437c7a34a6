"""bench/search_efficiency.py --quick, as CI runs it: the table, then one JSON line whose
figures say slotune beat the baselines on the quick scenario."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from search.space import SearchSpace

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
    for key in (
        "worst_median_trials",
        "min_ratio_vs_tpe",
        "min_ratio_vs_grid",
        "min_ratio_vs_band_grid",
        "scenarios",
    ):
        assert key in out, key
    (sc,) = out["scenarios"].values()
    st = sc["strategies"]
    assert st["slotune"]["reached"] == st["slotune"]["runs"] == 3
    assert out["worst_median_trials"] == st["slotune"]["median"]
    # Fewer trials than every baseline (the bounds of a censored baseline included).
    for name in ("gp-unseeded", "tpe", "random", "grid", "grid-band"):
        assert st[name]["median"] > st["slotune"]["median"], name
    # The same runs scored by the baselines' incumbent (one feasible window) are done no
    # later than by the declared one, and the like-for-like ratio is stated beside.
    one = st["slotune-1w"]
    assert one["runs"] == 3 and one["median"] <= st["slotune"]["median"]
    assert sc["ratio_vs_grid_as_scored_alike"] >= sc["ratio_vs_grid"]
    assert "min_ratio_vs_grid_as_scored_alike" in out
    # The headline grid is the whole power-of-two cross product (concurrency >= batch).
    assert st["grid"]["cap"] > st["grid-band"]["cap"]


def test_grid_is_the_power_of_two_cross_product_in_ascending_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = importlib.util.spec_from_file_location("search_efficiency", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)

    class Target:
        space = SearchSpace(batch_min=1, batch_max=20, headroom_max=4.0)

    class B:
        target = Target()

    grid = [(k.max_batch_size, k.max_concurrency) for k in mod.grid_knobs(B())]
    pow2 = [1, 2, 4, 8, 16, 32, 64]  # batch up to 20, concurrency up to 80
    assert grid == [(b, c) for b in pow2 if b <= 20 for c in pow2 if c >= b]
    band = [(k.max_batch_size, k.max_concurrency) for k in mod.grid_knobs(B(), "grid-band")]
    assert band == [(b, b * h) for b in pow2 if b <= 20 for h in (1, 2, 4)]
    with pytest.raises(ValueError, match="'dense'"):
        mod.grid_knobs(B(), "dense")
