"""The canary loop across faults (issue 17, items 4, 5 and 9): a window that spans a fault
is never data, the knobs from before tuning survive a SIGKILL, a resumed study counts its
trials, and every place numbers a trial the same way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from controller.targets import Measurement, WindowPlan, fleet_fault
from controller.tune import ORIGINAL_KNOBS_FILE, TuneLimits
from search.space import Knobs
from tests.controller.test_tune import FakeTarget, make_tuner, run

ROOT = Path(__file__).resolve().parents[2]


class FaultyTarget(FakeTarget):
    """The fake deployment, with chosen windows spanning a fault (e.g. a replica restart)."""

    def __init__(self, faults: dict[int, str], **kw) -> None:
        super().__init__(**kw)
        self.faults = faults

    def measure(self, knobs: Knobs) -> Measurement:
        i = len(self.measured)
        m = super().measure(knobs)
        return replace(m, fault=self.faults[i]) if i in self.faults else m


def test_a_window_across_a_fault_is_discarded_and_measured_again(tmp_path: Path) -> None:
    target = FaultyTarget({1: "the replicas changed during the window (restart)"})
    tuner = make_tuner(tmp_path)
    out = run(tmp_path, target, tuner=tuner, limits=TuneLimits(max_trials=3, time_budget_s=1e6))
    assert not out.aborted and len(out.report.trials) == 3
    # the second trial's knobs were applied again and measured twice; the tuner was told once
    assert target.measured[1] == target.measured[2]
    assert target.applied.count(target.measured[1]) >= 2
    told = [t for t in tuner.study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    assert len(told) == 3
    second = out.report.trials[1]
    assert second.remeasured == 1 and "re-measured" in second.note
    assert [t.remeasured for t in out.report.trials] == [0, 1, 0]
    assert "restart" in out.report.meta["discarded_windows"]
    html = (tmp_path / "out" / "report.html").read_text()
    assert "discarded_windows" in html and "restart" in html


def test_windows_that_keep_faulting_stop_the_run_with_the_best_so_far(tmp_path: Path) -> None:
    target = FaultyTarget({i: "7 client errors in the window" for i in range(1, 50)})
    limits = TuneLimits(max_trials=5, time_budget_s=1e6, remeasures=2)
    out = run(tmp_path, target, limits=limits)
    assert "spanned a fault" in out.aborted and "client errors" in out.aborted
    assert len(out.report.trials) == 1  # only the clean first window is data
    assert len(target.measured) == 1 + 3  # the faulty trial: one window and two re-measures


def test_a_window_is_a_fault_when_the_replicas_change_or_errors_exceed_the_bound() -> None:
    a = (("r1", 100, "v1"),)
    assert fleet_fault(a, a) == ""
    assert "changed" in fleet_fault(a, (("r2", 101, "v1"),))  # restarted: new id and pid
    assert "changed" in fleet_fault(a, (("r1", 100, "v2"),))  # updated mid-window
    assert "changed" in fleet_fault(a, ())  # crashed and not back yet
    assert "different config versions" in fleet_fault(
        (("r1", 1, "v1"), ("r2", 2, "v2")), (("r1", 1, "v1"), ("r2", 2, "v2"))
    )
    plan = WindowPlan(max_client_errors=2, max_client_error_frac=0.01)
    assert plan.error_fault(2, 100) == ""
    assert "3 client errors" in plan.error_fault(3, 100)
    assert plan.error_fault(5, 1000) == ""  # 1% of 1000 requests
    with pytest.raises(ValueError, match="max_client_error_frac"):
        WindowPlan(max_client_error_frac=2.0)


def test_the_original_knobs_are_saved_before_the_first_change(tmp_path: Path) -> None:
    record = tmp_path / "out" / ORIGINAL_KNOBS_FILE
    seen: list[bool] = []

    class Watching(FakeTarget):
        def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> None:
            seen.append(record.exists())
            super().apply(knobs)

    run(tmp_path, Watching(start=Knobs(max_batch_size=4, max_concurrency=6)))
    assert seen and seen[0], "the first change came before the record was written"
    rec = json.loads(record.read_text())
    assert rec["knobs"] == {"max_batch_size": 4, "max_concurrency": 6}


def test_a_record_of_another_app_or_a_corrupt_one_is_refused_by_name(tmp_path: Path) -> None:
    from controller.errors import BadInput

    out = tmp_path / "out"
    out.mkdir()
    (out / ORIGINAL_KNOBS_FILE).write_text('{"app": "other", "knobs": null}')
    with pytest.raises(BadInput, match=r"original_knobs.json.*app 'other'"):
        run(tmp_path, FakeTarget())
    (out / ORIGINAL_KNOBS_FILE).write_text("{not json")
    with pytest.raises(BadInput, match="original_knobs.json: not a record"):
        run(tmp_path, FakeTarget())


def test_max_trials_counts_the_trials_of_a_resumed_study(tmp_path: Path) -> None:
    first = run(tmp_path, FakeTarget(), limits=TuneLimits(max_trials=3, time_budget_s=1e6))
    assert len(first.report.trials) == 3
    target = FakeTarget()
    again = run(
        tmp_path,
        target,
        tuner=make_tuner(tmp_path),  # the same study storage and name: resumed
        limits=TuneLimits(max_trials=4, time_budget_s=1e6),
    )
    assert len(target.measured) == 1  # 3 of the 4 were run before
    assert len(again.report.trials) == 4
    assert "3 of them from the resumed study" in again.stop_reason


def test_one_numbering_in_the_summary_the_jsonl_and_the_report(tmp_path: Path) -> None:
    out = run(tmp_path, FakeTarget())
    lines = (tmp_path / "out" / "trials.jsonl").read_text().splitlines()
    assert [json.loads(x)["number"] for x in lines] == [t.number for t in out.report.trials]
    chosen = out.report.chosen
    assert chosen is not None and f"(trial {chosen.number})" in out.final_note
    curve = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert curve["operating_point"]["trial"] == chosen.number


# A driver that tunes a fake deployment whose knobs live in a file (so they outlast the
# process), with nothing feasible (TPOT SLO 5 ms): the run can only restore.
DRIVER = """
import json, os, sys, time
from pathlib import Path
import tests.controller.test_tune as tt
from controller.tune import TuneLimits, run_tune
from metrics.observation import Slo
from search.space import Knobs

