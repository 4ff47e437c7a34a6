"""The actuators' pure parts: knob paths, the restart guard, config edits (serve, serve-llm).

No Ray: configs are dicts shaped as Ray Serve 2.60 and Ray Serve LLM write them, and the
REST client is a fake that records what would be sent.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from controller.backends.actuator import UNSETTLED, ActuatorError, ApplyCost, KnobEffects
from controller.backends.knob_path import (
    KnobPath,
    classify,
    get_path,
    restarting_changes,
    set_path,
)
from controller.backends.none import NoActuator
from controller.backends.serve import (
    ServeActuator,
    admission_of,
    foreign_serve_limit,
    pick_deployment,
    with_knobs,
)
from controller.backends.serve_autoscaling import (
    Scaling,
    limit_per_target,
    predicted_replicas,
    target_for,
)
from controller.backends.serve_llm import ServeLLMActuator, llm_deployment_name, llm_index
from controller.backends.serve_rest import fleet_of, settled
from controller.targets import fleet_fault
from search.space import Knobs


def test_knob_paths_parse_and_print() -> None:
    p = KnobPath.parse("args.llm_configs[0].engine_kwargs.max_num_seqs")
    assert p.scope == "app" and p.parts == (
        "args",
        "llm_configs",
        0,
        "engine_kwargs",
        "max_num_seqs",
    )
    assert str(p) == "args.llm_configs[0].engine_kwargs.max_num_seqs"
    q = KnobPath.parse("user_config.batching.max_batch_size")
    assert q.scope == "deployment" and q.parts == ("user_config", "batching", "max_batch_size")
    for bad in ("", "a..b", "user_config.", "a[x]", "1abc"):
        with pytest.raises(ValueError, match="knob path"):
            KnobPath.parse(bad)


def test_get_and_set_path() -> None:
    tree = {"a": {"b": [1, {"c": 2}]}}
    assert get_path(tree, ("a", "b", 1, "c")) == 2
    assert get_path(tree, ("a", "x"), None) is None
    with pytest.raises(KeyError):
        get_path(tree, ("a", "b", 5))
    new = set_path(tree, ("a", "b", 1, "d", "e"), 3)  # creates the missing mapping
    assert new["a"]["b"][1] == {"c": 2, "d": {"e": 3}} and tree["a"]["b"][1] == {"c": 2}
    with pytest.raises(KeyError):
        set_path(tree, ("a", "b", 7), 1)  # a list entry is never invented


@pytest.mark.parametrize(
    ("scope", "parts", "effect"),
    [
        ("deployment", ("user_config", "max_batch_size"), "live"),
        ("deployment", ("max_ongoing_requests",), "live"),
        ("deployment", ("num_replicas",), "live"),
        ("deployment", ("max_queued_requests",), "live"),
        ("deployment", ("autoscaling_config", "max_replicas"), "live"),
        ("deployment", ("autoscaling_config", "policy"), "restart"),
        ("deployment", ("autoscaling_config",), "restart"),  # added or dropped: code version
        ("deployment", ("ray_actor_options", "num_cpus"), "restart"),
        ("deployment", ("placement_group_bundles",), "restart"),
        ("deployment", ("max_replicas_per_node",), "restart"),
        ("deployment", ("version",), "restart"),
        ("deployment", ("request_router_config", "request_router_class"), "restart"),
        ("deployment", ("something_new",), "unknown"),
        ("app", ("args", "max_slots"), "restart"),
        ("app", ("runtime_env", "env_vars", "X"), "restart"),
        ("app", ("import_path",), "restart"),
        ("app", ("route_prefix",), "unknown"),
    ],
)
def test_restart_table(scope: str, parts: tuple, effect: str) -> None:
    assert classify(scope, parts) == effect


def _slotune_app() -> dict[str, Any]:
    return {
        "name": "mine",
        "route_prefix": "/",
        "import_path": "serving.app.server:app",
        "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}},
        "args": {"model": "tiny", "max_slots": 64},
        "deployments": [
            {
                "name": "CompletionServer",
                "num_replicas": 2,
                "max_ongoing_requests": 16,
                "user_config": {"max_batch_size": 2, "ttft_p99_s": 1.0},
            }
        ],
    }


def test_serve_edit_changes_exactly_two_fields() -> None:
    old = _slotune_app()
    new = with_knobs(
        old,
        deployment="CompletionServer",
        batch_path=KnobPath.parse("user_config.max_batch_size"),
        batch=8,
        max_ongoing_requests=32,
    )
    dep = new["deployments"][0]
    assert dep["user_config"] == {"max_batch_size": 8, "ttft_p99_s": 1.0}
    assert dep["max_ongoing_requests"] == 32
    assert restarting_changes(old, new) == []
    rest = copy.deepcopy(new)
    rest["deployments"][0].update(old["deployments"][0])
    assert rest == old  # nothing else moved


def test_serve_edit_of_slotunes_own_app_moves_its_admission_key_and_serves_limit() -> None:
    """deploy/serve-config.yaml's layout: the replica admits 16 and queues 64, and Serve
    hands it up to 96 (16 + 64 + a margin of 16). The admission limit is the user_config
    key; Serve's limit follows it as serving.app.deploy builds it."""
    from serving.app.deploy import serve_limit

    old = _slotune_app()
    dep = old["deployments"][0]
    dep["user_config"] = {"max_batch_size": 8, "max_ongoing_requests": 16}
    dep["user_config"]["max_queued_requests"] = 64
    dep["max_ongoing_requests"] = 96
    assert admission_of(dep) == 16
    new = with_knobs(
        old,
        deployment="CompletionServer",
        batch_path=KnobPath.parse("user_config.max_batch_size"),
        batch=4,
        max_ongoing_requests=12,
    )
    got = new["deployments"][0]
    assert got["user_config"] == {
        "max_batch_size": 4, "max_ongoing_requests": 12, "max_queued_requests": 64
    }  # fmt: skip
    assert got["max_ongoing_requests"] == serve_limit(12, 64) == 12 + 64 + 12
    assert admission_of(got) == 12
    assert restarting_changes(old, new) == []
    # without a queue of its own, Serve's router queues and the two limits are one
    del dep["user_config"]["max_queued_requests"]
    bare = with_knobs(
        old,
        deployment="CompletionServer",
        batch_path=KnobPath.parse("user_config.max_batch_size"),
        batch=4,
        max_ongoing_requests=12,
    )
    assert bare["deployments"][0]["max_ongoing_requests"] == 12
    assert admission_of({"max_ongoing_requests": 7, "user_config": {"b": 1}}) == 7
    # Serve's limit is what slotune writes for the key and queue, or someone else's edit
    assert foreign_serve_limit(got) == "" and foreign_serve_limit(bare["deployments"][0]) == ""
    got["max_ongoing_requests"] = 50
    assert foreign_serve_limit(got) == (
        "Serve's max_ongoing_requests is 50 where user_config max_ongoing_requests=12 and "
        "max_queued_requests=64 make it 88, as slotune writes it"
    )
    assert admission_of(got) == 12  # the knobs alone cannot show it
    assert foreign_serve_limit({"max_ongoing_requests": 7, "user_config": {"b": 1}}) == ""
    assert foreign_serve_limit({"max_ongoing_requests": 7}) == ""


