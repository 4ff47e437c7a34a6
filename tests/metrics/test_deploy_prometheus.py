"""deploy/prometheus/: the scrape config and rules pass promtool, and the rules do what they say."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from metrics import names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="the 'promtool' binary is missing (apt-get install prometheus)"
)


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_config_is_valid() -> None:
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_are_valid() -> None:
    r = promtool("check", "rules", "rules.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_unit_tests_pass() -> None:
    r = promtool("test", "rules", "rules_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    for f in ("rules.yml", "rules_test.yml"):
        shutil.copy(DEPLOY / f, tmp_path / f)
    rules = tmp_path / "rules.yml"
    text = rules.read_text()
    assert "slotune:ttft_seconds:p99_rate1m > 1.0" in text
    rules.write_text(
        text.replace(
            "slotune:ttft_seconds:p99_rate1m > 1.0", "slotune:ttft_seconds:p99_rate1m > 2.0"
        )
    )
    r = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert r.returncode != 0


def test_rules_read_the_contract_names() -> None:
    text = (DEPLOY / "rules.yml").read_text()
    for h in (names.TTFT_SECONDS, names.TPOT_SECONDS):
        assert names.histogram_samples(h)[0] in text
    for c in (names.REQUESTS_TOTAL, names.REJECTED_TOTAL):
        assert names.counter_samples(c)[0] in text
    assert names.CONTROLLER_STALE in text