tt.SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.005)
state, out, slow = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "slow"

class Deployment(tt.FakeTarget):
    def current_knobs(self):
        return Knobs(**json.loads(state.read_text()))
    def describe(self):
        return {"target": "fake", "app": "deployment-file"}
    def apply(self, knobs, *, batch_cap=None):
        super().apply(knobs)
        state.write_text(json.dumps({"max_batch_size": knobs.max_batch_size,
                                     "max_concurrency": knobs.max_concurrency}))
    def measure(self, knobs):
        if slow and self.measured:
            time.sleep(120)  # the second trial hangs: the parent SIGKILLs us here
        return super().measure(knobs)

out.mkdir(exist_ok=True)
tuner = tt.make_tuner(out)
res = run_tune(target=Deployment(), tuner=tuner, base=tt.base(),
               limits=TuneLimits(max_trials=3, time_budget_s=1e6), out_dir=out,
               sleep=lambda s: None)
print(json.dumps({"final": res.final_knobs, "note": res.final_note, "aborted": res.aborted}))
"""


def _start_and_wait_for_second_trial(tmp_path: Path) -> tuple[subprocess.Popen, list[str]]:
    """The driver, run until its second (hanging) trial has applied its knobs."""
    state, out = tmp_path / "deployment.json", tmp_path / "out"
    state.write_text(json.dumps({"max_batch_size": 4, "max_concurrency": 4}))
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    argv = [sys.executable, str(script), str(state), str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*argv, "slow"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        jsonl = out / "trials.jsonl"
        # wait until the first trial is recorded and the second trial's knobs are applied
        while time.monotonic() < deadline:
            if jsonl.exists() and jsonl.read_text().count("\n") >= 1:
                applied = json.loads(state.read_text())
                if applied != {"max_batch_size": 4, "max_concurrency": 4}:
                    break
            assert proc.poll() is None, "the driver ended before it could be killed"
            time.sleep(0.1)
        else:
            pytest.fail("the first run never reached its second trial")
        time.sleep(0.3)
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc, argv


def test_a_rerun_after_sigkill_restores_the_knobs_from_before_the_first_run(
    tmp_path: Path,
) -> None:
    state = tmp_path / "deployment.json"
    proc, argv = _start_and_wait_for_second_trial(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed_on = json.loads(state.read_text())
    assert killed_on != {"max_batch_size": 4, "max_concurrency": 4}  # an untested trial's
    rerun = subprocess.run(
        [*argv, "fast"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    result = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert result["final"] == [4, 4], result
    assert "restored" in result["note"]
    assert json.loads(state.read_text()) == {"max_batch_size": 4, "max_concurrency": 4}


def test_sigterm_mid_trial_exits_cleanly_on_the_knobs_from_before(tmp_path: Path) -> None:
    proc, _ = _start_and_wait_for_second_trial(tmp_path)
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["aborted"] == "terminated (SIGTERM)" and result["final"] == [4, 4]
    state = json.loads((tmp_path / "deployment.json").read_text())
    assert state == {"max_batch_size": 4, "max_concurrency": 4}
