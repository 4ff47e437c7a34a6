"""Client compatibility (issue 18): what vLLM's benchmark client and other OpenAI/vLLM
tools send is accepted; ``ignore_eos``, ``min_tokens``, stop strings and ids and
``continuous_usage_stats`` are honoured; what cannot be honoured is a 400 naming the
field; ``completion_tokens`` never counts the stop token.

The request bodies are the ones vLLM's benchmark client builds
(vllm-project/vllm: vllm/benchmarks/lib/endpoint_request_func.py,
``async_request_openai_completions`` and ``async_request_openai_chat_completions``; its
``--extra-body`` adds fields such as ``stream_options.continuous_usage_stats``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.app import openai_api as oa
from serving.app import openai_request as oreq
from serving.app.openai_fields import CHAT_FIELDS
from serving.app.text_output import TextOutput
from serving.engine.engine import Engine
from serving.model.config import ModelConfig
from serving.model.tokenizer import ByteTokenizer, render_chat
from tests.fixtures.tiny_app import tiny_app

MODEL = "slotune-tiny"
EOS = ByteTokenizer.EOS


def vllm_bench_completions_body(prompt: str, output_len: int, **extra: object) -> dict:
    """endpoint_request_func.py ``async_request_openai_completions``'s payload, with
    ``ignore_eos`` as ``--ignore-eos`` sets it and ``extra`` as ``--extra-body`` merges it."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    } | extra


