"""deploy/k8s/ and deploy/kuberay/, statically: every object is well formed and of its
Kubernetes type, references resolve, the RBAC is exactly what the controller's Kubernetes
calls need, and the pods run locked down. (No cluster runs on these machines.)"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import ROOT, k8s_objects, one

DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# The controller's command line (docs/deploy.md), verbatim.
CONTROL_ARGS = (
    "control --app slotune --actuator kuberay --rayservice slotune --namespace $(POD_NAMESPACE) "
    "--dashboard-url http://slotune-head-svc:8265 "
    "--prometheus-url http://prometheus-operated.monitoring.svc:9090 --metrics-prefix ray_ "
    "--curve /etc/slotune/curve.json --state /var/lib/slotune/control.json "
    "--metrics-port 9108 --metrics-host 0.0.0.0 --interval 60"
).split()


def test_every_object_is_named_and_namespace_free() -> None:
    objects = k8s_objects()
    assert len(objects) >= 14
    seen = set()
    for path, d in objects:
        where = f"{path.name}: {d.get('kind')}"
        assert d.get("apiVersion") and d.get("kind"), where
        name = d.get("metadata", {}).get("name")
        assert name and DNS1123.fullmatch(name), where
        # one namespace for all, chosen at apply time (kubectl apply -n NS)
        assert "namespace" not in d["metadata"], where
        if path.parent.name == "k8s":  # the RayService variants share a name on purpose
            assert (d["kind"], name) not in seen, where
            seen.add((d["kind"], name))


def _model(type_name: str) -> Any:
    client = pytest.importorskip("kubernetes.client", reason="the kubernetes client is missing")
    return getattr(client, type_name)


def _check(value: Any, type_name: str, where: str) -> None:
    """``value`` has only fields of the Kubernetes type ``type_name`` (the kubernetes
    client's models, generated from the API's OpenAPI), recursively."""
    if type_name.startswith("List["):
        assert isinstance(value, list), where
        for i, v in enumerate(value):
            _check(v, type_name[5:-1], f"{where}[{i}]")
    elif type_name.startswith("Dict["):
        assert isinstance(value, dict), where
        inner = type_name[5:-1].split(", ", 1)[1]
        for k, v in value.items():
            _check(v, inner, f"{where}.{k}")
    elif type_name in ("str", "int", "bool", "float", "object", "datetime"):
        ok = {"str": str, "int": int, "bool": bool, "float": (int, float)}.get(type_name, object)
        assert isinstance(value, ok), f"{where}: {value!r} is not {type_name}"
    else:
        model = _model(type_name)
        assert isinstance(value, dict), f"{where}: {value!r} is not a {type_name}"
        fields = {v: k for k, v in model.attribute_map.items()}
        for k, v in value.items():
            assert k in fields, f"{where}: {type_name} has no field {k!r}"
            _check(v, model.openapi_types[fields[k]], f"{where}.{k}")


CORE_TYPES = {
    "ServiceAccount": "V1ServiceAccount",
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "PersistentVolumeClaim": "V1PersistentVolumeClaim",
    "Deployment": "V1Deployment",
    "Service": "V1Service",
    "Job": "V1Job",
}


def test_core_objects_have_only_fields_of_their_kubernetes_types() -> None:
    checked = 0
    for path, d in k8s_objects():
        if d["kind"] in CORE_TYPES:
            _check(d, CORE_TYPES[d["kind"]], f"{path.name}:{d['kind']}")
            checked += 1
        elif d["kind"] == "RayService":  # its pod templates (the CRD embeds PodTemplateSpec)
            cluster = d["spec"]["rayClusterConfig"]
            for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
                _check(g["template"], "V1PodTemplateSpec", f"{path.name}:template")
    assert checked == len(CORE_TYPES) + 3  # the canary's ServiceAccount, Role and binding too


def test_checker_rejects_a_misspelt_field() -> None:
    dep = one("Deployment", "slotune-control")
    bad = {**dep, "spec": {**dep["spec"], "replica": 1}}
    with pytest.raises(AssertionError, match="has no field 'replica'"):
        _check(bad, "V1Deployment", "bad")


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, one(kind, name)["spec"]["template"]["spec"])
        for kind, name in (("Deployment", "slotune-control"), ("Job", "slotune-canary"))
    ]


def test_service_accounts_and_bindings_resolve() -> None:
    for _, pod in _pod_specs():
        one("ServiceAccount", pod["serviceAccountName"])
    for _, b in k8s_objects():
        if b["kind"] == "RoleBinding":
            assert b["roleRef"]["kind"] == "Role"
            one("Role", b["roleRef"]["name"])
            for s in b["subjects"]:
                assert s["kind"] == "ServiceAccount"
                one("ServiceAccount", s["name"])


def _rules(role: str) -> set[tuple[str, str, str | None, str]]:
    out = set()
    for r in one("Role", role)["rules"]:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    for n in r.get("resourceNames") or [None]:
                        out.add((g, res, n, v))
    assert not any("*" in str(x) for rule in out for x in rule), "no wildcards"
    return out


VERB = {"get": "get", "read": "get", "list": "list", "watch": "watch", "create": "create"}
VERB |= {"replace": "update", "patch": "patch", "delete": "delete"}
_CALL = re.compile(r"\b(get|read|list|watch|create|replace|patch|delete)_namespaced_(\w+)")


def _calls(module: Any) -> set[str]:
    """The verbs a module's Kubernetes calls need: its own calls, and a get for each read
    through controller.backends.kube.read_object."""
    source = inspect.getsource(module)
    verbs = {VERB[m.group(1)] for m in _CALL.finditer(source)}
    return verbs | ({"get"} if "read_object(" in source else set())


def test_controller_rbac_is_exactly_its_kubernetes_calls() -> None:
    from controller.backends import kuberay
    from controller.control import kube_lease

    # every call of the Kubernetes API in controller/ is in these two modules, or in the
    # one read they share (kube.read_object: a get)
    callers = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "controller").rglob("*.py")
        if _CALL.search(p.read_text())
    }
    assert callers == {
        "controller/backends/kube.py",
        "controller/backends/kuberay.py",
        "controller/control/kube_lease.py",
    }
    assert {
        m.group(1) for m in _CALL.finditer((ROOT / "controller/backends/kube.py").read_text())
    } == {"get"}
    args = one("Deployment", "slotune-control")["spec"]["template"]["spec"]["containers"][0]
    rayservice = args["args"][args["args"].index("--rayservice") + 1]
    lease = kube_lease.lease_name(rayservice)
    assert lease == "slotune-control-slotune"
    need = {(kuberay.GROUP, kuberay.PLURAL, rayservice, v) for v in _calls(kuberay)}
    for v in _calls(kube_lease):
        # a create cannot be limited by name (RBAC matches the URL's name, a create has none)
        need.add((kube_lease.GROUP, kube_lease.PLURAL, None if v == "create" else lease, v))
    assert need == {
        ("ray.io", "rayservices", "slotune", "get"),
        ("ray.io", "rayservices", "slotune", "patch"),
        ("coordination.k8s.io", "leases", "slotune-control-slotune", "get"),
        ("coordination.k8s.io", "leases", "slotune-control-slotune", "update"),
        ("coordination.k8s.io", "leases", None, "create"),
    }
    assert _rules("slotune-control") == need


def test_canary_rbac_only_publishes_its_configmap() -> None:
    assert _rules("slotune-canary") == {
        ("", "configmaps", "slotune-curve", "get"),
        ("", "configmaps", "slotune-curve", "patch"),
        ("", "configmaps", None, "create"),
    }
    pod = one("Job", "slotune-canary")["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken", True)  # kubectl applies with its token


def test_controller_deployment_runs_one_controller_with_the_documented_command() -> None:
    dep = one("Deployment", "slotune-control")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # never two pods at once
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == CONTROL_ARGS
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert "HOSTNAME" not in env  # the pod's name, set by Kubernetes: the Lease holder
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    curve = Path(c["args"][c["args"].index("--curve") + 1])
    cm = volumes[mounts[str(curve.parent)]["name"]]["configMap"]
    assert cm["name"] == "slotune-curve"
    assert {"key": "curve.json", "path": curve.name} in cm["items"]
    state = Path(c["args"][c["args"].index("--state") + 1])
    claim = volumes[mounts[str(state.parent)]["name"]]["persistentVolumeClaim"]["claimName"]
    pvc = one("PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not mounts[str(state.parent)].get("readOnly")
    assert env["HOME"]["value"] in mounts  # writable, the root filesystem is not


def test_canary_job_runs_once_and_publishes_what_the_controller_mounts() -> None:
    job = one("Job", "slotune-canary")
    spec = job["spec"]
    assert spec["backoffLimit"] == 0
    assert 0 < spec["activeDeadlineSeconds"] <= 4 * 3600
    assert spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (tune,), (publish,) = pod["initContainers"], pod["containers"]
    assert publish["command"] == ["kubectl"]
    assert publish["args"][:2] == ["apply", "--server-side"]
    applied = publish["args"][publish["args"].index("-f") + 1]
    out = next(e["value"] for e in tune["env"] if e["name"] == "OUT_DIR")
    assert applied == f"{out}/slotune-curve.yaml"
    assert "name: slotune-curve" in tune["args"][0]
    # `slotune tune` leaves its deadline room: --time-budget is under activeDeadlineSeconds
    budget = float(re.search(r"--time-budget (\d+)", tune["args"][0]).group(1))
    assert budget < spec["activeDeadlineSeconds"] * 0.75


def test_every_container_is_locked_down_and_sized() -> None:
    for name, pod in _pod_specs():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{c['name']}"
            csc = c["securityContext"]
            assert csc["readOnlyRootFilesystem"] is True, where
            assert csc["allowPrivilegeEscalation"] is False, where
            assert csc["capabilities"] == {"drop": ["ALL"]}, where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), where
            assert c["imagePullPolicy"] == "IfNotPresent", where
            writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
            assert "/tmp" in writable, where  # the one writable scratch place
