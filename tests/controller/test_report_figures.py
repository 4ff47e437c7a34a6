"""The report's pictures as a reviewer sees them: labels readable, inside the picture and
not on top of each other, for a run with a sweep and production windows, and for a
comparison of two runs (simulated canary runs, the whole loop and export)."""

from __future__ import annotations

import logging
from dataclasses import replace

import optuna
import pytest

from controller.report.batch_plot import batch_figure
from controller.report.compare import compare
from controller.report.compare_html import compare_figure
from controller.report.curve import CurveReport
from controller.report.figure import to_png
from controller.report.plot import curve_figure
from controller.sim.scenarios import SCENARIOS
from controller.tune_simulated import slowed, tune_simulated
from tests.fixtures.figure_checks import readability_problems

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[CurveReport, CurveReport]:
    logging.getLogger("controller").setLevel(logging.ERROR)
    d = tmp_path_factory.mktemp("runs")
    sc = SCENARIOS["h100x4-70b"]
    a = tune_simulated(sc, seed=0, out_dir=d / "a", usd_per_hour=12.0, curve_points=6).report
    b = tune_simulated(
        slowed(sc, 1.3), seed=1, out_dir=d / "b", usd_per_hour=12.0, curve_points=6
    ).report
    return a, b


def with_production(r: CurveReport) -> CurveReport:
    """Two production windows: sweep windows re-labelled (the same measurements)."""
    sweep = [t for t in r.trials if t.role == "sweep"][2:4]
    n = max(t.number for t in r.trials)
    prod = [replace(t, role="production", number=n + 1 + i) for i, t in enumerate(sweep)]
    return r.with_trials([*r.trials, *prod])


def _check(fig) -> None:
    try:
        assert readability_problems(fig) == []
    finally:
        to_png(fig)  # closes it


def test_the_run_has_a_sweep_from_batch_one_past_the_cut(runs) -> None:
    a, _ = runs
    sweep = sorted(t.max_batch_size for t in a.trials if t.role == "sweep")
    top = max(t.max_batch_size for t in a.searched if t.feasible)
    assert sweep[0] == 1 and sweep[-1] > top and len(sweep) == 6
    assert a.chosen is not None and a.chosen.role == "search"


def test_curve_by_batch_is_readable(runs) -> None:
    _check(batch_figure(with_production(runs[0])))


def test_throughput_latency_plot_is_readable(runs) -> None:
    _check(curve_figure(with_production(runs[0])))


def test_comparison_plot_is_readable(runs) -> None:
    a, b = runs
    c = compare(a, b, labels=("v1", "v2 (+30% step)"))
    assert c.worse
    _check(compare_figure(c, ("v1", "v2 (+30% step)")))


def test_the_checker_sees_an_overlap(runs) -> None:
    fig = batch_figure(runs[0])
    ax = fig.axes[0]
    ax.text(0.5, 0.5, "one label", transform=ax.transAxes)
    ax.text(0.5, 0.5, "another label", transform=ax.transAxes)
    ax.text(0.1, 0.1, "tiny", fontsize=4, transform=ax.transAxes)
    try:
        problems = readability_problems(fig)
    finally:
        to_png(fig)
    assert any("overlaps" in p and "one label" in p for p in problems)
    assert any("'tiny' is 4 pt" in p for p in problems)
