"""The ``serve`` actuator with Ray Serve's autoscaler on: the admission limit and
``target_ongoing_requests`` move together, live, and the replica count it predicts is the
one Ray's own default policy settles at.

The first two tests run Ray Serve 2.60's code without a cluster (its default policy, its
app code version); the last deploys slotune's own app with an ``autoscaling_config`` of
two replicas (min = max: the 2-core machine is not asked for more) through Serve's REST
API, as ``serve deploy`` or KubeRay would, and retunes it.
"""

from __future__ import annotations

import copy
import itertools

import pytest

from controller.backends.actuator import UNSETTLED
from controller.backends.serve import ServeActuator
from controller.backends.serve_autoscaling import Scaling, predicted_replicas
from search.space import Knobs

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "actuator-autoscaling"
DEPLOYMENT = "CompletionServer"


def _settle_with_rays_policy(
    total: float, target: float, lo: int, hi: int, current: int, factors: tuple[float, float]
) -> int:
    """Run Serve's default policy, wrapped as Serve wraps it (factors, delays, bounds:
    ray/serve/autoscaling_policy.py _apply_autoscaling_config; ray/serve/_private/
    autoscaling_state.py get_decision_num_replicas), decision after decision, the new
    target's replicas running at once, until the count stops moving."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.autoscaling_policy import (
        _apply_autoscaling_config,
        replica_queue_length_autoscaling_policy,
    )
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(
        min_replicas=lo,
        max_replicas=hi,
        target_ongoing_requests=target,
        upscale_delay_s=0,
        downscale_delay_s=0,
        upscaling_factor=factors[0],
        downscaling_factor=factors[1],
    )
    policy = _apply_autoscaling_config(replica_queue_length_autoscaling_policy)
    state: dict = {}
    seen = [current]
    for _ in range(200):
        ctx = AutoscalingContext(
            deployment_id=DeploymentID(name="d", app_name="a"),
            deployment_name="d",
            app_name="a",
            current_num_replicas=current,
            target_num_replicas=current,
            running_replicas=[],
            total_num_requests=total,
            total_queued_requests=0.0,
            aggregated_metrics=None,
            raw_metrics=None,
            capacity_adjusted_min_replicas=lo,
            capacity_adjusted_max_replicas=hi,
            policy_state=state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=None,
            config=config,
        )
        decision, state = policy(ctx)
        nxt = max(lo, min(hi, int(decision)))  # apply_bounds
        if nxt == current:
            return current
        current = nxt
        seen.append(current)
    raise AssertionError(f"Serve's policy did not settle: {seen[-10:]}")


def test_predicted_replicas_is_where_rays_default_policy_settles() -> None:
    grid = itertools.product(
        (0, 0.4, 1, 7, 23, 48, 49, 95.5, 400),  # total ongoing
        (0.5, 1, 2, 12, 24.75),  # target
        ((0, 5), (1, 10), (2, 2), (3, 50)),  # bounds
        (0, 1, 2, 7),  # replicas now
        ((1.0, 1.0), (0.5, 0.5), (1.0, 0.3)),  # up/downscaling factors (at most 1)
    )
    checked = 0
    for total, target, (lo, hi), current, factors in grid:
        current = max(lo, min(hi, current))
        want = _settle_with_rays_policy(total, target, lo, hi, current, factors)
        got = predicted_replicas(
            ongoing_total=total, target=target, min_replicas=lo, max_replicas=hi, current=current
        )
        assert got == want, (total, target, lo, hi, current, factors)
        checked += 1
    assert checked > 1000


def test_only_a_declared_autoscaling_config_changes_live() -> None:
    """Ray's app code version (what restarts replicas when it changes) ignores the target
    inside a declared autoscaling_config but sees the mapping added to an entry."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    base = {"name": "a", "import_path": "m:app", "deployments": [{"name": "D"}]}
    declared = copy.deepcopy(base)
    declared["deployments"][0]["autoscaling_config"] = {"max_replicas": 4}

    def version(cfg: dict, **auto: float) -> str:
        cfg = copy.deepcopy(cfg)
        cfg["deployments"][0]["max_ongoing_requests"] = 32
        if auto:
            cfg["deployments"][0].setdefault("autoscaling_config", {}).update(auto)
        return get_app_code_version(ServeApplicationSchema(**cfg))

    assert version(declared) == version(declared, target_ongoing_requests=24.0)
    assert version(declared, target_ongoing_requests=24.0) == version(
        declared, target_ongoing_requests=7.5
    )
    assert version(base) != version(base, target_ongoing_requests=24.0)  # a restart


