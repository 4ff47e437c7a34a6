"""The stand-in Kubernetes API server, driven by the real ``kubernetes`` client over HTTP.

Each test pins one rule of the real API server the KubeRay backend relies on (see the
docstring of ``tests/fixtures/kube_standin.py`` for the sources): merge and JSON patch,
optimistic concurrency (409 on a stale resourceVersion, 422 on a PUT without one), NotFound,
AlreadyExists, 415 for strategic merge on a custom resource, Lease MicroTimes, the kubeconfig.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import (
    ApiException,
    BadRequestException,
    ConflictException,
    NotFoundException,
    ServiceException,
    UnauthorizedException,
    UnprocessableEntityException,
)

from tests.fixtures.kube_standin import KubeStandIn

NS, NAME = "serving", "slotune"
RS = ("ray.io", "v1", NS, "rayservices", NAME)  # CustomObjectsApi's leading arguments
PATH = f"/apis/ray.io/v1/namespaces/{NS}/rayservices/{NAME}"
SERVE_CONFIG = """\
applications:
  - name: llm
    import_path: serving.app:app
    deployments:
      - name: LLM
        max_ongoing_requests: 64
        user_config:
          max_batch_size: 8
"""
CONFLICT = (
    'Operation cannot be fulfilled on rayservices.ray.io "slotune": the object has been '
    "modified; please apply your changes to the latest version and try again"
)


def rayservice() -> dict[str, Any]:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"serveConfigV2": SERVE_CONFIG, "rayClusterConfig": {"rayVersion": "2.40.0"}},
        "status": {"serviceStatus": "Running"},
    }


def status_of(e: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body = json.loads(e.value.body)
    assert body["kind"] == "Status" and body["apiVersion"] == "v1"
    return body


@pytest.fixture
def kube() -> Iterator[KubeStandIn]:
    with KubeStandIn() as k:
        yield k


@pytest.fixture
def api(kube: KubeStandIn) -> Iterator[client.ApiClient]:
    c = kube.api_client()
    yield c
    c.close()


@pytest.fixture
def objects(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def test_get_and_merge_patch_round_trip_a_multiline_serve_config(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    got = objects.get_namespaced_custom_object(*RS)
    assert got["spec"]["serveConfigV2"] == SERVE_CONFIG
    meta = got["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"].endswith("Z")

    new_config = SERVE_CONFIG.replace("max_batch_size: 8", "max_batch_size: 16")
    body = {"metadata": {"resourceVersion": meta["resourceVersion"]}}
    body["spec"] = {"serveConfigV2": new_config}
    patched = objects.patch_namespaced_custom_object(*RS, body)

    assert patched["spec"]["serveConfigV2"] == new_config
    assert patched["spec"]["rayClusterConfig"] == {"rayVersion": "2.40.0"}  # merged, not replaced
    assert int(patched["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert patched["metadata"]["generation"] == 2
    assert patched["metadata"]["uid"] == meta["uid"]
    assert kube.get("ray.io/v1", "rayservices", NS, NAME) == patched
    assert objects.get_namespaced_custom_object(*RS) == patched
    assert kube.requests[1] == ("PATCH", PATH, "application/merge-patch+json")


def test_status_is_kept_and_metadata_changes_leave_generation(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    body = {"metadata": {"annotations": {"slotune/trial": "3"}}, "status": {"serviceStatus": "X"}}
    patched = objects.patch_namespaced_custom_object(*RS, body)
    assert patched["status"] == {"serviceStatus": "Running"}  # the /status subresource's
    assert patched["metadata"]["annotations"] == {"slotune/trial": "3"}
    assert patched["metadata"]["generation"] == 1

    def operator(obj: dict[str, Any]) -> None:
        obj["status"]["serviceStatus"] = "FailedToUpdateService"

    edited = kube.edit("ray.io/v1", "rayservices", NS, NAME, operator)
    assert edited["status"]["serviceStatus"] == "FailedToUpdateService"
    assert edited["metadata"]["resourceVersion"] != patched["metadata"]["resourceVersion"]
    assert objects.get_namespaced_custom_object(*RS)["status"] == edited["status"]


def test_a_patch_with_a_stale_resource_version_is_409_and_changes_nothing(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    stale = objects.get_namespaced_custom_object(*RS)["metadata"]["resourceVersion"]
    kube.edit(
        "ray.io/v1", "rayservices", NS, NAME, lambda o: o["metadata"].update(labels={"a": "b"})
    )
    before = kube.get("ray.io/v1", "rayservices", NS, NAME)

    body = {"metadata": {"resourceVersion": stale}, "spec": {"serveConfigV2": "changed"}}
    with pytest.raises(ConflictException) as e:
        objects.patch_namespaced_custom_object(*RS, body)
    assert isinstance(e.value, ApiException) and e.value.status == 409
    status = status_of(e)
    assert (status["status"], status["reason"], status["code"]) == ("Failure", "Conflict", 409)
    assert status["message"] == CONFLICT
    assert status["details"] == {"name": NAME, "group": "ray.io", "kind": "rayservices"}
    assert kube.get("ray.io/v1", "rayservices", NS, NAME) == before


def test_race_fails_exactly_one_conditional_write_and_a_fresh_read_then_succeeds(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    kube.race(1)
    conflicts = 0
    for _ in range(5):
        rv = objects.get_namespaced_custom_object(*RS)["metadata"]["resourceVersion"]
        body = {"metadata": {"resourceVersion": rv}, "spec": {"serveConfigV2": "v2"}}
        try:
            objects.patch_namespaced_custom_object(*RS, body)
            break
        except ConflictException:
            conflicts += 1
    assert conflicts == 1
    assert kube.get("ray.io/v1", "rayservices", NS, NAME)["spec"]["serveConfigV2"] == "v2"

    kube.race(1)  # a patch without resourceVersion is unconditional: the race does not touch it
    objects.patch_namespaced_custom_object(*RS, {"spec": {"serveConfigV2": "v3"}})
    assert kube.get("ray.io/v1", "rayservices", NS, NAME)["spec"]["serveConfigV2"] == "v3"


def test_replace_needs_a_resource_version_and_a_fresh_one(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    current = objects.get_namespaced_custom_object(*RS)
    unversioned = {k: v for k, v in current.items() if k != "metadata"}
    unversioned["metadata"] = {"name": NAME, "namespace": NS}
    with pytest.raises(UnprocessableEntityException) as e:
        objects.replace_namespaced_custom_object(*RS, unversioned)
    status = status_of(e)
    assert (e.value.status, status["reason"]) == (422, "Invalid")
    assert status["message"] == (
        'rayservices.ray.io "slotune" is invalid: metadata.resourceVersion: Invalid value: 0: '
        "must be specified for an update"
    )
    assert status["details"]["causes"][0]["field"] == "metadata.resourceVersion"

    current["spec"]["serveConfigV2"] = "replaced"
    replaced = objects.replace_namespaced_custom_object(*RS, current)
    assert replaced["spec"]["serveConfigV2"] == "replaced"
    assert replaced["metadata"]["generation"] == 2
    assert kube.requests[-1][:2] == ("PUT", PATH)
    with pytest.raises(ConflictException) as e:  # current still holds the old version
        objects.replace_namespaced_custom_object(*RS, current)
    assert status_of(e)["message"] == CONFLICT


def test_a_missing_object_is_404_not_found(objects: client.CustomObjectsApi) -> None:
    with pytest.raises(NotFoundException) as e:
        objects.get_namespaced_custom_object("ray.io", "v1", NS, "rayservices", "nope")
    status = status_of(e)
    assert (e.value.status, status["reason"]) == (404, "NotFound")
    assert status["message"] == 'rayservices.ray.io "nope" not found'
    with pytest.raises(NotFoundException):
        objects.patch_namespaced_custom_object("ray.io", "v1", NS, "rayservices", "nope", {})
    with pytest.raises(NotFoundException) as e:  # a type the server does not serve
        objects.get_namespaced_custom_object("ray.io", "v1", NS, "rayclusters", "x")
    assert status_of(e)["message"] == "the server could not find the requested resource"


def test_json_patch_applies_and_a_failed_test_op_is_422(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    rv = objects.get_namespaced_custom_object(*RS)["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "replace", "path": "/spec/serveConfigV2", "value": "json-patched"},
        {"op": "add", "path": "/metadata/annotations", "value": {"a/b": "c"}},
        {"op": "remove", "path": "/spec/rayClusterConfig"},
    ]
    jp = "application/json-patch+json"
    patched = objects.patch_namespaced_custom_object(*RS, ops, _content_type=jp)
    assert patched["spec"] == {"serveConfigV2": "json-patched"}
    assert patched["metadata"]["annotations"] == {"a/b": "c"}
    assert kube.requests[-1] == ("PATCH", PATH, jp)

    before = kube.get("ray.io/v1", "rayservices", NS, NAME)
    failing = [
        {"op": "test", "path": "/spec/serveConfigV2", "value": "something else"},
        {"op": "replace", "path": "/spec/serveConfigV2", "value": "never"},
    ]
    with pytest.raises(UnprocessableEntityException) as e:  # patch.go: 422, not 409
        objects.patch_namespaced_custom_object(*RS, failing, _content_type=jp)
    assert status_of(e)["reason"] == "Invalid"
    with pytest.raises(UnprocessableEntityException):  # replace needs an existing path
        objects.patch_namespaced_custom_object(
            *RS, [{"op": "replace", "path": "/spec/nope", "value": 1}], _content_type=jp
        )
    assert kube.get("ray.io/v1", "rayservices", NS, NAME) == before


def test_strategic_merge_patch_on_a_custom_resource_is_415(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    smp = "application/strategic-merge-patch+json"
    with pytest.raises(ApiException) as e:
        objects.patch_namespaced_custom_object(*RS, {"spec": {"x": 1}}, _content_type=smp)
    status = status_of(e)
    assert (e.value.status, status["reason"]) == (415, "UnsupportedMediaType")
    assert status["message"] == (
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
    )
    assert "x" not in kube.get("ray.io/v1", "rayservices", NS, NAME)["spec"]


def lease(holder: str, at: datetime) -> client.V1Lease:
    spec = client.V1LeaseSpec(
        holder_identity=holder,
        lease_duration_seconds=15,
        acquire_time=at,
        renew_time=at,
        lease_transitions=0,
    )
    return client.V1Lease(metadata=client.V1ObjectMeta(name="slotune-leader"), spec=spec)


def test_lease_create_read_replace_conflict_already_exists_and_delete(
    kube: KubeStandIn, api: client.ApiClient
) -> None:
    leases = client.CoordinationV1Api(api)
    at = datetime(2026, 12, 5, 1, 2, 3, 250_000, tzinfo=timezone.utc)
    created = leases.create_namespaced_lease(NS, lease("pod-a", at))
    assert created.metadata.resource_version and created.metadata.uid
    stored = kube.get("coordination.k8s.io/v1", "leases", NS, "slotune-leader")
    assert stored["spec"]["renewTime"] == "2026-12-05T01:02:03.250000Z"  # MicroTime, UTC

    read = leases.read_namespaced_lease("slotune-leader", NS)
    assert isinstance(read, client.V1Lease) and isinstance(read.spec, client.V1LeaseSpec)
    assert (read.spec.holder_identity, read.spec.lease_duration_seconds) == ("pod-a", 15)
    assert read.spec.acquire_time == at and read.spec.renew_time == at
    assert read.spec.lease_transitions == 0

    read.spec.renew_time = datetime(2026, 12, 5, 1, 2, 13, 500_000, tzinfo=timezone.utc)
    renewed = leases.replace_namespaced_lease("slotune-leader", NS, read)
    assert renewed.spec.renew_time == read.spec.renew_time
    assert renewed.metadata.resource_version != read.metadata.resource_version

    read.spec.holder_identity = "pod-b"  # read still holds the old version: pod-b lost the race
    with pytest.raises(ConflictException) as e:
        leases.replace_namespaced_lease("slotune-leader", NS, read)
    assert status_of(e)["message"] == (
        'Operation cannot be fulfilled on leases.coordination.k8s.io "slotune-leader": the '
        "object has been modified; please apply your changes to the latest version and try again"
    )
    with pytest.raises(ConflictException) as e:
        leases.create_namespaced_lease(NS, lease("pod-b", at))
    status = status_of(e)
    assert status["reason"] == "AlreadyExists"
    assert status["message"] == 'leases.coordination.k8s.io "slotune-leader" already exists'
    assert leases.read_namespaced_lease("slotune-leader", NS).spec.holder_identity == "pod-a"

    done = leases.delete_namespaced_lease("slotune-leader", NS)
    done = done if isinstance(done, dict) else api.sanitize_for_serialization(done)
    assert (done["kind"], done["status"]) == ("Status", "Success")
    assert kube.get("coordination.k8s.io/v1", "leases", NS, "slotune-leader") is None
    with pytest.raises(NotFoundException):
        leases.delete_namespaced_lease("slotune-leader", NS)


def test_a_whole_second_lease_time_is_refused_as_the_real_server_refuses_it(
    kube: KubeStandIn, api: client.ApiClient
) -> None:
    # the client writes datetime.isoformat(): no fraction for a whole second, and MicroTime
    # parses with six fractional digits exactly
    leases = client.CoordinationV1Api(api)
    whole = datetime(2026, 12, 5, 1, 2, 3, tzinfo=timezone.utc)
    with pytest.raises(BadRequestException) as e:
        leases.create_namespaced_lease(NS, lease("pod-a", whole))
    assert '"2026-12-05T01:02:03+00:00"' in status_of(e)["message"]
    assert kube.get("coordination.k8s.io/v1", "leases", NS, "slotune-leader") is None

    objects = client.CustomObjectsApi(api)  # a dict body keeps the string as written
    body = api.sanitize_for_serialization(lease("pod-a", whole))
    body["spec"]["acquireTime"] = body["spec"]["renewTime"] = "2026-12-05T01:02:03.000000Z"
    objects.create_namespaced_custom_object("coordination.k8s.io", "v1", NS, "leases", body)
    read = client.CoordinationV1Api(api).read_namespaced_lease("slotune-leader", NS)
    assert read.spec.renew_time == whole


def test_fail_next_answers_the_status_then_recovers_and_requests_are_logged(
    kube: KubeStandIn, objects: client.CustomObjectsApi
) -> None:
    kube.put(rayservice())
    kube.fail_next(2, status=503)
    for _ in range(2):
        with pytest.raises(ServiceException) as e:
            objects.get_namespaced_custom_object(*RS)
        assert (e.value.status, status_of(e)["reason"]) == (503, "ServiceUnavailable")
    assert objects.get_namespaced_custom_object(*RS)["metadata"]["name"] == NAME
    assert kube.requests == [("GET", PATH, "")] * 3


def test_load_kube_config_from_the_written_kubeconfig(kube: KubeStandIn, tmp_path: Path) -> None:
    kube.put(rayservice())
    path = kube.kubeconfig(tmp_path / "config")
    previous = client.Configuration.get_default_copy()
    try:
        config.load_kube_config(config_file=str(path))
        got = client.CustomObjectsApi().get_namespaced_custom_object(*RS)
    finally:
        client.Configuration.set_default(previous)
    assert got["spec"]["serveConfigV2"] == SERVE_CONFIG

    anonymous = client.ApiClient(client.Configuration(host=kube.url))  # no token: 401
    with pytest.raises(UnauthorizedException):
        client.CustomObjectsApi(anonymous).get_namespaced_custom_object(*RS)
    anonymous.close()


def test_it_binds_loopback_and_stops_cleanly() -> None:
    with KubeStandIn() as k:
        assert k.url.startswith("http://127.0.0.1:")
        port = int(k.url.rsplit(":", 1)[1])
        k.put(rayservice())
        api = k.api_client()
        client.CustomObjectsApi(api).get_namespaced_custom_object(*RS)  # a kept-alive connection
    deadline = time.monotonic() + 5
    while any("process_request" in t.name for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a request thread outlived the server"
        time.sleep(0.05)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    api.close()
