"""``slotune serve`` takes the SLO in ms like every other command."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrics.observation import Slo


def _serve(argv: list[str], capsys, monkeypatch) -> tuple[int, str, dict]:
    """Run ``slotune serve`` with Ray and Serve replaced by recorders (nothing starts)."""
    import ray
    from ray import serve as ray_serve

    import serving.app.cluster
    import serving.app.deploy
    from controller.cli.main import main

    seen: dict = {}
    local = serving.app.cluster.LocalRay(gcs_address="127.0.0.1:1", token_path=Path("/none"))
    monkeypatch.setattr(
        serving.app.cluster, "start_local_ray", lambda **kw: seen.update(start=kw) or local
    )
    monkeypatch.setattr(
        serving.app.deploy,
        "deploy_app",
        lambda args, live, **kw: seen.update(deploy=(args, live, kw)),
    )
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_serve, "shutdown", lambda: None)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--for", "0.01", *argv])
    return int(e.value.code or 0), capsys.readouterr().err, seen


def test_slo_flags_are_milliseconds(capsys, monkeypatch) -> None:
    code, err, seen = _serve(["--slo-ttft-ms", "1500", "--slo-tpot-ms", "80"], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][1].slo == Slo(ttft_p99_s=1.5, tpot_p99_s=0.08)


def test_defaults_are_one_second_and_100_ms(capsys, monkeypatch) -> None:
    code, err, seen = _serve([], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][1].slo == Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--slo-tpot-ms", "-5"], "--slo-tpot-ms -5"),
        (["--slo-ttft-ms", "nan"], "--slo-ttft-ms nan"),
    ],
)
def test_bad_slo_flags_exit_2_before_anything_starts(
    argv: list[str], fragment: str, capsys, monkeypatch
) -> None:
    code, err, seen = _serve(argv, capsys, monkeypatch)
    assert code == 2 and not seen
    line = err.strip()
    assert line.startswith("slotune: error:") and fragment in line and "\n" not in line


def test_serve_help_shows_only_the_ms_flags(capsys) -> None:
    from controller.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--slo-ttft-ms" in out and "--slo-tpot-ms" in out
    assert "--ttft-slo" not in out and "--tpot-slo" not in out
    with pytest.raises(SystemExit) as e:
        main(["serve", "--ttft-slo", "0.9"])
    assert e.value.code == 2  # the seconds flags are gone, not hidden


def test_streaming_pace_defaults_to_the_replicas_and_flags_reach_the_app(
    capsys, monkeypatch
) -> None:
    from serving.app.config import ServerArgs

    code, err, seen = _serve([], capsys, monkeypatch)
    assert code == 0, err
    d = ServerArgs()
    assert seen["deploy"][0].stream_interval_s == d.stream_interval_s
    assert seen["deploy"][0].stream_events_per_s == d.stream_events_per_s
    argv = ["--stream-interval", "0", "--stream-events-per-s", "40"]
    code, err, seen = _serve(argv, capsys, monkeypatch)
    assert code == 0, err
    assert (seen["deploy"][0].stream_interval_s, seen["deploy"][0].stream_events_per_s) == (0, 40)


# --- placement: one replica per visible GPU on cuda -------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs torch reports here (no CUDA is needed to run these)."""
    import torch

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_replica_count_defaults_to_one_on_cpu_and_one_per_visible_gpu_on_cuda(gpus) -> None:
    from controller.cli.serve import replica_count

    gpus(0)  # never asked on the CPU
    assert replica_count(None, "cpu") == 1
    assert replica_count(3, "cpu") == 3
    gpus(4)
    assert replica_count(None, "cuda") == 4
    assert replica_count(None, "cuda:0") == 4
    assert replica_count(2, "cuda") == 2


@pytest.mark.parametrize(
    ("given", "device", "visible", "fragment"),
    [
        (0, "cpu", 0, "--num-replicas 0: must be an integer >= 1"),
        (-1, "cuda", 2, "--num-replicas -1: must be an integer >= 1"),
        (None, "cuda", 0, "--device cuda: torch sees no GPU here"),
        (1, "cuda", 0, "--device cuda: torch sees no GPU here"),
        (3, "cuda", 2, "--num-replicas 3: each replica on --device cuda takes a GPU and 2 are"),
    ],
)
def test_replica_count_refuses_what_cannot_be_placed(given, device, visible, fragment, gpus):
    from controller.cli.serve import replica_count
    from controller.errors import BadInput

    gpus(visible)
    with pytest.raises(BadInput, match=fragment) as e:
        replica_count(given, device)
    assert "\n" not in str(e.value)


def test_cuda_serves_a_replica_on_each_gpu_ray_is_told_of(capsys, monkeypatch, gpus) -> None:
    gpus(2)
    code, err, seen = _serve(["--device", "cuda"], capsys, monkeypatch)
    assert code == 0, err
    args, _, kw = seen["deploy"]
    assert args.device == "cuda" and kw["num_replicas"] == 2
    assert seen["start"]["num_gpus"] == 2
    code, err, seen = _serve(["--device", "cuda", "--num-replicas", "1"], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][2]["num_replicas"] == 1 and seen["start"]["num_gpus"] == 2


def test_cpu_serves_one_replica_and_leaves_gpus_to_ray(capsys, monkeypatch) -> None:
    code, err, seen = _serve([], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][2]["num_replicas"] == 1 and seen["start"]["num_gpus"] is None
    code, err, seen = _serve(["--num-replicas", "2"], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][2]["num_replicas"] == 2


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--device", "cuda"], "--device cuda: torch sees no GPU here"),
        (["--device", "cuda:1"], "device='cuda:1': a replica placed by Ray (num_gpus=1)"),
        (["--device", "cuda", "--num-replicas", "0"], "--num-replicas 0"),
        (["--served-model-name", ""], "served_model_name='': must be a non-empty string"),
        (["--served-model-name", "a b"], "served_model_name='a b'"),
    ],
)
def test_bad_placement_and_names_exit_2_before_ray(argv, fragment, capsys, monkeypatch, gpus):
    gpus(0)
    code, err, seen = _serve(argv, capsys, monkeypatch)
    assert code == 2 and not seen
    line = err.strip()
    assert line.startswith("slotune: error:") and fragment in line and "\n" not in line


def test_served_model_name_reaches_the_app(capsys, monkeypatch) -> None:
    code, err, seen = _serve(["--served-model-name", "org/llama-8b"], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][0].served_name == "org/llama-8b"
    code, err, seen = _serve([], capsys, monkeypatch)
    assert seen["deploy"][0].served_model_name is None  # the default: slotune-<model>


def test_checkpoint_must_hold_config_and_weights_and_goes_absolute(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for path, fragment in (
        (a_file, f"--checkpoint {a_file}: not a folder"),
        (ckpt, f"--checkpoint {ckpt}: no config.json in it"),
    ):
        code, err, seen = _serve(["--checkpoint", str(path)], capsys, monkeypatch)
        assert code == 2 and not seen and fragment in err and err.count("\n") == 1
    (ckpt / "config.json").write_text("{}")
    code, err, seen = _serve(["--checkpoint", str(ckpt)], capsys, monkeypatch)
    assert code == 2 and "no *.safetensors in it" in err
    (ckpt / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    code, err, seen = _serve(["--checkpoint", "ckpt"], capsys, monkeypatch)
    assert code == 0, err
    assert seen["deploy"][0].checkpoint == str(ckpt.resolve())