def test_serve_edit_of_a_code_defined_user_config_keeps_its_other_keys() -> None:
    old = {"name": "x", "import_path": "m:app", "deployments": []}  # no override at all
    new = with_knobs(
        old,
        deployment="Model",
        batch_path=KnobPath.parse("user_config.batching.max_batch_size"),
        batch=4,
        max_ongoing_requests=8,
        effective_user_config={"batching": {"max_batch_size": 2, "wait_s": 0.01}, "k": 1},
    )
    assert new["deployments"] == [
        {
            "name": "Model",
            "max_ongoing_requests": 8,
            "user_config": {"batching": {"max_batch_size": 4, "wait_s": 0.01}, "k": 1},
        }
    ]
    assert restarting_changes(old, new) == []  # an added override of live keys


@pytest.mark.parametrize(
    ("knob", "flagged"),
    [
        ("ray_actor_options.num_cpus", "deployments[CompletionServer].ray_actor_options"),
        ("args.max_slots", "args.max_slots"),
        ("runtime_env.env_vars.X", "runtime_env.env_vars.X"),
    ],
)
def test_serve_edit_into_restart_fields_is_flagged(knob: str, flagged: str) -> None:
    old = _slotune_app()
    new = with_knobs(
        old,
        deployment="CompletionServer",
        batch_path=KnobPath.parse(knob),
        batch=3,
        max_ongoing_requests=16,
    )
    assert [p for p, _ in restarting_changes(old, new)] == [flagged]


