"""``slotune roofline`` and ``slotune calibrate`` as a user runs them."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controller.cli.main import main
from search.roofline.hardware import CATALOG as HW

ROOT = Path(__file__).resolve().parents[2]
ISSUE_ARGS = [
    "roofline",
    "--model",
    "llama-3.1-70b",
    "--hardware",
    "h100-sxm",
    "--tp",
    "4",
    "--context",
    "4096",
    "--slo-tpot-ms",
    "50",
    "--price-per-hour",
    "2.5",
]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_issue_command_prints_table_figures_and_advice(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(ISSUE_ARGS, capsys)
    assert code == 0, err
    for text in ("TPOT ms", "tokens/s", "bound", "ridge point", "295.3", "327,680", "knee"):
        assert text in out
    assert "Operate at B=109" in out and "KV cache caps it" in out
    assert "0.5995" in out  # $ per million tokens at $2.5/h x 4 devices


def test_json_has_the_issues_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*ISSUE_ARGS, "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["kv_bytes_per_token"] == 327_680
    assert d["ridge_flops_per_byte"] == pytest.approx(295.3, abs=0.5)
    assert d["max_batch_memory"] == 109 and d["knee_batch"] >= 1
    op = d["operating_point"]
    assert set(op) >= {"batch", "tpot_ms", "tokens_per_s", "usd_per_million_tokens"}
    assert op["usd_per_million_tokens"] == pytest.approx(
        2.5 * 4 / (op["tokens_per_s"] * 3600) * 1e6
    )
    assert all(set(p) >= {"batch", "tpot_ms", "tokens_per_s", "bound"} for p in d["curve"])
    assert [p["batch"] for p in d["curve"]] == list(range(1, 110))


def test_csv_and_plot_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path, png = tmp_path / "curve.csv", tmp_path / "curve.png"
    code, out, _ = run(
        [*ISSUE_ARGS, "--max-batch", "128", "--csv", str(csv_path), "--plot", str(png)], capsys
    )
    assert code == 0
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 128 and rows[0]["batch"] == "1" and rows[0]["bound"] == "memory"
    assert rows[-1]["fits"] == "0"  # past the KV cap of 109
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in out


def test_catalog_price_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["roofline", "--model", "llama-3.1-8b", "--json"], capsys)
    assert code == 0
    assert json.loads(out)["usd_per_hour"] == HW["h100-sxm"].usd_per_hour


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "llama-9"], "'llama-9'.*allowed: llama-3.1-8b"),
        (["--hardware", "b300"], "'b300'.*allowed: h100-sxm"),
        (["--slo-tpot-ms", "0"], "--slo-tpot-ms 0: must be a positive"),
        (["--slo-tpot-ms", "-5"], "--slo-tpot-ms -5"),
        (["--model", "llama-3.1-405b"], "needs 811.7 GB.*--tp 16"),
        (["--tp", "3"], "tp=3.*allowed: 1, 2, 4, 8"),
        (["--dtype", "fp4"], "dtype='fp4'"),
        (["--hardware", "/nonexistent/hw.json"], "cannot read"),
        (["--plot", "x.svg"], "must end in .png"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["roofline", *args], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("slotune: error: ")
    assert "Traceback" not in err
    assert re.search(needle, err), err


def test_no_feasible_point_exits_3_after_the_analysis(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*ISSUE_ARGS[:-4], "--slo-tpot-ms", "5", "--json"], capsys)
    assert code == 3
    assert json.loads(out)["operating_point"] is None
    assert "no feasible point" in err


def test_model_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = tmp_path / "m.json"
    m.write_text(
        json.dumps(
            {
                "name": "my-3b",
                "layers": 28,
                "hidden": 3072,
                "heads": 24,
                "kv_heads": 8,
                "head_dim": 128,
                "vocab": 128256,
                "intermediate": 8192,
            }
        )
    )
    code, out, _ = run(["roofline", "--model", str(m), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["kv_bytes_per_token"] == 2 * 28 * 8 * 128 * 2


@pytest.mark.slow
def test_calibrate_quick_writes_json_that_roofline_reads(tmp_path: Path) -> None:
    """Through the real entry point, in fresh processes (as a user runs it): calibrate
    into the user cache, then `--hardware local` finds it."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    kw = {"cwd": ROOT, "capture_output": True, "text": True, "timeout": 120, "env": env}
    cli = [sys.executable, "-m", "controller"]
    p = subprocess.run([*cli, "roofline", "--hardware", "local", "--model", "slotune-tiny"], **kw)
    assert p.returncode == 2 and "run `slotune calibrate` first" in p.stderr
    p = subprocess.run(
        [*cli, "calibrate", "--quick", "--model", "slotune-tiny", "--dtypes", "bf16"], **kw
    )
    assert p.returncode == 0, p.stderr
    written = list((tmp_path / "slotune").glob("hardware-*.json"))
    assert len(written) == 1 and f"wrote {written[0]}" in p.stdout
    assert "memory bandwidth" in p.stdout
    d = json.loads(written[0].read_text())
    assert d["decode"]["bf16"]["weight_rate"] and d["measured"]["plan"] == "quick"
    p = subprocess.run(
        [*cli, "roofline", "--hardware", "local", "--model", "slotune-tiny"]
        + ["--context", "64", "--slo-tpot-ms", "1000", "--json"],
        **kw,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["calibrated"] is True and out["operating_point"]["batch"] >= 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dtypes", "fp64"], "dtype='fp64'.*allowed: fp32, bf16, fp16"),
        (["--device", "tpu"], "device='tpu'.*allowed: cpu, cuda"),
        (["--model", "nope"], "'nope'.*allowed:"),
        (["--threads", "0"], "--threads 0"),
    ],
)
def test_calibrate_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["calibrate", "--quick", "--out", str(tmp_path / "x.json"), *args], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(needle, err), err
    assert not (tmp_path / "x.json").exists()
