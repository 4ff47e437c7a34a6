"""deploy/k8s/ for the Prometheus Operator: the PrometheusRule is rules.yml (no drift), the
PodMonitor scrapes exactly the RayService's Ray pods, the ServiceMonitor the controller.

Run as a module to rewrite deploy/k8s/prometheusrule.yaml from deploy/prometheus/rules.yml:
``.venv/bin/python -m tests.deploy.test_prometheus_operator``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.deploy.manifests import DEPLOY, K8S, RULES, load_all, one

PROMETHEUS_RULE = K8S / "prometheusrule.yaml"


def render(rules_text: str, current: str) -> str:
    """The PrometheusRule file: its own header (up to ``spec:``) and rules.yml's groups,
    comments kept, indented under ``spec``."""
    head = current[: current.index("\nspec:\n")] + "\nspec:\n"
    lines = rules_text.splitlines()
    body = lines[lines.index("groups:") :]
    return head + "\n".join(f"  {line}" if line.strip() else "" for line in body) + "\n"


def test_prometheus_rule_groups_are_rules_yml_groups() -> None:
    rule = one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    expected = yaml.safe_load(RULES.read_text())["groups"]
    assert rule["spec"]["groups"] == expected, (
        "deploy/k8s/prometheusrule.yaml differs from deploy/prometheus/rules.yml: "
        "rewrite it with `.venv/bin/python -m tests.deploy.test_prometheus_operator`"
    )
    # comments too: the file is exactly what the module writes
    current = PROMETHEUS_RULE.read_text()
    assert render(RULES.read_text(), current) == current, "comments differ: rewrite it as above"


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels AND every matchExpression)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def ray_pods(path: Path) -> list[tuple[dict[str, str], dict[str, Any], dict[str, str]]]:
    """(labels as KubeRay sets them, the Ray container, rayStartParams) of each pod group:
    the template's labels plus the ones KubeRay adds and lets no template override
    (ray-project/kuberay, ray-operator/controllers/ray/common/pod.go, labelPod)."""
    (rs,) = load_all(path)
    cluster = rs["spec"]["rayClusterConfig"]
    groups = [("head", "headgroup", cluster["headGroupSpec"])]
    groups += [("worker", g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    out = []
    for node_type, group, spec in groups:
        template = spec["template"]
        labels = {
            **template["metadata"].get("labels", {}),
            "ray.io/node-type": node_type,
            "ray.io/cluster": f"{rs['metadata']['name']}-x7k2p",
            "ray.io/group": group,
            "ray.io/is-ray-node": "yes",
            "app.kubernetes.io/name": "kuberay",
        }
        (container,) = template["spec"]["containers"]
        out.append((labels, container, spec["rayStartParams"]))
    return out


def test_pod_monitor_scrapes_every_ray_pod_of_either_rayservice_on_its_metrics_port() -> None:
    pm = one("PodMonitor")
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    for path in (DEPLOY / "kuberay/rayservice.yaml", DEPLOY / "kuberay/rayservice-gpu.yaml"):
        for labels, container, params in ray_pods(path):
            assert matches(pm["spec"]["selector"], labels), (path.name, labels)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports[endpoint["port"]] == int(params["metrics-export-port"]) == 8080
    assert set(pm["spec"]["podTargetLabels"]) == {"ray.io/cluster", "ray.io/node-type"}


_CONTROL = ("Deployment", "slotune-control")


def _pod_labels(kind: str, name: str) -> dict[str, str]:
    return one(kind, name)["spec"]["template"]["metadata"]["labels"]


def test_pod_monitor_leaves_the_controller_and_the_canary_out() -> None:
    pm = one("PodMonitor")
    for kind, name in (("Deployment", "slotune-control"), ("Job", "slotune-canary")):
        assert not matches(pm["spec"]["selector"], _pod_labels(kind, name)), name


def test_service_monitor_reaches_the_controller_metrics_port() -> None:
    sm, svc = one("ServiceMonitor"), one("Service", "slotune-control")
    dep = one("Deployment", "slotune-control")
    assert matches(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert matches({"matchLabels": svc["spec"]["selector"]}, _pod_labels(*_CONTROL))
    assert matches(dep["spec"]["selector"], _pod_labels(*_CONTROL))
    (endpoint,) = sm["spec"]["endpoints"]
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == port["port"] == 9108
    args = container["args"]
    assert args[args.index("--metrics-port") + 1] == "9108"
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0"  # reachable from Prometheus
    assert endpoint["path"] == "/metrics"


def test_monitoring_objects_are_labelled_for_a_selector() -> None:
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        assert one(kind)["metadata"]["labels"]["app.kubernetes.io/part-of"] == "slotune"


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(render(RULES.read_text(), PROMETHEUS_RULE.read_text()))
    print(f"wrote {PROMETHEUS_RULE}")
