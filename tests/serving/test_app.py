"""The completion server: pure schema/SSE/metric logic, then the live Ray Serve app.

The Ray tests share one deployment of the ``tiny`` model on the session cluster
and talk to it over loopback HTTP with the official ``openai`` client and httpx.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from metrics import names
from metrics.observation import DEFAULT_SLO, Slo
from serving.app import openai_api as oa
from serving.app import openai_request as oreq
from serving.app.config import LiveConfig, ServerArgs
from serving.app.serve_metrics import BucketLayout, GaugeRefresher, ServeMetrics
from serving.app.text_output import IncrementalDecoder, TextOutput

# -- request parsing ------------------------------------------------------------

MODEL = "slotune-tiny"


def parse(**body: object) -> oreq.CompletionRequest:
    return oreq.parse_completion_request(body, served_model=MODEL)


def test_parse_defaults_follow_openai() -> None:
    r = parse(model=MODEL, prompt="hi")
    assert (r.prompt, r.max_tokens, r.temperature, r.stream) == ("hi", 16, 1.0, False)
    r = parse(prompt=[1, 2, 3], max_tokens=5, temperature=0, stream=True, n=1)
    assert (r.prompt, r.max_tokens, r.temperature, r.stream) == ((1, 2, 3), 5, 0, True)
    assert parse(prompt=["one"]).prompt == "one"
    assert parse(prompt="x", stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({}, "prompt", "required"),
        ({"prompt": ["a", "b"]}, "prompt", "one prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "-1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "1.5"),
        ({"prompt": "x", "max_tokens": "7"}, "max_tokens", "'7'"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "True"),
        ({"prompt": "x", "temperature": -0.1}, "temperature", "-0.1"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature", "nan"),
        ({"prompt": "x", "n": 2}, "n", "n: 2 is not supported (only 1)"),
        ({"prompt": "x", "stream": "yes"}, "stream", "'yes'"),
        ({"prompt": "x", "top_p": 0.9}, "top_p", "top_p: 0.9 is not supported (only 1)"),
        ({"prompt": "x", "stop": 7}, "stop", "stop=7"),
    ],
)
def test_parse_rejects_bad_input_naming_the_field(
    body: dict[str, object], param: str, fragment: str
) -> None:
    with pytest.raises(oa.ApiError) as e:
        oreq.parse_completion_request(body, served_model=MODEL)
    assert e.value.status == 400
    assert e.value.param == param
    assert fragment in e.value.message
    err = e.value.body()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] == e.value.message


def test_parse_unknown_model_is_404() -> None:
    with pytest.raises(oa.ApiError) as e:
        parse(model="gpt-4", prompt="x")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(oa.ApiError):
        oreq.parse_completion_request(["not", "a", "dict"], served_model=MODEL)


def test_bodies_and_sse_framing() -> None:
    assert oa.finish_reason(4, 4) == "length" and oa.finish_reason(3, 4) == "stop"
    body = oa.completion_body(
        completion_id="cmpl-1", model=MODEL, text="ab", finish="stop", usage_=oa.usage(3, 2)
    )
    assert body["choices"][0]["text"] == "ab"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    ev = oa.sse_event(body)
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    assert json.loads(ev[len(b"data: ") : -2]) == body
    assert oa.SSE_DONE == b"data: [DONE]\n\n"
    models = oa.models_body(MODEL, created=1)
    assert models["data"][0]["id"] == MODEL


def test_incremental_decoder_never_splits_a_character() -> None:
    text = "añ€😀z"
    data = text.encode()  # byte-level "tokens"

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    dec = IncrementalDecoder(decode=decode)
    deltas = [dec.push(b) for b in data]
    assert "".join(deltas) + dec.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "ñ"  # held back until the 2-byte char completes
    many = IncrementalDecoder(decode=decode)
    assert many.push_many(data[:3]) == "añ" and many.push_many(data[3:5]) == ""
    assert many.push_many(data[5:]) + many.flush() == "€😀z"
    cut = IncrementalDecoder(decode=decode)
    assert cut.push_many("é".encode()[:1]) == "" and cut.flush() == "\ufffd"


def test_incremental_decoder_decodes_a_short_window_per_token() -> None:
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return bytes(ids).decode("utf-8", errors="replace")

    dec = IncrementalDecoder(decode=decode)
    text = "ab€" * 200
    out = "".join(dec.push(b) for b in text.encode()) + dec.flush()
    assert out == text
    assert max(seen) <= 4  # the window, not the whole output (1,000 bytes)


@pytest.mark.parametrize("text", ["", "plain", 'quote " back \\ slash', "añ€😀\n\t", "\x00"])
def test_chunk_encoder_matches_the_generic_json_byte_for_byte(text: str) -> None:
    enc = oa.ChunkEncoder(completion_id='cmpl-"q', model="slotune-tiny", created=7)
    generic = oa.completion_body(
        completion_id='cmpl-"q', model="slotune-tiny", text=text, finish=None, created=7
    )
    assert enc.text(text) == oa.sse_event(generic)
    final = oa.completion_body(
        completion_id='cmpl-"q', model="slotune-tiny", text=text, finish="stop", created=7
    )
    assert enc.final(text, "stop") == oa.sse_event(final)


# -- metric emission ---------------------------------------------------------------


class _Rec:
    """A stand-in for ray.serve.metrics classes that records every call."""

    def __init__(self, name: str, description: str = "", **kw: object) -> None:
        self.name, self.kw, self.calls = name, kw, []

    def observe(self, v: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("observe", v, tags))

    def inc(self, v: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("inc", v, tags))

    def set(self, v: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("set", v, tags))


FAKE = SimpleNamespace(Histogram=_Rec, Counter=_Rec, Gauge=_Rec)
SLO = Slo(ttft_p99_s=0.5, tpot_p99_s=0.05)


def timing(ttft: float, tpot: float | None, n: int) -> SimpleNamespace:
    return SimpleNamespace(ttft_s=ttft, tpot_s=tpot, queue_wait_s=0.01, generated_tokens=n)


@pytest.mark.parametrize(
    ("t", "met"),
    [
        (timing(0.4, 0.04, 10), True),
        (timing(0.5, 0.05, 10), True),  # at the threshold meets it
        (timing(0.6, 0.04, 10), False),
        (timing(0.4, 0.06, 10), False),
        (timing(0.4, None, 1), True),  # one token: judged on TTFT alone
        (timing(0.6, None, 1), False),
        (timing(math.nan, 0.01, 5), False),
    ],
)
def test_slo_met_needs_both_thresholds(t: SimpleNamespace, met: bool) -> None:
    m = ServeMetrics(slo=SLO, metrics_module=FAKE)
    m.record_finish(t)
    assert m.requests.calls[-1][2] == {"slo_met": "true" if met else "false"}


def test_bucket_layout_contains_the_slo_and_defaults() -> None:
    b = BucketLayout.for_slo(SLO)
    assert {0.5, DEFAULT_SLO.ttft_p99_s} <= set(b.ttft)
    assert {0.05, DEFAULT_SLO.tpot_p99_s} <= set(b.tpot)
    assert b.exact_for(SLO)
    assert max(hi / lo for lo, hi in zip(b.tpot, b.tpot[1:], strict=False)) <= 1.1 + 1e-9


def test_bucket_layout_does_not_depend_on_the_slo() -> None:
    # Ray drops a second histogram of the same name with other bounds: one layout.
    odd = Slo(ttft_p99_s=0.777, tpot_p99_s=0.0333)
    assert BucketLayout.for_slo(odd) == BucketLayout.for_slo(SLO)
    assert not BucketLayout.for_slo(odd).exact_for(odd)


def test_serve_metrics_records_the_contract_names() -> None:
    m = ServeMetrics(slo=SLO, metrics_module=FAKE)
    assert m.ttft.name == names.TTFT_SECONDS and m.tpot.name == names.TPOT_SECONDS
    assert m.ttft.kw["boundaries"] == list(m.buckets.ttft)
    m.record_finish(timing(0.4, 0.04, 10))
    m.record_finish(timing(0.9, None, 1))
    assert m.ttft.calls == [("observe", 0.4, None), ("observe", 0.9, None)]
    assert m.tpot.calls == [("observe", 0.04, None)]  # no TPOT for a single token
    assert [c[2] for c in m.requests.calls] == [{"slo_met": "true"}, {"slo_met": "false"}]
    assert sum(c[1] for c in m.tokens.calls) == 11
    m.set_slo(Slo(ttft_p99_s=1.0, tpot_p99_s=0.05))  # live change flips the verdict
    m.record_finish(timing(0.9, None, 1))
    assert m.requests.calls[-1][2] == {"slo_met": "true"}


def test_gauge_refresher_resets_gauges_until_stopped() -> None:
    m = ServeMetrics(slo=SLO, metrics_module=FAKE)
    stats = SimpleNamespace(running=3, waiting=1, kv_usage=0.25, max_batch_size=8)
    seen = threading.Event()

    def read() -> SimpleNamespace:
        if len(m.running.calls) >= 2:
            seen.set()
        return stats

    r = GaugeRefresher(metrics=m, stats=read, period_s=0.01)
    r.start()
    assert seen.wait(5)
    r.stop()
    n = len(m.running.calls)
    time.sleep(0.05)
    assert len(m.running.calls) == n
    assert m.kv_usage.calls[-1][1] == 0.25 and m.max_batch_size.calls[-1][1] == 8


# -- the live app on Ray Serve -------------------------------------------------------

APP = "t-app"
PREFIX = "/t-app"


@pytest.fixture(scope="module")
def server(ray_cluster):
    from serving.app.deploy import delete_app, deploy_app

    deploy_app(
        ServerArgs(model="tiny", max_slots=16),
        LiveConfig(max_batch_size=8, ttft_p99_s=0.75, tpot_p99_s=0.08, max_ongoing_requests=16),
        name=APP,
        route_prefix=PREFIX,
        max_queued_requests=32,
    )
    yield SimpleNamespace(base=ray_cluster.http_url + PREFIX, metrics_url=ray_cluster.metrics_url)
    delete_app(APP)


def openai_client(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_objects(lines: Iterator[str]) -> Iterator[dict | str]:
    """The JSON objects of an SSE stream, then the string "[DONE]"."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