def _llm_app(max_num_seqs: int | None = 64) -> dict[str, Any]:
    """An app as ray.serve.llm's docs write one (ray/serve/llm/__init__.py build_openai_app)."""
    engine: dict[str, Any] = {"tensor_parallel_size": 1, "max_model_len": 4096}
    if max_num_seqs is not None:
        engine["max_num_seqs"] = max_num_seqs
    return {
        "name": "llm_app",
        "route_prefix": "/",
        "import_path": "ray.serve.llm:build_openai_app",
        "args": {
            "llm_configs": [
                {
                    "model_loading_config": {
                        "model_id": "qwen-0.5b",
                        "model_source": "Qwen/Qwen2.5-0.5B-Instruct",
                    },
                    "accelerator_type": "A10G",
                    "engine_kwargs": engine,
                    "deployment_config": {
                        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}
                    },
                }
            ]
        },
    }


def test_llm_deployment_names_follow_ray_serve_llm() -> None:
    cfg = _llm_app()
    assert llm_deployment_name(cfg["args"]["llm_configs"][0]) == "qwen-0_5b"
    assert llm_index(cfg, "LLMServer:qwen-0_5b") == 0
    with pytest.raises(ActuatorError, match="serves none"):
        llm_index(cfg, "LLMServer:other")
    with pytest.raises(ActuatorError, match="not a Ray Serve LLM app"):
        llm_index(_slotune_app(), "CompletionServer")


def test_llm_edit_restarts_only_for_the_batch_knob() -> None:
    old = _llm_app()
    path = KnobPath.parse("args.llm_configs[0].engine_kwargs.max_num_seqs")
    new = with_knobs(
        old, deployment="LLMServer:qwen-0_5b", batch_path=path, batch=128, max_ongoing_requests=96
    )
    assert new["args"]["llm_configs"][0]["engine_kwargs"]["max_num_seqs"] == 128
    assert new["deployments"] == [{"name": "LLMServer:qwen-0_5b", "max_ongoing_requests": 96}]
    assert [p for p, _ in restarting_changes(old, new)] == [str(path)]
    assert restarting_changes(old, new, allowed=frozenset({str(path)})) == []
    # The same batch, a new admission limit: live, nothing to allow.
    same = with_knobs(
        old, deployment="LLMServer:qwen-0_5b", batch_path=path, batch=64, max_ongoing_requests=8
    )
    assert restarting_changes(old, same) == []
    # No max_num_seqs yet: the key is added, still only the allowed path.
    bare = _llm_app(None)
    added = with_knobs(
        bare, deployment="LLMServer:qwen-0_5b", batch_path=path, batch=32, max_ongoing_requests=8
    )
    assert restarting_changes(bare, added, allowed=frozenset({str(path)})) == []


def _details(app_cfg: dict[str, Any], deployment: str, **dep_cfg: Any) -> dict[str, Any]:
    replicas = [{"replica_id": f"r{i}", "pid": 100 + i, "state": "RUNNING"} for i in range(2)]
    return {
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": {
            app_cfg["name"]: {
                "status": "RUNNING",
                "deployed_app_config": app_cfg,
                "deployments": {
                    deployment: {
                        "status": "HEALTHY",
                        "target_num_replicas": 2,
                        "deployment_config": {"max_ongoing_requests": 16, **dep_cfg},
                        "replicas": replicas,
                    }
                },
            }
        },
    }


