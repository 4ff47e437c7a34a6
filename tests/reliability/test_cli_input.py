"""Issue 17 items 6 and 8, and the CLI bullet: every bad value or file is one line naming
it, exit 2, no traceback, and it is caught before any work (no Ray, no measurement).

Each case runs the real entry point (``controller.cli.main.main``) with the first piece of
work of each command replaced by a tripwire; a few go through the installed ``slotune``
script in a subprocess, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SLOTUNE = Path(sys.executable).with_name("slotune")


class ReachedWork(Exception):
    """A command got past its checks to real work: the bad value was not caught."""


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch) -> None:
    import controller.cli.tune as cli_tune
    import search.calibrate.device as calib

    def work(**_: object) -> None:
        raise ReachedWork

    monkeypatch.setattr(cli_tune, "prepare", work)  # tune: Ray starts here
    monkeypatch.setattr(calib, "calibrate", work)  # calibrate: measuring starts here


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0), capsys.readouterr().err


def assert_one_line_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]):
    code, err = run(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("slotune: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    return err


def study_journal(path: Path) -> Path:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from search.tuner import open_storage

    study = optuna.create_study(storage=open_storage(str(path)), study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    return path


CORRUPT = ("garbage_first", "garbage_middle", "wrong_shape", "not_an_object", "binary")


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    good = study_journal(tmp_path / "good.journal")
    lines = good.read_bytes().splitlines(keepends=True)
    corrupt = {
        "garbage_first": b"garbage\n" + b"".join(lines),
        "garbage_middle": lines[0] + b"{not json\n" + b"".join(lines[1:]),
        "wrong_shape": b'{"a": 1}\n' + b"".join(lines),
        "not_an_object": b"[1, 2]\n" + b"".join(lines),
        "binary": b"\xff\xfe\x00\x01\n" + b"".join(lines),
    }
    assert set(corrupt) == set(CORRUPT)
    out = {"dir": tmp_path, "a_file": a_file, "good": good}
    for name, data in corrupt.items():
        p = tmp_path / f"{name}.journal"
        p.write_bytes(data)
        out[name] = p
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    study_journal(run_dir / "study.journal")
    out["run_dir"] = run_dir
    trace_long = tmp_path / "long.jsonl"
    long_prompt = json.dumps({"prompt": "x" * 500, "max_tokens": 20})
    trace_long.write_text('{"prompt_tokens": 8, "max_tokens": 8}\n' + long_prompt + "\n")
    out["trace_long"] = trace_long
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"prompt_tokens": 8, "max_tokens": 8}\nnot json\n')
    out["trace_bad"] = bad_trace
    return out


# ---- item 6: request lengths against the built-in model's context ----------------------

LENGTH_CASES = [
    (["--prompt-tokens", "100000"], "--prompt-tokens 100000"),
    (["--output-tokens", "100000"], "--output-tokens 100000"),
    (["--prompt-tokens", "400", "--output-tokens", "200"], "400 + 200 = 600"),
    (["--model", "tiny", "--prompt-tokens", "500", "--output-tokens", "13"], "'tiny'"),
    (["--prompt-tokens", "uniform:10-600"], "600 + 8"),
    (["--prompt-tokens", "lognormal:100,0.5"], "lognormal:100,0.5 draws up to 800"),
    (["--output-tokens", "lognormal:64,0.2"], "draws up to 512"),
    # the built-in model deployed on an attached cluster: its context is known too
    (["--address", "127.0.0.1:1", "--prompt-tokens", "600"], "--prompt-tokens 600"),
]


@pytest.mark.parametrize(("args", "needle"), LENGTH_CASES)
def test_tune_lengths_beyond_the_context_exit_2_before_ray(
    args: list[str], needle: str, tripwires: None, tmp_path: Path, capsys
) -> None:
    err = assert_one_line_exit_2(["tune", "--out", str(tmp_path / "o"), *args], needle, capsys)
    assert "holds 512 tokens" in err  # the engine's slot context, named


def test_tune_trace_request_beyond_the_context_exit_2(tripwires, files, tmp_path, capsys) -> None:
    argv = ["tune", "--out", str(tmp_path / "o"), "--trace", str(files["trace_long"])]
    assert_one_line_exit_2(argv, "request 2 has 500 prompt + 20 output", capsys)


@pytest.mark.parametrize(
    "args",
    [
        ["--prompt-tokens", "400", "--output-tokens", "112"],  # exactly 512: fits
        ["--app", "mine", "--prompt-tokens", "100000"],  # another deployment: its own limit
    ],
)
def test_lengths_that_may_fit_reach_set_up(args: list[str], tripwires, tmp_path, capsys) -> None:
    with pytest.raises(ReachedWork):
        main(["tune", "--out", str(tmp_path / "o"), *args])


# ---- item 8: every file error names the file ------------------------------------------


# (argv, what the one line must say); {name} is a path from the `files` fixture
FILE_CASES = [
    (["export", "{dir}"], "STUDY {dir}: is a folder"),
    (["export", "{dir}/"], "STUDY {dir}: is a folder"),
    (["export", "{run_dir}"], "did you mean {run_dir}/study.journal"),
    (["export", "{dir}/missing.journal"], "{dir}/missing.journal: no such file"),
    (["export", "{good}", "--out", "{a_file}"], "--out {a_file}: exists and is not a folder"),
    (["export", "{good}", "--out", "{a_file}/sub"], "--out {a_file}/sub"),
    (["export", "bogus://nowhere"], "STUDY bogus://nowhere: not an Optuna storage URL"),
    (["roofline", "--csv", "{dir}"], "--csv {dir}: is a folder"),
    (["roofline", "--csv", "{dir}/new/c.csv"], "folder {dir}/new does not exist"),
    (["roofline", "--csv", "{a_file}/c.csv"], "{a_file} is not a folder"),
    (["roofline", "--csv", "/proc/slotune.csv"], "--csv /proc/slotune.csv: cannot write"),
    (["roofline", "--plot", "/proc/slotune.png"], "--plot /proc/slotune.png: cannot write"),
    (["roofline", "--plot", "{dir}/new/p.png"], "folder {dir}/new does not exist"),
    (["roofline", "--hardware", "{a_file}"], "hardware file '{a_file}': not JSON"),
    (["calibrate", "--out", "{dir}"], "--out {dir}: is a folder"),
    (["calibrate", "--out", "{dir}/new/h.json"], "folder {dir}/new does not exist"),
    (["tune", "--out", "{a_file}"], "--out {a_file}: exists and is not a folder"),
    (["tune", "--out", "{a_file}/sub"], "--out {a_file}/sub"),
    (["tune", "--study", "{dir}"], "--study {dir}: is a folder"),
    (["tune", "--study", "{dir}/new/s.journal"], "folder {dir}/new does not exist"),
    (["tune", "--trace", "{dir}"], "--trace {dir}: is a folder"),
    (["tune", "--trace", "{dir}/no.jsonl"], "--trace {dir}/no.jsonl: no such file"),
    (["tune", "--trace", "{trace_bad}"], "--trace {trace_bad} line 2"),
    (["simulate", "--study", "{dir}"], "--study {dir}: is a folder"),
    (["simulate", "--study", "{dir}/new/s.journal"], "folder {dir}/new does not exist"),
] + [
    case
    for ref in ("{" + name + "}" for name in CORRUPT)
    for case in (
        (["export", ref], f"STUDY {ref}: not an Optuna journal file"),
        (["tune", "--study", ref], f"--study {ref}: not an Optuna journal file"),
        (["simulate", "--study", ref], f"--study {ref}: not an Optuna journal file"),
    )
]


@pytest.mark.parametrize(("argv", "needle"), FILE_CASES, ids=[" ".join(c[0]) for c in FILE_CASES])
def test_file_error_names_the_file_and_exits_2(
    argv: list[str], needle: str, tripwires: None, files: dict[str, Path], capsys
) -> None:
    names = {k: str(v) for k, v in files.items()}
    argv = [a.format(**names) for a in argv]
    if argv[0] == "tune" and "--out" not in argv:
        argv += ["--out", str(files["dir"] / "tune-out")]
    assert_one_line_exit_2(argv, needle.format(**names), capsys)
    assert not (files["dir"] / "new").exists()  # a missing folder is named, never made


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file modes")
def test_unwritable_folder_is_named(tripwires, tmp_path: Path, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert_one_line_exit_2(["roofline", "--csv", str(ro / "c.csv")], "Permission denied", capsys)
    assert_one_line_exit_2(["tune", "--out", str(ro / "o")], f"--out {ro / 'o'}", capsys)


def test_output_folders_are_created_with_their_parents(files, capsys) -> None:
    """An output folder (export --out) is made like mkdir -p; the study is read once."""
    out = files["dir"] / "deep" / "er"
    code, err = run(["export", str(files["good"]), "--out", str(out)], capsys)
    assert code == 3, err  # a bare study holds no feasible point: exit 3, files written
    assert (out / "report.html").exists()


# ---- other user errors: numbers, names, URLs ------------------------------------------

VALUE_CASES = [
    (["tune", "--url", "notaurl"], "--url notaurl"),
    (["tune", "--url", "http://127.0.0.1:99999"], "--url http://127.0.0.1:99999"),
    (["tune", "--metrics-url", "ftp://x/metrics"], "--metrics-url ftp://x/metrics"),
    (["tune", "--prometheus-url", "localhost:9090"], "--prometheus-url localhost:9090"),
    (["tune", "--deployment", "LLM"], "--deployment LLM: names a deployment within --app"),
    (["tune", "--max-slots", "0"], "--max-slots 0"),
    (["tune", "--max-slots", "-3"], "--max-slots -3"),
    (["tune", "--seed", "-1"], "--seed -1"),
    (["tune", "--warmup", "nan"], "--warmup nan"),
    (["tune", "--warmup", "-1"], "--warmup -1"),
    (["tune", "--window", "0"], "--window 0"),
    (["tune", "--max-window", "inf"], "--max-window inf"),
    (["tune", "--min-requests", "-1"], "--min-requests -1"),
    (["tune", "--time-budget", "nan"], "--time-budget nan"),
    (["tune", "--prompt-tokens", "0"], "--prompt-tokens length spec '0'"),
    (["tune", "--output-tokens", "uniform:9-2"], "--output-tokens length spec"),
    # the backend flags (issue 18)
    (["tune", "--actuator", "k8s"], "--actuator k8s: choose one of serve, serve-llm, none"),
    (["tune", "--actuator", "embedded"], "--actuator embedded: choose one of"),
    (["tune", "--actuator", "serve"], "--actuator serve: tunes an existing application"),
    (["tune", "--actuator", "none"], "--actuator none: give --url"),
    (
        ["tune", "--actuator", "none", "--url", "http://127.0.0.1:8000", "--address", "x:1"],
        "--address x:1: --actuator none changes nothing",
    ),
    (["tune", "--batch-knob", "user_config.b"], "--batch-knob user_config.b: names a config"),
    (["tune", "--metrics-profile", "tgi"], "--metrics-profile tgi: choose one of"),
    (["tune", "--endpoint", "embeddings"], "--endpoint embeddings: choose one of"),
    (["tune", "--prompt-format", "ids"], "--prompt-format ids: choose one of"),
    (["tune", "--dashboard-url", "8265"], "--dashboard-url 8265"),
    (["tune", "--tp", "0"], "--tp 0"),
    (["tune", "--max-batch", "0"], "--max-batch 0"),
    (["tune", "--model-config", "llama-9b"], "--model-config llama-9b"),
    (["tune", "--app", "a", "--hardware", "tpu-v9"], "--hardware tpu-v9"),
    (["tune", "--model-config", "llama-3.1-8b"], "--model-config, --hardware and --tp describe"),
    (["tune", "--tokenizer", "/nonexistent/tok.json"], "--tokenizer /nonexistent/tok.json"),
    (["simulate", "--seed", "-1"], "--seed -1"),
    (["simulate", "--seed", str(2**40)], f"--seed {2**40}"),
    (["simulate", "--tp", "0"], "--tp 0"),
    (["simulate", "--slo-ttft-ms", "nan"], "--slo-ttft-ms nan"),
    (["simulate", "--slo-tpot-ms", "-1"], "--slo-tpot-ms -1"),
    (["calibrate", "--dtypes", ","], "--dtypes ','"),
    (["calibrate", "--threads", "0"], "--threads 0"),
    (["control", "--app", "a", "--max-batch", "0"], "--max-batch 0"),
    (["control", "--app", "a", "--interval", "0"], "--interval 0"),
    (["control", "--app", "a", "--tighten-at", "1.5"], "--tighten-at 1.5"),
    (["control", "--app", "a", "--loosen-below", "nan"], "--loosen-below nan"),
    (["control", "--app", "a", "--attainment", "0.4"], "--attainment 0.4"),
    (["control", "--app", "a", "--attainment", "1"], "--attainment 1.0"),
    (["control", "--app", "a", "--stabilization", "-1"], "--stabilization -1"),
    (["control", "--app", "a", "--prometheus-url", "9090"], "--prometheus-url 9090"),
    (["control", "--app", "a", "--actuator", "k8s"], "--actuator k8s"),
    (["control", "--app", "a", "--actuator", "none"], "give --curve"),
    (["control", "--app", "a", "--actuator", "kuberay"], "give --rayservice"),
    (["control", "--app", "a", "--rayservice", "rs"], "only for --actuator kuberay, not serve"),
    (
        [
            "control",
            "--app",
            "a",
            "--actuator",
            "kuberay",
            "--rayservice",
            "rs",
            "--max-batch",
            "8",
        ],
        "no Kubernetes credentials",
    ),  # fmt: skip
    (["control", "--app", "a", "--curve", "/nonexistent/curve.json"], "/nonexistent/curve.json"),
    (
        ["control", "--app", "a", "--actuator", "none", "--max-batch", "4"],
        "give --prometheus-url or --metrics-url",
    ),
    (
        ["control", "--app", "a", "--actuator", "none", "--max-batch", "8", "--tighten-at", "0.6"],
        "loosen_below=0.9 >= tighten_at=0.6",
    ),  # fmt: skip
    (["observe", "http:///metrics"], "http:///metrics"),
    (["observe", "http://127.0.0.1:99999/metrics"], "http://127.0.0.1:99999/metrics"),
    (["export", "x.journal", "--price-per-hour", "nan"], "--price-per-hour nan"),
    (["roofline", "--context", "1e9"], "'--context'"),  # click's own parse error
    (["roofline", "--no-such-flag"], "--no-such-flag"),
    (["no-such-command"], "no-such-command"),
]


@pytest.mark.parametrize(("argv", "needle"), VALUE_CASES, ids=[" ".join(c[0]) for c in VALUE_CASES])
def test_bad_value_is_one_line_and_exit_2(
    argv: list[str], needle: str, tripwires: None, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))  # no cluster to reach
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    if argv[0] == "tune":
        argv = [*argv, "--out", str(tmp_path / "o")]
    assert_one_line_exit_2(argv, needle, capsys)


# ---- the installed script, as a user runs it ------------------------------------------


@pytest.mark.skipif(not SLOTUNE.exists(), reason="the slotune script is not installed here")
def test_installed_script_names_the_file(files) -> None:
    for argv, needle in (
        (["export", str(files["dir"])], "is a folder"),
        (["export", str(files["garbage_middle"])], "not an Optuna journal file"),
    ):
        p = subprocess.run(
            [str(SLOTUNE), *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr
