"""deploy/grafana/slotune-control.json: a dashboard Grafana imports (schema fields of
grafana/grafana kinds/dashboard/dashboard_kind.cue), whose every query reads metric-contract
or recorded names and is valid PromQL (promtool)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from metrics.observation import DEFAULT_SLO
from tests.deploy.manifests import (
    DEPLOY,
    NO_PROMTOOL,
    PROMTOOL,
    contract_names,
    metric_names,
    promtool,
    recorded_names,
)

DASHBOARD = DEPLOY / "grafana" / "slotune-control.json"
# Grafana's variables, as a query would see them
VARIABLES = {"$__rate_interval": "1m", "${application}": ".*", "$application": ".*"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    return _dashboard()["panels"]


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and annotation, variables filled in."""
    d = _dashboard()
    out = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in d["panels"] for t in p["targets"]
    ]
    out += [
        (f"annotation {a['name']!r}", a["expr"]) for a in d["annotations"]["list"] if "expr" in a
    ]
    filled = []
    for where, expr in out:
        for k, v in VARIABLES.items():
            expr = expr.replace(k, v)
        assert "$" not in expr, f"{where}: an unknown variable in {expr!r}"
        filled.append((where, expr))
    return filled


def test_dashboard_is_importable() -> None:
    d = _dashboard()
    assert d["schemaVersion"] == 39
    assert d["uid"] == "slotune-control" and d["title"]
    assert "id" not in d  # an import assigns it
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 < g["w"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]  # 24 columns
        # every query goes to the chosen Prometheus
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
    # no two panels overlap
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not cells & mine, p["title"]
        cells |= mine


def test_panels_cover_what_an_operator_watches() -> None:
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in _panels()}
    wanted = {
        "slotune:ttft_seconds:p99_rate1m": "TTFT",
        "slotune:tpot_seconds:p99_rate1m": "TPOT",
        "slotune:goodput_rps:rate1m": "oodput",
        "slotune:throughput_rps:rate1m": "hroughput",
        "slotune_controller_knob": "knobs",
        "slotune_controller_decisions_total": "Decisions",
        "slotune_controller_degraded": "egraded",
        "slotune_controller_metrics_stale": "tale",
        "ray_slotune_rejected_requests_total": "Rejected",
        "ray_slotune_running_requests": "unning",
        "ray_slotune_waiting_requests": "aiting",
    }
    for name, title_part in wanted.items():
        assert any(name in e and title_part in t for t, e in exprs.items()), name
    decisions = next(e for t, e in exprs.items() if "Decisions" in t)
    assert "by (action, outcome)" in decisions and "rate(" in decisions


def test_latency_panels_draw_the_slo_lines() -> None:
    for metric, slo in (("ttft", DEFAULT_SLO.ttft_p99_s), ("tpot", DEFAULT_SLO.tpot_p99_s)):
        (p,) = [p for p in _panels() if f"slotune:{metric}_seconds" in p["targets"][0]["expr"]]
        defaults = p["fieldConfig"]["defaults"]
        assert defaults["unit"] == "s"
        assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
        assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, slo]


def test_every_query_reads_contract_or_recorded_names() -> None:
    allowed = contract_names() | recorded_names()
    seen = set()
    for where, expr in queries():
        names = metric_names(expr)
        assert names, f"{where}: reads no metric"
        assert names <= allowed, f"{where}: {sorted(names - allowed)} not defined anywhere"
        seen |= names
    for v in _dashboard()["templating"]["list"]:
        if v["type"] == "query":
            (m,) = re.findall(r"label_values\((\w+),\s*\w+\)", v["query"]["query"])
            assert m in allowed, v["name"]
    assert {n for n in seen if n.startswith("slotune_controller_")}, "no controller metric"


def test_name_check_would_catch_a_typo() -> None:
    assert metric_names('sum by (le) (rate(ray_slotune_ttft_second_bucket{a="b"}[5m])) > 1e3') == {
        "ray_slotune_ttft_second_bucket"
    }
    assert "ray_slotune_ttft_second_bucket" not in contract_names()


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    rules = [{"record": f"dashboard:query_{i}", "expr": e} for i, (_, e) in enumerate(queries())]
    (tmp_path / "q.yml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    r = promtool("check", "rules", "q.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # ... and promtool does reject a broken one
    bad = {"groups": [{"name": "q", "rules": [{"record": "a:b", "expr": "sum by (x"}]}]}
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(bad))
    assert promtool("check", "rules", "bad.yml", cwd=tmp_path).returncode != 0
