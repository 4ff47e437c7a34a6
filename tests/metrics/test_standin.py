"""The stand-in vLLM/SGLang server, read with its metrics profile, agrees with the client.

Loose bounds only: the client's latencies include the loopback network and its own event
loop, so they are never below the server's by more than a bucket's rounding, and the
counts (requests, tokens) must match exactly.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from controller.load.generator import run_load_sync
from controller.load.result import client_observation
from controller.load.spec import LoadSpec
from controller.windows import ClientWindow
from metrics import profiles
from metrics.build import with_client_goodput
from metrics.observation import Slo
from metrics.sources import ScrapeSource
from serving.sim.workload import LengthDist
from tests.fixtures.vllm_standin import StandinConfig, StandinServer

SLO = Slo(ttft_p99_s=2.0, tpot_p99_s=0.5)
N = 24


def _spec(url: str) -> LoadSpec:
    return LoadSpec(
        url=f"{url}/v1/completions",
        concurrency=6,
        max_requests=N,
        duration_s=60.0,
        prompt_tokens=LengthDist(mean=8),
        output_tokens=LengthDist(mean=12),
        ignore_eos=True,
        request_timeout_s=30.0,
    )


@pytest.mark.parametrize(
    "vllm_standin",
    [StandinConfig(max_num_seqs=4, step_a_s=0.01, step_b_s=0.002)],
    indirect=True,
)
def test_standin_metrics_agree_with_the_client(vllm_standin: StandinServer) -> None:
    url = vllm_standin.url
    models = httpx.get(f"{url}/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "standin-model"
    src = ScrapeSource(f"{url}/metrics", slo=SLO, profile=profiles.VLLM)
    s0 = src.snapshot()
    assert profiles.detect(httpx.get(f"{url}/metrics", timeout=5).text) == "vllm"
    result = run_load_sync(_spec(url))
    obs = src.observe(s0, src.snapshot())
    client = client_observation(result, SLO)
    assert result.completed == N and all(r.output_tokens == 12 for r in result.records)
    assert not obs.stale, obs.note
    assert (obs.completed, obs.generated_tokens) == (N, N * 12)
    assert not obs.slo_met_known and client.slo_met == N
    # The server's clock starts at arrival, the client's earlier: medians are ordered
    # (up to the bucket interpolation) and of the same size.
    for server_p, client_p in ((obs.ttft.p50, client.ttft.p50), (obs.tpot.p50, client.tpot.p50)):
        assert math.isfinite(server_p) and math.isfinite(client_p)
        assert server_p <= 2.5 * client_p + 0.02
        assert client_p <= 2.5 * server_p + 0.05
    merged = with_client_goodput(obs, client)
    assert merged.slo_met == N and merged.goodput_rps > 0


@pytest.mark.parametrize(
    "vllm_standin", [StandinConfig(flavour="sglang", max_num_seqs=2)], indirect=True
)
def test_standin_sglang_flavour(vllm_standin: StandinServer) -> None:
    url = vllm_standin.url
    src = ScrapeSource(f"{url}/metrics", slo=SLO, profile=profiles.SGLANG)
    s0 = src.snapshot()
    result = run_load_sync(_spec(url))
    obs = src.observe(s0, src.snapshot())
    assert profiles.detect(httpx.get(f"{url}/metrics", timeout=5).text) == "sglang"
    assert result.completed == N and (obs.completed, obs.generated_tokens) == (N, N * 12)
    assert "token-weighted" in obs.note


def test_streaming_format_and_usage(vllm_standin: StandinServer) -> None:
    body = {"prompt": "a b c", "max_tokens": 3, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{vllm_standin.url}/v1/completions", json=body, timeout=10) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert len(texts) == 3 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    bad = httpx.post(f"{vllm_standin.url}/v1/completions", json={"max_tokens": 2}, timeout=5)
    assert bad.status_code == 400


def test_client_window_builds_the_observation_from_records(vllm_standin: StandinServer) -> None:
    result = run_load_sync(_spec(vllm_standin.url))
    w = ClientWindow(slo=SLO)
    obs = w.end(w.begin(), start_s=result.start_s, end_s=result.end_s, records=result.records)
    assert obs.completed == N and obs.slo_met_known and obs.slo_met == N
    assert "network" in obs.note and obs.source.startswith("client")
    with pytest.raises(TypeError, match="records="):
        w.end(None, start_s=0.0, end_s=1.0)
