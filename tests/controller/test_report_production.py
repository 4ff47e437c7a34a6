"""Production windows in the exported curve (controller/report/production.py, ``slotune
export --control-log``): audit logs written by the real control loop against scripted
windows are read back as production trial records, drawn beside a real study's trials
without moving its operating point."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from controller.cli.main import main
from controller.control.decide import State
from controller.control.loop import LoopConfig, run_control
from controller.control.policy import Policy
from controller.control.store import save_state
from controller.report.curve import CurveReport
from controller.report.files import write_report
from controller.report.production import NO_REQUESTS, PAUSED, STALE, production_records
from controller.tune_study import report_from_study
from metrics.observation import Observation, Percentiles, Slo, SloVerdict, Verdict
from search.space import Knobs
from tests.controller.test_control_loop import Clock, FakeActuator
from tests.controller.test_tune import FakeTarget
from tests.controller.test_tune import run as run_tune

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
K16 = Knobs(max_batch_size=16, max_concurrency=16)
K12 = Knobs(max_batch_size=12, max_concurrency=12)
WINDOW_S = 60.0


def window(start: float, end: float, *, tpot: float, completed: int = 600) -> Observation:
    """A window whose p99 TPOT is ``tpot`` seconds (TTFT 0.4 s), every request within SLO
    when TPOT is, 20 tokens a request."""

    def v(p99: float, bound: float) -> SloVerdict | None:
        if not completed:
            return None
        met = Verdict.MET if p99 <= bound else Verdict.VIOLATED
        return SloVerdict(
            verdict=met, threshold_s=bound, estimate_s=p99, samples=completed, confidence=0.95
        )

    return Observation(
        start_s=start,
        end_s=end,
        completed=completed,
        slo_met=completed if tpot <= SLO.tpot_p99_s else completed // 2,
        generated_tokens=20 * completed,
        ttft=Percentiles(p99=0.4),
        tpot=Percentiles(p99=tpot),
        ttft_verdict=v(0.4, SLO.ttft_p99_s),
        tpot_verdict=v(tpot, SLO.tpot_p99_s),
        source="script",
    )


class Windows:
    """A reader whose n-th window is ``plan[n]``: a p99 TPOT in seconds (or a (TPOT,
    completed) pair), "empty" (no request completed) or an exception (the metrics could
    not be read: a stale window)."""

    def __init__(self, plan: list) -> None:
        self.plan, self.n = plan, 0

    def begin(self) -> None:
        return None

    def end(self, token: object, *, start_s: float, end_s: float) -> Observation:
        step = self.plan[self.n]
        self.n += 1
        if isinstance(step, Exception):
            raise step
        if step == "empty":
            return window(start_s, end_s, tpot=math.nan, completed=0)
        tpot, completed = step if isinstance(step, tuple) else (step, 600)
        return window(start_s, end_s, tpot=tpot, completed=completed)


def control(tmp_path: Path, plan: list, start: Knobs = K16, **kw) -> Path:
    """Run the real control loop over ``plan``; the audit log it wrote."""
    clock = Clock()
    audit = tmp_path / "audit.jsonl"
    run_control(
        reader=Windows(plan),
        actuator=kw.pop("actuator", None) or FakeActuator(start),
        policy=Policy(slo=SLO, batch_max=64, stabilization_s=120.0),
        state_path=tmp_path / "state.json",
        audit_path=audit,
        config=LoopConfig(interval_s=WINDOW_S, max_ticks=len(plan), **kw),
        clock=clock,
        sleep=clock.sleep,
    )
    return audit


DOWN = ConnectionError("Prometheus at http://127.0.0.1:9090 refused the connection")


def test_each_window_is_a_production_record_on_the_knobs_it_ran(tmp_path: Path) -> None:
    # violated at B=16 (tighten to 12), Prometheus down, nothing completed, met at B=12
    audit = control(tmp_path, [0.15, DOWN, "empty", 0.05])
    rows = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [r["action"] for r in rows] == ["tighten", "hold", "hold", "hold"]

    got = production_records(audit, slo=SLO, first_number=7)
    assert got.ticks == 4 and dict(got.skipped) == {STALE: 1, NO_REQUESTS: 1}
    a, b = got.records
    assert {a.role, b.role} == {"production"} and {a.source, b.source} == {"control"}
    assert [a.number, b.number] == [7, 8]
    # the knobs in force while the window was measured: the tick's "from", not its "to"
    assert (a.max_batch_size, a.max_concurrency) == (16, 16) and rows[0]["to"] != rows[0]["from"]
    assert (b.max_batch_size, b.max_concurrency) == (12, 12)
    assert a.window_s == WINDOW_S
    assert a.tokens_per_s == pytest.approx(20 * 600 / WINDOW_S)
    assert a.throughput_rps == pytest.approx(600 / WINDOW_S)
    assert a.goodput_rps == pytest.approx(300 / WINDOW_S)
    assert a.p99_tpot_ms == pytest.approx(150.0) and a.p99_ttft_ms == pytest.approx(400.0)
    assert (a.tpot_verdict, a.ttft_verdict, a.tpot_samples) == ("violated", "met", 600)
    assert not a.feasible and a.verdict == "violated" and "violated, tighten" in a.note
    assert b.feasible and b.p99_tpot_ms == pytest.approx(50.0) and "met, hold" in b.note
    assert math.isnan(b.p50_tpot_ms)
    assert got.summary() == (
        f"merged 2 production windows from {audit} (2 of 4 ticks skipped: 1 stale, "
        "1 no completed requests)"
    )


def test_a_drift_pause_is_skipped_its_knobs_are_not_from(tmp_path: Path) -> None:
    # the deployment runs B=16 but the state says slotune last wrote B=24: paused
    save_state(State(knobs=Knobs(max_batch_size=24, max_concurrency=24)), tmp_path / "state.json")
    audit = control(tmp_path, [0.05, 0.05])
    got = production_records(audit, slo=SLO, first_number=0)
    assert got.records == () and dict(got.skipped) == {PAUSED: 2}


def test_a_dry_run_draws_the_knobs_that_kept_running(tmp_path: Path) -> None:
    audit = control(tmp_path, [0.15, 0.15], dry_run=True)
    got = production_records(audit, slo=SLO, first_number=0)
    assert [(r.max_batch_size, r.max_concurrency) for r in got.records] == [(16, 16)] * 2
    assert all("(dry run)" in r.note for r in got.records) and not got.skipped


def test_an_old_log_without_tokens_has_no_tokens_per_s(tmp_path: Path) -> None:
    audit = control(tmp_path, [0.05])
    row = json.loads(audit.read_text())
    del row["observation"]["generated_tokens"]
    row["observation"]["slo_met"] = None  # a source that cannot tell (vLLM): no goodput
    audit.write_text(json.dumps(row) + "\n")
    (r,) = production_records(audit, slo=SLO, first_number=0).records
    assert math.isnan(r.tokens_per_s) and math.isnan(r.goodput_rps)
    assert r.throughput_rps == pytest.approx(10.0) and r.feasible


def test_a_met_window_over_the_reports_stricter_slo_is_not_drawn_feasible(tmp_path) -> None:
    audit = control(tmp_path, [0.08])  # met against the controller's 100 ms
    strict = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)
    (r,) = production_records(audit, slo=strict, first_number=0).records
    assert r.tpot_verdict == "met" and not r.feasible
    assert "p99 TPOT over the report's SLO" in r.note
    (r,) = production_records(audit, slo=SLO, first_number=0).records
    assert r.feasible


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: "{not json", "line 2: not JSON"),
        (lambda r: "[1, 2]", "line 2: a JSON list, not an object"),
        (lambda r: b'{"\xff"}'.decode("latin-1"), "line 2: not UTF-8 text (byte 3)"),
        (lambda r: {k: v for k, v in r.items() if k != "from"}, "line 2: no 'from'"),
        (lambda r: {**r, "from": {"max_batch_size": 4}}, "line 2: no 'from.max_concurrency'"),
        (lambda r: {**r, "from": {"max_batch_size": 0, "max_concurrency": 4}}, "max_batch_size=0"),
        (
            lambda r: {**r, "observation": {**r["observation"], "completed": "600"}},
            "line 2: observation.completed='600': must be an integer >= 0",
        ),
        (
            lambda r: {**r, "observation": {**r["observation"], "tpot": {"verdict": "ok"}}},
            "line 2: observation.tpot.verdict='ok': must be one of met, violated, insufficient",
        ),
        (
            lambda r: {
                **r,
                "observation": {**r["observation"], "end_s": r["observation"]["start_s"]},
            },
            "is not after start_s",
        ),
    ],
)
def test_a_malformed_line_names_the_file_and_line(tmp_path: Path, edit, needle: str) -> None:
    audit = control(tmp_path, [0.05, 0.05, 0.05])
    lines = audit.read_text().splitlines()
    bad = edit(json.loads(lines[1]))
    lines[1] = bad if isinstance(bad, str) else json.dumps(bad)
    audit.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    with pytest.raises(ValueError) as e:
        production_records(audit, slo=SLO, first_number=0)
    msg = str(e.value)
    assert needle in msg and f"{audit} line 2" in msg and "\n" not in msg


def test_role_survives_the_csv_and_the_json_round_trip(tmp_path: Path) -> None:
    audit = control(tmp_path, [0.15, 0.05])
    prod = production_records(audit, slo=SLO, first_number=0).records
    report = CurveReport(slo=SLO, trials=prod)
    paths = write_report(report, tmp_path / "out")
    with paths["curve.csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [r["role"] for r in rows] == ["production"] * 2
    assert rows[0]["max_batch_size"] == "16" and rows[0]["source"] == "control"
    again = CurveReport.from_dict(json.loads(paths["curve.json"].read_text()))
    assert [t.role for t in again.trials] == ["production"] * 2
    assert again.trials[0].p99_tpot_ms == pytest.approx(150.0)
    assert report.chosen is None  # production windows are drawn, never chosen


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    return int(e.value.code or 0), cap.out, cap.err


def test_export_merges_production_windows_without_moving_the_operating_point(
    tmp_path: Path, capsys
) -> None:
    study_dir, prod_dir = tmp_path / "study", tmp_path / "prod"
    study_dir.mkdir()
    out = run_tune(study_dir, FakeTarget())
    journal = str(study_dir / "study.journal")
    n = len(out.report.trials)
    code, _, _ = _cli(["export", journal, "--out", str(tmp_path / "plain")], capsys)
    assert code == 0
    plain = json.loads((tmp_path / "plain" / "curve.json").read_text())

    # production at a knob the search never chose, meeting the SLO on more goodput
    big = Knobs(max_batch_size=60, max_concurrency=60)
    prod_dir.mkdir()
    # (p99 TPOT 30 ms: within the study's 40 ms SLO as well as the controller's 100 ms)
    audit = control(prod_dir, [(0.03, 6000), DOWN, (0.03, 6000)], actuator=FakeActuator(big))
    argv = ["export", journal, "--control-log", str(audit), "--out", str(tmp_path / "merged")]
    code, stdout, _ = _cli(argv, capsys)
    assert code == 0, stdout
    assert f"merged 2 production windows from {audit} (1 of 3 ticks skipped: 1 stale)" in stdout
    merged = json.loads((tmp_path / "merged" / "curve.json").read_text())
    prod = [t for t in merged["trials"] if t["role"] == "production"]
    assert len(prod) == 2 and len(merged["trials"]) == n + 2
    assert [t["number"] for t in prod] == [n, n + 1]  # numbered after the study's
    assert {(t["max_batch_size"], t["feasible"]) for t in prod} == {(60, True)}
    assert prod[0]["goodput_rps"] > plain["operating_point"]["goodput_rps"]
    assert merged["operating_point"] == plain["operating_point"]
    searched = CurveReport.from_dict(merged)  # had they been search trials, they would win
    searched = searched.with_trials([replace(t, role="search") for t in searched.trials])
    assert searched.operating_point()["max_batch_size"] == 60
    assert report_from_study(journal).to_dict()["trials"] == plain["trials"]  # study untouched

    # a second log is numbered after the first
    again = tmp_path / "again.jsonl"
    again.write_text(audit.read_text())
    argv += ["--control-log", str(again)]
    code, stdout, _ = _cli(argv, capsys)
    assert code == 0 and stdout.count("merged 2 production windows") == 2
    merged = json.loads((tmp_path / "merged" / "curve.json").read_text())
    assert [t["number"] for t in merged["trials"][n:]] == [n, n + 1, n + 2, n + 3]


def test_export_with_a_bad_control_log_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    run_tune(tmp_path, FakeTarget())
    journal = str(tmp_path / "study.journal")
    missing = tmp_path / "nope.jsonl"
    code, _, err = _cli(["export", journal, "--control-log", str(missing)], capsys)
    assert code == 2 and err == f"slotune: error: --control-log {missing}: no such file\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"time_s": 1}\n')
    code, _, err = _cli(["export", journal, "--control-log", str(bad)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"--control-log {bad} line 1: no 'outcome'" in err
