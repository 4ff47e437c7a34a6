"""Metrics profiles: detection, vLLM/SGLang names and layouts, goodput from the client."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from metrics import names, profiles
from metrics.build import observation_from_requests, with_client_goodput
from metrics.observation import Slo, Verdict
from metrics.snapshot import parse_exposition
from metrics.sources import PromQLSource, ScrapeSource, counter_selector
from tests.fixtures.prometheus_server import TextEndpoint
from tests.metrics.emit import Emitter

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.08)  # 0.08 s lies inside vLLM's (0.075, 0.1] bucket
LAB = {"model_name": "m", "engine": "0"}


class VllmEmitter:
    """vLLM's families as its PrometheusStatLogger registers them (metrics.profiles.VLLM)."""

    def __init__(self, *, ray: bool = False) -> None:
        self.registry = reg = CollectorRegistry()
        p = profiles.VLLM

        def n(name: str) -> str:
            return names.read_as(name, prefix="ray_" if ray else "")

        ln = [*LAB, *(["ReplicaId"] if ray else [])]
        self.lab = {**LAB, **({"ReplicaId": "r1"} if ray else {})}
        self.ttft = Histogram(n(p.ttft[0]), "", ln, registry=reg, buckets=p.buckets[p.ttft[0]])
        self.tpot = Histogram(n(p.tpot[0]), "", ln, registry=reg, buckets=p.buckets[p.tpot[0]])
        self.ok = Counter(n("vllm:request_success"), "", [*ln, "finished_reason"], registry=reg)
        self.tokens = Counter(n("vllm:generation_tokens"), "", ln, registry=reg)
        # vLLM creates every labelled child at start (make_per_engine), so do we
        for r in ("stop", "length", "abort"):
            self.ok.labels(**self.lab, finished_reason=r)
        for m in (self.ttft, self.tpot, self.tokens):
            m.labels(**self.lab)

    def record(self, ttft: float, tpot: float, tokens: int, reason: str = "length") -> None:
        self.ttft.labels(**self.lab).observe(ttft)
        self.tpot.labels(**self.lab).observe(tpot)
        self.ok.labels(**self.lab, finished_reason=reason).inc()
        self.tokens.labels(**self.lab).inc(tokens)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


SGLANG_TEXT = """\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5.0
sglang:time_to_first_token_seconds_count{model_name="m"} 5.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 0.7
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
"""


@pytest.fixture
def endpoint() -> Iterator[TextEndpoint]:
    ep = TextEndpoint()
    yield ep
    ep.close()


def test_detect_each_profile_from_exposition_text() -> None:
    for prefix in ("", "ray_"):
        em = Emitter(slo=SLO, prefix=prefix)
        em.touch(application="a", deployment="d", replica="r")
        assert profiles.detect(em.text()) == "slotune"
    assert profiles.detect(VllmEmitter().text()) == "vllm"
    assert profiles.detect(VllmEmitter(ray=True).text()) == "vllm"
    assert profiles.detect(SGLANG_TEXT) == "sglang"
    assert profiles.detect("# TYPE up gauge\nup 1\n") is None  # no server profile: client
    assert profiles.detect("<html>not metrics</html>") is None
    snap = parse_exposition(VllmEmitter(ray=True).text(), time_s=0)
    assert profiles.detect_snapshot(snap) == ("vllm", "ray_")


def test_ray_names_follow_vllms_ray_wrapper() -> None:
    assert names.read_as("vllm:time_to_first_token_seconds", prefix="ray_") == (
        "ray_vllm_time_to_first_token_seconds"
    )
    assert names.read_as("vllm:kv_cache_usage_perc", prefix="") == "vllm:kv_cache_usage_perc"
    assert profiles.profile("sglang") is profiles.SGLANG
    with pytest.raises(ValueError, match="tgi"):
        profiles.profile("tgi")
    with pytest.raises(ValueError, match="no server metrics"):
        ScrapeSource("http://127.0.0.1:1/metrics", slo=SLO, profile=profiles.CLIENT)