def vllm_bench_chat_body(prompt: str, output_len: int, **extra: object) -> dict:
    """endpoint_request_func.py ``async_request_openai_chat_completions``'s payload."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    } | extra


CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


# -- parsing ----------------------------------------------------------------------------


def test_vllm_bench_completions_body_parses_with_its_extensions() -> None:
    r = oreq.parse_completion_request(
        vllm_bench_completions_body("hello", 32, **CONTINUOUS), served_model=MODEL
    )
    assert (r.prompt, r.max_tokens, r.stream, r.ignore_eos) == ("hello", 32, True, True)
    assert r.include_usage and r.continuous_usage and not r.chat


def test_vllm_bench_chat_body_parses_to_the_plain_template() -> None:
    r = oreq.parse_chat_request(vllm_bench_chat_body("hello", 8), served_model=MODEL)
    assert r.prompt == "user: hello\nassistant: " == render_chat([("user", "hello")])
    assert (r.max_tokens, r.ignore_eos, r.chat, r.include_usage) == (8, True, True, True)
    plain = oreq.parse_chat_request(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]},
        served_model=MODEL,
    )
    assert plain.prompt == "system: be brief\nuser: q\nassistant: "
    assert plain.max_tokens is None and plain.temperature == 1.0  # the context decides
    assert (
        oreq.parse_chat_request(
            {"messages": [{"role": "user", "content": "q"}], "add_generation_prompt": False},
            served_model=MODEL,
        ).prompt
        == "user: q\n"
    )


# Every standard field at the value a client sends when it does not use it.
AT_DEFAULTS = {
    "logprobs": None, "n": 1, "stop": None, "seed": None, "user": "u", "echo": False,
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
    "suffix": None, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1.0,
    "length_penalty": 1, "use_beam_search": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "response_format": {"type": "text"},
    "tools": None, "tool_choice": "none", "priority": 0, "min_tokens": 0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "truncate_prompt_tokens": None,
}  # fmt: skip


def test_standard_fields_at_their_defaults_are_accepted_on_both_endpoints() -> None:
    r = oreq.parse_completion_request({"prompt": "x"} | AT_DEFAULTS, served_model=MODEL)
    assert r.stop == () and r.min_tokens == 0 and not r.ignore_eos
    c = oreq.parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 0}
        | AT_DEFAULTS,
        served_model=MODEL,
    )
    assert c.chat


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 2, "n: 2 is not supported (only 1)"),
        ("best_of", 3, "best_of: 3 is not supported (only 1)"),
        ("top_p", 0.9, "top_p: 0.9 is not supported (only 1)"),
        ("logprobs", 1, "logprobs: 1 is not supported"),
        ("echo", True, "echo: True is not supported"),
        ("presence_penalty", 0.5, "presence_penalty: 0.5 is not supported"),
        ("logit_bias", {"5": 10}, "logit_bias: {'5': 10} is not supported"),
        ("suffix", "end", "suffix: 'end' is not supported"),
        ("response_format", {"type": "json_object"}, "response_format:"),
        ("seed", 7, "seed: 7 is not supported with temperature 1.0"),
        ("use_beam_search", True, "use_beam_search: True is not supported"),
    ],
)
def test_a_value_it_cannot_honour_is_a_400_naming_the_field(
    field: str, value: object, message: str
) -> None:
    for parse, base in (
        (oreq.parse_completion_request, {"prompt": "x"}),
        (oreq.parse_chat_request, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        with pytest.raises(oa.ApiError) as e:
            parse(base | {field: value}, served_model=MODEL)
        assert e.value.status == 400 and e.value.param == field
        assert e.value.message.startswith(message), e.value.message


def test_seed_is_honoured_with_greedy_decoding() -> None:
    r = oreq.parse_completion_request(
        {"prompt": "x", "seed": 7, "temperature": 0}, served_model=MODEL
    )
    assert r.temperature == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stream_options": {"continuous_usage_stats": 1}, "stream": True}, None),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_values_of_honoured_extensions_are_400s(body: dict, param: str | None) -> None:
    with pytest.raises(oa.ApiError) as e:
        oreq.parse_completion_request({"prompt": "x"} | body, served_model=MODEL)
    assert e.value.status == 400
    assert e.value.param == (param or "stream_options.continuous_usage_stats")


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0].content[0].type"),
        (7, "messages[0].content"),
    ],
)
def test_chat_content_it_cannot_render_is_refused_naming_the_part(
    content: object, param: str
) -> None:
    with pytest.raises(oa.ApiError) as e:
        oreq.parse_chat_request(
            {"messages": [{"role": "user", "content": content}]}, served_model=MODEL
        )
    assert e.value.param == param


def test_unknown_fields_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    body = {"prompt": "x", "compat_test_field": 1, "request_id": "r-1"}
    with caplog.at_level(logging.WARNING, logger="serving.app.openai_fields"):
        oreq.parse_completion_request(body, served_model=MODEL)
        oreq.parse_completion_request(body, served_model=MODEL)
    logged = [r for r in caplog.records if "compat_test_field" in r.getMessage()]
    assert len(logged) == 1


def test_stream_options_follow_vllm() -> None:
    def opts(o: dict) -> tuple[bool, bool]:
        r = oreq.parse_completion_request(
            {"prompt": "x", "stream": True, "stream_options": o}, served_model=MODEL
        )
        return r.include_usage, r.continuous_usage

    assert opts({}) == (True, False)  # vLLM's StreamOptions: include_usage defaults true
    assert opts({"continuous_usage_stats": True}) == (True, True)
    assert opts({"include_usage": False, "continuous_usage_stats": True}) == (False, False)
    assert opts({"include_obfuscation": False}) == (True, False)  # other keys ignored
    no_stream = oreq.parse_completion_request(
        {"prompt": "x", "stream_options": {}}, served_model=MODEL
    )
    assert not no_stream.include_usage


chat_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["role", "content", "type", "text", "x"]), inner),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(CHAT_FIELDS) + ["bogus"]), chat_values))
def test_chat_parser_returns_a_request_or_a_4xx(body: dict) -> None:
    try:
        req = oreq.parse_chat_request(body, served_model=MODEL)
    except oa.ApiError as e:
        assert 400 <= e.status < 500 and e.message
        json.dumps(e.body(), ensure_ascii=False).encode("utf-8")
    else:
        assert req.chat and isinstance(req.prompt, str)


# -- the text a client sees and the tokens counted ---------------------------------------


def byte_decode(ids) -> str:
    return ByteTokenizer(vocab_size=512).decode(list(ids))


def test_the_stop_token_is_neither_shown_nor_counted() -> None:
    out = TextOutput(decode=byte_decode, stop_ids=frozenset({EOS}))
    assert out.push(list(b"ab")) == "ab"
    assert out.push([ord("c"), EOS]) == "c"
    assert out.finish(max_tokens=10) == ("", "stop")
    assert out.tokens == 3 and out.stopped == "id"
    # the stop token as the max_tokens-th token: still a stop, still not counted
    last = TextOutput(decode=byte_decode, stop_ids=frozenset({EOS}))
    last.push([ord("a"), EOS])
    assert last.finish(max_tokens=2) == ("", "stop") and last.tokens == 1
    # EOS not a stop id (ignore_eos): counted, shows nothing, the budget ends it
    ignored = TextOutput(decode=byte_decode)
    assert ignored.push([ord("a"), EOS, ord("b")]) == "ab"
    assert ignored.finish(max_tokens=3) == ("", "length") and ignored.tokens == 3


def test_stop_strings_across_chunks_cut_the_text_and_the_count() -> None:
    out = TextOutput(decode=byte_decode, stop=("END",))
    sent = out.push(list(b"hello E")) + out.push(list(b"N")) + out.push(list(b"D and more"))
    tail, finish = out.finish(max_tokens=50)
    assert sent + tail == "hello " and finish == "stop" and out.stopped == "string"
    assert out.tokens == len("hello ")  # the tokens of "END" produced no output
    assert out.push(list(b"late")) == ""  # after the stop nothing more comes out
    kept = TextOutput(decode=byte_decode, stop=("END", "lo"), include_stop_str=True)
    assert kept.push(list(b"hello END")) + kept.finish(50)[0] == "hello"
    assert kept.tokens == len("hello")


def test_no_stop_string_before_min_tokens() -> None:
    out = TextOutput(decode=byte_decode, stop=("a",), min_tokens=2)
    text = out.push(list(b"aXa")) + out.push(list(b"bab")) + out.finish(50)[0]
    assert text == "aX" and out.tokens == 2  # the first "a" was token 1 of min_tokens 2


def test_a_stop_string_never_splits_a_character() -> None:
    out = TextOutput(decode=byte_decode, stop=("€",))
    euro = list("€".encode())
    assert out.push(list(b"x") + euro[:1]) == "x"  # the cut character is held
    assert out.push(euro[1:2]) == ""
    assert out.push(euro[2:]) == "" and out.stopped == "string"
    assert out.finish(9) == ("", "stop") and out.tokens == 1


def run_stream(chunks: list[list[int]], **kw: object) -> list:
    async def gen():
        for c in chunks:
            yield c

    async def collect() -> bytes:
        return b"".join(
            [
                e
                async for e in oa.sse_completion_stream(
                    gen(),
                    completion_id="chatcmpl-1",
                    model=MODEL,
                    prompt_tokens=4,
                    **kw,
                )
            ]
        )

    lines = asyncio.run(collect()).decode().split("\n\n")
    return [s[6:] if s == "data: [DONE]" else json.loads(s[6:]) for s in lines if s]


def test_chat_stream_format_with_usage_in_every_chunk() -> None:
    events = run_stream(
        [list(b"hi"), list(b" there"), [EOS]],
        output=TextOutput(decode=byte_decode, stop_ids=frozenset({EOS})),
        max_tokens=20,
        chat=True,
        include_usage=True,
        continuous_usage=True,
    )
    *chunks, last_usage, done = events
    assert done == "[DONE]" and last_usage["choices"] == []
    assert last_usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks + [last_usage])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "hi"}
    assert "".join(d.get("content", "") for d in deltas) == "hi there"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert [c["usage"]["completion_tokens"] for c in chunks] == [2, 8, 8]


def test_a_stream_ended_by_a_stop_string_stops_reading_the_engine() -> None:
    read: list[int] = []

    async def engine():
        for c in (list(b"ab"), list(b"c."), list(b"never")):
            read.append(len(c))
            yield c

    async def collect() -> list[bytes]:
        return [
            e
            async for e in oa.sse_completion_stream(
                engine(),
                output=TextOutput(decode=byte_decode, stop=(".",)),
                completion_id="cmpl-1",
                model=MODEL,
                max_tokens=50,
                prompt_tokens=1,
                include_usage=True,
            )
        ]

    body = b"".join(asyncio.run(collect())).decode()
    assert read == [2, 2]
    events = [json.loads(s[6:]) for s in body.split("\n\n") if s.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "abc"
    assert events[-1]["usage"]["completion_tokens"] == 3


# -- the engine: ignore_eos and min_tokens ------------------------------------------------


class _EosLoving(torch.nn.Module):
    """The model, with EOS the likeliest token by far at every position."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.inner(*args, **kwargs)
        out[..., EOS] += 1e4
        return out


