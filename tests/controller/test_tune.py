"""The canary loop against a deterministic fake target and the real Optuna tuner."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from controller.progress import Progress
from controller.report.curve import CurveReport
from controller.report.records import PredictedPoint, TrialRecord
from controller.target_errors import TargetError, TargetUnavailable
from controller.targets import Measurement, Target
from controller.tune import TuneLimits, run_tune
from controller.tune_study import report_from_study
from metrics.observation import Observation, Percentiles, Slo, SloVerdict, Verdict
from search.space import Knobs, SearchSpace
from search.tuner import Tuner

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.040)
OUT_TOKENS = 16


def tpot_of(b: int) -> float:
    return 0.010 + 0.0008 * b  # meets 40 ms up to batch 37


class FakeTarget:
    """Physics in closed form: TPOT grows with batch; queueing beyond the batch adds TTFT."""

    def __init__(self, *, start: Knobs | None = None, window_s: float = 10.0, clock=None):
        self.applied: list[Knobs] = []
        self.measured: list[Knobs] = []
        self.start = start
        self.window_s = window_s
        self.clock = clock
        self.fail: dict[int, BaseException] = {}  # measurement index → exception to raise
        self.empty: set[int] = set()

    def current_knobs(self) -> Knobs | None:
        return self.start

    def describe(self) -> dict:
        return {"target": "fake"}

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> None:
        self.applied.append(knobs)

    def measure(self, knobs: Knobs) -> Measurement:
        i = len(self.measured)
        self.measured.append(knobs)
        if self.clock is not None:
            self.clock.t += self.window_s + 2.0
        if i in self.fail:
            raise self.fail[i]
        b, c = knobs.max_batch_size, knobs.max_concurrency
        tpot = tpot_of(b)
        ttft = 0.05 + (c - b) / b * OUT_TOKENS * tpot
        n = 0 if i in self.empty else int(b / tpot / OUT_TOKENS * self.window_s)

        def verdict(x: float, thr: float) -> SloVerdict:
            v = Verdict.INSUFFICIENT if n < 300 else (Verdict.MET if x <= thr else Verdict.VIOLATED)
            return SloVerdict(verdict=v, threshold_s=thr, estimate_s=x, samples=n, confidence=0.95)

        met = n if (tpot <= SLO.tpot_p99_s and ttft <= SLO.ttft_p99_s) else 0
        obs = Observation(
            start_s=1000.0,
            end_s=1000.0 + self.window_s,
            completed=n,
            slo_met=met,
            generated_tokens=n * OUT_TOKENS,
            ttft=Percentiles(p50=ttft * 0.8, p99=ttft) if n else Percentiles(),
            tpot=Percentiles(p50=tpot * 0.9, p99=tpot) if n else Percentiles(),
            ttft_verdict=verdict(ttft, SLO.ttft_p99_s),
            tpot_verdict=verdict(tpot, SLO.tpot_p99_s),
            source="fake",
        )
        return Measurement(
            observation=obs, client=obs, note="no completed requests" if not n else ""
        )


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_tuner(
    tmp_path: Path, *, seed_batch: int = 16, name: str = "t", cls: type[Tuner] = Tuner
) -> Tuner:
    return cls(
        space=SearchSpace(batch_min=1, batch_max=64, headroom_max=2.0),
        slo=SLO,
        storage=str(tmp_path / "study.journal"),
        study_name=name,
        seed_knobs=[Knobs(max_batch_size=seed_batch, max_concurrency=seed_batch)],
        model_tpot_s=lambda b: 0.008 + 0.0006 * b,  # the "peak roofline": optimistic
        seed=0,
    )


def base() -> CurveReport:
    pred = tuple(
        PredictedPoint(batch=b, tpot_s=0.008 + 0.0006 * b, tokens_per_s=b / (0.008 + 0.0006 * b))
        for b in (1, 2, 4, 8, 16, 32, 64)
    )
    return CurveReport(
        slo=SLO, trials=(), predicted=pred, model="fake", hardware="fake-hw", usd_per_hour=1.0
    )


def run(tmp_path: Path, target: FakeTarget, **kw) -> object:
    limits = kw.pop("limits", TuneLimits(max_trials=10, time_budget_s=1e6, retry_wait_s=0.0))
    return run_tune(
        target=target,
        tuner=kw.pop("tuner", None) or make_tuner(tmp_path),
        base=base(),
        limits=limits,
        out_dir=tmp_path / "out",
        sleep=kw.pop("sleep", lambda s: None),
        **kw,
    )


def test_finds_a_feasible_point_and_leaves_the_deployment_on_it(tmp_path: Path) -> None:
    target = FakeTarget(start=Knobs(max_batch_size=4, max_concurrency=4))
    assert isinstance(target, Target)
    out = run(tmp_path, target)
    chosen = out.report.chosen
    assert chosen is not None and out.feasible and not out.aborted
    assert tpot_of(chosen.max_batch_size) <= SLO.tpot_p99_s
    assert chosen.max_batch_size >= 20  # well up the curve, not the first guess
    # The deployment ends on the chosen, measured-feasible knobs.
    assert target.applied[-1] == Knobs(
        max_batch_size=chosen.max_batch_size, max_concurrency=chosen.max_concurrency
    )
    assert out.final_knobs == (chosen.max_batch_size, chosen.max_concurrency)
    # Each trial applied before it measured, one measurement per trial.
    assert target.applied[:-1] == target.measured
    lines = (tmp_path / "out" / "trials.jsonl").read_text().splitlines()
    assert len(lines) == len(out.report.trials) == len(target.measured)
    d = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert d["operating_point"]["max_batch_size"] == chosen.max_batch_size
    assert d["operating_point"]["usd_per_million_tokens"] > 0
    assert out.stop_reason


def test_export_rebuilds_the_same_files_from_the_study(tmp_path: Path) -> None:
    out = run(tmp_path, FakeTarget())
    again = report_from_study(str(tmp_path / "study.journal"), "t")
    assert again.to_dict() == out.report.to_dict()
    again2 = report_from_study(str(tmp_path / "study.journal"))  # the only study
    assert again2.to_dict() == out.report.to_dict()
    with pytest.raises(ValueError, match="not in"):
        report_from_study(str(tmp_path / "study.journal"), "nope")


def test_no_feasible_point_restores_the_original_knobs(tmp_path: Path) -> None:
    global SLO
    old = SLO
    SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.005)  # below any TPOT: nothing is feasible
    try:
        start = Knobs(max_batch_size=4, max_concurrency=8)
        target = FakeTarget(start=start)
        limits = TuneLimits(max_trials=4, time_budget_s=1e6)
        tuner = Tuner(
            space=SearchSpace(batch_min=1, batch_max=64, headroom_max=2.0),
            slo=SLO,
            storage=None,
            seed_knobs=[Knobs(max_batch_size=8, max_concurrency=8)],
            seed=0,
        )
        out = run(tmp_path, target, tuner=tuner, limits=limits)
    finally:
        SLO = old
    assert out.report.chosen is None and not out.feasible
    assert target.applied[-1] == start and out.final_knobs == (4, 8)
    assert "restored" in out.final_note
    assert json.loads((tmp_path / "out" / "curve.json").read_text())["operating_point"] is None


def test_transient_failures_are_retried_with_a_doubling_wait(tmp_path: Path) -> None:
    target = FakeTarget()
    target.fail = {i: TargetUnavailable("scrape timed out") for i in (1, 2, 3)}
    waits: list[float] = []
    limits = TuneLimits(max_trials=3, time_budget_s=1e6, retries=3, retry_wait_s=2.0)
    out = run(tmp_path, target, limits=limits, sleep=waits.append)
    assert not out.aborted and len(out.report.trials) == 3
    assert target.measured[1] == target.measured[2] == target.measured[3] == target.measured[4]
    assert waits == [2.0, 4.0, 8.0]


def test_metrics_down_mid_run_stops_with_best_so_far(tmp_path: Path) -> None:
    target = FakeTarget(start=Knobs(max_batch_size=2, max_concurrency=2))
    target.fail = {i: TargetUnavailable("connection refused") for i in range(3, 20)}
    tuner = make_tuner(tmp_path)
    out = run(tmp_path, target, tuner=tuner)
    assert "measurements unavailable" in out.aborted and "connection refused" in out.aborted
    assert len(out.report.trials) == 3  # the ones measured before the endpoint went down
    assert (tmp_path / "out" / "report.html").exists()
    # The interrupted trial is marked failed in the study.
    states = [t.state.name for t in tuner.study.get_trials()]
    assert states[-1] == "FAIL"
    # Left on a measured feasible point (or the original), never the knob being measured.
    chosen = out.report.chosen
    last = target.applied[-1]
    if chosen is not None:
        assert (last.max_batch_size, last.max_concurrency) == (
            chosen.max_batch_size,
            chosen.max_concurrency,
        )
    else:
        assert last == Knobs(max_batch_size=2, max_concurrency=2)


def test_ctrl_c_exports_and_reverts(tmp_path: Path) -> None:
    target = FakeTarget(start=Knobs(max_batch_size=1, max_concurrency=1))
    target.fail = {2: KeyboardInterrupt()}  # before the stop rule could end the run
    out = run(tmp_path, target)
    assert out.interrupted and "Ctrl-C" in out.aborted
    assert len(out.report.trials) == 2
    assert (tmp_path / "out" / "curve.json").exists()
    interrupted_knobs = target.measured[2]
    chosen = out.report.chosen
    assert chosen is not None  # the fake's seed (16) is feasible
    assert target.applied[-1] == Knobs(
        max_batch_size=chosen.max_batch_size, max_concurrency=chosen.max_concurrency
    )
    if interrupted_knobs != target.applied[-1]:
        assert all(
            (t.max_batch_size, t.max_concurrency)
            != (interrupted_knobs.max_batch_size, interrupted_knobs.max_concurrency)
            or t.feasible
            for t in out.report.trials
        )


def test_permanent_target_error_stops_at_once(tmp_path: Path) -> None:
    target = FakeTarget()
    target.fail = {2: TargetError("app 'x' was deleted")}
    out = run(tmp_path, target)
    assert out.aborted == "app 'x' was deleted" and len(target.measured) == 3


def test_time_budget_bounds_the_run(tmp_path: Path) -> None:
    clock = Clock()
    target = FakeTarget(window_s=10.0, clock=clock)
    limits = TuneLimits(max_trials=50, time_budget_s=40.0)
    out = run(tmp_path, target, limits=limits, clock=clock)
    # each trial takes 12 s: the 4th would end at 48 s > 40 s, so it is not started
    assert len(out.report.trials) == 3
    assert "time budget" in out.stop_reason


def test_max_trials_bounds_the_run(tmp_path: Path) -> None:
    target = FakeTarget()
    out = run(tmp_path, target, limits=TuneLimits(max_trials=2, time_budget_s=1e6))
    assert len(out.report.trials) == 2 and "max trials" in out.stop_reason


def test_window_without_completed_requests_is_not_feasible(tmp_path: Path) -> None:
    target = FakeTarget()
    target.empty = {0}
    out = run(tmp_path, target, limits=TuneLimits(max_trials=2, time_budget_s=1e6))
    first = out.report.trials[0]
    assert first.completed == 0 and not first.feasible
    assert "no completed requests" in first.note
    assert math.isnan(first.p99_tpot_ms)


def test_limits_validation() -> None:
    with pytest.raises(ValueError, match="max_trials=0"):
        TuneLimits(max_trials=0)
    with pytest.raises(ValueError, match="time_budget_s=-1"):
        TuneLimits(time_budget_s=-1)


def test_progress_hooks_are_called(tmp_path: Path) -> None:
    calls: list[str] = []

    class P(Progress):
        def begin(self, n, total, knobs):
            calls.append(f"begin {n}/{total}")

        def end(self, rec, best, total):
            calls.append("end")

    run(tmp_path, FakeTarget(), progress=P(), limits=TuneLimits(max_trials=2, time_budget_s=1e6))
    assert calls == ["begin 1/2", "end", "begin 2/2", "end"]


class SimAsTarget:
    """The simulator behind the Target protocol: knobs take effect at each window."""

    def __init__(self, sim) -> None:
        self.sim = sim

    def current_knobs(self) -> Knobs | None:
        return None

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> None:
        pass

    def measure(self, knobs: Knobs) -> Measurement:
        return Measurement(observation=self.sim.measure(knobs))

    def describe(self) -> dict:
        return self.sim.describe()


def test_runs_the_simulator_target(tmp_path: Path) -> None:
    from controller.sim.scenarios import resolve_scenario
    from controller.sim.target import SimTarget

    t = SimTarget(resolve_scenario("cpu-small"), seed=1)
    tuner = Tuner(
        space=t.space,
        slo=t.scenario.slo,
        storage=None,
        seed_knobs=t.seed_knobs(),
        model_tpot_s=t.model_tpot_s,
        seed=1,
    )
    rep = CurveReport(slo=t.scenario.slo, trials=())
    out = run_tune(
        target=SimAsTarget(t),
        tuner=tuner,
        base=rep,
        limits=TuneLimits(max_trials=6, time_budget_s=1e6),
        out_dir=tmp_path / "sim",
    )
    assert len(out.report.trials) >= 1 and (tmp_path / "sim" / "curve.png").exists()


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from controller.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    return int(e.value.code or 0), cap.out, cap.err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["tune", "--slo-tpot-ms", "-5"], "--slo-tpot-ms -5"),
        (["tune", "--slo-ttft-ms", "nan"], "--slo-ttft-ms nan"),
        (["tune", "--model", "huge"], "--model huge"),
        (["tune", "--max-trials", "0"], "max_trials=0"),
        (["tune", "--output-tokens", "uniform:x"], "length spec"),
        (["tune", "--price-per-hour", "-1"], "--price-per-hour -1"),
        (["tune", "--metrics-url", "http://a/m", "--prometheus-url", "http://b"], "not both"),
        (["tune", "--trace", "/nonexistent/trace.jsonl"], "trace.jsonl"),
        (["export", "/nonexistent/study.journal"], "no such file"),
        (["tune", "--address", "127.0.0.1:1"], "nothing answers there"),
        (["tune", "--address", "nonsense"], "expected HOST:PORT"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, match, capsys, tmp_path) -> None:
    code, _, err = _cli([*argv, *(["--out", str(tmp_path)] if argv[0] == "tune" else [])], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slotune: error:") and match in lines[0]


def test_cli_export_rebuilds_the_report(tmp_path: Path, capsys) -> None:
    out = run(tmp_path, FakeTarget())
    code, stdout, _ = _cli(
        ["export", str(tmp_path / "study.journal"), "--out", str(tmp_path / "exp")], capsys
    )
    assert code == 0 and "report.html" in stdout
    a = json.loads((tmp_path / "exp" / "curve.json").read_text())
    assert a == json.loads((tmp_path / "out" / "curve.json").read_text())
    assert a["operating_point"]["max_batch_size"] == out.report.chosen.max_batch_size
    code, _, err = _cli(
        ["export", str(tmp_path / "study.journal"), "--study-name", "nope", "--out", str(tmp_path)],
        capsys,
    )
    assert code == 2 and "nope" in err


def test_cli_export_of_a_study_without_a_feasible_point_exits_3(tmp_path: Path, capsys) -> None:
    target = FakeTarget()
    target.empty = set(range(10))  # nothing ever completes
    run(tmp_path, target, limits=TuneLimits(max_trials=2, time_budget_s=1e6))
    code, _, err = _cli(["export", str(tmp_path / "study.journal"), "--out", str(tmp_path)], capsys)
    assert code == 3 and "no feasible point" in err


class _Reader:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def begin(self):
        self.calls.append("begin")
        return "tok"

    def end(self, token, *, start_s, end_s):
        self.calls.append("end")
        if self.fail:
            raise TargetUnavailable("scrape refused")
        return Observation(start_s=start_s, end_s=end_s, completed=7, slo_met=7, source="fake")


def test_measure_window_warms_up_then_measures_until_enough_requests() -> None:
    import asyncio
    import time

    from controller.targets import RequestShape, WindowPlan, measure_window
    from serving.sim.workload import LengthDist
    from tests.controller.test_loadgen import FakeOpenAI, serving

    fake = FakeOpenAI(first_delay_s=0.002, token_delay_s=0.001)
    reader = _Reader()
    plan = WindowPlan(warmup_s=0.3, window_s=0.2, max_window_s=20.0, min_requests=40, poll_s=0.05)
    shape = RequestShape(prompt_tokens=LengthDist(mean=4), output_tokens=LengthDist(mean=3))

    async def go():
        async with serving(fake) as url:
            t = time.time()
            m = await measure_window(
                url=url.removesuffix("/v1/completions"),
                knobs=Knobs(max_batch_size=2, max_concurrency=3),
                slo=SLO,
                plan=plan,
                shape=shape,
                reader=reader,
            )
            return m, t

    m, t_start = asyncio.run(go())
    assert reader.calls == ["begin", "end"]
    assert m.observation.completed == 7  # the server's view is what the reader said
    c = m.client
    assert c is not None and c.source == "client"
    assert c.start_s >= t_start + 0.3  # the window opens after the warm-up
    assert c.completed >= 40  # it ran until enough requests finished
    assert c.window_s < 20.0
    assert fake.max_in_flight <= 3  # saturating closed loop at the admission limit
    assert all(p == "/v1/completions" for _, p, _ in fake.hits)


def test_measure_window_stops_the_load_when_the_metrics_fail() -> None:
    import asyncio

    from controller.targets import RequestShape, WindowPlan, measure_window
    from tests.controller.test_loadgen import FakeOpenAI, serving

    fake = FakeOpenAI(first_delay_s=0.002, token_delay_s=0.001)
    plan = WindowPlan(warmup_s=0.1, window_s=0.1, max_window_s=1.0, min_requests=0, poll_s=0.05)

    async def go():
        async with serving(fake) as url:
            with pytest.raises(TargetUnavailable):
                await measure_window(
                    url=url,
                    knobs=Knobs(max_batch_size=1, max_concurrency=1),
                    slo=SLO,
                    plan=plan,
                    shape=RequestShape(),
                    reader=_Reader(fail=True),
                )
            n = len(fake.hits)
            await asyncio.sleep(0.3)
            return n, len(fake.hits)

    before, after = asyncio.run(go())
    assert after == before  # no load keeps running after the failure


def test_scrape_window_turns_an_unreachable_endpoint_into_a_transient_error() -> None:
    from controller.windows import ScrapeWindow
    from metrics.sources import ScrapeSource
    from tests.fixtures.ray_cluster import free_port

    src = ScrapeSource(f"http://127.0.0.1:{free_port()}/metrics", slo=SLO, prefix="ray_")
    with pytest.raises(TargetUnavailable, match="metrics unavailable"):
        ScrapeWindow(src).begin()


class _PromSrc:
    """A PromQLSource stand-in: Prometheus stores a sample every ``scrape_s`` of the clock."""

    url = "http://prom"
    prefix = "ray_"
    selector = {"application": "app"}

    def __init__(self, clock: Clock, *, scrape_s: float = 1.0, first_s: float = 0.0) -> None:
        self.clock, self.scrape_s, self.first_s = clock, scrape_s, first_s
        self.ranges: list[tuple[float, float]] = []
        self.queries: list[str] = []

    def query(self, expr: str, *, at: float):
        self.queries.append(expr)
        last = math.floor(min(at, self.clock.t) / self.scrape_s) * self.scrape_s
        if last < self.first_s:
            return []
        if expr.startswith("max(timestamp("):
            return [({}, last)]
        assert expr.startswith("count_over_time(") and 'application="app"' in expr
        window = float(expr.rsplit("[", 1)[1].rstrip("ms])")) / 1000
        return [({"slo_met": "true"}, window // self.scrape_s)]

    def observe_range(self, *, window_s: float, end_s: float) -> Observation:
        self.ranges.append((window_s, end_s))
        return Observation(start_s=end_s - window_s, end_s=end_s, completed=9, slo_met=9)


def _prom_window(src: _PromSrc, clock: Clock, **kw):
    from controller.windows import PromQLWindow

    def sleep(s: float) -> None:
        clock.t += s

    return PromQLWindow(src, clock=clock, sleep=sleep, poll_s=0.5, **kw)


def test_promql_window_waits_for_a_sample_after_the_window_then_reads_it_shifted() -> None:
    clock = Clock()
    clock.t = 112.5  # the window [100, 112.5] just ended; Prometheus has up to t=112
    src = _PromSrc(clock, scrape_s=1.0)
    w = _prom_window(src, clock, report_lag_s=1.0)
    obs = w.end(w.begin(), start_s=100.0, end_s=112.5)
    assert clock.t >= 113.5  # waited for a scrape after end + the exporter's lag
    assert src.ranges == [(12.5, 113.5)] and obs.window_s == 12.5
    assert not obs.stale


def test_promql_window_without_fresh_samples_is_unavailable_not_judged() -> None:
    clock = Clock()
    clock.t = 50.0
    src = _PromSrc(clock, first_s=1e9)  # the series never shows up
    w = _prom_window(src, clock, fresh_timeout_s=5.0)
    with pytest.raises(TargetUnavailable, match="no sample at all"):
        w.end(None, start_s=40.0, end_s=50.0)
    assert src.ranges == [] and clock.t <= 50.0 + 1.0 + 5.0 + 0.5


def test_a_window_of_too_few_scrapes_is_stale() -> None:
    clock = Clock()
    clock.t = 20.0
    src = _PromSrc(clock, scrape_s=5.0)  # deploy/prometheus/prometheus.yml's interval
    w = _prom_window(src, clock, fresh_timeout_s=30.0, min_scrapes=3)
    obs = w.end(None, start_s=12.0, end_s=20.0)  # 8 s: one or two scrapes
    assert obs.stale and "scrape(s) in the 8.0 s window" in obs.note
    assert not obs.feasible


def test_export_of_a_bare_tuner_study(tmp_path: Path) -> None:
    """A study written by the tuner alone (e.g. `slotune simulate`) still exports."""
    tuner = make_tuner(tmp_path, name="bare")
    target = FakeTarget()
    for _ in range(3):
        k = tuner.propose()
        tuner.report(k, target.measure(k).observation)
    rep = report_from_study(str(tmp_path / "study.journal"), "bare")
    assert [t.max_batch_size for t in rep.trials] == [k.max_batch_size for k in target.measured]
    assert rep.slo.tpot_p99_s == pytest.approx(SLO.tpot_p99_s)
    assert all(t.completed > 0 for t in rep.trials)


def test_cli_export_with_a_price_adds_the_cost_and_says_where_it_came_from(
    tmp_path: Path, capsys
) -> None:
    study = str(tmp_path / "study.journal")
    tuner = make_tuner(tmp_path)
    b = base()
    from dataclasses import replace

    run_tune(
        target=FakeTarget(),
        tuner=tuner,
        base=replace(b, usd_per_hour=None, meta={"price": "not given"}),
        limits=TuneLimits(max_trials=6, time_budget_s=1e6, retry_wait_s=0.0),
        out_dir=tmp_path / "out",
        sleep=lambda s: None,
    )
    d = json.loads((tmp_path / "out" / "curve.json").read_text())
    op = d["operating_point"]
    assert op["usd_per_million_tokens"] is None
    per_dollar = op["usd_per_million_tokens_per_usd_hour"]
    assert per_dollar == pytest.approx(1e6 / (op["tokens_per_s"] * 3600))
    page = (tmp_path / "out" / "report.html").read_text()
    assert "No device price was given" in page and "--price-per-hour" in page
    code, _, _ = _cli(
        ["export", study, "--price-per-hour", "2", "--out", str(tmp_path / "p")], capsys
    )
    assert code == 0
    priced = json.loads((tmp_path / "p" / "curve.json").read_text())
    assert priced["operating_point"]["usd_per_million_tokens"] == pytest.approx(2 * per_dollar)
    assert priced["meta"]["price"].startswith("--price-per-hour")
    assert "At $2/h" in (tmp_path / "p" / "report.html").read_text()


def test_windows_are_lengthened_to_span_enough_scrapes(capsys) -> None:
    from controller.cli.tune_backend import fit_to_scrapes
    from controller.targets import WindowPlan
    from controller.windows import PromQLWindow, ScrapeWindow

    class Every5s(PromQLWindow):
        def scrape_interval_s(self) -> float:
            return 5.0  # deploy/prometheus/prometheus.yml

    plan = WindowPlan(warmup_s=1.0, window_s=5.0, max_window_s=10.0)
    reader = Every5s(None, report_lag_s=1.0, min_scrapes=3, fresh_timeout_s=10.0)
    fitted = fit_to_scrapes(plan, reader, quiet=False)
    assert fitted.window_s == 16.0 and fitted.max_window_s == 16.0
    assert reader.fresh_timeout_s == 15.0
    assert "every 5 s" in capsys.readouterr().err
    long = WindowPlan(window_s=20.0, max_window_s=30.0)
    assert fit_to_scrapes(long, reader, quiet=True) == long
    assert fit_to_scrapes(plan, ScrapeWindow(None), quiet=True) == plan


def test_the_summary_says_the_cost_or_how_to_get_it(tmp_path: Path, capsys) -> None:
    from dataclasses import replace

    from controller.cli.tune import _finish

    out = run(tmp_path, FakeTarget())
    _finish(out, tmp_path, quiet=True)  # base() has $1/h
    text = capsys.readouterr().out
    assert "operating point: max_batch_size=" in text and "cost: At $1/h" in text
    unpriced = replace(out, report=replace(out.report, usd_per_hour=None))
    _finish(unpriced, tmp_path, quiet=True)
    text = capsys.readouterr().out
    assert "cost: No device price was given" in text and "--price-per-hour" in text


class _EagerStopTuner(Tuner):
    """A real tuner that always claims its stop rule is met (as a tuner that declared a
    knob on pooled windows would, while no knob has every window within the SLO)."""

    def should_stop(self) -> bool:
        return True

    def stop_reason(self) -> str:
        return "always"


def test_the_stop_rule_waits_for_a_point_the_report_would_deploy(tmp_path: Path) -> None:
    # Seed 64 violates TPOT (tpot_of(64) = 61 ms > 40 ms): the first trial leaves nothing
    # deployable, so the loop must go on despite the rule, and stop once there is a point.
    target = FakeTarget()
    tuner = make_tuner(tmp_path, seed_batch=64, cls=_EagerStopTuner)
    out = run(tmp_path, target, tuner=tuner)
    assert len(out.report.trials) >= 2
    assert out.report.chosen is not None
    assert out.stop_reason == "stop rule: always"
    # it stopped at the first trial after which the report had a point
    assert all(not t.feasible for t in out.report.trials[:-1])


class RestartingTarget(FakeTarget):
    """A serve-llm-like target: the batch cap (max_num_seqs) restarts replicas, admission
    is live; the engine runs min(C, cap) sequences a step."""

    RESTART_S = 30.0

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.cap: int | None = None
        self.caps: list[int | None] = []

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None):
        from controller.backends.actuator import ApplyCost

        self.applied.append(knobs)
        self.caps.append(batch_cap)
        restarted = batch_cap is not None and batch_cap != self.cap
        self.cap = batch_cap if batch_cap is not None else self.cap
        if restarted and self.clock is not None:
            self.clock.t += self.RESTART_S
        return ApplyCost(seconds=self.RESTART_S if restarted else 0.0, restarted=restarted)


def test_a_restarting_batch_limit_is_moved_rarely_and_its_restarts_are_counted(tmp_path: Path):
    from controller.report.html import explain
    from search.stages import KnobCosts

    clock = Clock()
    target = RestartingTarget(clock=clock)
    tuner = Tuner(
        space=SearchSpace(batch_min=1, batch_max=64, headroom_max=2.0),
        slo=SLO,
        storage=str(tmp_path / "study.journal"),
        study_name="t",
        seed_knobs=[Knobs(max_batch_size=16, max_concurrency=16)],
        model_tpot_s=lambda b: 0.008 + 0.0006 * b,
        seed=0,
        costs=KnobCosts(batch="restart"),
    )
    out = run_tune(
        target=target,
        tuner=tuner,
        base=base(),
        limits=TuneLimits(max_trials=12, time_budget_s=1e6, retry_wait_s=0.0),
        out_dir=tmp_path / "out",
        clock=clock,
        sleep=lambda s: None,
    )
    loop_caps = target.caps[: len(out.report.trials)]  # the last apply leaves it on the pick
    changes = sum(1 for a, b in zip([None, *loop_caps], loop_caps, strict=False) if a != b)
    assert 1 <= changes <= 1 + KnobCosts().max_batch_changes  # the first setting, then <= 3
    backend = out.report.backend
    assert backend["batch_limit"] == "restart" and backend["restarts"] == changes
    assert backend["restart_s"] == RestartingTarget.RESTART_S * changes
    noted = [t for t in out.report.trials if "replica restart" in t.note]
    assert len(noted) == changes
    assert all(t.wall_s >= RestartingTarget.RESTART_S for t in noted)  # in the trial's time
    assert "restarts the replicas" in " ".join(explain(out.report))


class CountingTarget(FakeTarget):
    """FakeTarget whose verdicts carry their request counts (as every real source's do):
    ``over`` (a function of the knobs) of each window's 200 requests exceed the TPOT SLO."""

    def __init__(self, over, **kw) -> None:
        super().__init__(**kw)
        self.over = over

    def measure(self, knobs: Knobs) -> Measurement:
        from dataclasses import replace

        from metrics.samples import verdict_from_counts

        m = super().measure(knobs)
        n, k = 200, self.over(knobs)
        tpot = m.observation.tpot
        if k > n // 100:  # more than 1% over: the window's p99 is over the SLO, by as much
            tpot = replace(tpot, p99=SLO.tpot_p99_s * (1 + k / n))
        obs = replace(
            m.observation,
            tpot=tpot,
            completed=n,
            slo_met=n - k,
            ttft_verdict=verdict_from_counts(n, 0, SLO.ttft_p99_s, 0.1),
            tpot_verdict=verdict_from_counts(n, k, SLO.tpot_p99_s, 0.05),
        )
        return Measurement(observation=obs, client=obs)


def test_export_tells_undecided_from_infeasible(tmp_path: Path, capsys) -> None:
    # 200 clean requests a window: never enough for an anytime-valid MET in one window
    # ... and the tuner's two windows a point are too few when one request is over
    (tmp_path / "u").mkdir()
    (tmp_path / "b").mkdir()
    undecided = CountingTarget(lambda k: 1)
    run(tmp_path / "u", undecided, limits=TuneLimits(max_trials=3, time_budget_s=1e6))
    code, _, err = _cli(
        ["export", str(tmp_path / "u" / "study.journal"), "--out", str(tmp_path / "u")], capsys
    )
    assert code == 4 and "undecided" in err and "best candidate" in err
    assert "more requests with none over the SLO" in err  # what would decide it
    # every window far over the SLO: none feasible, the canary fails (exit 3)
    bad = CountingTarget(lambda k: 150)
    run(tmp_path / "b", bad, limits=TuneLimits(max_trials=3, time_budget_s=1e6))
    code, _, err = _cli(
        ["export", str(tmp_path / "b" / "study.journal"), "--out", str(tmp_path / "b")], capsys
    )
    assert code == 3 and "no feasible point" in err


def test_the_time_budget_follows_a_slow_request_rate() -> None:
    from controller.tune import _time_budget

    limits = TuneLimits(time_budget_s=240.0, budget_requests=800, budget_windows=6)
    rec = TrialRecord.from_observation(
        number=0,
        knobs=Knobs(max_batch_size=4, max_concurrency=4),
        obs=Observation(start_s=0.0, end_s=100.0, completed=100, slo_met=100),
        feasible=False,
        wall_s=100.0,
    )
    assert _time_budget(limits, []) == 240.0
    assert _time_budget(limits, [rec]) == 6 * 800 / 1.0  # 1 req/s: six 800-request windows
    fast = replace(rec, completed=10_000)
    assert _time_budget(limits, [fast]) == 240.0
    assert _time_budget(replace(limits, budget_requests=0), [rec]) == 240.0


def test_windows_that_disagree_are_reported_as_noise(tmp_path: Path) -> None:
    seen: dict[Knobs, int] = {}

    def over(k: Knobs) -> int:  # the second window of every knob is far slower
        seen[k] = seen.get(k, 0) + 1
        return 0 if seen[k] % 2 else 30

    out = run(tmp_path, CountingTarget(over), limits=TuneLimits(max_trials=6, time_budget_s=1e6))
    noted = [t for t in out.report.trials if "environment noisy" in t.note]
    assert noted and "disagree beyond sampling error" in noted[0].note
    assert "0/200, 30/200" in out.report.meta["noise"]
