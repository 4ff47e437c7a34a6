"""The cost wording and the catalogued price; calibration at the replica's thread count; the
plan of the search."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

from controller import tune_plan
from controller.report.cost import catalog_price, cost_sentence, million_token_cost
from search.roofline.hardware import CATALOG

# --- cost -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA L4", "l4"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_catalogued_gpus_get_the_catalog_price_with_its_source(name: str, key: str) -> None:
    price, source = catalog_price(name)
    assert price == CATALOG[key].usd_per_hour and price > 0
    assert (
        key in source and "search/roofline/hardware.py" in source and "--price-per-hour" in source
    )


@pytest.mark.parametrize(
    "name", ["AMD EPYC 7B13", "NVIDIA L40S", "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090"]
)
def test_no_price_is_made_up_for_an_unknown_part(name: str) -> None:
    assert catalog_price(name) is None


def test_cost_sentence_without_a_price_says_how_to_get_one() -> None:
    s = cost_sentence(None, 100.0)
    per_dollar = million_token_cost(1.0, 100.0)  # $2.78 per $1/h at 100 tokens/s
    assert f"${per_dollar:.3g}" in s and "$1/h" in s
    assert "--price-per-hour" in s and "slotune export" in s


def test_cost_sentence_with_a_price_states_it_and_its_source() -> None:
    s = cost_sentence(3.6, 1000.0, "catalog")
    assert "$3.6/h (catalog)" in s and "$1 per million" in s
    assert "nothing was generated" in cost_sentence(2.0, math.nan)


# --- calibration at the replica's threads ------------------------------------------------


class FakeCal:
    def __init__(self, threads: int, elapsed: float = 1.0) -> None:
        from search.calibrate.device import CALIBRATION_VERSION

        self.measured = {"threads": threads, "version": CALIBRATION_VERSION}
        self.elapsed_s = elapsed
        self.spec = types.SimpleNamespace(
            to_json=lambda path, extra: Path(path).write_text(
                json.dumps({"name": f"cal-{threads}t", "measured": extra})
            )
        )


def test_a_cached_calibration_at_other_threads_is_not_used(tmp_path: Path, monkeypatch) -> None:
    import torch

    import search.calibrate.device
    import search.roofline.hardware

    calls: list[int] = []

    def calibrate(*, device, plan, threads):
        calls.append(threads)
        return FakeCal(threads)

    monkeypatch.setattr(search.calibrate.device, "calibrate", calibrate)
    monkeypatch.setattr(
        search.calibrate.device,
        "default_cache_path",
        lambda dev, *, threads: tmp_path / f"hardware-host-cpu-{threads}t.json",
    )
    monkeypatch.setattr(search.calibrate.device, "pick_device", lambda d: torch.device("cpu"))
    monkeypatch.setattr(
        search.roofline.hardware.HardwareSpec,
        "from_json",
        classmethod(lambda cls, p: json.loads(Path(p).read_text())["name"]),
    )
    version = search.calibrate.device.CALIBRATION_VERSION
    cache = tmp_path / "hardware-host-cpu-2t.json"
    # a cache of an older calibration method, at the same threads: measured again
    cache.write_text(json.dumps({"name": "old-2t", "measured": {"threads": 2}}))
    spec, note = tune_plan.hardware_spec("cpu", quiet=True, threads=2)
    assert calls == [2] and "calibrated now" in note
    spec, note = tune_plan.hardware_spec("cpu", quiet=True, threads=2)
    assert spec == "cal-2t" and calls == [2]  # the same threads: the cache is used
    # a cache that says it was measured at other threads is measured again
    cache.write_text(json.dumps({"name": "cal-2t", "measured": {"threads": 3, "version": version}}))
    spec, note = tune_plan.hardware_spec("cpu", quiet=True, threads=2)
    assert calls == [2, 2]
    spec, note = tune_plan.hardware_spec("cpu", quiet=True, threads=1)
    assert calls == [2, 2, 1] and "calibrated now at 1 thread" in note
    assert (tmp_path / "hardware-host-cpu-1t.json").exists()
    spec, note = tune_plan.hardware_spec("cpu", quiet=True, threads=1)
    assert spec == "cal-1t" and calls == [2, 2, 1]  # cached now, not measured again


def test_the_cache_of_search_calibrate_is_named_by_thread_count() -> None:
    import torch

    from search.calibrate.device import default_cache_path

    assert default_cache_path(torch.device("cpu"), threads=1).name.endswith("-1t.json")


def test_tune_price_comes_from_the_flag_else_the_catalog_for_the_builtin_gpu_run(
    monkeypatch,
) -> None:
    import torch

    from controller.cli import tune as cli_tune

    assert cli_tune._price(1.25, embedded=True) == (1.25, "--price-per-hour")
    monkeypatch.setattr(cli_tune, "local_device", lambda: "cpu")
    assert cli_tune._price(None, embedded=True) == (None, "not given")  # never for a CPU
    monkeypatch.setattr(cli_tune, "local_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    price, source = cli_tune._price(None, embedded=True)
    assert price == CATALOG["h100-sxm"].usd_per_hour and "h100-sxm" in source
    # attached to someone else's deployment: its hardware is not this process's to guess
    assert cli_tune._price(None, embedded=False) == (None, "not given")


def test_the_plan_bounds_the_search_by_max_slots_and_seeds_the_roofline_point() -> None:
    from metrics.observation import Slo
    from search.roofline.hardware import resolve_hardware

    plan = tune_plan.plan_search(
        model="small",
        hardware=resolve_hardware("h100-sxm"),
        slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1),
        price=None,
        max_slots=16,
        context=64,
    )
    assert plan.space.batch_max <= 16
    assert plan.seeds[0].max_batch_size == plan.seed_batch <= 16
    assert len(plan.predicted) == len(plan.analysis.curve)