@pytest.fixture(scope="module")
def eos_engine() -> Engine:
    eng = Engine(
        model_config=ModelConfig.from_name("tiny", dtype="float32"),
        max_slots=2,
        max_batch_size=2,
        max_len=32,
        num_threads=1,
    )
    eng.executor.model = _EosLoving(eng.model)
    return eng


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_honours_ignore_eos_and_min_tokens(eos_engine: Engine, temperature: float) -> None:
    prompt = list(b"hello")
    kw = {"max_tokens": 6, "temperature": temperature}
    assert eos_engine.generate(prompt, stop_ids=[EOS], **kw) == [EOS]
    assert eos_engine.generate(prompt, stop_ids=[], **kw) == [EOS] * 6  # ignore_eos
    ids = eos_engine.generate(prompt, stop_ids=[EOS], min_tokens=3, **kw)
    assert len(ids) == 4 and EOS not in ids[:3] and ids[3] == EOS
    out = TextOutput(decode=byte_decode, stop_ids=frozenset({EOS}))
    out.push(ids)
    assert out.finish(6)[1] == "stop" and out.tokens == 3
    with pytest.raises(ValueError, match="every token id is a stop id"):
        eos_engine.add_request(prompt, max_tokens=4, stop_ids=range(512), min_tokens=1)
    assert not eos_engine.has_work