def _deploy_autoscaled(cluster, name: str, *, batch: int, limit: int, autoscaling: dict):
    """slotune's tiny app as ``name``, its admission limit ``limit`` (Serve's router queues:
    the deployment's limit is the same), with ``autoscaling`` as its declared
    ``autoscaling_config``, through Serve's REST API as ``serve deploy`` or KubeRay would;
    returns the REST client once the app runs."""
    from controller.backends.serve_rest import ServeRest, declarative_apps
    from serving.app.cluster import read_token
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import app_config

    cfg = app_config(
        name=name,
        route_prefix=f"/{name}",
        args=ServerArgs(model="tiny", max_slots=16),
        live=LiveConfig(
            max_batch_size=batch, ttft_p99_s=3.0, tpot_p99_s=0.25, max_ongoing_requests=limit
        ),
        max_queued_requests=-1,
    )
    (entry,) = cfg["deployments"]
    del entry["num_replicas"]  # Serve refuses an int next to an autoscaling_config
    entry["autoscaling_config"] = autoscaling
    rest = ServeRest(cluster.dashboard_url, token=read_token())
    details = rest.details()
    try:
        rest.put(details, [*(a for a in declarative_apps(details) if a["name"] != name), cfg])
        rest.wait(name, DEPLOYMENT, lambda d: True, timeout_s=120)
    except BaseException:
        rest.close()
        raise
    return rest


