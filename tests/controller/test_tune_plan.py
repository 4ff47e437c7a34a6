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

    from controller.cli import tune_backend as cli_tune

    assert cli_tune.price(1.25, embedded=True) == (1.25, "--price-per-hour")
    monkeypatch.setattr(cli_tune, "local_device", lambda: "cpu")
    assert cli_tune.price(None, embedded=True) == (None, "not given")  # never for a CPU
    monkeypatch.setattr(cli_tune, "local_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    price, source = cli_tune.price(None, embedded=True)
    assert price == CATALOG["h100-sxm"].usd_per_hour and "h100-sxm" in source
    # attached to someone else's deployment: its hardware is not this process's to guess
    assert cli_tune.price(None, embedded=False) == (None, "not given")


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


# --- what the roofline assumes: any model, any device, tp; unseeded when unknown ----------


def _slo(tpot_s: float = 0.05):
    from metrics.observation import Slo

    return Slo(ttft_p99_s=2.0, tpot_p99_s=tpot_s)


def test_any_catalogued_model_and_device_seed_the_plan_with_a_reason() -> None:
    from search.roofline.hardware import resolve_hardware
    from search.roofline.models import resolve_model

    plan = tune_plan.plan_for(
        model=resolve_model("llama-3.1-8b"),
        hardware=resolve_hardware("h100-sxm"),
        slo=_slo(),
        price=None,
        max_batch=512,
        context=2048,
    )
    assert plan.seeded and plan.roofline is not None and plan.roofline.model.name == "llama-3.1-8b"
    assert plan.seeds[0].max_batch_size == plan.seed_batch > 1
    assert plan.space.batch_max <= 512 and plan.predicted
    assert "llama-3.1-8b" in plan.reason and "h100-sxm" in plan.reason
    assert f"B={plan.seed_batch}" in plan.reason
    assert plan.model_tpot_s is not None and plan.model_tpot_s(1) > 0


def test_tensor_parallelism_reaches_the_roofline() -> None:
    from search.roofline.hardware import resolve_hardware
    from search.roofline.models import resolve_model

    m, hw = resolve_model("llama-3.1-70b"), resolve_hardware("h100-sxm")
    kw = dict(model=m, hardware=hw, slo=_slo(0.1), price=2.5, max_batch=1024, context=4096)
    with pytest.raises(ValueError, match="--tp 2"):  # 141 GB of weights on one 80 GB device
        tune_plan.plan_for(tp=1, **kw)
    two, four = tune_plan.plan_for(tp=2, **kw), tune_plan.plan_for(tp=4, **kw)
    assert two.roofline.tp == 2 and four.roofline.tp == 4 and "4 x h100-sxm" in four.reason
    assert four.roofline.max_batch_memory > 2 * two.roofline.max_batch_memory
    assert four.analysis.at(1).tpot_s < two.analysis.at(1).tpot_s
    with pytest.raises(ValueError, match="tp=3: must divide"):
        tune_plan.plan_for(tp=3, **kw)


def test_without_a_model_the_search_runs_unseeded_and_says_why() -> None:
    from search.roofline.hardware import resolve_hardware

    plan = tune_plan.plan_for(
        model=None, hardware=resolve_hardware("h100-sxm"), slo=_slo(), price=None, context=64
    )
    assert not plan.seeded and plan.reason == tune_plan.NO_MODEL
    assert "--model-config" in plan.reason and plan.reason.startswith("unseeded")
    assert (plan.space.batch_min, plan.space.batch_max, plan.space.headroom_max) == (1, 256, 2.0)
    assert [k.max_batch_size for k in plan.seeds] == [16, 4, 64]  # log-spaced, middle first
    assert plan.predicted == () and plan.roofline is None and plan.seed_batch is None
    assert plan.model_tpot_s is None
    small = tune_plan.plan_for(model=None, hardware=None, slo=_slo(), price=None, max_batch=2,
                               context=64, reason="unseeded: test")  # fmt: skip
    assert small.reason == "unseeded: test" and all(k.max_batch_size <= 2 for k in small.seeds)
    with pytest.raises(ValueError, match="max_batch=0"):
        tune_plan.plan_for(model=None, hardware=None, slo=_slo(), price=None, max_batch=0,
                           context=64)  # fmt: skip


def test_an_unseeded_plan_starts_the_tuner_at_its_first_knob() -> None:
    from search.tuner import Tuner

    plan = tune_plan.plan_for(model=None, hardware=None, slo=_slo(), price=None, context=64)
    tuner = Tuner(space=plan.space, slo=_slo(), seed_knobs=plan.seeds, model_tpot_s=None)
    assert tuner.propose() == plan.seeds[0]


def test_a_plan_is_seeded_with_a_prediction_or_unseeded_without_one() -> None:
    from search.space import SearchSpace

    space = SearchSpace(batch_max=8)
    with pytest.raises(ValueError, match="seeded=True"):
        tune_plan.SearchPlan(space=space, seeds=(), seeded=True, reason="x")
    with pytest.raises(ValueError, match="reason=''"):
        tune_plan.SearchPlan(space=space, seeds=(), seeded=False, reason="")


def test_roofline_model_from_a_config_a_catalogue_name_or_none(tmp_path: Path) -> None:
    from search.roofline.models import CATALOG

    assert tune_plan.roofline_model(None, None) is None
    assert tune_plan.roofline_model("llama-3.1-8b", None) is CATALOG["llama-3.1-8b"]
    assert tune_plan.roofline_model(None, "mistral-7b") is CATALOG["mistral-7b"]
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    m = tune_plan.roofline_model(str(d / "config.json"), None)
    assert m.name == "my-llama" and m.kv_bytes_per_token() == 131_072
    with pytest.raises(ValueError, match="give one"):
        tune_plan.roofline_model(str(d), "mistral-7b")
    with pytest.raises(ValueError, match="no such file, and not a catalogue model"):
        tune_plan.roofline_model(str(tmp_path / "nope.json"), None)
    with pytest.raises(ValueError, match="not in the catalog"):
        tune_plan.roofline_model(None, "gpt-5")


def test_roofline_hardware_calibrates_here_only_when_the_replicas_run_here(monkeypatch) -> None:
    calls: list[tuple[str, int]] = []

    def fake(device, *, quiet, threads):
        calls.append((device, threads))
        return "local-spec", "calibration note"

    monkeypatch.setattr(tune_plan, "hardware_spec", fake)
    kw = dict(device="cpu", threads=1, quiet=True)
    hw, note = tune_plan.roofline_hardware("h200", replicas_here=False, **kw)
    assert hw is CATALOG["h200"] and "h200" in note and calls == []
    hw, note = tune_plan.roofline_hardware(None, replicas_here=False, **kw)
    assert hw is None and note.startswith("unseeded") and "--hardware" in note
    assert tune_plan.roofline_hardware(None, replicas_here=True, **kw)[0] == "local-spec"
    assert tune_plan.roofline_hardware("local", replicas_here=False, **kw)[0] == "local-spec"
    assert calls == [("cpu", 1), ("cpu", 1)]
    with pytest.raises(ValueError, match="not in the catalog"):
        tune_plan.roofline_hardware("tpu-v9", replicas_here=False, **kw)
