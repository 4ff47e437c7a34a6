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


@pytest.fixture(scope="module")
def autoscaled(ray_cluster):
    from controller.backends.serve_rest import ServeRest, declarative_apps
    from serving.app.cluster import read_token
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import app_config, delete_app

    cfg = app_config(
        name=APP,
        route_prefix=f"/{APP}",
        args=ServerArgs(model="tiny", max_slots=16),
        live=LiveConfig(max_batch_size=2, ttft_p99_s=3.0, tpot_p99_s=0.25, max_ongoing_requests=16),
        max_queued_requests=-1,  # Serve's router queues: the deployment's limit is 16
    )
    (entry,) = cfg["deployments"]
    del entry["num_replicas"]  # Serve refuses an int next to an autoscaling_config
    entry["autoscaling_config"] = {
        "min_replicas": 2,
        "max_replicas": 2,
        "target_ongoing_requests": 12,
    }
    rest = ServeRest(ray_cluster.dashboard_url, token=read_token())
    details = rest.details()
    rest.put(details, [*(a for a in declarative_apps(details) if a["name"] != APP), cfg])
    try:
        rest.wait(APP, DEPLOYMENT, lambda d: True, timeout_s=120)
        yield ray_cluster
    finally:
        rest.close()
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
