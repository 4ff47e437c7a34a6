"""slotune compare: the verdict on simulated canary runs (a rerun is not worse, a version
30% slower per step is), its intervals, and the command's files and exit codes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from controller.cli.main import main
from controller.report.compare import compare, load_run
from controller.report.curve import CurveReport
from controller.report.files import write_report
from controller.sim.scenarios import SCENARIOS
from controller.tune_simulated import slowed, tune_simulated

optuna.logging.set_verbosity(optuna.logging.WARNING)
SCENARIO = SCENARIOS["h100x4-70b"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Exported runs: A, a rerun of A's version, and a version 30% slower per step: the
    second of the ten seed triples of the proof below (a rerun is called worse in at most
    one of those ten; since the guide's first step moved in 30bfbd8 that one is the first,
    seeds 0 and 100, its TPOT 4.6% slower at the same knobs from the windows' slowdown)."""
    d = tmp_path_factory.mktemp("runs")
    for name, sc, seed in (
        ("a", SCENARIO, 1),
        ("rerun", SCENARIO, 101),
        ("slow", slowed(SCENARIO, 1.3), 201),
    ):
        tune_simulated(sc, seed=seed, out_dir=d / name, usd_per_hour=12.0)
    return {n: d / n for n in ("a", "rerun", "slow")}


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return int(e.value.code or 0)


def test_a_slower_version_exits_5_and_a_rerun_0(runs, tmp_path: Path, capsys) -> None:
    assert run_cli("compare", str(runs["a"]), str(runs["rerun"]), "--out", str(tmp_path / "r")) == 0
    code = run_cli(
        "compare", str(runs["a"]), str(runs["slow"] / "curve.json"), "--out", str(tmp_path / "s")
    )
    assert code == 5
    err = capsys.readouterr().err
    assert "B is worse: goodput" in err and "below 90% of A's" in err
    d = json.loads((tmp_path / "s" / "compare.json").read_text())
    assert d["verdict"] == "B is worse" and d["worse"] is True
    assert {t["name"] for t in d["tests"]} == {"goodput", "TPOT", "TTFT"}
    assert d["method"]["per_test_level"] == pytest.approx(0.05 / 3)
    for side in ("a", "b"):
        g = d[side]["goodput_rps"]
        assert g["low"] < g["value"] < g["high"]
        c = d[side]["usd_per_million_tokens"]
        assert c["low"] < c["value"] < c["high"]
        p = d[side]["p99_tpot_ms"]
        assert p["low"] <= p["value"] <= p["high"]
    assert (tmp_path / "s" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "B is worse" in (tmp_path / "s" / "compare.html").read_text()


def test_latency_judges_only_at_the_same_knobs(runs) -> None:
    """B = A's own windows with every TPOT 30% slower (same knobs, same goodput): worse by
    TPOT; the same shift at other knobs is said, not judged."""
    a = load_run(runs["a"])

    def slower(t):
        ev = dict(t.evidence)
        ev["tpot_hist"] = [[None if le is None else le * 1.3, n] for le, n in ev["tpot_hist"]]
        return replace(t, evidence=ev)

    b = a.with_trials([slower(t) for t in a.trials])
    c = compare(a, b)
    assert c.worse and any(r.startswith("TPOT slower at the same knobs") for r in c.reasons)
    other = b.with_trials([replace(t, max_concurrency=t.max_concurrency + 1) for t in b.trials])
    c2 = compare(a, other)
    assert not c2.worse and any("at other knobs" in n for n in c2.notes)


def test_no_operating_point(runs, tmp_path: Path) -> None:
    a = load_run(runs["a"])
    bad = {"feasible": False, "tpot_verdict": "violated", "p99_tpot_ms": 1e4, "evidence": None}
    none = a.with_trials([replace(t, **bad) for t in a.trials])
    assert none.chosen is None
    write_report(none, tmp_path / "none")
    c = compare(a, none)
    assert c.worse and "has no operating point" in c.reasons[0]
    assert not compare(none, a).worse
    assert (
        run_cli(
            "compare", str(tmp_path / "none"), str(tmp_path / "none"), "--out", str(tmp_path / "o")
        )
        == 6
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["compare", "/nonexistent/run", "{a}"], "RUN_A /nonexistent/run: no exported run"),
        (["compare", "{a}", "{a}", "--alpha", "2"], "alpha=2.0: must be in (0, 1)"),
        (["compare", "{a}", "{a}", "--effect", "0.4"], "effect=0.4: must be in [0.5, 1)"),
    ],
)
def test_bad_input_is_one_line_exit_2(runs, tmp_path, capsys, args, needle) -> None:
    argv = [x.format(a=runs["a"]) for x in args] + ["--out", str(tmp_path / "o")]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.mark.slow
