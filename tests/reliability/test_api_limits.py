"""Limits of the live completion API (issue 17): an oversized body is refused before it is
read, an impossible prompt before it is tokenized, and a client that leaves mid-stream is
still counted. The session Ray cluster, loopback only, bounded."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.fixtures.tiny_app import tiny_app

pytestmark = pytest.mark.ray

APP = "limits"


@pytest.fixture(scope="module")
def base(ray_cluster):
    with tiny_app(ray_cluster, APP, batch=2, ongoing=2, queued=4) as url:
        yield url


def test_a_body_declared_too_large_is_refused_before_it_is_sent(base: str) -> None:
    """Headers announce 100 MB, 20 bytes follow, and the connection stays open: the 413
    comes back without the server waiting for the rest."""
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port), timeout=20) as s:
        s.sendall(
            (
                f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
                '{"prompt": "xxxxxx'
            ).encode()
        )
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            more = s.recv(65536)
            if not more:
                break
            data += more
    head, body = data.decode(errors="replace").split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 413"), head[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"


def _length(response: bytes) -> int:
    """The Content-Length of a response whose headers have arrived."""
    for line in response.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_a_chunked_upload_is_cut_off_at_the_limit(base: str) -> None:
    def chunks():
        yield b'{"prompt": "'
        for _ in range(64):  # 64 x 64 KiB = 4 MiB, over the 1 MiB default
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(base + "/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_a_prompt_too_long_by_its_length_is_refused_untokenized(base: str) -> None:
    r = httpx.post(base + "/v1/completions", json={"prompt": "x" * 500_000}, timeout=60)
    assert r.status_code == 400
    assert "characters cannot fit the context" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "\\ud800"}', timeout=60)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def _aborted(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ray_slotune_aborted_requests_total{")
        and 'reason="client_disconnect"' in line
        and f'application="{APP}"' in line
    )


def test_a_client_that_leaves_mid_stream_is_counted(base: str, ray_cluster) -> None:
    before = _aborted(ray_cluster.metrics_url)
    body = {"prompt": "go", "max_tokens": 400, "temperature": 0, "stream": True}
    for _ in range(3):
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break  # the first token: now hang up
    deadline = time.monotonic() + 20
    while _aborted(ray_cluster.metrics_url) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _aborted(ray_cluster.metrics_url) == before + 3
    stats = httpx.get(base + "/stats", timeout=10).json()
    assert stats["admitted"] == 0 and stats["queued"] == 0  # their places were given back


def _raw_status(base: str, head: bytes) -> int:
    """Send ``head`` (request line and headers, no body) and read the status code."""
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port), timeout=20) as s:
        s.sendall(head)
        data = b""
        while b"\r\n" not in data:
            more = s.recv(4096)
            if not more:
                break
            data += more
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize(
    "declared", [b"abc", b"-1", b"1e3", b"9" * 18, b"9" * 30, b"9" * 5000, b"\xb2"]
)
def test_a_content_length_that_is_no_byte_count_or_too_big_is_a_4xx_at_once(
    base: str, declared: bytes
) -> None:
    """The HTTP parser refuses what is not digits or not a 64-bit count; a number past the
    limit is the replica's 413 from the header alone (no body follows)."""
    url = urlparse(base)
    status = _raw_status(
        base,
        f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: "
        + declared
        + b"\r\n\r\n",
    )
    assert 400 <= status < 500, (declared[:40], status)
    if declared == b"9" * 18:
        assert status == 413
    r = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_token_ids_too_many_for_the_context_are_refused_by_their_count(base: str) -> None:
    r = httpx.post(base + "/v1/completions", json={"prompt": [1] * 600}, timeout=60)
    assert r.status_code == 400
    assert "600 token ids cannot fit the context" in r.json()["error"]["message"]
