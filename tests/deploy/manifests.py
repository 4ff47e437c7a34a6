"""What the deploy/ tests share: the files, their objects, and the metric names PromQL may use."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from metrics import names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "rules.yml"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "the 'promtool' binary is missing (apt-get install prometheus)"


def load_all(path: Path) -> list[dict[str, Any]]:
    """The objects of a (multi-document) YAML file, empty documents left out."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    """Every object of the Kubernetes manifests: deploy/k8s/ and the RayServices."""
    paths = sorted(K8S.glob("*.yaml")) + sorted((DEPLOY / "kuberay").glob("*.yaml"))
    return [(p, d) for p in paths for d in load_all(p)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) in deploy/k8s/."""
    found = [
        d
        for _, d in k8s_objects()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} objects of kind {kind} named {name}"
    return found[0]


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]


def recorded_names() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def contract_names() -> set[str]:
    """Series names PromQL may read: the server's metrics as Ray exports them (ray_ prefix,
    sample names), and the controller's own as it serves them (no prefix)."""
    out: set[str] = set()
    for h in names.HISTOGRAMS:
        out.update(names.histogram_samples(h))
    for c in names.COUNTERS:
        out.add(names.counter_samples(c)[0])
    for g in names.GAUGES:
        out.add(names.exported(g))
    out.update(
        v
        for k, v in vars(names).items()
        if k.startswith("CONTROLLER_") and isinstance(v, str) and v.startswith(names.PREFIX)
    )
    return out


_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (not functions, labels or keywords)."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = _GROUPING.sub(" ", s)
    s = _NUMBER.sub(" ", s)
    found = set()
    for m in _IDENT.finditer(s):
        after = s[m.end() :].lstrip()
        if after.startswith("(") or m.group() in _KEYWORDS:
            continue  # a function call, or an operator
        found.add(m.group())
    return found


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
