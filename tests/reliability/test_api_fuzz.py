"""Arbitrary bytes, JSON, strings and headers against the completion API (issue 17): the parser
only ever returns a request or raises an OpenAI-style 4xx; the live endpoint never
answers 5xx, never hangs, and serves a reference request correctly after each input.

The live part runs on the session Ray cluster over loopback, bounded by
``max_examples`` and a per-request timeout.
"""

from __future__ import annotations

import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.app import openai_api as oa
from serving.app import openai_request as oreq
from serving.app.openai_fields import COMPLETION_FIELDS
from tests.fixtures.tiny_app import tiny_app

SERVED = "slotune-tiny"
# Every field the completion endpoint knows (honoured or default-only), plus unknown ones.
FIELDS = sorted(COMPLETION_FIELDS) + ["bogus", "\ud800", ""]

# Text including lone surrogates (hypothesis leaves them out by default).
texts = st.text(
    st.one_of(
        st.characters(),
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    ),
    max_size=40,
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(FIELDS) | texts, inner)
    ),
    max_leaves=20,
)
# Bodies that look like requests: real field names with arbitrary values.
requestish = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


def _check_parsed(body: object) -> None:
    try:
        req = oreq.parse_completion_request(body, served_model=SERVED)
    except oa.ApiError as e:
        assert 400 <= e.status < 500
        err = e.body()["error"]
        assert isinstance(err["message"], str) and err["message"]
        json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # as Starlette sends it
        return
    assert isinstance(req, oreq.CompletionRequest)
    if isinstance(req.prompt, str):
        req.prompt.encode("utf-8")  # what the tokenizer will do: never fails now


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_give_a_4xx(raw: bytes) -> None:
    try:
        body = oa.parse_json_body(raw)
    except oa.ApiError as e:
        assert 400 <= e.status < 500
        return
    _check_parsed(body)


@settings(max_examples=400, deadline=None)
@given(st.one_of(json_values, requestish))
def test_arbitrary_json_values_give_a_request_or_a_4xx(body: object) -> None:
    _check_parsed(body)


def test_the_inputs_that_used_to_escape_as_500() -> None:
    with pytest.raises(oa.ApiError, match="lone surrogate"):
        oreq.parse_completion_request(oa.parse_json_body(b'{"prompt":"\\ud800"}'), served_model="m")
    with pytest.raises(oa.ApiError, match="nested too deeply"):
        oa.parse_json_body(b"[" * 20_000 + b"]" * 20_000)
    with pytest.raises(oa.ApiError, match="not UTF-8"):
        oa.parse_json_body(b'{"prompt": "\xff"}')
    with pytest.raises(oa.ApiError, match="not a JSON value"):
        oa.parse_json_body(b'{"prompt": "x", "temperature": NaN}')
    with pytest.raises(oa.ApiError, match="not valid JSON"):
        oa.parse_json_body(b'{"max_tokens": 1' + b"0" * 5000 + b"}")  # over int's digits limit
    with pytest.raises(oa.ApiError, match="one prompt per request"):
        oreq.parse_completion_request({"prompt": [[[1]]]}, served_model="m")


def test_stream_options_need_a_stream_and_a_boolean() -> None:
    parse = oreq.parse_completion_request
    with pytest.raises(oa.ApiError, match="only allowed with stream: true"):
        parse({"prompt": "x", "stream_options": {"include_usage": True}}, served_model="m")
    with pytest.raises(oa.ApiError, match="must be true or false") as e:
        parse(
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
            served_model="m",
        )
    assert e.value.param == "stream_options.include_usage"
    ok = parse(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        served_model="m",
    )
    assert ok.include_usage is True


# ---- the live endpoint --------------------------------------------------------------------

APP = "fuzz"
REF = {"prompt": "abc", "max_tokens": 3, "temperature": 0}
CONTENT_TYPES = ["application/json", "text/plain", "", "application/json; charset=latin-1"]


@pytest.fixture(scope="module")
def endpoint(ray_cluster):
    with (
        tiny_app(ray_cluster, APP, batch=2, ongoing=4, queued=8) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        ref = client.post("/v1/completions", json=REF)
        assert ref.status_code == 200
        yield client, ref.json()["choices"][0]["text"]


def _post_and_check(client: httpx.Client, reference: str, content: bytes, ctype: str) -> None:
    headers = {"content-type": ctype} if ctype else {}
    r = client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code < 500, (r.status_code, content[:200], r.text[:300])
    if r.status_code >= 400:
        assert "message" in r.json()["error"], r.text[:300]
    again = client.post("/v1/completions", json=REF)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference


@pytest.mark.ray
@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=300), ctype=st.sampled_from(CONTENT_TYPES))
def test_live_endpoint_arbitrary_bytes(endpoint, raw: bytes, ctype: str) -> None:
    _post_and_check(*endpoint, raw, ctype)


@pytest.mark.ray
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(json_values, requestish))
def test_live_endpoint_arbitrary_json(endpoint, body: object) -> None:
    try:
        raw = json.dumps(body).encode()
    except (UnicodeEncodeError, ValueError):  # a surrogate key json cannot escape: as text
        raw = repr(body).encode("utf-8", "surrogateescape")
    _post_and_check(*endpoint, raw, "application/json")


@pytest.mark.ray
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.text(string.ascii_letters + string.digits + "/._-%?&=", max_size=30),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
)
def test_live_endpoint_arbitrary_routes_and_methods(endpoint, path: str, method: str) -> None:
    client, reference = endpoint
    r = client.request(method, "/" + path.lstrip("/"))
    assert r.status_code < 500, (method, path, r.status_code, r.text[:200])
    again = client.post("/v1/completions", json=REF)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference


# Headers a client may send with any value; framing headers (Host, Content-Length,
# Transfer-Encoding, Connection) are the HTTP layer's and left out.
HEADER_NAMES = [
    "content-type", "content-encoding", "accept", "accept-encoding", "authorization",
    "user-agent", "x-request-id", "openai-organization", "cookie", "range", "expect",
]  # fmt: skip
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


@pytest.mark.ray
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    headers=st.dictionaries(st.sampled_from(HEADER_NAMES), header_values, max_size=4),
    body=st.sampled_from([json.dumps(REF).encode(), b"", b"{", b"\x1f\x8b\x08\x00"]),
)
def test_live_endpoint_arbitrary_headers(endpoint, headers: dict[str, str], body: bytes) -> None:
    client, reference = endpoint
    headers = {k: v.strip() for k, v in headers.items()}
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code < 500, (headers, body, r.status_code, r.text[:200])
    again = client.post("/v1/completions", json=REF)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
