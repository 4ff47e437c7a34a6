"""The ``serve`` actuator against the real Ray Serve: Serve's public REST API only.

slotune's own app (deployed as a declarative config, like ``serve deploy`` would) is tuned
through the dashboard of the session cluster: knobs change with no replica restart, a
restart-forcing change is refused with nothing sent, and with two replicas an apply returns
only once both run the new config while a foreign update during a window voids it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from controller.backends.actuator import UNSETTLED, ActuatorError
from controller.backends.serve import ServeActuator
from controller.targets import fleet_fault
from metrics.observation import Observation, Slo
from search.space import Knobs
from tests.controller.test_control_loop import window

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "actuator-serve"
SLO = Slo(ttft_p99_s=3.0, tpot_p99_s=0.25)


@pytest.fixture(scope="module")
def two_replicas(ray_cluster):
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import delete_app, deploy_app

    deploy_app(
        ServerArgs(model="tiny", max_slots=16),
        LiveConfig(max_batch_size=2, ttft_p99_s=3.0, tpot_p99_s=0.25, max_ongoing_requests=16),
        max_queued_requests=-1,
        name=APP,
        route_prefix=f"/{APP}",
        num_replicas=2,
    )
    try:
        yield ray_cluster
    finally:
        delete_app(APP)


def _actuator(cluster, **kw) -> ServeActuator:
    return ServeActuator(app=APP, dashboard_url=cluster.dashboard_url, **kw)


def _replica_batches(cluster) -> set[int]:
    from serving.app.deploy import replica_states

    return {s.max_batch_size for s in replica_states(APP)}


def test_knobs_change_live_through_rest_without_restart(two_replicas) -> None:
    a = _actuator(two_replicas)
    assert a.deployment == "CompletionServer"
    before = a.fleet()
    assert len(before) == 2
    cost = a.apply(Knobs(max_batch_size=4, max_concurrency=12))
    assert cost.changed and not cost.restarted
    after = a.fleet()
    assert [r[:2] for r in after] == [r[:2] for r in before]  # same replicas, same pids
    assert a.current() == Knobs(max_batch_size=4, max_concurrency=12)
    # Both replicas run it the moment apply returned (each reports what it applied) ...
    assert _replica_batches(two_replicas) == {4}
    # ... and the one serving HTTP says so too.
    stats = httpx.get(f"{two_replicas.http_url}/{APP}/stats", timeout=30).json()
    assert stats["max_batch_size"] == 4


@pytest.mark.parametrize("knob", ["ray_actor_options.num_cpus", "args.max_slots"])
def test_a_restart_forcing_change_is_refused_with_nothing_changed(two_replicas, knob) -> None:
    a = _actuator(two_replicas)
    config = a.rest.details()["applications"][APP]["deployed_app_config"]
    fleet = a.fleet()
    with pytest.raises(ActuatorError, match="restart replicas.*nothing was changed"):
        _actuator(two_replicas, batch_knob=knob).apply(Knobs(max_batch_size=3, max_concurrency=12))
    assert a.rest.details()["applications"][APP]["deployed_app_config"] == config
    assert a.fleet() == fleet


class _ForeignUpdateReader:
    """A window reader whose window sees someone else update the deployment."""

    def __init__(self, foreign: ServeActuator) -> None:
        self.foreign = foreign

    def begin(self) -> str:
        return "tok"

    def end(self, token: str, *, start_s: float, end_s: float) -> Observation:
        self.foreign.apply(Knobs(max_batch_size=1, max_concurrency=7))
        return Observation(start_s=start_s, end_s=end_s, completed=1, slo_met=1, source="fake")


def test_a_window_never_spans_an_update(two_replicas) -> None:
    from controller.targets import RequestShape, WindowPlan, measure_window
    from serving.sim.workload import LengthDist

    a = _actuator(two_replicas)
    a.apply(Knobs(max_batch_size=2, max_concurrency=8))
    assert _replica_batches(two_replicas) == {2}  # both replicas, before apply returned
    assert len({r[2] for r in a.fleet()}) == 1
    first = a.fleet()
    a.apply(Knobs(max_batch_size=3, max_concurrency=8))
    assert _replica_batches(two_replicas) == {3}
    assert fleet_fault(first, a.fleet())  # an update between two reads is seen

    m = asyncio.run(
        measure_window(
            url=f"{two_replicas.http_url}/{APP}",
            knobs=Knobs(max_batch_size=2, max_concurrency=2),
            slo=SLO,
            plan=WindowPlan(warmup_s=0.5, window_s=1.0, max_window_s=5.0, min_requests=0),
            shape=RequestShape(prompt_tokens=LengthDist(mean=4), output_tokens=LengthDist(mean=2)),
            reader=_ForeignUpdateReader(_actuator(two_replicas)),
            fleet=a.fleet,
        )
    )
    assert "changed during the window" in m.fault


class _Calm:
    """Calm, plentiful traffic in every window."""

    def begin(self) -> str:
        return "tok"

    def end(self, token: str, *, start_s: float, end_s: float) -> Observation:
        return window(start_s, end_s)


def test_a_replica_killed_mid_window_is_no_decision_and_control_resumes(
    two_replicas, tmp_path
) -> None:
    import json
    import os
    import signal
    import time

    from controller.control.decide import State
    from controller.control.loop import LoopConfig, run_control
    from controller.control.policy import Policy
    from controller.control.store import save_state
    from serving.app.deploy import replica_pids

    a = _actuator(two_replicas)
    k = Knobs(max_batch_size=2, max_concurrency=8)
    a.apply(k)
    save_state(State(knobs=k), tmp_path / "state.json")
    ticks = []

    def sleep(s: float) -> None:
        ticks.append(s)
        if len(ticks) == 1:  # in the first window: SIGKILL one replica
            os.kill(replica_pids(APP)[0], signal.SIGKILL)
        elif len(ticks) == 2:  # then let Serve replace it before the next window
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                fleet = a.fleet()
                if len(fleet) == 2 and not any(v.startswith(UNSETTLED) for *_, v in fleet):
                    break
                time.sleep(0.5)
        time.sleep(s)

    run_control(
        reader=_Calm(),
        actuator=a,
        policy=Policy(slo=SLO, batch_max=8),
        state_path=tmp_path / "state.json",
        audit_path=tmp_path / "audit.jsonl",
        config=LoopConfig(interval_s=1.0, max_ticks=3),
        sleep=sleep,
    )
    rows = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert rows[0]["outcome"] == "inconclusive" and rows[0]["action"] == "hold", rows[0]
    assert "mid-update" in rows[0]["reason"] or "replicas" in rows[0]["reason"], rows[0]
    # the replacement replica is a new fleet: the windows after it are judged again
    assert rows[-1]["outcome"] == "met", [r["reason"] for r in rows]
    assert a.current() == k  # nothing was changed on a partial window


class _Throttle:
    """A replica process on a CPU duty cycle (SIGSTOP ``stop_s``, SIGCONT ``run_s``): a slow
    node, made real. Bounded in time; the process is always left running."""

    def __init__(self, pid: int, *, stop_s: float, run_s: float, limit_s: float) -> None:
        import threading

        self.pid, self.stop_s, self.run_s, self.limit_s = pid, stop_s, run_s, limit_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        import os
        import signal
        import time

        end = time.monotonic() + self.limit_s
        try:
            while not self.done.is_set() and time.monotonic() < end:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.run_s)
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> _Throttle:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def test_a_slow_replica_is_named_not_averaged_away(two_replicas) -> None:
    """One of two replicas on a third of a CPU: the window read from Ray's metrics port
    holds each replica's p99 TPOT, and the tick names the slow one as an outlier."""
    from controller.control.decide import Signals, State, decide
    from controller.control.outliers import OUTLIER_RATIO
    from controller.control.policy import Policy
    from controller.targets import RequestShape, WindowPlan, measure_window
    from controller.tune_setup import make_reader
    from serving.app.deploy import replica_states
    from serving.sim.workload import LengthDist

    a = _actuator(two_replicas)
    k = Knobs(max_batch_size=4, max_concurrency=8)
    a.apply(k)
    loose = Slo(ttft_p99_s=30.0, tpot_p99_s=5.0)  # the reader's verdicts: not the point here
    shape = RequestShape(prompt_tokens=LengthDist(mean=8), output_tokens=LengthDist(mean=16))

    def window_now(seconds: float) -> Observation:
        reader, _ = make_reader(
            slo=loose, app=APP, metrics_url=two_replicas.metrics_url, prometheus_url=None,
            prefix="ray_", profile="slotune", under_ray=True,
        )  # fmt: skip
        m = asyncio.run(
            measure_window(
                url=f"{two_replicas.http_url}/{APP}",
                knobs=k,
                slo=loose,
                plan=WindowPlan(warmup_s=2.0, window_s=seconds, max_window_s=seconds + 10),
                shape=shape,
                reader=reader,
                fleet=a.fleet,
            )
        )
        assert not m.fault, m.fault
        return m.observation

    # (a replica killed by an earlier test keeps its series in Ray's export: no requests)
    healthy = window_now(8.0)
    served = [p99 for _, p99, n in healthy.replica_tpot if n > 0]
    assert len(served) == 2, healthy.replica_tpot
    fleet_p99 = max(served)
    slow, fast = sorted(replica_states(APP), key=lambda s: s.replica_id)
    with _Throttle(slow.pid, stop_s=0.07, run_s=0.03, limit_s=60.0):
        seen = window_now(12.0)
    by_replica = {r: (p99, n) for r, p99, n in seen.replica_tpot if n > 0}
    assert set(by_replica) == {slow.replica_id, fast.replica_id}, by_replica
    assert by_replica[slow.replica_id][0] >= OUTLIER_RATIO * by_replica[fast.replica_id][0], (
        by_replica
    )
    # the SLO at twice the healthy fleet's p99: the slow replica is over it, the fleet
    # p99 may or may not be, and the tick must say which replica it is either way
    policy = Policy(
        slo=Slo(ttft_p99_s=30.0, tpot_p99_s=2 * fleet_p99), batch_max=16, min_requests=10
    )
    d = decide(Signals(observation=seen, live=k, fault=""), State(knobs=k), policy)
    assert d.outliers == (slow.replica_id,), (d.reason, by_replica)
    assert f"outlier: replica {slow.replica_id}" in d.reason
