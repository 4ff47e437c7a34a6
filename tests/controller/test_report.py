"""The exported curve: CSV, JSON keys, PNG, a self-contained HTML that a real browser renders."""

from __future__ import annotations

import base64
import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from controller.report.cost import million_token_cost
from controller.report.curve import CurveReport
from controller.report.files import write_report
from controller.report.plot import plot_png
from controller.report.records import PredictedPoint, TrialRecord
from metrics.observation import Observation, Percentiles, Slo, SloVerdict, Verdict
from tests.fixtures.screenshot import chromium, screenshot

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)


def trial(n: int, b: int, c: int, tps: float, good: float, tpot_ms: float, feasible: bool):
    return TrialRecord(
        number=n,
        max_batch_size=b,
        max_concurrency=c,
        tokens_per_s=tps,
        goodput_rps=good,
        throughput_rps=good * 1.1,
        completed=120,
        rejected=0,
        p50_ttft_ms=80.0,
        p99_ttft_ms=300.0 if feasible else 1400.0,
        p50_tpot_ms=tpot_ms * 0.8,
        p99_tpot_ms=tpot_ms,
        ttft_verdict="met" if feasible else "violated",
        tpot_verdict="met" if tpot_ms <= 50 else "violated",
        ttft_samples=120,
        tpot_samples=120,
        feasible=feasible,
        window_s=10.0,
        wall_s=14.0,
        client_completed=118,
        client_p99_tpot_ms=tpot_ms * 1.05,
        client_p99_ttft_ms=320.0,
    )


def predicted() -> tuple[PredictedPoint, ...]:
    pts = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        step = max(0.010, b * 0.0004)  # memory-bound floor, then compute-bound
        pts.append(PredictedPoint(batch=b, tpot_s=step, tokens_per_s=b / step, bound="memory"))
    return tuple(pts)


def sample_report(trials=None) -> CurveReport:
    trials = trials or (
        trial(0, 16, 16, 700.0, 10.0, 30.0, True),
        trial(1, 64, 64, 1500.0, 14.0, 48.0, True),
        trial(2, 128, 256, 1900.0, 20.0, 80.0, False),  # most goodput but misses the SLO
        trial(3, 4, 8, 220.0, 3.0, 15.0, True),
    )
    return CurveReport(
        slo=SLO,
        trials=tuple(trials),
        predicted=predicted(),
        model="small",
        hardware="local-cpu",
        hardware_detail={"memory_bandwidth_gb_s": 24.5, "bf16_tflops": 2.8},
        usd_per_hour=2.0,
        knee_batch=25,
        ridge_flops_per_byte=114.0,
        predicted_batch=100,
        stop_reason="best point stable",
        meta={"command": "slotune tune", "wall_s": 123.0},
    )


def test_chosen_point_is_the_best_feasible_never_an_infeasible_one() -> None:
    r = sample_report()
    assert r.chosen is not None and r.chosen.number == 1
    op = r.operating_point()
    assert op is not None
    assert op["verdict"] == "met"
    assert op["usd_per_million_tokens"] == pytest.approx(2.0 / (1500.0 * 3600) * 1e6)
    no = sample_report([trial(0, 8, 8, 300, 5, 70, False)])
    assert no.chosen is None and no.operating_point() is None


def test_a_knob_that_failed_one_of_its_measurements_is_not_chosen() -> None:
    r = sample_report(
        [
            trial(0, 64, 64, 1500.0, 14.0, 48.0, True),
            trial(1, 16, 16, 700.0, 10.0, 30.0, True),
            trial(2, 64, 64, 1450.0, 13.0, 52.0, False),  # the re-measure missed the SLO
            trial(3, 16, 16, 720.0, 11.0, 31.0, True),
        ]
    )
    c = r.chosen
    assert c is not None and (c.max_batch_size, c.number) == (16, 3)
    op = r.operating_point()
    assert op["measurements"] == 2 and op["mean_goodput_rps"] == pytest.approx(10.5)


def test_cost_formula() -> None:
    # $2/h at 1000 tokens/s: 3.6M tokens an hour → $0.556 per million
    assert million_token_cost(2.0, 1000.0) == pytest.approx(0.5555555, rel=1e-6)
    assert math.isnan(million_token_cost(None, 1000.0))
    assert math.isnan(million_token_cost(2.0, 0.0))


def test_roofline_fraction_interpolates_the_predicted_curve() -> None:
    r = sample_report()
    p = r.predicted_at(64)
    assert p is not None and p.tokens_per_s == pytest.approx(64 / (64 * 0.0004))
    mid = r.predicted_at(48)  # between 32 and 64
    assert mid is not None and 0.0128 < mid.tpot_s < 0.0256
    assert mid.tokens_per_s == pytest.approx(48 / mid.tpot_s)
    t = r.trials[1]
    assert r.roofline_fraction(t) == pytest.approx(1500.0 / 2500.0)
    assert r.predicted_at(1000) is None
    assert r.slo_cut_predicted().batch == 64  # 0.0256 s ≤ 50 ms < 0.0512 s at 128


