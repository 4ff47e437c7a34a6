"""One controller per deployment on Kubernetes: the coordination.k8s.io Lease, through the
real ``kubernetes`` client against the stand-in API server (no cluster runs here)."""

from __future__ import annotations

import pytest

from controller.control.kube_lease import KubeLease, LeaseLost, lease_name
from controller.control.store import LeaseHeld
from tests.fixtures.kube_standin import KubeStandIn

NS = "serving"
NAME = lease_name("slotune")


class Clock:
    def __init__(self) -> None:
        self.t = 1_790_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def kube():
    with KubeStandIn() as k:
        yield k


def _lease(kube: KubeStandIn, who: str, clock: Clock, duration_s: float = 300) -> KubeLease:
    from kubernetes import client

    api = client.CustomObjectsApi(kube.api_client())
    return KubeLease(NAME, NS, duration_s=duration_s, identity=who, api=api, clock=clock)


def _stored(kube: KubeStandIn) -> dict:
    obj = kube.get("coordination.k8s.io/v1", "leases", NS, NAME)
    assert obj is not None
    return obj["spec"]


def test_the_first_controller_creates_the_lease_and_a_second_is_refused(kube) -> None:
    clock = Clock()
    with _lease(kube, "pod-a", clock):
        spec = _stored(kube)
        assert spec["holderIdentity"] == "pod-a" and spec["leaseDurationSeconds"] == 300
        clock.t += 100
        with pytest.raises(LeaseHeld, match="held by 'pod-a'.*expires in 200 s"):
            _lease(kube, "pod-b", clock).acquire()
    # released on exit: the next one takes it at once, a new holder
    after = _stored(kube)
    assert not after.get("holderIdentity")
    with _lease(kube, "pod-b", clock):
        spec = _stored(kube)
        assert spec["holderIdentity"] == "pod-b" and spec["leaseTransitions"] == 1


def test_an_expired_lease_is_taken_over_and_the_old_holder_stops(kube) -> None:
    clock = Clock()
    a = _lease(kube, "pod-a", clock)
    a.acquire()  # then SIGKILLed: never released
    clock.t += 299
    with pytest.raises(LeaseHeld):
        _lease(kube, "pod-b", clock).acquire()
    clock.t += 2  # past renewTime + leaseDurationSeconds
    b = _lease(kube, "pod-b", clock)
    b.acquire()
    assert _stored(kube)["holderIdentity"] == "pod-b"
    with pytest.raises(LeaseLost, match="held by 'pod-b'"):
        a.renew()  # the old holder, back from a pause, must not act again
    b.renew()


def test_a_pod_restarted_in_place_takes_its_own_lease_back_at_once(kube) -> None:
    clock = Clock()
    _lease(kube, "pod-a", clock).acquire()  # killed, not released
    clock.t += 10
    again = _lease(kube, "pod-a", clock)
    again.acquire()
    spec = _stored(kube)
    assert spec["holderIdentity"] == "pod-a" and spec.get("leaseTransitions", 0) == 0


def test_renewing_moves_the_renew_time_only(kube) -> None:
    clock = Clock()
    a = _lease(kube, "pod-a", clock)
    a.acquire()
    first = _stored(kube)
    clock.t += 60
    a.renew()
    second = _stored(kube)
    assert second["acquireTime"] == first["acquireTime"]
    assert second["renewTime"] != first["renewTime"]
    clock.t += 250  # 310 s after acquiring, 250 s after the renewal: still held
    with pytest.raises(LeaseHeld):
        _lease(kube, "pod-b", clock).acquire()


def test_two_controllers_racing_for_an_expired_lease_one_wins(kube) -> None:
    clock = Clock()
    _lease(kube, "pod-a", clock).acquire()
    clock.t += 1000
    kube.race(1)  # another controller rewrites the Lease between our read and our write
    with pytest.raises(LeaseHeld, match="taken by another controller"):
        _lease(kube, "pod-b", clock).acquire()


def test_an_unreachable_api_server_is_an_error_not_a_lease(kube) -> None:
    from controller.backends.actuator import ActuatorUnavailable

    kube.fail_next(1, status=503)
    with pytest.raises(ActuatorUnavailable, match="Lease serving/slotune-control-slotune: 503"):
        _lease(kube, "pod-a", Clock()).acquire()
    assert kube.get("coordination.k8s.io/v1", "leases", NS, NAME) is None


def test_an_api_server_away_holds_ticks_and_stops_once_the_lease_may_have_expired(kube) -> None:
    clock = Clock()
    a = _lease(kube, "pod-a", clock, duration_s=300)
    a.acquire()
    clock.t += 60
    kube.fail_next(1, status=503)
    assert "could not be renewed" in a.renew()  # still ours: this tick only holds
    clock.t += 60
    assert a.renew() == ""  # back: renewed, the clock restarts from now
    clock.t += 250
    kube.fail_next(1, status=503)
    assert "not acting this tick" in a.renew()  # 250 s since the last renewal
    clock.t += 60
    kube.fail_next(1, status=503)
    with pytest.raises(LeaseLost, match="not renewed for 310 s"):
        a.renew()  # past the duration: another controller may hold it now
