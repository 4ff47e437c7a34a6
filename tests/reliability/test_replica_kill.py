"""A replica SIGKILLed in the middle of a trial's window (Ray restarts it): the window is
discarded and the trial measured again; no data point spans the restart (issue 17, item 4).

Bounded: the tiny model, 1-2 s windows, one kill, at most three windows.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "kill-mid-trial"


@pytest.fixture(scope="module")
def app(ray_cluster):
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import delete_app, deploy_app

    deploy_app(
        ServerArgs(model="tiny", max_slots=16),
        LiveConfig(max_batch_size=4, ttft_p99_s=3.0, tpot_p99_s=0.25, max_ongoing_requests=4),
        max_queued_requests=-1,
        name=APP,
        route_prefix=f"/{APP}",
    )
    try:
        yield ray_cluster
    finally:
        delete_app(APP)


def _target(cluster):
    from controller.targets import RayServeTarget, RequestShape, WindowPlan
    from controller.windows import ScrapeWindow
    from metrics.observation import Slo
    from metrics.sources import ScrapeSource
    from serving.sim.workload import LengthDist

    slo = Slo(ttft_p99_s=3.0, tpot_p99_s=0.25)
    src = ScrapeSource(cluster.metrics_url, slo=slo, prefix="ray_", selector={"application": APP})
    return RayServeTarget(
        url=f"{cluster.http_url}/{APP}",
        app_name=APP,
        slo=slo,
        reader=ScrapeWindow(src),
        plan=WindowPlan(warmup_s=1.0, window_s=4.0, max_window_s=6.0, min_requests=10_000),
        shape=RequestShape(
            prompt_tokens=LengthDist(mean=8),
            output_tokens=LengthDist(mean=4),
            request_timeout_s=20.0,
        ),
        apply_timeout_s=90.0,
    )


def test_a_replica_killed_mid_window_voids_the_window_and_the_trial_is_measured_again(
    app, tmp_path: Path
) -> None:
    from controller.report.curve import CurveReport
    from controller.tune import TuneLimits, run_tune
    from search.space import Knobs, SearchSpace
    from search.tuner import Tuner
    from serving.app.deploy import replica_states

    target = _target(app)
    victim = replica_states(APP)[0]
    killed_at: list[float] = []
    measure = target.measure

    def measure_and_kill(knobs: Knobs):
        if not killed_at:  # the first window only: kill the replica 2.5 s into the trial

            def kill() -> None:
                time.sleep(2.5)
                killed_at.append(time.time())
                os.kill(victim.pid, signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()
        return measure(knobs)

    target.measure = measure_and_kill  # type: ignore[method-assign]
    knobs = Knobs(max_batch_size=4, max_concurrency=4)
    tuner = Tuner(
        space=SearchSpace(batch_min=1, batch_max=16, headroom_max=1.0),
        slo=target.slo,
        storage=None,
        seed_knobs=[knobs],
        seed=0,
    )
    out = run_tune(
        target=target,
        tuner=tuner,
        base=CurveReport(slo=target.slo, trials=()),
        limits=TuneLimits(max_trials=1, time_budget_s=600, remeasures=2),
        out_dir=tmp_path / "out",
    )
    assert killed_at, "the replica was never killed"
    assert not out.aborted, out.aborted
    (rec,) = out.report.trials
    assert rec.remeasured >= 1 and "re-measured" in rec.note
    assert "replicas changed" in out.report.meta["discarded_windows"]
    # the kept window ran on the restarted replica only, with no client errors
    after = replica_states(APP)
    assert [s.pid for s in after] != [victim.pid]
    assert rec.client_errors == 0 and rec.completed > 0