def test_files_written_with_the_keys_the_issue_lists(tmp_path: Path) -> None:
    paths = write_report(sample_report(), tmp_path / "out")
    assert sorted(p.name for p in paths.values()) == sorted(
        ["curve.csv", "curve.json", "curve.png", "curve_by_batch.png", "report.html"]
    )
    d = json.loads(paths["curve.json"].read_text())
    assert {"slo", "operating_point", "trials", "predicted"} <= set(d)
    assert set(d["operating_point"]) >= {
        "max_batch_size",
        "max_concurrency",
        "goodput_rps",
        "tokens_per_s",
        "p99_ttft_ms",
        "p99_tpot_ms",
        "usd_per_million_tokens",
        "verdict",
    }
    assert d["operating_point"]["max_batch_size"] == 64
    assert len(d["trials"]) == 4 and len(d["predicted"]) == 8
    for t in d["trials"]:
        assert {
            "ttft_verdict",
            "tpot_verdict",
            "ttft_samples",
            "p50_ttft_ms",
            "p99_tpot_ms",
        } <= set(t)
    rows = list(csv.DictReader(paths["curve.csv"].open()))
    assert [int(r["max_batch_size"]) for r in rows] == [16, 64, 128, 4]
    assert rows[2]["feasible"] == "False"
    png = paths["curve.png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    html = paths["report.html"].read_text()
    m = re.search(r'src="data:image/png;base64,([^"]+)"', html)
    assert m and base64.b64decode(m.group(1)) == png
    assert "http://" not in html and "https://" not in html  # self-contained
    assert "max_batch_size=64" in html and "max_concurrency=64" in html
    assert "knee of the curve near batch 25" in html
    assert "cuts the predicted curve at batch 64" in html
    assert "per million output tokens" in html
    x = d["client_cross_check"]
    assert x["trials"] == 4 and x["median_p99_tpot_rel_diff"] == pytest.approx(0.05)
    assert "median +5% (TPOT)" in html


def test_export_round_trip_rebuilds_the_same_json(tmp_path: Path) -> None:
    paths = write_report(sample_report(), tmp_path / "a")
    d = json.loads(paths["curve.json"].read_text())
    again = CurveReport.from_dict(d)
    paths2 = write_report(again, tmp_path / "b")
    assert json.loads(paths2["curve.json"].read_text()) == d
    assert paths2["curve.csv"].read_text() == paths["curve.csv"].read_text()


def test_no_feasible_point_says_do_not_ship(tmp_path: Path) -> None:
    r = sample_report([trial(0, 8, 8, 300, 5, 70, False), trial(1, 2, 2, 90, 1, 60, False)])
    paths = write_report(r, tmp_path)
    d = json.loads(paths["curve.json"].read_text())
    assert d["operating_point"] is None
    assert "No feasible operating point" in paths["report.html"].read_text()


def test_record_from_observation_keeps_verdicts_and_samples() -> None:
    v = SloVerdict(
        verdict=Verdict.MET, threshold_s=1.0, estimate_s=0.3, samples=150, confidence=0.95
    )
    w = SloVerdict(
        verdict=Verdict.INSUFFICIENT, threshold_s=0.05, estimate_s=0.04, samples=40, confidence=0.95
    )
    obs = Observation(
        start_s=100.0,
        end_s=110.0,
        completed=150,
        slo_met=140,
        generated_tokens=4800,
        ttft=Percentiles(p50=0.1, p99=0.3),
        tpot=Percentiles(p50=0.02, p99=0.04),
        ttft_verdict=v,
        tpot_verdict=w,
        source="scrape",
    )

    class K:
        max_batch_size = 8
        max_concurrency = 12

    t = TrialRecord.from_observation(number=3, knobs=K(), obs=obs, feasible=False, client=obs)
    assert (t.tokens_per_s, t.goodput_rps) == (480.0, 14.0)
    assert (t.ttft_verdict, t.tpot_verdict, t.ttft_samples, t.tpot_samples) == (
        "met",
        "insufficient",
        150,
        40,
    )
    assert t.p99_tpot_ms == pytest.approx(40.0) and t.client_p99_tpot_ms == pytest.approx(40.0)
    assert t.verdict == "insufficient"
    assert TrialRecord.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_plot_without_prediction_or_trials_still_renders() -> None:
    r = CurveReport(slo=SLO, trials=())
    assert plot_png(r)[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (scripts/system-deps.sh)")
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    paths = write_report(sample_report(), tmp_path / "r")
    img = screenshot(paths["report.html"], tmp_path / "report.png", height=1600)
    assert img.shape[0] == 1600 and img.shape[1] == 1200
    rgb = img[..., :3]
    non_white = (rgb.sum(axis=-1) < 2.9).mean()
    assert non_white > 0.05, "screenshot is (almost) blank"
    # The plot's green "meets SLO" markers, rendered by the browser from the embedded PNG.
    green = (rgb[..., 1] > 0.5) & (rgb[..., 0] < 0.3) & (rgb[..., 2] < 0.45)
    assert green.sum() > 50


def test_windows_too_small_for_a_verdict_say_what_to_do(tmp_path: Path) -> None:
    small = [
        TrialRecord.from_dict(
            {**trial(i, 4, 4, 50.0, 1.0, 30.0, False).to_dict(), "completed": 40,
             "ttft_verdict": "insufficient", "tpot_verdict": "insufficient"}
        )
        for i in range(3)
    ]  # fmt: skip
    r = sample_report(small)
    hint = r.sample_hint()
    assert "3 of 3 windows" in hint and "at most 40 requests" in hint and "299" in hint
    assert hint in write_report(r, tmp_path)["report.html"].read_text()
    assert sample_report().sample_hint() == ""  # verdicts were reached there


def _window(n: int, tpot_s: float, secs: float, *, slow: int = 0, seed: int = 0) -> Observation:
    """``n`` requests in ``secs`` around ``tpot_s``, ``slow`` of them over the TPOT SLO."""
    from metrics.build import observation_from_requests

    rng = np.random.default_rng(seed)
    tpot = list(rng.uniform(0.8, 1.0, n) * tpot_s)
    for i in range(slow):
        tpot[i] = SLO.tpot_p99_s * 1.5
    return observation_from_requests(
        slo=SLO, start_s=0.0, end_s=secs, ttft_s=[0.2] * n, tpot_s=tpot, generated_tokens=8 * n
    )


def test_the_report_chooses_exactly_what_the_tuner_declares(tmp_path: Path) -> None:
    """One rule for both: a knob whose short windows were each too small for a p99 verdict
    but whose pooled requests meet the SLO is deployed (the old every-window rule refused
    it, and a live run stopped 'stable' with no point); a knob with a violated window
    pooled into VIOLATED is not, even where its goodput is higher."""
    from search.space import Knobs, SearchSpace
    from search.tuner import Tuner

    tuner = Tuner(
        space=SearchSpace(batch_min=1, batch_max=256, headroom_max=4.0),
        slo=SLO,
        storage=f"sqlite:///{tmp_path / 's.db'}",
        study_name="one-rule",
        seed_knobs=[],
    )
    windows = [
        (Knobs(max_batch_size=16, max_concurrency=16), _window(200, 0.03, 5.0, seed=1)),
        (Knobs(max_batch_size=64, max_concurrency=64), _window(400, 0.04, 5.0, seed=2)),
        (Knobs(max_batch_size=16, max_concurrency=16), _window(200, 0.03, 5.0, seed=3)),
        (Knobs(max_batch_size=64, max_concurrency=64), _window(400, 0.04, 5.0, slow=30, seed=4)),
        (Knobs(max_batch_size=8, max_concurrency=8), _window(400, 0.02, 20.0, seed=5)),
        (Knobs(max_batch_size=8, max_concurrency=8), _window(400, 0.02, 20.0, seed=6)),
    ]
    records = []
    for knobs, obs in windows:
        told = tuner.report(knobs, obs)
        records.append(
            TrialRecord.from_observation(
                number=told.number, knobs=knobs, obs=obs, feasible=told.feasible
            )
        )
    # The first B=16 window alone cannot call a p99 (200 requests): not feasible on its own.
    assert records[0].tpot_verdict == "insufficient" and not records[0].feasible
    best = tuner.best()
    assert best is not None and best[0] == Knobs(max_batch_size=16, max_concurrency=16)
    r = sample_report(records)
    c = r.chosen
    assert c is not None and (c.max_batch_size, c.max_concurrency) == (16, 16)
    assert c.number == records[2].number  # its latest measurement
    op = r.operating_point()
    assert op["confirmed"] is True and op["measurements"] == 2 and op["met_windows"] == 0
    # Its verdict is the pooled one it was chosen on, not its latest window's alone.
    assert op["verdict"] == "met" and op["latest_window_verdict"] == "insufficient"
    # The same answer from the exported JSON (what `slotune export` reads back).
    back = CurveReport.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.chosen == c
    # With B=16 measured once, nothing is declared: the report falls back to the best
    # single window that met the SLO, marked unconfirmed, as `slotune simulate` does.
    only = sample_report(records[:2])
    assert only.chosen is not None and only.chosen.max_batch_size == 64
    assert only.operating_point()["confirmed"] is False