def stats(base: str) -> dict:
    r = httpx.get(base + "/stats", timeout=30)
    r.raise_for_status()
    return r.json()


def long_prompt_running_to_length(base: str, max_tokens: int) -> str:
    """A prompt whose greedy continuation does not hit EOS within max_tokens."""
    client = openai_client(base)
    for prompt in ("The quick brown fox", "Once upon a time", "abc", "slotune", "0123"):
        c = client.completions.create(
            model="slotune-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        if c.choices[0].finish_reason == "length":
            return prompt
    pytest.fail("every probe prompt ended on EOS: cannot build a long stream")


@pytest.mark.ray
def test_openai_client_stream_and_non_stream_agree(server) -> None:
    client = openai_client(server.base)
    full = client.completions.create(
        model="slotune-tiny", prompt="Hello, world", max_tokens=12, temperature=0
    )
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == "slotune-tiny"
    n = full.usage.completion_tokens
    assert 1 <= n <= 12
    assert choice.finish_reason == ("length" if n == 12 else "stop")
    assert full.usage.prompt_tokens >= len("Hello, world")
    chunks = list(
        client.completions.create(
            model="slotune-tiny",
            prompt="Hello, world",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # greedy: the same tokens either way
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    sampled = client.completions.create(
        model="slotune-tiny", prompt=[1, 2, 3], max_tokens=5, temperature=1.5
    )
    assert sampled.usage.prompt_tokens == 3 and sampled.usage.completion_tokens <= 5


@pytest.mark.ray
def test_replica_runs_with_the_threads_policy_and_priority_it_was_given(server) -> None:
    rt = stats(server.base)["runtime"]
    assert rt["torch_threads"] == 1  # ServerArgs.torch_threads, not Ray's OMP_NUM_THREADS
    assert rt["omp_wait_policy"] == "PASSIVE"
    # Ray renices workers to 15 unless told otherwise (serving.app.cluster.RAY_ENV_DEFAULTS):
    # the engine thread must run at the niceness of the process that started Ray.
    assert rt["engine_thread_niceness"] == os.getpriority(os.PRIO_PROCESS, 0)
    assert rt["user_code_in_separate_thread"] is False  # handlers on the replica's main loop


@pytest.mark.ray
def test_models_health_and_unknown_route(server) -> None:
    assert [m.id for m in openai_client(server.base).models.list().data] == ["slotune-tiny"]
    r = httpx.get(server.base + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(server.base + "/v2/nothing", timeout=30)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(server.base + "/v1/completions", timeout=30)
    assert r.status_code == 405


@pytest.mark.ray
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "x" * 600, "max_tokens": 4}, "exceeds the context length"),
        ({"prompt": "hi", "max_tokens": 10**7}, "exceeds the context length"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens=-1"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens='many'"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens=2.5"),
        ({"prompt": "hi", "best_of": 2}, "best_of: 2 is not supported (only 1)"),
        ({"prompt": [10**9]}, "prompt token"),
    ],
)
def test_bad_input_is_a_400_with_a_json_error(server, body: dict, fragment: str) -> None:
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"]
    r = httpx.post(server.base + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.ray
def test_openai_client_sees_bad_request_and_server_keeps_serving(server) -> None:
    import openai

    client = openai_client(server.base)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="slotune-tiny", prompt="hi", max_tokens=-3)
    ok = client.completions.create(model="slotune-tiny", prompt="hi", max_tokens=3)
    assert ok.usage.completion_tokens <= 3


@pytest.mark.ray
def test_client_disconnect_mid_stream_frees_the_kv_slot(server) -> None:
    max_tokens = 400
    prompt = long_prompt_running_to_length(server.base, 32)
    assert stats(server.base)["running"] == 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_objects(r.iter_lines())
            got = [next(events) for _ in range(3)]
            assert all(
                isinstance(e, dict) and e["choices"][0]["finish_reason"] is None for e in got
            )
            mid = stats(server.base)
            assert mid["running"] == 1 and mid["kv_usage"] > 0
        # leaving the block closes the connection with the stream unfinished
    deadline = time.monotonic() + 10
    while (s := stats(server.base))["running"] or s["kv_usage"]:
        assert time.monotonic() < deadline, f"slot still held after disconnect: {s}"
        time.sleep(0.05)


def _samples(text: str, name: str, app: str) -> list[tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("application") == app:
                out.append((s.labels, s.value))
    return out


@pytest.mark.ray
def test_contract_metrics_on_rays_export_port(server) -> None:
    client = openai_client(server.base)
    generated = 0
    for i in range(3):
        c = client.completions.create(
            model="slotune-tiny", prompt=f"metrics {i}", max_tokens=6, temperature=0
        )
        generated += c.usage.completion_tokens
    ttft_bucket = names.exported(names.TTFT_SECONDS) + "_bucket"
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(server.metrics_url, timeout=30).text
        done = _samples(text, names.exported(names.REQUESTS_TOTAL), APP)
        # Counters and histograms reach the export port in separate reports: wait for
        # all of them (CI once scraped the counter one report before the histograms).
        tokens = _samples(text, names.exported(names.GENERATED_TOKENS_TOTAL), APP)
        ready = (
            sum(v for _, v in done) >= 3
            and sum(v for _, v in tokens) >= generated
            and _samples(text, ttft_bucket, APP)
            and _samples(text, names.exported(names.TPOT_SECONDS) + "_bucket", APP)
        )
        if ready or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(v for _, v in done) >= 3
    assert {lab["slo_met"] for lab, _ in done} <= {"true", "false"}
    assert all(lab["deployment"] == "CompletionServer" and lab["replica"] for lab, _ in done)
    tokens = _samples(text, names.exported(names.GENERATED_TOKENS_TOTAL), APP)
    assert sum(v for _, v in tokens) >= generated
    les = {lab["le"] for lab, _ in _samples(text, ttft_bucket, APP)}
    # The deployed SLO (and the default) are bucket bounds.
    assert {"0.75", "1.0", "+Inf"} <= les
    tpot_les = {
        lab["le"] for lab, _ in _samples(text, names.exported(names.TPOT_SECONDS) + "_bucket", APP)
    }
    assert {"0.08", "0.1"} <= tpot_les
    count = _samples(text, names.exported(names.TTFT_SECONDS) + "_count", APP)
    assert sum(v for _, v in count) >= 3
    for gauge in (names.RUNNING_REQUESTS, names.KV_CACHE_USAGE_RATIO, names.MAX_BATCH_SIZE):
        assert _samples(text, names.exported(gauge), APP), f"{gauge} not exported"
    (mbs,) = _samples(text, names.exported(names.MAX_BATCH_SIZE), APP)
    assert mbs[1] == 8


def _run_stream(
    steps: list[tuple[int | list[int], float]], **kw: object
) -> tuple[list, list[bytes]]:
    """Drive sse_completion_stream with (token or chunk of tokens, clock-at-arrival) pairs."""
    import asyncio

    now = [0.0]

    async def chunks():
        for tok, t in steps:
            now[0] = t
            yield [tok] if isinstance(tok, int) else tok

    async def collect() -> list[bytes]:
        return [
            c
            async for c in oa.sse_completion_stream(
                chunks(),
                output=TextOutput(decode=lambda ids: bytes(ids).decode("utf-8", errors="replace")),
                completion_id="cmpl-x",
                model=MODEL,
                clock=lambda: now[0],
                **kw,
            )
        ]

    chunks_out = asyncio.run(collect())
    lines = b"".join(chunks_out).decode().split("\n\n")
    return [s[6:] if s == "data: [DONE]" else json.loads(s[6:]) for s in lines if s], chunks_out


def test_sse_stream_sends_first_token_at_once_and_coalesces_after() -> None:
    steps = [(ord(c), 0.01 * i) for i, c in enumerate("abcdefgh")]
    events, chunks = _run_stream(
        steps, max_tokens=8, prompt_tokens=3, include_usage=True, interval_s=0.025
    )
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]
    assert "".join(texts) == "abcdefgh"
    assert texts[0] == "a"  # first token not delayed
    assert texts[1:] == ["bcd", "efg", "h"]  # then at most one event per 25 ms
    assert events[-2]["usage"]["completion_tokens"] == 8 and events[-1] == "[DONE]"
    final = [e for e in events if isinstance(e, dict) and e["choices"]][-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == 4  # the end (last text, usage, [DONE]) is one write


def test_sse_stream_with_no_interval_sends_every_token() -> None:
    steps = [(ord(c), 0.0) for c in "xyz"]
    events, _ = _run_stream(steps, max_tokens=5, prompt_tokens=1, interval_s=0.0)
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict)]
    assert texts == ["x", "y", "z", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"


def test_sse_stream_sends_a_ready_chunk_as_one_event_and_counts_every_token() -> None:
    # A handler that fell behind gets several tokens at once: one event, none lost,
    # the first one still alone and at once.
    steps = [(ord("a"), 0.0), (list(b"bcd"), 0.5), (list(b"ef"), 1.0)]
    events, chunks = _run_stream(
        steps, max_tokens=6, prompt_tokens=2, include_usage=True, interval_s=0.0
    )
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]
    assert texts == ["a", "bcd", "ef", ""]
    assert len(chunks) == 4
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_sse_stream_asks_for_the_next_token_when_a_character_is_cut() -> None:
    # "é" is two bytes: after the first the text is incomplete, so the server asks
    # the engine to hand over the next token at once (not after its interval).
    asked: list[int] = []
    steps = [(0xC3, 0.0), (0xA9, 0.01), (ord("x"), 0.02), ([0xE2, 0x82], 0.03), (0xAC, 0.04)]
    events, _ = _run_stream(
        steps, max_tokens=6, prompt_tokens=1, on_incomplete=lambda: asked.append(1)
    )
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]
    assert "".join(texts) == "éx€"
    assert texts[0] == "é"
    assert len(asked) == 2  # after 0xC3 and after 0xE2 0x82, never after whole text
