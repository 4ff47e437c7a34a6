from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from controller.cli import observe as cli
from metrics.observation import Slo
from tests.fixtures.prometheus_server import TextEndpoint, free_port
from tests.metrics.emit import Emitter

app = typer.Typer()
cli.register(app)


@app.callback()
def _root() -> None:  # a callback keeps "observe" a named subcommand
    pass


def test_observe_prints_json_for_a_scrape() -> None:
    em = Emitter(slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1))
    em.touch(application="a", deployment="LLM", replica="r")
    ep = TextEndpoint(em.text())
    try:
        r = CliRunner().invoke(
            app,
            [
                "observe",
                *(ep.url, "--window", "0.1", "--json", "-l", "deployment=LLM"),
                *("--slo-ttft-ms", "800", "--slo-tpot-ms", "50"),
            ],
        )
    finally:
        ep.close()
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["completed"] == 0 and d["stale"] is False and d["feasible"] is False
    assert d["ttft_verdict"]["verdict"] == "insufficient"
    assert d["ttft_verdict"]["threshold_s"] == 0.8 and d["tpot_verdict"]["threshold_s"] == 0.05
    assert d["window_s"] > 0


def test_observe_reports_unreachable_in_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    r = CliRunner().invoke(app, ["observe", url, "--window", "0.1"])
    assert r.exit_code == 1
    assert "metrics unavailable" in r.output and "Traceback" not in r.output


def test_observe_rejects_bad_selector() -> None:
    r = CliRunner().invoke(app, ["observe", "http://127.0.0.1:1/metrics", "-l", "nolabel"])
    assert r.exit_code == 2 and "label=value" in r.output


def test_observe_takes_the_slo_in_ms_like_every_command() -> None:
    r = CliRunner().invoke(app, ["observe", "http://127.0.0.1:1/metrics", "--slo-tpot-ms", "0"])
    assert r.exit_code == 2 and "--slo-tpot-ms 0" in r.output
    r = CliRunner().invoke(app, ["observe", "http://127.0.0.1:1/metrics", "--ttft-slo", "1"])
    assert r.exit_code == 2