@pytest.mark.parametrize("ray", [False, True])
def test_vllm_histograms_give_counts_percentiles_and_a_bracketed_tpot_verdict(
    endpoint: TextEndpoint, ray: bool
) -> None:
    em = VllmEmitter(ray=ray)
    endpoint.body = em.text()
    src = ScrapeSource(endpoint.url, slo=SLO, profile=profiles.VLLM, prefix="ray_" if ray else "")
    s0 = src.snapshot()
    rng = np.random.default_rng(3)
    ttft = rng.uniform(0.05, 0.5, 400)
    tpot = rng.uniform(0.02, 0.07, 400)
    tpot[:20] = 0.09  # 5% of requests inside (0.075, 0.1]: above or below 0.08? unknown
    for a, b in zip(ttft, tpot, strict=True):
        em.record(float(a), float(b), 10)
    em.record(0.1, 0.03, 3, reason="abort")  # aborted: not a completion
    endpoint.body = em.text()
    obs = src.observe(s0, src.snapshot())
    assert not obs.stale, obs.note
    assert obs.completed == 400 and obs.generated_tokens == 4003
    # No SLO label on vLLM's counter: goodput is unknown here, and says where to get it.
    assert not obs.slo_met_known and math.isnan(obs.goodput_rps)
    assert "goodput from the client" in obs.note
    v = obs.tpot_verdict
    assert v is not None and v.bracket_s == (0.075, 0.1)
    assert v.verdict is Verdict.INSUFFICIENT  # 0..20 of 400 above: cannot call it
    assert "TPOT p99 verdict bracketed" in obs.note and "(0.075, 0.1]" in obs.note
    # TTFT's SLO (1.0 s) is one of vLLM's bounds: exact, and met.
    assert obs.ttft_verdict is not None and obs.ttft_verdict.bracket_s is None
    assert obs.ttft_verdict.verdict is Verdict.MET
    # The client's records of the same requests fill goodput in.
    client = observation_from_requests(
        slo=SLO, start_s=obs.start_s, end_s=obs.end_s, ttft_s=ttft, tpot_s=tpot
    )
    merged = with_client_goodput(obs, client)
    assert merged.slo_met_known and merged.slo_met == client.slo_met == 380
    assert merged.goodput_rps == pytest.approx(380 / obs.window_s)
    assert with_client_goodput(merged, client) is merged


def test_inter_token_latency_is_read_when_request_tpot_is_absent(endpoint: TextEndpoint) -> None:
    reg = CollectorRegistry()
    b = profiles.VLLM_TPOT_BUCKETS
    itl = Histogram("vllm:inter_token_latency_seconds", "", ["model_name"], registry=reg, buckets=b)
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"], registry=reg)
    ok = Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=reg)
    ok.labels(model_name="m", finished_reason="stop")
    endpoint.body = generate_latest(reg).decode()
    src = ScrapeSource(endpoint.url, slo=SLO, profile=profiles.VLLM)
    s0 = src.snapshot()
    for _ in range(5):
        ttft.labels(model_name="m").observe(0.2)
        itl.labels(model_name="m").observe(0.03)
        ok.labels(model_name="m", finished_reason="stop").inc()
    endpoint.body = generate_latest(reg).decode()
    obs = src.observe(s0, src.snapshot())
    assert obs.completed == 5 and obs.tpot_verdict is not None and obs.tpot_verdict.samples == 5
    assert "token-weighted" in obs.note and not obs.stale


def test_sglang_profile_reads_its_families(endpoint: TextEndpoint) -> None:
    reg = CollectorRegistry()
    p = profiles.SGLANG
    ttft = Histogram(p.ttft[0], "", ["model_name"], registry=reg, buckets=p.buckets[p.ttft[0]])
    itl = Histogram(p.tpot[0], "", ["model_name"], registry=reg, buckets=p.buckets[p.tpot[0]])
    done = Counter("sglang:num_requests", "", ["model_name"], registry=reg)
    toks = Counter("sglang:generation_tokens", "", ["model_name"], registry=reg)
    for m in (ttft, itl, done, toks):
        m.labels(model_name="m")
    endpoint.body = generate_latest(reg).decode()
    assert profiles.detect(endpoint.body) == "sglang"
    src = ScrapeSource(endpoint.url, slo=SLO, profile=p, selector={"model_name": "m"})
    s0 = src.snapshot()
    for _ in range(12):
        ttft.labels(model_name="m").observe(0.3)
        itl.labels(model_name="m").observe(0.01)
        done.labels(model_name="m").inc()
        toks.labels(model_name="m").inc(8)
    endpoint.body = generate_latest(reg).decode()
    obs = src.observe(s0, src.snapshot())
    assert (obs.completed, obs.generated_tokens) == (12, 96) and not obs.slo_met_known
    assert obs.ttft.p50 == pytest.approx(0.3)  # interpolated in SGLang's (0.2, 0.4] bucket


def test_promql_source_takes_a_profile_and_agrees_on_names() -> None:
    PromQLSource("http://127.0.0.1:1", slo=SLO, profile=profiles.VLLM, prefix="ray_")
    sel = counter_selector(profiles.VLLM.completed, prefix="ray_", selector={"ReplicaId": "r"})
    alts = "ray_vllm_request_success_total|ray_vllm_request_success_total_total"
    assert sel == f'{{__name__=~"{alts}",ReplicaId="r"}}'
    with pytest.raises(ValueError, match="no server metrics"):
        PromQLSource("http://127.0.0.1:1", slo=SLO, profile=profiles.CLIENT)