@pytest.fixture(scope="module")
def autoscaled(ray_cluster):
    from serving.app.deploy import delete_app

    auto = {"min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 12}
    try:
        rest = _deploy_autoscaled(ray_cluster, APP, batch=2, limit=16, autoscaling=auto)
        rest.close()
        yield ray_cluster
    finally:
        delete_app(APP)


def test_limit_and_target_move_together_live_without_restart(autoscaled) -> None:
    from serving.app.deploy import replica_states

    a = ServeActuator(app=APP, dashboard_url=autoscaled.dashboard_url)
    assert a.scaling() == Scaling(
        target_ongoing_requests=12.0, min_replicas=2, max_replicas=2, current_replicas=2
    )
    before = a.fleet()
    pids = sorted((s.replica_id, s.pid) for s in replica_states(APP))
    assert len(before) == 2 and len(pids) == 2

    cost = a.apply(Knobs(max_batch_size=4, max_concurrency=24))  # 16/12 kept: target 18
    assert cost.changed and not cost.restarted

    dep = a.rest.details()["applications"][APP]["deployments"][DEPLOYMENT]
    cfg = dep["deployment_config"]
    assert cfg["max_ongoing_requests"] == 24
    auto = cfg["autoscaling_config"]
    assert (auto["target_ongoing_requests"], auto["min_replicas"], auto["max_replicas"]) == (
        18.0,
        2,
        2,
    )
    # Both replicas run the new limit (each reports what it applied), and none restarted.
    states = replica_states(APP)
    assert {s.max_ongoing_requests for s in states} == {24}
    assert {s.max_batch_size for s in states} == {4}
    assert sorted((s.replica_id, s.pid) for s in states) == pids
    assert [r[:2] for r in a.fleet()] == [r[:2] for r in before]
    scaling = a.scaling()
    assert scaling is not None and scaling.target_ongoing_requests == 18.0
    assert scaling.follows_admission and scaling.default_policy
    assert scaling.predict(1000) == 2  # bounded by max_replicas
    assert a.describe()["autoscaling"]["target_ongoing_requests"] == 18.0


SCALING_APP = "actuator-autoscaling-events"


class _Clients:
    """slotune's closed-loop load generator (``run_load``), ``n`` workers each sending its
    next completion when the last one ends: a steady number of requests in flight. On a
    thread of its own, bounded by ``limit_s``; stopped on exit."""

    def __init__(self, url: str, n: int, *, limit_s: float) -> None:
        import threading

        from controller.load.spec import LoadSpec, completions_url
        from serving.sim.workload import LengthDist

        self.spec = LoadSpec(
            url=completions_url(url),
            mode="closed",
            concurrency=n,
            duration_s=limit_s,
            max_requests=100_000,
            prompt_tokens=LengthDist(mean=8),
            output_tokens=LengthDist(mean=48),
            request_timeout_s=120.0,
            ignore_eos=True,
        )
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.ok = 0

    def _run(self) -> None:
        import asyncio

        from controller.load.generator import run_load

        async def go() -> None:
            self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
            self.started.set()
            self.ok = (await run_load(self.spec, stop=self.stop)).completed

        asyncio.run(go())

    def __enter__(self) -> _Clients:
        self.thread.start()
        self.started.wait(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=130)


def _settles_at(a: ServeActuator, want: int, timeout_s: float) -> list[int]:
    """Poll the replica count Serve reports until it is ``want`` (the counts seen)."""
    import time

    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sc = a.scaling()
        assert sc is not None
        fleet = a.fleet()
        running = len(fleet)
        if not seen or seen[-1] != running:
            seen.append(running)
        settled = not any(v.startswith(UNSETTLED) for _, _, v in fleet)
        if running == want and settled and sc.current_replicas == want:
            return seen
        time.sleep(1.0)
    raise AssertionError(f"Serve did not settle at {want} replicas in {timeout_s} s: {seen}")


def test_a_raised_limit_scales_the_fleet_as_predicted_and_decide_holds_it(ray_cluster) -> None:
    """Serve's autoscaler live, 1..2 replicas, 5 requests in flight: at limit 8, target 4
    it runs 2 replicas; the tick's loosening to limit 10 (target 5) is predicted to settle
    at 1, so it holds; applied anyway, Serve does go to 1, and back to 2 at the old limit."""
    import math

    from controller.control.decide import Action, Signals, State, decide
    from controller.control.policy import Policy
    from metrics.observation import Observation, Slo, SloVerdict, Verdict
    from serving.app.deploy import delete_app

    in_flight = 5
    auto = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 4,  # limit 8 per target 4: the ratio kept when it moves
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 3.0,
    }
    url = f"{ray_cluster.http_url}/{SCALING_APP}"
    rest = None
    try:
        rest = _deploy_autoscaled(ray_cluster, SCALING_APP, batch=8, limit=8, autoscaling=auto)
        a = ServeActuator(app=SCALING_APP, dashboard_url=ray_cluster.dashboard_url)
        assert _settles_at(a, 1, 60)[-1] == 1  # no load: the minimum
        with _Clients(url, in_flight, limit_s=420) as load:
            _settles_at(a, 2, 150)
            sc = a.scaling()
            assert sc is not None and (sc.target_ongoing_requests, sc.current_replicas) == (4.0, 2)
            assert sc.predict(in_flight) == 2
            cur = Knobs(max_batch_size=8, max_concurrency=8)

            def met(share: float) -> SloVerdict:
                return SloVerdict(
                    verdict=Verdict.MET, threshold_s=1.0, estimate_s=share,
                    samples=500, confidence=0.95,
                )  # fmt: skip

            # A calm window as these replicas run it (2.5 of the 5 in flight each) with demand
            # refused at the door: the loosening (8 -> 10, the target 4 -> 5) would let the 5
            # settle on 1 replica, so the tick holds.
            calm = Observation(
                start_s=0.0, end_s=400.0, completed=500, slo_met=500, rejected=5, overloaded=5,
                running=in_flight / 2, waiting=0.0, ttft_verdict=met(0.1), tpot_verdict=met(0.1),
            )  # fmt: skip
            policy = Policy(
                slo=Slo(ttft_p99_s=1.0, tpot_p99_s=1.0), batch_max=16, increase=4,
                stabilization_s=60.0,
            )  # fmt: skip
            calm_state = State(knobs=cur, calm_since=0.0)
            d = decide(Signals(observation=calm, live=cur, scaling=sc), calm_state, policy)
            assert d.action is Action.HOLD and "would settle at 1 of 2" in d.reason, d.reason
            # Without the autoscaler's view it loosens: the guard is what held.
            free = decide(Signals(observation=calm, live=cur), calm_state, policy)
            assert free.action is Action.LOOSEN, free.reason
            assert free.knobs == Knobs(max_batch_size=10, max_concurrency=10), free.reason
            # Applied anyway: Serve's autoscaler does what was predicted ...
            cost = a.apply(free.knobs)
            assert cost.changed and not cost.restarted
            target = a.scaling().target_ongoing_requests  # type: ignore[union-attr]
            assert math.ceil(in_flight / target) == 1
            assert _settles_at(a, 1, 150)[-1] == 1
            # ... and the old limit brings the second replica back.
            a.apply(cur)
            assert _settles_at(a, 2, 150)[-1] == 2
        assert load.ok > 0
    finally:
        if rest is not None:
            rest.close()
        delete_app(SCALING_APP)
