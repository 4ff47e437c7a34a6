"""TTFT from the deployment's front door: the proxy's arrival stamp, its trust rules, the
replica-clock histogram beside it, a streamed TTFT observed once (by the proxy, the
handover header kept from the client), and client disconnects mid-stream in the metrics.

The Ray tests deploy the tiny model on the session cluster (started by
serving.app.cluster.start_local_ray, whose environment installs the proxy callback) and
talk to it over loopback HTTP.
"""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import httpx
import pytest
from starlette.datastructures import Headers

from metrics import names
from metrics.observation import Slo
from serving.app import ray_private
from serving.app.front_door import (
    ARRIVAL_HEADER,
    MAX_STAMP_AGE_S,
    TTFT_HANDOFF_HEADER,
    ArrivalStamp,
    front_door_arrival,
    stamp_age_s,
)
from serving.app.serve_metrics import ServeMetrics
from tests.fixtures.tiny_app import tiny_app

# -- the middleware and the stamp ------------------------------------------------


def _run_stamp(scope: dict) -> dict:
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        seen.update(scope)

    async def receive() -> dict:
        return {"type": "http.request"}

    async def send(message) -> None:
        pass

    asyncio.run(ArrivalStamp(app, wall_ns=lambda: 1234)(scope, receive, send))
    return seen


def test_the_stamp_replaces_one_the_client_sent() -> None:
    key = ARRIVAL_HEADER.encode()
    seen = _run_stamp({"type": "http", "headers": [(b"host", b"x"), (key, b"1"), (key, b"2")]})
    assert seen["headers"] == [(b"host", b"x"), (key, b"1234")]


def test_other_scopes_pass_unstamped() -> None:
    seen = _run_stamp({"type": "lifespan"})
    assert "headers" not in seen


@pytest.mark.parametrize(
    ("value", "age"),
    [
        (None, None),
        ("", None),
        ("12a", None),
        ("-5", None),
        ("1" * 21, None),
        (str(10**12), 0.0),  # now
        (str(10**12 - 250_000_000), 0.25),
        (str(10**12 + 1), None),  # from the future: another node's clock, or forged
        (str(10**12 - int((MAX_STAMP_AGE_S + 1) * 1e9)), None),  # too old to believe
    ],
)
def test_stamp_age(value: str | None, age: float | None) -> None:
    got = stamp_age_s(value, now_wall_ns=10**12)
    assert got == (None if age is None else pytest.approx(age))


def test_front_door_arrival_on_the_engine_clock_only_when_trusted() -> None:
    h = Headers({ARRIVAL_HEADER: str(10**12 - 100_000_000)})
    assert front_door_arrival(
        h, trusted=True, now_engine=50.0, now_wall_ns=10**12
    ) == pytest.approx(49.9)
    assert front_door_arrival(h, trusted=False, now_engine=50.0, now_wall_ns=10**12) is None
    assert front_door_arrival(Headers({}), trusted=True, now_engine=5.0, now_wall_ns=1) is None


def test_proxy_callback_returns_the_stamp_middleware(monkeypatch) -> None:
    (mw,) = ray_private.proxy_middlewares()
    assert mw.cls is ArrivalStamp
    monkeypatch.setenv(ray_private.PROXY_CALLBACK_ENV, ray_private.PROXY_CALLBACK)
    assert ray_private.proxy_stamps_arrival()
    monkeypatch.setenv(ray_private.PROXY_CALLBACK_ENV, "someone.else:callback")
    assert not ray_private.proxy_stamps_arrival()


# -- the metrics -----------------------------------------------------------------