# -- the live app -------------------------------------------------------------------------

APP = "compat"


@pytest.fixture(scope="module")
def base(ray_cluster):
    with tiny_app(ray_cluster, APP, batch=4, ongoing=4, queued=8) as url:
        yield url


def sse(base: str, path: str, body: dict) -> list:
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + path, json=body) as r:
            assert r.status_code == 200, r.read()
            data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.ray
@pytest.mark.parametrize(
    ("path", "make", "text_of"),
    [
        ("/v1/completions", vllm_bench_completions_body, lambda c: c["text"]),
        ("/v1/chat/completions", vllm_bench_chat_body, lambda c: c["delta"].get("content", "")),
    ],
)
def test_vllm_bench_body_streams_the_requested_tokens(base: str, path, make, text_of) -> None:
    events = sse(base, path, make("The quick brown fox", 40, temperature=0, **CONTINUOUS))
    chunks, last = events[:-1], events[-1]
    assert chunks and all(c["choices"] for c in chunks) and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 40  # ignore_eos: the whole budget
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # continuous usage stats
    assert counts == sorted(counts) and counts[-1] == 40 and counts[0] >= 1
    assert isinstance("".join(text_of(c["choices"][0]) for c in chunks), str)
    plain = sse(base, path, make("The quick brown fox", 40, temperature=0))
    assert "usage" not in plain[0] and plain[-1]["usage"]["completion_tokens"] == 40


@pytest.mark.ray
def test_ignore_eos_continues_past_eos_live(base: str) -> None:
    """A prompt whose greedy output ends on EOS goes on to max_tokens with ignore_eos."""
    for prompt in ("abc", "Hello", "0123", "slotune", "The end", "x", "Once upon a time"):
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        if r["choices"][0]["finish_reason"] == "stop":
            full = httpx.post(
                base + "/v1/completions", json=body | {"ignore_eos": True}, timeout=60
            ).json()
            assert full["usage"]["completion_tokens"] == 48
            assert full["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["completion_tokens"] < 48
            return
    pytest.skip("no probe prompt ends on EOS with this model (the engine test covers it)")


@pytest.mark.ray
def test_stop_token_and_min_tokens_live(base: str) -> None:
    """Every id a stop id: the first token ends the request and is not counted. Every id
    but 511 (one printable character with the byte tokenizer): min_tokens forces 511."""
    every = list(range(512))
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop_token_ids": every},
        timeout=60,
    ).json()
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0] == {
        "index": 0, "text": "", "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip
    events = sse(
        base,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "stop_token_ids": every[:-1],
            "min_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    one = ByteTokenizer(vocab_size=512).decode([511])
    assert text.startswith(one * 3) and set(text) == {one}
    assert events[-1]["usage"]["completion_tokens"] == len(text)  # one token a character


@pytest.mark.ray
def test_stop_strings_and_400s_live(base: str) -> None:
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = next((ch for ch in text[3:] if ch.isascii() and ch.isprintable()), None)
    if stop is not None:
        cut = httpx.post(base + "/v1/completions", json=body | {"stop": [stop]}, timeout=60)
        got = cut.json()
        assert got["choices"][0]["text"] == text[: text.index(stop)]
        assert got["choices"][0]["finish_reason"] == "stop"
        assert got["usage"]["completion_tokens"] < 30
    msgs = {"messages": [{"role": "user", "content": "x"}]}
    for path, req, field in (
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/chat/completions", msgs | {"top_p": 0.5}, "top_p"),
        ("/v1/chat/completions", msgs | {"logprobs": True}, "logprobs"),
    ):
        r = httpx.post(base + path, json=req, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert r.json()["error"]["message"].startswith(f"{field}: ")
    ok = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "my_tag": 1},
        timeout=60,
    ).json()
    assert ok["object"] == "chat.completion" and ok["choices"][0]["message"]["role"] == "assistant"
    assert ok["usage"]["completion_tokens"] <= 3


def test_ignore_eos_drops_only_eos_from_the_stop_ids() -> None:
    from serving.app.completions import request_stop_ids

    def stop_ids(**body: object) -> frozenset[int]:
        req = oreq.parse_completion_request({"prompt": "x"} | body, served_model=MODEL)
        return request_stop_ids(req, eos_ids=frozenset((EOS, 99)))

    assert stop_ids() == {EOS, 99}  # every end id of the model
    assert stop_ids(ignore_eos=True) == frozenset()
    assert stop_ids(ignore_eos=True, stop_token_ids=[46]) == {46}
    assert stop_ids(stop_token_ids=[46, 46]) == {EOS, 99, 46}
