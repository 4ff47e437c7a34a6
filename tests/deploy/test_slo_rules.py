"""The SLO-burn and controller alerts of deploy/prometheus/rules.yml: their promtool unit
tests (rules_test.yml) fail when a threshold, a window or a guard is wrong, and every rule
reads names of the metric contract."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    NO_PROMTOOL,
    PROMTOOL,
    RULES,
    contract_names,
    metric_names,
    promtool,
    recorded_names,
    rule_groups,
)

TESTS = RULES.parent / "rules_test.yml"
BURN = ("SlotuneErrorBudgetBurnFast", "SlotuneErrorBudgetBurnMedium", "SlotuneErrorBudgetBurnSlow")
WINDOWS = ("5m", "30m", "1h", "6h", "3d")


def _rules() -> dict[str, dict]:
    return {r.get("alert") or r["record"]: r for g in rule_groups() for r in g["rules"]}


def test_burn_alerts_pair_a_long_and_a_short_window_at_the_workbook_rates() -> None:
    rules = _rules()
    expected = {  # Google SRE workbook, "Alerting on SLOs", table of burn rates
        "SlotuneErrorBudgetBurnFast": ("14.4", "1h", "5m", "page"),
        "SlotuneErrorBudgetBurnMedium": ("6", "6h", "30m", "page"),
        "SlotuneErrorBudgetBurnSlow": ("1", "3d", "6h", "ticket"),
    }
    for alert, (rate, long, short, severity) in expected.items():
        r = rules[alert]
        expr = " ".join(r["expr"].split())
        assert expr == (
            f"slotune:slo_errors_per_request:ratio_rate{long} > {rate} * 0.01 and "
            f"slotune:slo_errors_per_request:ratio_rate{short} > {rate} * 0.01"
        ), alert
        assert r["labels"] == {"severity": severity, "long_window": long}
        assert "for" not in r  # the short window is what keeps it from flapping
    for w in WINDOWS:
        assert f"slotune:slo_errors_per_request:ratio_rate{w}" in rules


def test_error_ratios_are_misses_over_completions_per_window() -> None:
    rules = _rules()
    for w in WINDOWS:
        expr = " ".join(rules[f"slotune:slo_errors_per_request:ratio_rate{w}"]["expr"].split())
        by = "sum by (application, deployment)"
        assert expr == (
            f'( {by} (rate(ray_slotune_requests_total{{slo_met="false"}}[{w}])) or '
            f"0 * {by} (rate(ray_slotune_requests_total[{w}])) ) / "
            f"{by} (rate(ray_slotune_requests_total[{w}]))"
        )


def test_every_rule_reads_contract_or_recorded_names() -> None:
    allowed = contract_names() | recorded_names()
    for g in rule_groups():
        for r in g["rules"]:
            unknown = metric_names(r["expr"]) - allowed
            assert not unknown, f"{r.get('alert') or r['record']}: {sorted(unknown)}"


def _subset(tmp_path: Path, alerts: tuple[str, ...], records: tuple[str, ...]) -> None:
    """rules.yml, and the test groups of rules_test.yml that check these names, in tmp_path."""
    shutil.copy(RULES, tmp_path / "rules.yml")
    doc = yaml.safe_load(TESTS.read_text())

    def checks(group: dict) -> bool:
        seen = {t["alertname"] for t in group.get("alert_rule_test", [])}
        exprs = " ".join(t["expr"] for t in group.get("promql_expr_test", []))
        return bool(seen & set(alerts)) or any(r in exprs for r in records)

    doc["tests"] = [g for g in doc["tests"] if checks(g)]
    assert doc["tests"], f"no unit test checks {alerts or records}"
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _mutate(tmp_path: Path, old: str, new: str) -> None:
    rules = tmp_path / "rules.yml"
    text = rules.read_text()
    assert old in text, old
    rules.write_text(text.replace(old, new))


# (what is wrong, text in rules.yml, its replacement, the alerts whose tests must catch it)
MUTATIONS = [
    ("fast burn rate too high", "14.4 * 0.01", "36 * 0.01", BURN[:1]),
    ("fast burn rate too low", "14.4 * 0.01", "7 * 0.01", BURN[:1]),
    ("medium burn rate too high", "> 6 * 0.01", "> 14.4 * 0.01", BURN[1:2]),
    ("medium burn rate too low", "> 6 * 0.01", "> 3 * 0.01", BURN[1:2]),
    ("slow burn rate too high", "> 1 * 0.01", "> 2 * 0.01", BURN[2:]),
    ("budget of a 99.9% SLO", "> 1 * 0.01", "> 0.25 * 0.01", BURN[2:]),
    (
        "fast page without its short window",
        "\n            and slotune:slo_errors_per_request:ratio_rate5m > 14.4 * 0.01",
        "",
        BURN[:1],
    ),
    (
        "ticket without its short window",
        "\n            and slotune:slo_errors_per_request:ratio_rate6h > 1 * 0.01",
        "",
        BURN[2:],
    ),
    (
        "no decisions without the absent() guard",
        "\n            or absent(slotune_controller_decisions_total)",
        "",
        ("SlotuneControllerNoDecisions",),
    ),
    (
        "degraded alert on the wrong value",
        "slotune_controller_degraded == 1",
        "slotune_controller_degraded == 0",
        ("SlotuneControllerDegraded",),
    ),
]


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
@pytest.mark.parametrize(
    ("old", "new", "alerts"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS]
)
def test_rules_unit_tests_catch_a_wrong_burn_alert(
    tmp_path: Path, old: str, new: str, alerts: tuple[str, ...]
) -> None:
    _subset(tmp_path, alerts, ())
    _mutate(tmp_path, old, new)
    assert promtool("check", "rules", "rules.yml", cwd=tmp_path).returncode == 0
    r = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert r.returncode != 0, f"{old!r} -> {new!r} went unnoticed"
    # ... by an alert's test, not by a file promtool could not read
    assert any(f"alertname: {a}" in r.stdout + r.stderr for a in alerts), r.stdout + r.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_rules_unit_tests_catch_a_ratio_that_is_absent_not_zero(tmp_path: Path) -> None:
    # Without the `or 0 * ...` branch a deployment that never missed has no ratio at all
    # (no slo_met="false" series yet), and a dashboard shows nothing instead of 0.
    _subset(tmp_path, (), ("slotune:slo_errors_per_request:ratio_rate5m",))
    _mutate(tmp_path, "0 * sum by", "sum by")  # the fallback: all completions, not 0
    assert promtool("check", "rules", "rules.yml", cwd=tmp_path).returncode == 0
    r = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert r.returncode != 0
    assert "slotune:slo_errors_per_request:ratio_rate5m" in r.stdout + r.stderr