class _Rec:
    def __init__(self, name: str, description: str = "", **kw: object) -> None:
        self.name, self.calls = name, []

    def observe(self, v: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append(v)

    def inc(self, v: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append(tags)

    def set(self, v: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append(v)


FAKE = SimpleNamespace(Histogram=_Rec, Counter=_Rec, Gauge=_Rec)


def test_replica_ttft_is_the_front_door_ttft_less_the_serve_delay() -> None:
    m = ServeMetrics(slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1), metrics_module=FAKE)
    t = SimpleNamespace(ttft_s=0.3, tpot_s=0.01, queue_wait_s=0.05, generated_tokens=4)
    m.record_finish(t, serve_delay_s=0.1)
    m.record_aborted(reason=names.REASON_CLIENT_DISCONNECT, ttft_s=0.2, generated_tokens=2)
    m.record_aborted(
        reason=names.REASON_CLIENT_DISCONNECT, ttft_s=None, generated_tokens=0, serve_delay_s=0.1
    )
    assert m.ttft.calls == [0.3, 0.2]
    assert m.replica_ttft.calls == [pytest.approx(0.2), 0.2]
    assert m.replica_ttft.name == names.REPLICA_TTFT_SECONDS
    m.record_arrival_clock(front_door=True)
    m.record_arrival_clock(front_door=False)
    assert m.arrival_clock.calls == [
        {names.LABEL_CLOCK: names.CLOCK_FRONT_DOOR},
        {names.LABEL_CLOCK: names.CLOCK_REPLICA},
    ]


# -- live: the proxy stamps, the replica believes, a disconnect is counted --------

APP = "t-front-door"


def _sum(text: str, sample: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and s.labels.get("application") == APP:
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
    return total


def _wait_metrics(url: str, ready, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url, timeout=30).text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def _settled_metrics(url: str, samples: tuple[str, ...], timeout_s: float = 30.0) -> str:
    """The export once the app's replicas run and queue nothing and ``samples``' sums read
    the same twice 2 s apart: an earlier test's requests may still be finishing, and their
    observations on their way through Ray's agent (a replica records a request's TTFT when
    it ends; CI runs read baselines two replica TTFTs short of the export a moment later,
    once with the sums steady for 2 s)."""
    busy = tuple(names.exported(n) for n in (names.RUNNING_REQUESTS, names.WAITING_REQUESTS))
    deadline = time.monotonic() + timeout_s
    text = httpx.get(url, timeout=30).text
    while time.monotonic() < deadline:
        time.sleep(2.0)
        again = httpx.get(url, timeout=30).text
        idle = all(_sum(t, g) == 0 for t in (text, again) for g in busy)
        if idle and all(_sum(again, s) == _sum(text, s) for s in samples):
            return again
        text = again
    return text


@pytest.fixture(scope="module")
def app(ray_cluster):
    with tiny_app(ray_cluster, APP, batch=4, ongoing=4, queued=4) as base:
        yield SimpleNamespace(base=base, metrics_url=ray_cluster.metrics_url)


@pytest.mark.ray
def test_the_proxy_stamps_and_a_forged_stamp_is_replaced(app) -> None:
    clock = names.exported(names.ARRIVAL_CLOCK_TOTAL)
    ttft_sum = names.exported(names.TTFT_SECONDS) + "_sum"
    # A client claiming it arrived 100 s ago: the proxy replaces the stamp with its own.
    forged = str(time.time_ns() - 100 * 10**9)
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    for _ in range(3):
        r = httpx.post(
            app.base + "/v1/completions", json=body, headers={ARRIVAL_HEADER: forged}, timeout=60
        )
        assert r.status_code == 200
    text = _wait_metrics(
        app.metrics_url,
        lambda t: (
            _sum(t, clock) >= 3
            and _sum(t, names.exported(names.REPLICA_TTFT_SECONDS) + "_count") >= 3
        ),
    )
    assert _sum(text, clock, clock=names.CLOCK_FRONT_DOOR) >= 3
    assert _sum(text, clock, clock=names.CLOCK_REPLICA) == 0
    assert 0 < _sum(text, ttft_sum) < 50  # not the forged 100 s per request
    replica_sum = _sum(text, names.exported(names.REPLICA_TTFT_SECONDS) + "_sum")
    assert replica_sum <= _sum(text, ttft_sum)  # the front door is never after the replica


@pytest.mark.ray
def test_a_client_disconnect_mid_stream_is_counted_with_its_ttft(app) -> None:
    aborted = names.exported(names.ABORTED_TOTAL)
    ttft_count = names.exported(names.TTFT_SECONDS) + "_count"
    replica_count = names.exported(names.REPLICA_TTFT_SECONDS) + "_count"
    done = names.exported(names.REQUESTS_TOTAL)
    before = _settled_metrics(app.metrics_url, (ttft_count, replica_count))
    a0 = _sum(before, aborted, reason=names.REASON_CLIENT_DISCONNECT)
    c0, d0, r0 = _sum(before, ttft_count), _sum(before, done), _sum(before, replica_count)
    body = {
        "prompt": "stream then leave",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", app.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert TTFT_HANDOFF_HEADER not in r.headers  # the proxy took it off
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got == 3:
                    break
            assert got == 3
        # leaving the block closes the connection with the stream unfinished
    text = _wait_metrics(
        app.metrics_url,
        lambda t: _sum(t, aborted, reason=names.REASON_CLIENT_DISCONNECT) >= a0 + 1,
    )
    assert _sum(text, aborted, reason=names.REASON_CLIENT_DISCONNECT) == a0 + 1
    assert _sum(text, done) == d0  # not a completion
    # its first token is in the TTFT histogram (it got three events)
    text = _wait_metrics(app.metrics_url, lambda t: _sum(t, ttft_count) >= c0 + 1)
    assert _sum(text, ttft_count) == c0 + 1
    assert not math.isnan(_sum(text, names.exported(names.TTFT_SECONDS) + "_sum"))
    # and the replica's own clock too, once: recorded with the abort as it gave up on the
    # request (and so settled before the next test reads its baseline)
    text = _wait_metrics(app.metrics_url, lambda t: _sum(t, replica_count) >= r0 + 1)
    assert _sum(text, replica_count) == r0 + 1


@pytest.mark.ray
def test_a_streamed_ttft_is_observed_once_and_ends_at_the_proxy(app) -> None:
    ttft, replica = (names.exported(n) for n in (names.TTFT_SECONDS, names.REPLICA_TTFT_SECONDS))
    before = _settled_metrics(app.metrics_url, (ttft + "_count", replica + "_count"))
    c0, r0 = _sum(before, ttft + "_count"), _sum(before, replica + "_count")
    s0, rs0 = _sum(before, ttft + "_sum"), _sum(before, replica + "_sum")
    body = {"prompt": "one stream", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", app.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert TTFT_HANDOFF_HEADER not in r.headers
            assert any(line.startswith("data: ") for line in r.iter_lines())
    text = _wait_metrics(
        app.metrics_url,
        lambda t: _sum(t, ttft + "_count") >= c0 + 1 and _sum(t, replica + "_count") >= r0 + 1,
    )
    assert _sum(text, ttft + "_count") == c0 + 1  # the proxy's, not also the replica's
    assert _sum(text, replica + "_count") == r0 + 1
    # Ray's agent rebuilds histogram sums from bucket midpoints: compare loosely
    assert 0 <= _sum(text, ttft + "_sum") - s0 < 50
    assert 0 <= _sum(text, replica + "_sum") - rs0 < 50
