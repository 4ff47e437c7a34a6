"""The pure summary of bench/control_live.py: which windows count after a load step, and
which phase a knob change is filed under."""

from __future__ import annotations

from bench.control_live import summarise
from metrics.observation import Slo

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
PLAN = [("low", 100.0, 4, 16), ("high", 100.0, 12, 16)]
MARKS = [0.0, 100.0]


def row(start: float, end: float, p99: float, *, batch_to: int = 8) -> dict:
    return {
        "time_s": end,
        "outcome": "met" if p99 <= SLO.tpot_p99_s else "violated",
        "action": "hold" if batch_to == 8 else "tighten",
        "from": {"max_batch_size": 8, "max_concurrency": 8},
        "to": {"max_batch_size": batch_to, "max_concurrency": batch_to},
        "applied": batch_to != 8,
        "dry_run": False,
        "observation": {"start_s": start, "end_s": end, "tpot": {"p99_s": p99}},
    }


def test_a_change_is_filed_under_the_phase_it_was_made_in() -> None:
    # The window 80-110 s straddles the step at 100 s; the cut it leads to is made at 110 s,
    # under the new load: a change of the second phase, not of the first.
    rows = [row(20, 50, 0.05), row(50, 80, 0.05), row(80, 110, 0.2, batch_to=6)]
    got = summarise(rows, MARKS, PLAN, 20.0, SLO)
    assert got["changes_per_phase"] == [0, 1]
    # the straddling window is settling, neither load's; the two before it count, both within
    assert (got["within_after_settle"], got["judged_after_settle"]) == (2, 2)


def test_windows_count_on_their_measured_p99_whatever_the_controller_made_of_them() -> None:
    # an inconclusive window (its p99 too near the SLO to call) still counts, over or under;
    # one on too few requests for a p99, or read from stale metrics, does not
    def undecided(start: float, end: float, p99: float, **o) -> dict:
        r = row(start, end, p99)
        r["outcome"] = "inconclusive"
        r["observation"].update(o)
        return r

    rows = [
        undecided(20, 50, 0.102, completed=300),
        undecided(50, 80, 0.098, completed=300),
        undecided(120, 150, 0.2, completed=40),
        undecided(150, 180, 0.2, completed=300, stale=True),
        row(180, 200, 0.05),
    ]
    got = summarise(rows, MARKS, PLAN, 20.0, SLO)
    assert (got["within_after_settle"], got["judged_after_settle"]) == (2, 3)
