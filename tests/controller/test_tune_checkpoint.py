"""``slotune tune --checkpoint DIR``: the built-in app serves a local checkpoint, the roofline
is its config.json's, and ``--served-model`` (``--served-model-name``) names what the app
serves. The wiring up to ``prepare`` and inside it, without Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.cli.main import main

# A small Llama config.json (a real checkpoint's shape, far fewer layers and a short context)
CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}


def _checkpoint(root: Path, name: str = "my-llama", **config: Any) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG | config))
    (d / "model.safetensors").write_bytes(b"")  # read by the replica, not by these tests
    return d


class Reached(Exception):
    """``prepare`` was called: every check passed."""


@pytest.fixture
def prepared(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``slotune tune`` hands ``prepare`` (where Ray would start)."""
    import controller.cli.tune as cli_tune

    seen: dict[str, Any] = {}

    def record(**kw: Any) -> None:
        seen.update(kw)
        raise Reached

    monkeypatch.setattr(cli_tune, "prepare", record)
    return seen


def _tune(argv: list[str], tmp_path: Path) -> None:
    main(["tune", "--out", str(tmp_path / "out"), "--quiet", *argv])


def test_the_checkpoint_reaches_the_app_and_seeds_the_roofline(
    prepared: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Reached):
        _tune(["--checkpoint", "my-llama", "--served-model-name", "org/my-llama"], tmp_path)
    # absolute: the replica that loads it is a Ray worker, not in this working directory
    assert prepared["checkpoint"] == str(ckpt.resolve())
    spec = prepared["roofline_model"]
    assert spec.name == "my-llama" and (spec.layers, spec.kv_heads, spec.hidden) == (2, 2, 256)
    assert prepared["served_model_name"] == "org/my-llama"
    assert prepared["shape"].model == "org/my-llama"  # the requests name what is served
    assert prepared["app_name"] is None and prepared["actuator"] is None


def test_without_the_flags_the_preset_is_served_under_its_default_name(
    prepared: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.raises(Reached):
        _tune([], tmp_path)
    assert prepared["checkpoint"] is None and prepared["roofline_model"] is None
    assert prepared["served_model_name"] is None and prepared["shape"].model is None


def test_another_apps_model_id_is_only_the_requests(
    prepared: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.raises(Reached):
        _tune(["--app", "mine", "--served-model", "their model"], tmp_path)
    assert prepared["served_model_name"] is None and prepared["shape"].model == "their model"


@pytest.mark.parametrize(
    ("make", "extra", "needle"),
    [
        (lambda t: t / "missing", [], "--checkpoint {p}: no such folder"),
        (lambda t: _file(t), [], "--checkpoint {p}: not a folder"),
        (lambda t: _empty(t), [], "--checkpoint {p}: no config.json in it"),
        (lambda t: _checkpoint(t), ["--app", "mine"], "--checkpoint {p}: is what the built-in"),
        (
            lambda t: _checkpoint(t, model_type="mixtral", num_local_experts=8),
            [],
            "--checkpoint {p}: model config",
        ),
        # the roofline reads it, the engine could not: refused before Ray, not in the replica
        (lambda t: _checkpoint(t, hidden_act="gelu"), [], "config.json: hidden_act='gelu'"),
        (
            lambda t: _checkpoint(t),
            ["--prompt-tokens", "120", "--output-tokens", "16"],
            "checkpoint {abs} holds 128 tokens a request",
        ),
        (lambda t: _checkpoint(t), ["--served-model", "a b"], "--served-model 'a b': must be"),
        (lambda t: _checkpoint(t), ["--served-model-name", ""], "--served-model '': must be"),
    ],
)
def test_bad_checkpoints_and_names_are_one_line_exit_2_before_ray(
    make, extra: list[str], needle: str, prepared, tmp_path: Path, capsys
) -> None:
    p = make(tmp_path)
    with pytest.raises(SystemExit) as e:
        _tune(["--checkpoint", str(p), *extra], tmp_path)
    err = capsys.readouterr().err
    assert e.value.code == 2 and not prepared, err
    assert err.startswith("slotune: error: ") and err.count("\n") == 1, err
    assert needle.format(p=p, abs=p.resolve()) in err, err


def _file(root: Path) -> Path:
    (root / "f").write_text("x")
    return root / "f"


def _empty(root: Path) -> Path:
    (root / "empty").mkdir()
    (root / "empty" / "model.safetensors").write_bytes(b"")
    return root / "empty"


def test_the_plan_and_the_served_cache_follow_the_checkpoint() -> None:
    from controller.tune_plan import plan_search
    from controller.tune_served import served_key
    from metrics.observation import Slo
    from search.roofline.hardware import resolve_hardware
    from search.roofline.models import ModelSpec

    spec = ModelSpec.from_hf_config(CONFIG, name="org/my-llama")
    kw: dict[str, Any] = {
        "model": "small",
        "hardware": resolve_hardware("h100-sxm"),
        "slo": Slo(ttft_p99_s=1.0, tpot_p99_s=0.1),
        "price": None,
        "max_slots": 16,
        "context": 64,
    }
    assert plan_search(**kw, spec=spec).roofline.model is spec
    assert plan_search(**kw).roofline.model.name == "slotune-small"
    assert served_key("small", None) == "slotune-small"
    assert served_key("small", spec) == "checkpoint-org_my-llama"  # a file name, no folder


def test_prepare_deploys_the_checkpoint_under_its_name(monkeypatch, tmp_path: Path) -> None:
    """The built-in branch of ``prepare``, with Ray, the calibration and the deploy replaced
    by recorders: the app's args carry the checkpoint and the name, and the plan is the
    checkpoint's roofline."""
    import controller.tune_setup as setup
    import serving.app.deploy as deploy
    from controller.targets import RequestShape
    from metrics.observation import Slo
    from search.roofline.hardware import resolve_hardware
    from search.roofline.models import ModelSpec
    from serving.sim.workload import LengthDist

    spec = ModelSpec.from_hf_config(CONFIG, name="my-llama")
    deployed: dict[str, Any] = {}
    monkeypatch.setattr(setup, "start_local_ray", lambda: (1, 2))
    monkeypatch.setattr(setup, "embedded_threads", lambda: 1)
    monkeypatch.setattr(
        setup, "hardware_spec", lambda *a, **k: (resolve_hardware("h100-sxm"), "catalogue")
    )
    monkeypatch.setattr(setup, "make_reader", lambda **kw: (object(), "reader"))
    monkeypatch.setattr(setup, "serve_url", lambda app, details: "http://127.0.0.1:2")
    monkeypatch.setattr(setup, "serve_details", lambda url: {})
    monkeypatch.setattr(setup, "_make_actuator", lambda name, **kw: name)
    monkeypatch.setattr(deploy, "deploy_app", lambda args, live, **kw: deployed.update(args=args))
    got = setup.prepare(
        address=None,
        app_name=None,
        deployment=None,
        url=None,
        metrics_url=None,
        prometheus_url=None,
        prefix=None,
        slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1),
        model="small",
        max_slots=16,
        price=None,
        shape=RequestShape(
            prompt_tokens=LengthDist.parse("16"), output_tokens=LengthDist.parse("8")
        ),
        quiet=True,
        roofline_model=spec,
        served=False,
        checkpoint=str(tmp_path),
        served_model_name="my-llama",
    )
    args = deployed["args"]
    assert args.checkpoint == str(tmp_path) and args.served_name == "my-llama"
    assert got.plan.roofline.model is spec and "my-llama" in got.plan.reason
