"""ScrapeSource and PromQLSource agree on the same data, with a real Prometheus scraping a
prometheus_client exporter that stands in for Ray's metrics export port."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import start_http_server

from metrics import names
from metrics.build import observation_from_requests
from metrics.observation import Observation, Slo, Verdict
from metrics.sources import PromQLSource, ScrapeSource
from tests.fixtures.prometheus_server import PrometheusServer
from tests.metrics.emit import Emitter, latencies

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
R1 = {"application": "default", "deployment": "LLM", "replica": "r1"}
R2 = {"application": "default", "deployment": "LLM", "replica": "r2"}
OTHER = {"application": "default", "deployment": "Other", "replica": "o1"}
SEL = {"deployment": "LLM"}


@pytest.fixture(scope="module")
def scenario(prometheus_server: PrometheusServer) -> Iterator[dict[str, object]]:
    em = Emitter(slo=SLO, prefix="ray_")
    for lab in (R1, R2, OTHER):
        em.touch(**lab)
    for lab, running, waiting in ((R1, 6, 1), (R2, 10, 3), (OTHER, 50, 40)):
        em.batch(running, waiting, **lab)  # constant: a window's mean is the value
    server, thread = start_http_server(0, addr="127.0.0.1", registry=em.registry)
    address = f"127.0.0.1:{server.server_port}"
    try:
        scrape = ScrapeSource(f"http://{address}/metrics", slo=SLO, prefix="ray_", selector=SEL)
        with prometheus_server.scraping("agree", address):  # first scrape: every series at 0
            t_zero = prometheus_server.last_scrape_s("agree")
            s0 = scrape.snapshot()
            rng = np.random.default_rng(3)
            ttft, tpot = latencies(rng, 1500)
            for i, (a, b) in enumerate(zip(ttft, tpot, strict=True)):
                em.record(float(a), float(b), 7, **(R1 if i % 3 else R2))
            for _ in range(400):
                em.record(5.0, 1.0, 7, **OTHER)  # another deployment: must not leak in
            for _ in range(9):
                em.reject(**R2)
            em.reject(names.REASON_BAD_REQUEST, **R2)  # refused, but not for want of room
            s1 = scrape.snapshot()
            prometheus_server.wait_scrapes("agree", 2)
            t_end = prometheus_server.last_scrape_s("agree")
            yield {
                "scrape": scrape.observe(s0, s1),
                "ttft": ttft,
                "tpot": tpot,
                "t_zero": t_zero,
                "t_end": t_end,
                "prom": prometheus_server,
            }
    finally:
        server.shutdown()
        server.server_close()


def _promql(scenario: dict[str, object], **kw: object) -> PromQLSource:
    prom = scenario["prom"]
    assert isinstance(prom, PrometheusServer)
    return PromQLSource(prom.url, slo=SLO, prefix="ray_", selector=SEL, **kw)  # type: ignore[arg-type]


def test_scrape_and_promql_agree(scenario: dict[str, object]) -> None:
    scrape = scenario["scrape"]
    assert isinstance(scrape, Observation)
    t_zero, t_end = float(scenario["t_zero"]), float(scenario["t_end"])  # type: ignore[arg-type]
    # A window that starts before the all-zero scrape and ends on the last one: Prometheus
    # extrapolates nothing, so its increase() equals the exact delta.
    promql = _promql(scenario).observe_range(window_s=t_end - t_zero + 1.0, end_s=t_end)
    assert not scrape.stale and not promql.stale, (scrape.note, promql.note)
    for field in ("completed", "slo_met", "rejected", "overloaded", "generated_tokens"):
        assert getattr(promql, field) == getattr(scrape, field), field
    assert scrape.completed == 1500 and scrape.generated_tokens == 10500
    assert (scrape.rejected, scrape.overloaded) == (10, 9)
    # the batch per replica (6 and 10: 8) and the queue of both (1 + 3), not Other's
    for o in (scrape, promql):
        assert (o.running, o.waiting) == (8.0, 4.0), o.source
    # each replica's own p99 TPOT and count, the same from both (r1 has two in three)
    assert [(r, n) for r, _, n in scrape.replica_tpot] == [("r1", 1000), ("r2", 500)]
    for (r, a, _), (r2, b, _) in zip(scrape.replica_tpot, promql.replica_tpot, strict=True):
        assert r == r2 and math.isclose(a, b, rel_tol=1e-9), (r, a, b)
    for a, b in ((scrape.ttft, promql.ttft), (scrape.tpot, promql.tpot)):
        for q in ("p50", "p90", "p99"):
            assert math.isclose(getattr(a, q), getattr(b, q), rel_tol=1e-9), q
    for a, b in (
        (scrape.ttft_verdict, promql.ttft_verdict),
        (scrape.tpot_verdict, promql.tpot_verdict),
    ):
        assert a is not None and b is not None
        assert (a.verdict, a.samples) == (b.verdict, b.samples)
        assert a.exceed_fraction_upper == b.exceed_fraction_upper
        # Prometheus's own histogram_quantile on rate() equals ours on the exact delta.
        assert math.isclose(a.estimate_s, b.estimate_s, rel_tol=1e-9)
    # And both equal the truth from the raw requests where the buckets allow exactness.
    ref = observation_from_requests(
        slo=SLO,
        start_s=0,
        end_s=1,
        ttft_s=scenario["ttft"],
        tpot_s=scenario["tpot"],  # type: ignore[arg-type]
    )
    assert scrape.slo_met == ref.slo_met
    assert scrape.ttft_verdict is not None and ref.ttft_verdict is not None
    assert scrape.ttft_verdict.verdict is ref.ttft_verdict.verdict


def test_promql_window_without_data_is_stale(scenario: dict[str, object]) -> None:
    prom = scenario["prom"]
    assert isinstance(prom, PrometheusServer)
    # before the server's first sample: the session's Prometheus is shared, and a window
    # some minutes before this module's data may hold an earlier test's app named LLM
    obs = _promql(scenario).observe_range(window_s=30, end_s=prom.started_s - 60)
    assert obs.stale and "no series" in obs.note and obs.completed == 0
    assert obs.ttft_verdict is not None and obs.ttft_verdict.verdict is Verdict.INSUFFICIENT


def test_promql_missing_metric_is_stale(scenario: dict[str, object]) -> None:
    prom = scenario["prom"]
    assert isinstance(prom, PrometheusServer)
    src = PromQLSource(prom.url, slo=SLO, prefix="ray_", selector={"deployment": "Nope"})
    obs = src.observe_range(window_s=60, end_s=float(scenario["t_end"]))  # type: ignore[arg-type]
    assert obs.stale and "Nope" in obs.note and math.isnan(obs.tpot.p99)


def test_promql_stale_data_is_flagged(scenario: dict[str, object]) -> None:
    t_end = float(scenario["t_end"])  # type: ignore[arg-type]
    obs = _promql(scenario, max_staleness_s=5.0).observe_range(window_s=60, end_s=t_end + 120)
    # Prometheus keeps scraping the (unchanged) target after t_end, so the newest sample is
    # t_end or up to the time elapsed since (plus one scrape interval) later.
    newest_after = time.time() - t_end + 1.0
    assert obs.stale and 120 - newest_after <= obs.staleness_s <= 120.01, obs.staleness_s
