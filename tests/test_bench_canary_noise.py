"""The pure parts of bench/canary_noise.py and its two helpers (no Ray, no real canary):
the neighbour stops by itself, a run is driven and bounded through a stand-in ``slotune``,
the truth of verdicts, the schedule and the summary."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from bench.canary_noise import RunResult, Variant, read_report, run_canary, schedule, summary
from bench.noisy_neighbour import Neighbour, NoiseSpec
from bench.point_truth import judged, point, truth_of
from controller.targets import Measurement
from metrics.observation import Observation, SloVerdict, Verdict


def wait_until_stopped(nb: Neighbour, bound_s: float = 60.0) -> None:
    end = time.monotonic() + bound_s
    while nb.running and time.monotonic() < end:
        time.sleep(0.05)


def test_the_neighbour_stops_by_its_deadline_and_reports_its_duty() -> None:
    with Neighbour(NoiseSpec(duty=0.5, period_s=0.02, deadline_s=0.3)) as nb:
        wait_until_stopped(nb)
        assert not nb.running  # it quit by itself: nobody told it to
        assert 0 <= nb.duty <= 1.5  # CPU s ÷ wall s (scheduling makes it inexact)


def test_the_neighbour_stops_when_the_block_ends() -> None:
    nb = Neighbour(NoiseSpec(duty=0.2, period_s=0.05, deadline_s=600))
    with nb:
        assert nb.running
    assert not nb.running


def test_at_duty_zero_no_neighbour_runs() -> None:
    with Neighbour(NoiseSpec(duty=0.0)) as nb:
        assert not nb.running
    assert math.isnan(nb.duty)


@pytest.mark.parametrize(
    "kw", [{"duty": 1.5}, {"duty": -0.1}, {"period_s": 0}, {"deadline_s": math.inf}]
)
def test_a_bad_noise_spec_names_its_value(kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        NoiseSpec(**kw)


def test_runs_alternate_a_b_b_a() -> None:
    assert schedule(3, "both") == [
        (0, "new"), (0, "baseline"), (1, "baseline"), (1, "new"), (2, "new"), (2, "baseline"),
    ]  # fmt: skip
    assert schedule(2, "baseline") == [(0, "baseline"), (1, "baseline")]


def v(verdict: Verdict) -> SloVerdict:
    return SloVerdict(verdict=verdict, threshold_s=0.1, estimate_s=0.05, samples=1000,
                      confidence=0.95)  # fmt: skip


MET, VIOL, INS = Verdict.MET, Verdict.VIOLATED, Verdict.INSUFFICIENT


@pytest.mark.parametrize(
    ("verdicts", "truth"),
    [
        ([MET, MET], "feasible"),
        ([MET, VIOL], "infeasible"),
        ([INS, VIOL], "infeasible"),
        ([MET, INS], "unclear"),
        ([MET, None], "unclear"),
        ([], "unclear"),
    ],
)
def test_truth_of_verdicts(verdicts: list, truth: str) -> None:
    assert truth_of([None if x is None else v(x) for x in verdicts]) == truth


def measurement(server: tuple, client: tuple, fault: str = "") -> Measurement:
    def obs(ttft: Verdict, tpot: Verdict) -> Observation:
        return Observation(start_s=0, end_s=10, completed=1000, slo_met=990,
                           ttft_verdict=v(ttft), tpot_verdict=v(tpot))  # fmt: skip

    return Measurement(observation=obs(*server), client=obs(*client), fault=fault)


def test_judged_takes_the_verdicts_it_is_told_to() -> None:
    m = measurement((MET, MET), (VIOL, MET))
    assert judged(m, by="server", wall_s=1)["truth"] == "feasible"
    assert judged(m, by="client", wall_s=1)["truth"] == "infeasible"
    assert judged(m, by="both", wall_s=1)["truth"] == "infeasible"
    assert judged(m, by="server", wall_s=1)["client_ttft"] == ["violated", 50.0, 1000]
    assert judged(measurement((MET, MET), (MET, MET), "restart"), by="server", wall_s=1)[
        "truth"
    ] == "unclear"  # fmt: skip


def test_point_parses_b_comma_c() -> None:
    assert point("16,8") == (16, 8)
    for bad in ("16", "a,b", "0,4"):
        with pytest.raises(Exception, match="B"):
            point(bad)


def result(variant: str, rc: int | None, chosen: tuple[int, int] | None) -> RunResult:
    return RunResult(variant=variant, round=0, exit_code=rc, chosen=chosen, wall_s=100.0,
                     trials=6, stop_reason="", duty=0.5, out=Path("."))  # fmt: skip


def test_summary_counts_exit_0_with_a_truly_feasible_point() -> None:
    rs = [result("new", 0, (8, 8))] * 9 + [result("new", 0, (16, 16))]
    rs += [result("baseline", 0, (16, 16)), result("baseline", 3, None)]
    rs += [result("baseline", None, None), result("baseline", 4, (8, 8))]
    truths = {(8, 8): {"truth": "feasible"}, (16, 16): {"truth": "infeasible"}}
    s = summary(rs, truths)
    assert s["new"]["passes"] == 9 and s["new"]["target_met"]
    assert s["baseline"]["passes"] == 0 and not s["baseline"]["target_met"]
    assert s["baseline"]["exit_codes"] == {"0": 1, "3": 1, "4": 1, "timeout": 1}


def write_fake_slotune(root: Path, body: str) -> Variant:
    """A stand-in ``.venv/bin/slotune`` that ``run_canary`` runs as it would the real one."""
    exe = root / ".venv" / "bin" / "slotune"
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n{body}\n")
    exe.chmod(0o755)
    return Variant(name="new", root=root, rev="test")


def test_a_run_reads_the_report_and_exit_code(tmp_path: Path) -> None:
    body = (
        "out = sys.argv[sys.argv.index('--out') + 1]; os.makedirs(out)\n"
        "assert os.environ['RAY_TMPDIR']\n"
        "json.dump({'operating_point': {'max_batch_size': 8, 'max_concurrency': 12},"
        " 'trials': [{}, {}, {}], 'stop_reason': 'stable'}, open(out + '/curve.json', 'w'))\n"
        "sys.exit(0)"
    )
    var = write_fake_slotune(tmp_path / "co", body)
    r = run_canary(var, 0, out=tmp_path / "r", noise=NoiseSpec(duty=0.2, period_s=0.05),
                   timeout_s=120, keep_ray=False)  # fmt: skip
    assert (r.exit_code, r.chosen, r.trials, r.stop_reason) == (0, (8, 12), 3, "stable")


def test_a_run_past_its_limit_is_stopped(tmp_path: Path) -> None:
    var = write_fake_slotune(tmp_path / "co", "time.sleep(600)")
    r = run_canary(var, 1, out=tmp_path / "r", noise=NoiseSpec(duty=0.0),
                   timeout_s=1, keep_ray=False)  # fmt: skip
    assert r.exit_code is None and r.chosen is None and r.wall_s < 600
    assert "no report" in r.stop_reason


def test_read_report_without_a_report(tmp_path: Path) -> None:
    assert read_report(tmp_path / "curve.json") == (None, 0, "no report (FileNotFoundError)")
    (tmp_path / "curve.json").write_text(json.dumps({"operating_point": None, "trials": [{}]}))
    assert read_report(tmp_path / "curve.json") == (None, 1, "")
