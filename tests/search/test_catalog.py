"""Hardware and model catalogs: published figures, shapes, JSON round trips, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.roofline.hardware import (
    CATALOG as HW,
)
from search.roofline.hardware import HARDWARE_NAMES, HardwareSpec, resolve_hardware
from search.roofline.models import CATALOG as MODELS
from search.roofline.models import MODEL_NAMES, ModelSpec, resolve_model
from search.roofline.profile import DecodeProfile


def test_catalog_names_are_the_issues() -> None:
    assert set(HARDWARE_NAMES) == {"h100-sxm", "h100-pcie", "h200", "a100-80gb", "l4", "mi300x"}
    assert {
        "llama-3.1-8b",
        "llama-3.1-70b",
        "llama-3.1-405b",
        "mistral-7b",
        "qwen2.5-72b",
        "slotune-tiny",
        "slotune-small",
    } <= set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_published_parameter_count_equals_the_shapes(name: str) -> None:
    m = ModelSpec.from_name(name)
    assert m.params == m.architecture_params


def test_pinned_kv_bytes_per_token() -> None:
    assert ModelSpec.from_name("llama-3.1-8b").kv_bytes_per_token() == 131_072
    assert ModelSpec.from_name("llama-3.1-70b").kv_bytes_per_token() == 327_680
    assert ModelSpec.from_name("llama-3.1-8b").kv_bytes_per_token(4) == 262_144


def test_weight_bytes_and_read_per_step() -> None:
    m = ModelSpec.from_name("llama-3.1-8b")
    assert m.weight_bytes() == 2 * 8_030_261_248
    # The input embedding table is a lookup, not read whole each step.
    assert m.weight_bytes_read_per_step() == 2 * (8_030_261_248 - 128_256 * 4096 - 65 * 4096)


def test_h100_sxm_ridge_is_about_295() -> None:
    assert HardwareSpec.from_name("h100-sxm").ridge_flops_per_byte("bf16") == pytest.approx(
        295.3, abs=0.5
    )


@pytest.mark.parametrize("name", HARDWARE_NAMES)
def test_every_device_has_bf16_and_a_price(name: str) -> None:
    hw = HW[name]
    assert hw.flops("bf16") > hw.flops("fp32")
    assert hw.usd_per_hour > 0 and hw.interconnect_bandwidth > 0
    assert 10 < hw.ridge_flops_per_byte("bf16") < 1000


def test_unknown_names_list_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="'b200'.*h100-sxm.*mi300x"):
        HardwareSpec.from_name("b200")
    with pytest.raises(ValueError, match="'gpt-5'.*llama-3.1-8b.*slotune-small"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="allowed: bf16"):
        HW["a100-80gb"].flops("fp8")


def test_spec_validation_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="mem_bandwidth=-1"):
        HardwareSpec(name="x", peak_flops={"bf16": 1e12}, mem_bandwidth=-1, mem_capacity=1e9)
    with pytest.raises(ValueError, match="'int4'"):
        HardwareSpec(name="x", peak_flops={"int4": 1e12}, mem_bandwidth=1e9, mem_capacity=1e9)
    with pytest.raises(ValueError, match="kv_heads=5"):
        ModelSpec(
            name="m",
            params=1,
            layers=1,
            hidden=8,
            heads=8,
            kv_heads=5,
            head_dim=1,
            vocab=2,
            intermediate=4,
        )


def test_hardware_json_round_trip_with_calibration(tmp_path: Path) -> None:
    prof = DecodeProfile(
        weight_rate={1: 1e10, 16: 5e10}, kv_rate={1: 2e9}, layer_overhead_s={1: 2e-5}
    )
    hw = HardwareSpec(
        name="box",
        peak_flops={"bf16": 2e12, "fp32": 4e11},
        mem_bandwidth=2.4e10,
        mem_capacity=24e9,
        decode={"bf16": prof},
    )
    path = tmp_path / "box.json"
    hw.to_json(path, extra={"note": "for humans"})
    back = resolve_hardware(str(path))
    assert back == hw
    assert back.calibrated and back.decode["bf16"].weight_rate[16] == 5e10
    assert json.loads(path.read_text())["measured"] == {"note": "for humans"}
    assert HW["h200"] == HardwareSpec.from_dict(HW["h200"].to_dict())


def test_hardware_json_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not JSON"):
        resolve_hardware(str(bad))
    extra = tmp_path / "extra.json"
    d = HW["l4"].to_dict() | {"warp_speed": 9}
    extra.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="warp_speed"):
        resolve_hardware(str(extra))
    with pytest.raises(ValueError, match="cannot read"):
        resolve_hardware(str(tmp_path / "missing.json"))


def test_model_json_round_trip_and_params_from_shapes(tmp_path: Path) -> None:
    m = MODELS["mistral-7b"]
    p = tmp_path / "m.json"
    m.to_json(p)
    assert resolve_model(str(p)) == m
    d = m.to_dict()
    del d["params"]
    p.write_text(json.dumps(d))
    assert resolve_model(str(p)).params == 7_241_732_096


def test_decode_profile_interpolates_log_log() -> None:
    prof = DecodeProfile(weight_rate={1: 1e10, 4: 4e10, 16: 8e10}, kv_rate={1: 1e9, 4: 4e9})
    assert prof.weight_rate_at(4) == pytest.approx(4e10)
    assert prof.weight_rate_at(2) == pytest.approx(2e10)  # straight line in log-log
    assert prof.weight_rate_at(0.5) == pytest.approx(1e10)
    # Past the table the time per row stays constant: rate * batch is constant.
    assert prof.weight_rate_at(64) == pytest.approx(8e10 * 16 / 64)
    assert prof.kv_rate_at(2) == pytest.approx(2e9)
    assert prof.kv_rate_at(100) == pytest.approx(4e9)
    with pytest.raises(ValueError, match="batch 0"):
        DecodeProfile(weight_rate={0: 1.0}, kv_rate={1: 1.0})


# serving/ is the other half of the built-in models: the shapes must agree.
@pytest.mark.parametrize(
    ("preset", "catalog"), [("tiny", "slotune-tiny"), ("small", "slotune-small")]
)
def test_builtin_models_equal_the_serving_presets(preset: str, catalog: str) -> None:
    config = pytest.importorskip("serving.model.config")
    cfg = config.ModelConfig.from_name(preset)
    m = ModelSpec.from_name(catalog)
    assert (
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.vocab,
        m.intermediate,
        m.tied_embeddings,
    ) == (
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.intermediate_size,
        cfg.tie_embeddings,
    )
    assert m.params == cfg.n_params
    assert m.kv_bytes_per_token(cfg.bytes_per_param) == cfg.kv_bytes_per_token
