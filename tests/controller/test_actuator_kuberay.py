"""The ``kuberay`` actuator: knobs written into a RayService's serveConfigV2, with real Ray
Serve underneath.

No Kubernetes API server runs on these machines. The RayService lives in the stand-in API
server (tests/fixtures/kube_standin.py), reached through the real ``kubernetes`` client; a
small reconciler plays KubeRay's part: whenever the CR's serveConfigV2 changes, it submits
it to Serve's REST API (KubeRay does that with the same PUT). So a change made through the
CR reaches every replica of a real Serve app, and the tests see the rest: a 409 retried on
a fresh read, someone else's change (in the CR or on the cluster) paused on, a deleted
RayService ending the controller, a restart-forcing change refused with nothing written.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.backends.actuator import ActuatorError
from controller.backends.kuberay import KubeRayActuator
from controller.backends.serve import replace_app
from controller.backends.serve_rest import ServeRest, declarative_apps
from controller.control.decide import State
from controller.control.loop import ControlFailed, LoopConfig, run_control
from controller.control.policy import Policy
from controller.control.store import save_state
from metrics.observation import Observation, Slo
from search.space import Knobs
from tests.fixtures.kube_standin import KubeStandIn

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "actuator-kuberay"
NS = "serving"
RS = "slotune"
RAY = ("ray.io/v1", "rayservices", NS, RS)
SLO = Slo(ttft_p99_s=3.0, tpot_p99_s=0.25)


class MiniKubeRay:
    """KubeRay's part, on a thread: submit the RayService's serveConfigV2 to Serve whenever
    the CR changes (every other declarative app on the cluster is kept)."""

    def __init__(self, kube: KubeStandIn, rest: ServeRest) -> None:
        self.kube, self.rest = kube, rest
        self.stop = threading.Event()
        self.paused = threading.Event()  # set: KubeRay lags, submits nothing
        self.submitted = 0
        self._seen: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MiniKubeRay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(timeout=10)

    def resubmit(self) -> None:
        """Submit the CR again (as KubeRay does when its cache is lost)."""
        self._seen = None

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            if self.paused.is_set():
                continue
            cr = self.kube.get(*RAY)
            if cr is None or cr["spec"]["serveConfigV2"] == self._seen:
                continue
            text = cr["spec"]["serveConfigV2"]
            details = self.rest.details()
            apps = declarative_apps(details)
            for new in yaml.safe_load(text)["applications"]:
                apps = replace_app(apps, new)
            self.rest.put(details, apps)
            self._seen = text
            self.submitted += 1


@pytest.fixture(scope="module")
def rayservice(ray_cluster, tmp_path_factory):
    """slotune's app on the session cluster, declared by a RayService in the stand-in."""
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
    from serving.app.cluster import read_token

    rest = ServeRest(ray_cluster.dashboard_url, token=read_token())
    declared = rest.details()["applications"][APP]["deployed_app_config"]
    try:
        with KubeStandIn() as kube, MiniKubeRay(kube, rest) as operator:
            yield kube, rest, operator, declared
    finally:
        rest.close()
        delete_app(APP)


@pytest.fixture
def fresh(rayservice):
    """The RayService as first declared (each test starts from it), Serve settled on it."""
    kube, rest, operator, declared = rayservice
    kube.put(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayService",
            "metadata": {"name": RS, "namespace": NS},
            "spec": {"serveConfigV2": yaml.safe_dump({"applications": [declared]})},
        }
    )
    operator.resubmit()  # a test may have changed the cluster alone
    a = _actuator(kube, rest)
    a.rest.wait(APP, a.deployment, lambda d: a._in_effect(K0, 2, d), timeout_s=60)
    kube.requests.clear()
    return kube, a, operator


K0 = Knobs(max_batch_size=2, max_concurrency=16)


def _actuator(kube: KubeStandIn, rest: ServeRest, **kw: Any) -> KubeRayActuator:
    from kubernetes import client

    api = client.CustomObjectsApi(kube.api_client())
    return KubeRayActuator(app=APP, rayservice=RS, namespace=NS, api=api, rest=rest, **kw)