def test_slower_version_flagged_and_rerun_not_in_9_of_10_seeds(tmp_path: Path) -> None:
    """The issue's proof: +30% step time is flagged worse, a rerun of the same version is
    not, in at least 9 of 10 seeds each (each run the whole canary loop and export)."""
    flagged_slow = flagged_rerun = 0
    for s in range(10):
        d = tmp_path / str(s)
        a = tune_simulated(SCENARIO, seed=s, out_dir=d / "a").report
        r = tune_simulated(SCENARIO, seed=s + 100, out_dir=d / "r").report
        b = tune_simulated(slowed(SCENARIO, 1.3), seed=s + 200, out_dir=d / "b").report
        a, r, b = (CurveReport.from_dict(json.loads(json.dumps(x.to_dict()))) for x in (a, r, b))
        flagged_rerun += compare(a, r).worse
        flagged_slow += compare(a, b).worse
    assert flagged_slow >= 9 and flagged_rerun <= 1, (flagged_slow, flagged_rerun)


def test_runs_exported_without_latency_histograms_are_judged_on_goodput(runs, tmp_path) -> None:
    """Runs exported before windows kept their histograms: no latency test can judge, the
    goodput test still does, and the command says so instead of failing."""
    for name in ("a", "slow"):
        r = load_run(runs[name])
        old = [
            replace(t, evidence={k: v for k, v in t.evidence.items() if "hist" not in k})
            for t in r.trials
        ]
        write_report(r.with_trials(old), tmp_path / name)
    c = compare(load_run(tmp_path / "a"), load_run(tmp_path / "slow"))
    assert c.worse and [t.name for t in c.tests if t.rejected(c.level)] == ["goodput"]
    assert "no latency distribution stored" in c.tests[1].detail
    assert (
        run_cli(
            "compare", str(tmp_path / "a"), str(tmp_path / "slow"), "--out", str(tmp_path / "o")
        )
        == 5
    )


def test_simulate_out_exports_runs_that_compare_reads(tmp_path: Path, capsys) -> None:
    """From the README: two devices simulated and exported, then compared."""
    a, b = tmp_path / "h100", tmp_path / "a100"
    base = ["simulate", "--scenario", "h100x4-70b", "--curve-points", "4"]
    assert run_cli(*base, "--out", str(a), "--price-per-hour", "12") == 0
    assert run_cli(*base, "--hardware", "a100-80gb", "--out", str(b)) == 0
    out = capsys.readouterr().out
    assert f"report: {a / 'report.html'}" in out
    d = json.loads((a / "curve.json").read_text())
    assert sum(t["role"] == "sweep" for t in d["trials"]) == 4 and d["usd_per_hour"] == 12
    assert (a / "study.journal").is_file() and (a / "curve_by_batch.png").is_file()
    assert run_cli("compare", str(a), str(b), "--out", str(tmp_path / "c")) == 5
    assert run_cli("simulate", "--curve-points", "3") == 2
    assert "go with --out" in capsys.readouterr().err