class FakeRest:
    """Serve's REST API as a dict; a PUT moves the deployment to the new config at once
    (with new replica ids when ``restart``)."""

    base_url = "http://127.0.0.1:1"

    def __init__(self, details: dict[str, Any], *, restart: bool = False) -> None:
        self.state = details
        self.puts: list[dict[str, Any]] = []
        self.restart = restart

    def details(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def put(self, details: dict[str, Any], apps: list[dict[str, Any]]) -> None:
        self.puts.append(copy.deepcopy(apps))
        for cfg in apps:
            app = self.state["applications"][cfg["name"]]
            app["deployed_app_config"] = cfg
            for entry in cfg.get("deployments", []):
                dep = app["deployments"][entry["name"]]
                dep["deployment_config"].update({k: v for k, v in entry.items() if k != "name"})
                if self.restart:
                    for r in dep["replicas"]:
                        r["replica_id"] += "'"
                        r["pid"] += 1000

    def wait(self, app: str, deployment: str, done: Any, *, timeout_s: float) -> dict[str, Any]:
        dep = self.state["applications"][app]["deployments"][deployment]
        assert done(dep) and settled(dep)
        return dep


def test_serve_actuator_applies_live_and_refuses_restarts_without_sending() -> None:
    rest = FakeRest(_details(_slotune_app(), "CompletionServer", user_config={"max_batch_size": 2}))
    a = ServeActuator(app="mine", rest=rest)  # type: ignore[arg-type]
    assert a.deployment == "CompletionServer"
    assert a.current() == Knobs(max_batch_size=2, max_concurrency=16)
    assert a.effects() == KnobEffects(live=frozenset({"max_batch_size", "max_concurrency"}))
    cost = a.apply(Knobs(max_batch_size=4, max_concurrency=8))
    assert cost.changed and not cost.restarted and len(rest.puts) == 1
    assert a.current() == Knobs(max_batch_size=4, max_concurrency=8)
    assert a.apply(Knobs(max_batch_size=4, max_concurrency=8)).changed is False
    bad = ServeActuator(app="mine", rest=rest, batch_knob="args.max_slots")  # type: ignore[arg-type]
    with pytest.raises(ActuatorError, match=r"args\.max_slots \(restart\).*nothing was changed"):
        bad.apply(Knobs(max_batch_size=5, max_concurrency=8))
    assert len(rest.puts) == 1


def test_serve_actuator_names_the_deployment_when_there_are_several() -> None:
    details = _details(_slotune_app(), "A")
    details["applications"]["mine"]["deployments"]["B"] = {}
    with pytest.raises(ActuatorError, match=r"\['A', 'B'\]: name one with --deployment"):
        pick_deployment(details, "mine", None)
    assert pick_deployment(details, "mine", "B") == "B"


def test_serve_llm_actuator_restarts_for_the_batch_and_says_so() -> None:
    details = _details(_llm_app(), "LLMServer:qwen-0_5b", max_ongoing_requests=64)
    rest = FakeRest(details, restart=True)
    a = ServeLLMActuator(app="llm_app", rest=rest)  # type: ignore[arg-type]
    assert str(a.batch_path) == "args.llm_configs[0].engine_kwargs.max_num_seqs"
    assert a.current() == Knobs(max_batch_size=64, max_concurrency=64)
    assert a.effects().restart == frozenset({"max_batch_size"})
    cost = a.apply(Knobs(max_batch_size=128, max_concurrency=128))
    assert isinstance(cost, ApplyCost) and cost.restarted
    (apps,) = rest.puts
    assert apps[0]["deployments"] == [{"name": "LLMServer:qwen-0_5b", "max_ongoing_requests": 128}]
    rest.restart = False
    live = a.apply(Knobs(max_batch_size=128, max_concurrency=200))
    assert not live.restarted  # admission alone stays live


def test_fleet_versions_mark_an_update_under_way() -> None:
    dep = _details(_slotune_app(), "D")["applications"]["mine"]["deployments"]["D"]
    steady = fleet_of(dep)
    assert [r[:2] for r in steady] == [("r0", 100), ("r1", 101)]
    assert fleet_fault(steady, steady) == ""
    dep["status"] = "UPDATING"
    moving = fleet_of(dep)
    assert moving[0][2].startswith(UNSETTLED)
    assert "mid-update" in fleet_fault(moving, moving)
    dep["status"] = "HEALTHY"
    dep["deployment_config"]["max_ongoing_requests"] = 3
    assert "changed" in fleet_fault(steady, fleet_of(dep))


def test_none_actuator_changes_nothing() -> None:
    a = NoActuator()
    assert a.current() is None and a.fleet() == ()
    assert a.apply(Knobs(max_batch_size=2, max_concurrency=4)).changed is False
    assert a.effects() == KnobEffects()
    assert "recommendations, not applied" in a.describe()["note"]


# -- Serve's autoscaler ------------------------------------------------------------------


def _autoscaled_app(**auto: Any) -> dict[str, Any]:
    app = _slotune_app()
    dep = app["deployments"][0]
    del dep["num_replicas"]  # Serve refuses an int num_replicas next to autoscaling_config
    dep["max_ongoing_requests"] = 32
    dep["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 4, **auto}
    return app


def _autoscaled_details(app_cfg: dict[str, Any], target: float = 24.0) -> dict[str, Any]:
    # Serve's details show the whole AutoscalingConfig (ray/serve/schema.py
    # _deployment_info_to_schema), the policy included.
    auto = {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": target,
        "upscale_delay_s": 30.0,
        "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"},
    }
    return _details(
        app_cfg,
        "CompletionServer",
        max_ongoing_requests=32,
        user_config={"max_batch_size": 2, "ttft_p99_s": 1.0},
        autoscaling_config=auto,
    )


def test_the_target_keeps_the_operators_limit_per_target() -> None:
    ratio = limit_per_target(32, 24)
    assert ratio == pytest.approx(4 / 3)
    assert [target_for(c, ratio=ratio) for c in (32, 40, 16, 8, 33)] == [24, 30, 12, 6, 24.75]
    rest = FakeRest(_autoscaled_details(_autoscaled_app(target_ongoing_requests=24)))
    a = ServeActuator(app="mine", rest=rest)  # type: ignore[arg-type]
    assert a.apply(Knobs(max_batch_size=2, max_concurrency=32)).changed is False  # 32/24 kept
    cost = a.apply(Knobs(max_batch_size=4, max_concurrency=40))
    assert cost.changed and not cost.restarted
    (apps,) = rest.puts
    (entry,) = apps[0]["deployments"]
    assert entry["max_ongoing_requests"] == 40
    assert entry["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 30.0,
    }
    assert restarting_changes(_autoscaled_app(target_ongoing_requests=24), apps[0]) == []
    # Down and back up: the ratio is the operator's, not one worn by rounding.
    for limit, target in ((7, 5.25), (9, 6.75), (32, 24.0)):
        a.apply(Knobs(max_batch_size=4, max_concurrency=limit))
        auto = rest.puts[-1][0]["deployments"][0]["autoscaling_config"]
        assert auto["target_ongoing_requests"] == target
    assert a.scaling() == Scaling(
        target_ongoing_requests=24.0, min_replicas=1, max_replicas=4, current_replicas=2
    )
    described = a.describe()["autoscaling"]
    assert described["target_ongoing_requests"] == 24.0 and described["follows_admission"]


def test_the_target_stays_under_the_limit_by_ray_s_20_percent() -> None:
    # An operator's 10/10 (no headroom): the target is written at 10/1.2.
    rest = FakeRest(_autoscaled_details(_autoscaled_app(target_ongoing_requests=10), target=10))
    rest.state["applications"]["mine"]["deployments"]["CompletionServer"]["deployment_config"][
        "max_ongoing_requests"
    ] = 10
    a = ServeActuator(app="mine", rest=rest)  # type: ignore[arg-type]
    a.apply(Knobs(max_batch_size=2, max_concurrency=10))
    auto = rest.puts[-1][0]["deployments"][0]["autoscaling_config"]
    assert auto["target_ongoing_requests"] == 8.333
    # Never over limit / 1.2, whatever the ratio and limit; at least 1 (which wins at 1).
    for ratio in (1.2, 1.25, 4 / 3, 1.5, 2.0, 7.3):
        for limit in range(1, 300):
            t = target_for(limit, ratio=ratio)
            assert t >= 1.0 and (t <= limit / 1.2 or (limit == 1 and t == 1.0)), (ratio, limit)
    assert target_for(1, ratio=1.2) == 1.0
    assert limit_per_target(11, 10) == 1.2
    with pytest.raises(ValueError, match="ratio=1.1"):
        target_for(8, ratio=1.1)


def test_without_autoscaling_nothing_else_is_written() -> None:
    rest = FakeRest(_details(_slotune_app(), "CompletionServer", user_config={"max_batch_size": 2}))
    a = ServeActuator(app="mine", rest=rest)  # type: ignore[arg-type]
    a.apply(Knobs(max_batch_size=4, max_concurrency=40))
    (entry,) = rest.puts[0][0]["deployments"]
    assert "autoscaling_config" not in entry and entry["num_replicas"] == 2
    assert a.scaling() is None and "autoscaling" not in a.describe()


def test_autoscaling_from_the_code_keeps_its_target_and_says_so(caplog) -> None:
    """An entry without an autoscaling_config mapping: adding one is a new code version
    (a restart), so the limit moves alone."""
    app = _slotune_app()
    del app["deployments"][0]["num_replicas"]
    rest = FakeRest(_autoscaled_details(app))
    a = ServeActuator(app="mine", rest=rest)  # type: ignore[arg-type]
    a.apply(Knobs(max_batch_size=4, max_concurrency=20))
    (entry,) = rest.puts[0][0]["deployments"]
    assert entry["max_ongoing_requests"] == 20 and "autoscaling_config" not in entry
    assert "declares no autoscaling_config" in caplog.text
    assert a.scaling().follows_admission is False  # type: ignore[union-attr]
    with pytest.raises(ActuatorError, match="declares no autoscaling_config"):
        with_knobs(
            app,
            deployment="CompletionServer",
            batch_path=KnobPath.parse("user_config.max_batch_size"),
            batch=2,
            max_ongoing_requests=20,
            target_ongoing_requests=15.0,
        )
    added = copy.deepcopy(app)
    added["deployments"][0]["autoscaling_config"] = {"target_ongoing_requests": 15.0}
    assert restarting_changes(app, added) == [
        ("deployments[CompletionServer].autoscaling_config", "restart")
    ]


@pytest.mark.parametrize(
    ("total", "target", "lo", "hi", "current", "want"),
    [
        (48, 24, 1, 10, 2, 2),  # at the target: stays
        (49, 24, 1, 10, 2, 3),  # a request over: one more
        (47, 24, 1, 10, 5, 2),  # downscale to ceil(total / target)
        (0.5, 2, 1, 10, 3, 1),  # a fraction of a replica's worth is one replica
        (0, 2, 1, 10, 5, 1),  # no traffic: min_replicas
        (0, 2, 0, 10, 5, 0),  # ... which may be zero
        (1000, 2, 1, 10, 3, 10),  # capped at max_replicas
        (10, 2, 4, 4, 4, 4),  # min == max: fixed
        (5, 2, 1, 10, 0, 3),  # from zero replicas (cold start), same fixed point
        (0, 2, 0, 10, 0, 0),
        (6, 0.5, 1, 100, 1, 12),  # fractional targets
        (30, 24.75, 1, 10, 1, 2),
    ],
)
def test_predicted_replicas(total, target, lo, hi, current, want) -> None:
    got = predicted_replicas(
        ongoing_total=total, target=target, min_replicas=lo, max_replicas=hi, current=current
    )
    assert got == want
    s = Scaling(
        target_ongoing_requests=target, min_replicas=lo, max_replicas=hi, current_replicas=current
    )
    assert s.predict(total) == want


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"ongoing_total": -1.0}, "ongoing_total"),
        ({"ongoing_total": float("nan")}, "ongoing_total"),
        ({"target": 0.0}, "target_ongoing_requests"),
        ({"min_replicas": 5, "max_replicas": 4}, "min_replicas=5"),
        ({"current": -1}, "current replicas"),
    ],
)
def test_predicted_replicas_names_a_bad_value(kw: dict[str, Any], match: str) -> None:
    args = {"ongoing_total": 4.0, "target": 2.0, "min_replicas": 1, "max_replicas": 4, "current": 1}
    with pytest.raises(ValueError, match=match):
        predicted_replicas(**{**args, **kw})
