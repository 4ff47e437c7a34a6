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
