"""ScrapeSource and PromQLSource without a Prometheus server: windows, selectors, failures."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from metrics import names
from metrics.build import observation_from_requests
from metrics.errors import MalformedExposition, MetricsUnavailable, QueryRejected
from metrics.observation import Slo, Verdict
from metrics.snapshot import Snapshot
from metrics.sources import PromQLSource, ScrapeSource
from tests.fixtures.prometheus_server import TextEndpoint, free_port
from tests.metrics.emit import Emitter, latencies

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
R1 = {"application": "default", "deployment": "LLM", "replica": "r1"}
R2 = {"application": "default", "deployment": "LLM", "replica": "r2"}
OTHER = {"application": "default", "deployment": "Other", "replica": "o1"}


@pytest.fixture
def endpoint() -> Iterator[TextEndpoint]:
    ep = TextEndpoint()
    yield ep
    ep.close()


def test_window_matches_the_raw_requests(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO)
    em.touch(**R1)
    rng = np.random.default_rng(1)
    # Requests before the window do not count.
    for a, b in zip(*latencies(rng, 50), strict=True):
        em.record(float(a), float(b), 10, **R1)
    src = ScrapeSource(endpoint.url, slo=SLO)
    endpoint.body = em.text()
    s0 = src.snapshot()
    ttft, tpot = latencies(rng, 2000)
    for a, b in zip(ttft, tpot, strict=True):
        em.record(float(a), float(b), 10, **R1)
    for _ in range(7):
        em.reject(**R1)
    for reason in (names.REASON_BAD_REQUEST, names.REASON_TOO_LARGE):
        em.reject(reason, **R1)
    endpoint.body = em.text()
    s1 = src.snapshot()
    obs = src.observe(s0, s1)
    ref = observation_from_requests(
        slo=SLO, start_s=0, end_s=1, ttft_s=ttft, tpot_s=tpot, generated_tokens=20000, rejected=9
    )
    assert not obs.stale, obs.note
    assert (obs.completed, obs.slo_met) == (ref.completed, ref.slo_met) == (2000, ref.slo_met)
    assert 0 < obs.slo_met < 2000  # the data has both kinds
    assert (obs.generated_tokens, obs.rejected) == (20000, 9)
    assert obs.overloaded == 7  # the 400 and the 413 are not refusals for want of room
    # Thresholds are bucket bounds: the verdict rests on the exact count above them.
    for got, want in ((obs.ttft_verdict, ref.ttft_verdict), (obs.tpot_verdict, ref.tpot_verdict)):
        assert got is not None and want is not None
        assert got.verdict is want.verdict
        assert got.samples == want.samples == 2000
        assert got.exceed_fraction_upper == want.exceed_fraction_upper
    # Percentiles from ≤10%-wide buckets are within 10% of the exact ones.
    for got_p, want_p in ((obs.ttft, ref.ttft), (obs.tpot, ref.tpot)):
        for q in ("p50", "p90", "p99"):
            assert getattr(got_p, q) == pytest.approx(getattr(want_p, q), rel=0.1)
    assert obs.window_s == s1.time_s - s0.time_s > 0
    assert obs.goodput_rps == obs.slo_met / obs.window_s


def test_ray_prefix_selector_sums_replicas_and_excludes_others(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO, prefix=names.RAY_PREFIX)
    for lab in (R1, R2, OTHER):
        em.touch(**lab)
    endpoint.body = em.text()
    src = ScrapeSource(endpoint.url, slo=SLO, prefix="ray_", selector={"deployment": "LLM"})
    s0 = src.snapshot()
    for lab, n in ((R1, 30), (R2, 20), (OTHER, 1000)):
        for _ in range(n):
            em.record(0.2, 0.02, 5, **lab)
    endpoint.body = em.text()
    obs = src.observe(s0, src.snapshot())
    assert (obs.completed, obs.slo_met, obs.generated_tokens) == (50, 50, 250)
    assert obs.ttft_verdict is not None and obs.ttft_verdict.samples == 50
    # A plain reader (no prefix) of Ray's port finds nothing, and says so.
    plain = ScrapeSource(endpoint.url, slo=SLO)
    bad = plain.observe(s0, plain.snapshot())
    assert bad.stale and "slotune_requests_total" in bad.note and bad.completed == 0


def test_counter_reset_counts_from_zero(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO)
    for _ in range(100):
        em.record(0.2, 0.02, 5, **R1)
    endpoint.body = em.text()
    src = ScrapeSource(endpoint.url, slo=SLO)
    s0 = src.snapshot()
    restarted = Emitter(slo=SLO)  # the replica restarted: its counters start again
    for _ in range(30):
        restarted.record(0.2, 2.0, 5, **R1)
    endpoint.body = restarted.text()
    obs = src.observe(s0, src.snapshot())
    assert (obs.completed, obs.slo_met, obs.generated_tokens) == (30, 0, 150)
    assert obs.tpot_verdict is not None and obs.tpot_verdict.verdict is Verdict.VIOLATED


def test_counter_with_doubled_total_suffix_is_read(endpoint: TextEndpoint) -> None:
    text = "\n".join(
        [
            "# TYPE slotune_requests_total_total counter",
            'slotune_requests_total_total{slo_met="true"} 4',
            'slotune_requests_total_total{slo_met="false"} 1',
            "",
        ]
    )
    endpoint.body = text
    src = ScrapeSource(endpoint.url, slo=SLO)
    obs = src.observe(Snapshot(time_s=0.0), src.snapshot())
    assert (obs.completed, obs.slo_met) == (5, 4)


def test_empty_window_is_stale_and_insufficient(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO)
    em.record(0.2, 0.02, 5, **R1)
    endpoint.body = em.text()
    src = ScrapeSource(endpoint.url, slo=SLO)
    s = src.snapshot()
    obs = src.observe(s, s)
    assert obs.stale and "empty window" in obs.note
    assert obs.ttft_verdict is not None and obs.ttft_verdict.verdict is Verdict.INSUFFICIENT
    assert math.isnan(obs.ttft.p99) and obs.completed == 0
    assert not obs.feasible


def test_old_snapshot_is_stale(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO)
    em.touch(**R1)
    endpoint.body = em.text()
    now = [1000.0]
    src = ScrapeSource(endpoint.url, slo=SLO, clock=lambda: now[0], max_staleness_s=30)
    s0 = src.snapshot()
    now[0] = 1010.0
    s1 = src.snapshot()
    assert not src.observe(s0, s1).stale
    now[0] = 1100.0
    obs = src.observe(s0, s1)
    assert obs.stale and obs.staleness_s == 90.0 and "old" in obs.note


def test_observe_recent_uses_kept_snapshots(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO)
    endpoint.body = em.text()
    now = [0.0]
    src = ScrapeSource(endpoint.url, slo=SLO, clock=lambda: now[0])
    first = src.observe_recent(10.0)
    assert first.stale and first.window_s == 0  # nothing kept yet
    for t in (5.0, 10.0, 15.0, 20.0):
        now[0] = t
        src.snapshot()
    now[0] = 25.0
    obs = src.observe_recent(10.0)
    assert (obs.start_s, obs.end_s) == (15.0, 25.0)


def test_unreachable_endpoint_raises_transient_error() -> None:
    src = ScrapeSource(f"http://127.0.0.1:{free_port()}/metrics", slo=SLO, timeout_s=2)
    with pytest.raises(MetricsUnavailable, match="unreachable"):
        src.snapshot()


def test_timeout_raises_transient_error(endpoint: TextEndpoint) -> None:
    endpoint.delay_s = 1.0
    src = ScrapeSource(endpoint.url, slo=SLO, timeout_s=0.2)
    with pytest.raises(MetricsUnavailable, match="timed out"):
        src.snapshot()


def test_http_error_raises_transient_error(endpoint: TextEndpoint) -> None:
    endpoint.status = 503
    with pytest.raises(MetricsUnavailable, match="503"):
        ScrapeSource(endpoint.url, slo=SLO).snapshot()


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        ("<html><body>dashboard</body></html>", "text/plain"),
        ('slotune_requests_total{slo_met="true" 3\n', "text/plain"),
        ("ok", "text/html; charset=utf-8"),
    ],
)
def test_malformed_exposition_raises_typed_error(
    endpoint: TextEndpoint, body: str, ctype: str
) -> None:
    endpoint.body, endpoint.content_type = body, ctype
    with pytest.raises(MalformedExposition):
        ScrapeSource(endpoint.url, slo=SLO).snapshot()


def test_missing_metric_is_stale_never_zero_claimed_fresh(endpoint: TextEndpoint) -> None:
    endpoint.body = "# TYPE other_metric gauge\nother_metric 1\n"
    src = ScrapeSource(endpoint.url, slo=SLO)
    obs = src.observe(src.snapshot(), src.snapshot())
    assert obs.stale and "slotune_ttft_seconds" in obs.note
    assert obs.tpot_verdict is not None and obs.tpot_verdict.verdict is Verdict.INSUFFICIENT


def test_nan_counter_is_stale_not_a_crash(endpoint: TextEndpoint) -> None:
    em = Emitter(slo=SLO)
    em.record(0.2, 0.02, 5, **R1)
    src = ScrapeSource(endpoint.url, slo=SLO)
    endpoint.body = em.text()
    s0 = src.snapshot()
    endpoint.body = em.text().replace(
        'slotune_generated_tokens_total{application="default",deployment="LLM",replica="r1"} 5.0',
        'slotune_generated_tokens_total{application="default",deployment="LLM",replica="r1"} NaN',
    )
    obs = src.observe(s0, src.snapshot())
    assert obs.stale and "generated_tokens" in obs.note and obs.generated_tokens == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"selector": {"bad-label": "x"}}, "bad-label"),
        ({"selector": {"le": "1"}}, "le"),
        ({"prefix": "1x"}, "prefix"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_configuration_is_rejected_early(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScrapeSource("http://127.0.0.1:1/metrics", slo=SLO, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        PromQLSource("http://127.0.0.1:1", slo=SLO, **kwargs)  # type: ignore[arg-type]


def test_promql_unreachable_is_transient() -> None:
    src = PromQLSource(f"http://127.0.0.1:{free_port()}", slo=SLO, timeout_s=2)
    with pytest.raises(MetricsUnavailable):
        src.observe_range(window_s=30, end_s=1000.0)


def test_promql_rejected_query_is_permanent(endpoint: TextEndpoint) -> None:
    endpoint.status = 400
    endpoint.content_type = "application/json"
    endpoint.body = '{"status":"error","errorType":"bad_data","error":"parse error"}'
    src = PromQLSource(f"http://{endpoint.address}", slo=SLO)
    with pytest.raises(QueryRejected, match="parse error"):
        src.observe_range(window_s=30, end_s=1000.0)


def test_promql_garbled_reply_is_transient(endpoint: TextEndpoint) -> None:
    endpoint.body = "<html>proxy error</html>"
    endpoint.status = 502
    src = PromQLSource(f"http://{endpoint.address}", slo=SLO)
    with pytest.raises(MetricsUnavailable, match="not JSON"):
        src.observe_range(window_s=30, end_s=1000.0)


def test_openmetrics_exposition_is_read(endpoint: TextEndpoint) -> None:
    from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    em = Emitter(slo=SLO)
    em.touch(**R1)
    endpoint.content_type = CONTENT_TYPE_LATEST
    endpoint.body = om_latest(em.registry).decode()
    src = ScrapeSource(endpoint.url, slo=SLO)
    s0 = src.snapshot()
    for _ in range(12):
        em.record(0.2, 0.5, 3, **R1)
    endpoint.body = om_latest(em.registry).decode()
    obs = src.observe(s0, src.snapshot())
    assert (obs.completed, obs.slo_met, obs.generated_tokens) == (12, 0, 36)
    assert obs.tpot_verdict is not None and obs.tpot_verdict.verdict is Verdict.VIOLATED