def _declared(kube: KubeStandIn) -> dict[str, Any]:
    cr = kube.get(*RAY)
    assert cr is not None
    app = next(a for a in yaml.safe_load(cr["spec"]["serveConfigV2"])["applications"])
    return next(d for d in app["deployments"] if d["name"] == "CompletionServer")


def _patches(kube: KubeStandIn) -> list[tuple[str, str, str]]:
    return [r for r in kube.requests if r[0] in ("PATCH", "PUT")]


def _replica_batches() -> set[int]:
    from serving.app.deploy import replica_states

    return {s.max_batch_size for s in replica_states(APP)}


def test_knobs_go_into_the_cr_and_reach_every_replica(fresh) -> None:
    kube, a, _ = fresh
    assert a.current() == K0
    fleet = a.fleet()
    cost = a.apply(Knobs(max_batch_size=4, max_concurrency=12))
    assert cost.changed and not cost.restarted
    dep = _declared(kube)
    assert dep["user_config"]["max_batch_size"] == 4 and dep["max_ongoing_requests"] == 12
    assert dep["user_config"]["max_ongoing_requests"] == 12  # the replica admits up to it
    # one conditional merge patch of the CR, nothing written to the cluster by slotune
    (patch,) = _patches(kube)
    assert patch[0] == "PATCH" and patch[2] == "application/merge-patch+json"
    assert _replica_batches() == {4}  # both replicas, the moment apply returned
    assert [r[:2] for r in a.fleet()] == [r[:2] for r in fleet]  # no restart
    assert a.current() == Knobs(max_batch_size=4, max_concurrency=12)
    # idempotent: the same knobs again write nothing
    kube.requests.clear()
    assert not a.apply(Knobs(max_batch_size=4, max_concurrency=12)).changed
    assert _patches(kube) == []


def test_a_conflicting_write_is_retried_on_a_fresh_read(fresh) -> None:
    kube, a, _ = fresh
    kube.edit(*RAY, lambda o: o["metadata"].setdefault("labels", {}).update(team="ml"))
    kube.race(2)  # the next two writes each find the CR rewritten since they read it
    a.apply(Knobs(max_batch_size=3, max_concurrency=10))
    assert len(_patches(kube)) == 3  # two 409s, then through
    cr = kube.get(*RAY)
    assert cr is not None and cr["metadata"]["labels"] == {"team": "ml"}  # theirs kept
    assert _declared(kube)["user_config"]["max_batch_size"] == 3
    assert _replica_batches() == {3}


def test_a_restart_forcing_change_is_refused_with_nothing_written(fresh) -> None:
    kube, a, _ = fresh
    before = kube.get(*RAY)
    with pytest.raises(ActuatorError, match="restart replicas.*nothing was changed"):
        _actuator(kube, a.rest, batch_knob="args.max_slots").apply(
            Knobs(max_batch_size=3, max_concurrency=16)
        )
    assert _patches(kube) == [] and kube.get(*RAY) == before


class _Quiet:
    """A window reader with calm, plentiful traffic: only drift can stop a change."""

    def begin(self) -> str:
        return "tok"

    def end(self, token: str, *, start_s: float, end_s: float) -> Observation:
        return Observation(start_s=start_s, end_s=end_s, completed=500, slo_met=500)


def _one_tick(a: KubeRayActuator, tmp_path: Path) -> list[str]:
    import json

    tmp_path.mkdir(exist_ok=True)
    state = tmp_path / "state.json"
    save_state(State(knobs=K0), state)
    run_control(
        reader=_Quiet(),
        actuator=a,
        policy=Policy(slo=SLO, batch_max=8),
        state_path=state,
        audit_path=tmp_path / "audit.jsonl",
        config=LoopConfig(interval_s=0.01, max_ticks=1),
    )
    return [json.loads(x)["reason"] for x in (tmp_path / "audit.jsonl").read_text().splitlines()]


