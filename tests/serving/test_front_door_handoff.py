"""The first token timed where it leaves the front door: the replica hands a streamed
request's TTFT to Serve's proxy (a response header), the proxy's middleware takes the
header off and observes the TTFT when the first non-empty body chunk has gone out.

Pure ASGI and fake-metrics tests here; the live check (one cluster, the tiny model) is in
test_front_door.py beside the stamp's.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from metrics import names
from metrics.observation import Slo
from serving.app.front_door import (
    HANDOFF_TAGS,
    TTFT_HANDOFF_HEADER,
    ArrivalStamp,
    handoff_value,
    parse_handoff,
)
from serving.app.serve_metrics import ProxyTtft, ServeMetrics

TAGS = {"application": "app", "deployment": "LLM", "replica": "r1"}
HDR = TTFT_HANDOFF_HEADER.encode()


class _Clock:
    """A clock that moves only when told: ``t`` seconds."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _serve(messages: list[dict], *, observe=None) -> tuple[list[dict], list[tuple]]:
    """Run the middleware over an app that sends ``messages``, the clock advancing 1 s
    before each; what the server got and what was observed."""
    clock, sent, seen = _Clock(), [], []

    async def app(scope, receive, send) -> None:
        for m in messages:
            clock.t += 1.0
            await send(dict(m))

    async def receive() -> dict:
        return {"type": "http.request"}

    async def send(message) -> None:
        sent.append(message)

    def record(seconds: float, tags: dict[str, str]) -> None:
        seen.append((seconds, tags))

    mw = ArrivalStamp(app, observe=record if observe is None else observe, clock=clock)
    asyncio.run(mw({"type": "http", "headers": []}, receive, send))
    return sent, seen


def _start(*headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http.response.start", "status": 200, "headers": list(headers)}


def _body(b: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": b, "more_body": more}


def test_handoff_value_round_trips_and_names_bad_tags() -> None:
    assert parse_handoff(handoff_value(TAGS).encode()) == TAGS
    with pytest.raises(ValueError, match="tags="):
        handoff_value({"application": "a"})


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1]", b'{"application":"a"}', b'{"application":"a","deployment":'
     b'"d","replica":7}', ('{"application":"' + "x" * 300 + '","deployment":"d","replica":"r"}')
     .encode()],
)  # fmt: skip
def test_a_bad_handoff_is_not_believed(raw: bytes) -> None:
    assert parse_handoff(raw) is None


def test_the_proxy_times_the_first_non_empty_chunk_and_strips_the_header() -> None:
    sent, seen = _serve(
        [
            _start((b"content-type", b"text/event-stream"), (HDR, handoff_value(TAGS).encode())),
            _body(b""),  # an empty chunk is no token
            _body(b"data: {}\n\n"),  # t = 3: the first token leaves
            _body(b"data: {}\n\n"),
            _body(b"", more=False),
        ]
    )
    assert seen == [(3.0, TAGS)]  # once, from arrival (t = 0)
    assert sent[0]["headers"] == [(b"content-type", b"text/event-stream")]
    assert len(sent) == 5


def test_without_the_header_the_proxy_observes_nothing() -> None:
    sent, seen = _serve([_start((b"content-type", b"application/json")), _body(b"{}", False)])
    assert seen == [] and sent[0]["headers"] == [(b"content-type", b"application/json")]


def test_a_forged_handoff_is_stripped_but_not_observed() -> None:
    sent, seen = _serve([_start((HDR, b"junk")), _body(b"x", False)])
    assert seen == [] and sent[0]["headers"] == []


def test_a_response_that_ends_before_its_first_chunk_has_no_ttft() -> None:
    _, seen = _serve([_start((HDR, handoff_value(TAGS).encode())), _body(b"", False)])
    assert seen == []


def test_a_failing_metric_never_fails_the_response() -> None:
    def boom(seconds: float, tags: dict[str, str]) -> None:
        raise RuntimeError("metrics down")

    sent, _ = _serve(
        [_start((HDR, handoff_value(TAGS).encode())), _body(b"x", False)], observe=boom
    )
    assert len(sent) == 2


# -- the metrics on both sides -----------------------------------------------------


class _Rec:
    made: list[_Rec] = []

    def __init__(self, name: str, description: str = "", **kw: object) -> None:
        self.name, self.kw, self.calls = name, kw, []
        _Rec.made.append(self)

    def observe(self, v: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append((v, tags))

    def inc(self, v: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append((v, tags))

    def set(self, v: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append((v, tags))


FAKE = SimpleNamespace(Histogram=_Rec, Counter=_Rec, Gauge=_Rec)


def test_proxy_ttft_is_the_contract_histogram_with_the_replica_tags() -> None:
    p = ProxyTtft(metrics_module=FAKE)
    p.observe(0.02, TAGS)
    p.observe(-1.0, TAGS)  # a clock that went back: 0
    h = _Rec.made[-1]
    assert h.name == names.TTFT_SECONDS
    assert h.kw["boundaries"] == list(names.TTFT_BUCKETS)
    assert tuple(h.kw["tag_keys"]) == HANDOFF_TAGS
    assert h.calls == [(0.02, TAGS), (0.0, TAGS)]


def test_a_replica_that_handed_over_leaves_ttft_to_the_proxy_only() -> None:
    m = ServeMetrics(slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1), metrics_module=FAKE, tags=TAGS)
    assert parse_handoff(m.handoff.encode()) == TAGS
    t = SimpleNamespace(ttft_s=0.3, tpot_s=0.01, queue_wait_s=0.05, generated_tokens=4)
    m.record_finish(t, serve_delay_s=0.1, ttft_at_proxy=True)
    m.record_aborted(
        reason=names.REASON_CLIENT_DISCONNECT,
        ttft_s=0.2,
        generated_tokens=2,
        serve_delay_s=0.05,
        ttft_at_proxy=True,
    )
    m.record_finish(t, serve_delay_s=0.1)  # not handed over (e.g. not streamed)
    assert [v for v, _ in m.ttft.calls] == [0.3]
    assert [v for v, _ in m.replica_ttft.calls] == [
        pytest.approx(0.2),
        pytest.approx(0.15),
        pytest.approx(0.2),
    ]
    assert m.requests.calls == [(1, {names.LABEL_SLO_MET: "true"})] * 2  # verdicts kept
    assert m.aborted.calls == [(1, {names.LABEL_REASON: names.REASON_CLIENT_DISCONNECT})]


def test_without_tags_there_is_no_handoff() -> None:
    m = ServeMetrics(slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.1), metrics_module=FAKE)
    assert m.handoff is None
