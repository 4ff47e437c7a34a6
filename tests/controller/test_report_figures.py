"""The report's pictures as a reviewer sees them: labels readable, inside the picture and
not on top of each other, for a run with a sweep and production windows, and for a
comparison of two runs (simulated canary runs, the whole loop and export)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from controller.report.batch_plot import batch_figure
from controller.report.compare import compare
from controller.report.compare_html import compare_figure, write_compare
from controller.report.curve import CurveReport
from controller.report.figure import to_png
from controller.report.files import write_report
from controller.report.plot import curve_figure
from controller.sim.scenarios import SCENARIOS
from controller.tune_simulated import slowed, tune_simulated
from tests.fixtures.figure_checks import readability_problems
from tests.fixtures.screenshot import chromium, colour_share, screenshot

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[CurveReport, CurveReport]:
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


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (scripts/system-deps.sh)")
def test_reports_render_in_headless_chromium(runs, tmp_path: Path) -> None:
    """report.html (with the sweep and production windows) and compare.html as a browser
    draws them: PNGs that read back as images, with both pictures and the verdict on them."""
    a, b = runs
    paths = write_report(with_production(a), tmp_path / "report")
    html = paths["report.html"].read_text()
    assert "The curve by batch" in html and "production windows" in html
    img = screenshot(paths["report.html"], tmp_path / "report.png", height=2400)
    assert img.shape[:2] == (2400, 1200)
    assert colour_share(img, (0x1B / 255, 0x78 / 255, 0x37 / 255)) > 2e-4  # the measured curve
    c = compare(a, b, labels=("v1", "v2"))
    cpaths = write_compare(c, ("v1", "v2"), tmp_path / "compare")
    img = screenshot(cpaths["compare.html"], tmp_path / "compare.png", height=1600)
    assert img.shape[:2] == (1600, 1200)
    for rgb in ((0x21, 0x66, 0xAC), (0xB2, 0x18, 0x2B)):  # A's and B's series
        assert colour_share(img, tuple(x / 255 for x in rgb)) > 2e-4
    assert colour_share(img, (0xD7 / 255, 0x30 / 255, 0x27 / 255), tol=0.08) > 1e-4  # "worse" box
