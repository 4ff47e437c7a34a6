"""Prompts in the served model's tokens, without a server: exact counts with a tokenizer
trained in the test, token ids, characters without a tokenizer, and the LoadSpec fields
that choose them (endpoint, prompt_format, tokenizer, ignore_eos)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from controller.load.generator import run_load
from controller.load.prompts import PromptMaker
from controller.load.spec import (
    LoadSpec,
    TraceItem,
    completions_url,
    honours_ignore_eos,
    load_trace,
    saturating_spec,
)

URL = "http://127.0.0.1:1/v1/completions"


@pytest.mark.parametrize("kind", ["bpe", "wordlevel"])
@pytest.mark.parametrize(
    ("endpoint", "fmt"), [("completions", "text"), ("completions", "token_ids"), ("chat", "text")]
)
def test_prompts_have_exactly_the_sampled_token_count(request, kind, endpoint, fmt) -> None:
    path = request.getfixturevalue(kind)
    tok = Tokenizer.from_file(path)
    maker = PromptMaker(LoadSpec(url=URL, tokenizer=path, endpoint=endpoint, prompt_format=fmt))
    specials = endpoint == "completions"  # the server adds BOS to a completion's text
    bos = 1 if kind == "bpe" else 0
    for n in range(1, 70):
        p = maker.make(n, random.Random(n))
        if fmt == "token_ids":
            assert isinstance(p.value, tuple) and len(p.value) == n == p.tokens
            assert all(0 <= i < tok.get_vocab_size() for i in p.value)
            if bos:
                assert p.value[0] == tok.token_to_id("<s>")  # as the server would see text
            continue
        assert isinstance(p.value, str)
        counted = len(tok.encode(p.value, add_special_tokens=specials).ids)
        assert p.tokens == counted  # the recorded count is always the true one
        if n > bos or not specials:
            assert counted == n, (n, p.value)


def test_prompts_are_deterministic_per_seed(bpe) -> None:
    maker = PromptMaker(LoadSpec(url=URL, tokenizer=bpe))
    a = [maker.make(20, r).value for r in [random.Random(3)] * 4]
    b = [maker.make(20, r).value for r in [random.Random(3)] * 4]
    c = [maker.make(20, r).value for r in [random.Random(4)] * 4]
    assert a == b and a != c and len(set(a)) == 4  # one rng draws distinct prompts


def test_no_tokenizer_sizes_in_characters_and_token_ids_are_ascii() -> None:
    text = PromptMaker(LoadSpec(url=URL)).make(37, random.Random(0))
    assert isinstance(text.value, str) and len(text.value) == 37 == text.tokens
    ids = PromptMaker(LoadSpec(url=URL, prompt_format="token_ids")).make(37, random.Random(0))
    assert ids.value == tuple(text.value.encode("ascii")) and ids.tokens == 37


def test_trace_text_is_counted_with_the_tokenizer(bpe) -> None:
    tok = Tokenizer.from_file(bpe)
    maker = PromptMaker(LoadSpec(url=URL, tokenizer=bpe))
    p = maker.from_text("the quick brown fox")
    assert p.value == "the quick brown fox"
    assert p.tokens == len(tok.encode("the quick brown fox").ids)
    ids = PromptMaker(LoadSpec(url=URL, tokenizer=bpe, prompt_format="token_ids")).from_text("hi")
    assert list(ids.value) == tok.encode("hi").ids


def test_a_directory_holding_tokenizer_json_works(bpe) -> None:
    spec = LoadSpec(url=URL, tokenizer=str(Path(bpe).parent))
    assert PromptMaker(spec).make(9, random.Random(0)).tokens == 9


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"endpoint": "embeddings"}, "endpoint='embeddings'"),
        ({"prompt_format": "ids"}, "prompt_format='ids'"),
        ({"endpoint": "chat", "prompt_format": "token_ids"}, "prompt_format='token_ids'"),
        ({"tokenizer": "/nonexistent/tok.json"}, "tokenizer='/nonexistent/tok.json'"),
        ({"ignore_eos": "yes"}, "ignore_eos='yes'"),
        (
            {
                "prompt_format": "token_ids",
                "mode": "trace",
                "trace": (TraceItem(max_tokens=2, prompt="hi"),),
            },
            "needs a tokenizer",
        ),
    ],
)
def test_spec_validation_names_the_bad_value(kw, match) -> None:
    with pytest.raises(ValueError, match=match) as e:
        LoadSpec(url=URL, **kw)
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_a_tokenizer_fails_at_start(tmp_path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    spec = LoadSpec(url=URL, tokenizer=str(bad), max_requests=1, duration_s=5)
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        asyncio.run(run_load(spec))


def test_urls_summary_and_server_defaults(bpe) -> None:
    assert completions_url("http://h:1/", "chat") == "http://h:1/v1/chat/completions"
    assert completions_url("http://h:1/v1/completions", "chat") == "http://h:1/v1/chat/completions"
    assert completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/p/v1/completions") == "http://h:1/p/v1/completions"
    with pytest.raises(ValueError, match="endpoint='x'"):
        completions_url("http://h:1", "x")
    assert honours_ignore_eos("vllm") and honours_ignore_eos("sglang")
    assert honours_ignore_eos("slotune") and not honours_ignore_eos("openai")
    s = saturating_spec(
        URL, max_concurrency=3, duration_s=2.0, endpoint="chat", tokenizer=bpe, ignore_eos=True
    )
    summary = s.summary()
    assert summary["endpoint"] == "chat" and summary["tokenizer"] == bpe
    assert summary["prompt_format"] == "text" and summary["ignore_eos"] is True
    assert summary["concurrency"] == 3 and summary["prompt_tokens"] == "32"
    json.dumps(summary)  # a report can write it as is


def test_an_empty_trace_prompt_is_refused_when_read(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 2}\n{"prompt": "", "max_tokens": 2}\n')
    with pytest.raises(ValueError, match="line 2: trace prompt=''"):
        load_trace(path)


@pytest.mark.parametrize(
    ("endpoint", "fmt"), [("completions", "text"), ("completions", "token_ids"), ("chat", "text")]
)
def test_slotune_server_parses_every_body_the_generator_sends(endpoint, fmt) -> None:
    from controller.load.request import request_body
    from serving.app.openai_request import parse_chat_request, parse_completion_request

    spec = LoadSpec(url=URL, endpoint=endpoint, prompt_format=fmt, ignore_eos=True, model="m")
    prompt = PromptMaker(spec).make(11, random.Random(0))
    body = json.loads(json.dumps(request_body(spec, prompt, 7)))  # as it goes on the wire
    parse = parse_chat_request if endpoint == "chat" else parse_completion_request
    req = parse(body, served_model="m")
    assert req.max_tokens == 7 and req.ignore_eos and req.stream and req.include_usage
    if endpoint == "completions":
        assert req.prompt == prompt.value