def test_someone_elses_edit_of_the_cr_holds_then_pauses_the_controller(fresh, tmp_path) -> None:
    kube, a, operator = fresh

    def edit(o: dict[str, Any]) -> None:  # GitOps syncs another admission limit
        cfg = yaml.safe_load(o["spec"]["serveConfigV2"])
        dep = cfg["applications"][0]["deployments"][0]
        dep["max_ongoing_requests"] = dep["user_config"]["max_ongoing_requests"] = 9
        o["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)

    operator.paused.set()  # KubeRay has not submitted it yet: the two disagree
    kube.edit(*RAY, edit)
    (reason,) = _one_tick(a, tmp_path)
    assert "inconclusive, holding" in reason
    assert "declares B=2,C=9 but the cluster runs B=2,C=16" in reason
    operator.paused.clear()  # now it has: the cluster runs their knobs
    theirs = Knobs(max_batch_size=2, max_concurrency=9)
    a.rest.wait(APP, a.deployment, lambda d: a._in_effect(theirs, 2, d), timeout_s=60)
    (reason,) = _one_tick(a, tmp_path / "2")
    assert "runs B=2,C=9 but slotune last wrote B=2,C=16: changed by someone else" in reason
    assert _patches(kube) == []


def test_a_change_made_on_the_cluster_alone_holds_the_controller(fresh, tmp_path) -> None:
    from controller.backends.serve import ServeActuator

    kube, a, _ = fresh
    # someone uses Serve directly (serve deploy): the CR still says K0
    ServeActuator(app=APP, rest=a.rest).apply(Knobs(max_batch_size=5, max_concurrency=16))
    (reason,) = _one_tick(a, tmp_path)
    assert "declares B=2,C=16 but the cluster runs B=5,C=16" in reason
    assert _patches(kube) == []


def test_a_deleted_rayservice_ends_the_controller_with_a_clear_error(fresh, tmp_path) -> None:
    kube, a, _ = fresh
    kube.delete(*RAY)
    with pytest.raises(ActuatorError, match=f"RayService {NS}/{RS}: not found"):
        a.current()
    with pytest.raises(ControlFailed, match="not found"):
        _one_tick(a, tmp_path)


def _control(kube: KubeStandIn, a: KubeRayActuator, tmp_path: Path, monkeypatch) -> int:
    """``slotune control --actuator kuberay`` for one dry-run tick, its credentials from a
    kubeconfig naming the stand-in; windows scraped from an idle exporter."""
    from prometheus_client import start_http_server

    from controller.cli.main import main
    from tests.metrics.emit import Emitter

    tmp_path.mkdir(exist_ok=True)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setenv("HOSTNAME", "control-pod-1")
    em = Emitter(slo=SLO, prefix="ray_")
    em.touch(application=APP, deployment="CompletionServer", replica="r1")
    server, _ = start_http_server(0, addr="127.0.0.1", registry=em.registry)
    try:
        main(
            [
                "control", "--app", APP, "--actuator", "kuberay", "--rayservice", RS,
                "--namespace", NS, "--dashboard-url", a.rest.base_url,
                "--metrics-url", f"http://127.0.0.1:{server.server_port}/metrics",
                "--metrics-prefix", "ray_", "--metrics-profile", "slotune", "--max-batch", "8",
                "--state", str(tmp_path / "state.json"), "--interval", "1", "--max-ticks", "1",
                "--dry-run", "--quiet",
            ]
        )  # fmt: skip
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        server.shutdown()
        server.server_close()


def test_the_cli_holds_the_kubernetes_lease_and_a_second_controller_is_refused(
    fresh, tmp_path, monkeypatch, capsys
) -> None:
    import time

    kube, a, _ = fresh
    lease = ("coordination.k8s.io/v1", "leases", NS, f"slotune-control-{RS}")
    assert _control(kube, a, tmp_path, monkeypatch) == 0
    held = kube.get(*lease)
    assert held is not None and not held["spec"].get("holderIdentity")  # given up on exit
    posts = [r for r in kube.requests if r[0] == "POST" and r[1].endswith("/leases")]
    assert len(posts) == 1  # it was created, by this controller
    assert not [r for r in _patches(kube) if "rayservices" in r[1]]  # a dry run writes no knobs

    def other(o: dict[str, Any]) -> None:  # another pod holds it, renewed just now
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        o["spec"].update(holderIdentity="control-pod-2", renewTime=now, leaseDurationSeconds=300)

    kube.edit(*lease, other)
    assert _control(kube, a, tmp_path / "second", monkeypatch) == 1
    assert "held by 'control-pod-2'" in capsys.readouterr().err
    assert kube.get(*lease)["spec"]["holderIdentity"] == "control-pod-2"
