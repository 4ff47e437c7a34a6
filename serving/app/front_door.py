"""When a request reached the deployment's front door: Serve's HTTP proxy.

A replica's own clock starts when Ray hands it the request, after Serve's proxy has
routed it and its router has queued it; an independent client measured TTFT 18 ms
(concurrency 1) to 280 ms (p99, concurrency 8) above that clock. So the proxy stamps
each request as it arrives, before routing, in a header (:class:`ArrivalStamp`, an
ASGI middleware), and the replica starts its TTFT clock there
(:func:`front_door_arrival`).

How the middleware gets into the proxy: Ray 2.60's proxy wraps its ASGI app in the
middlewares that the function named by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
returns, called once when the proxy starts (ray/serve/_private/http_util.py
``configure_http_middlewares``, ``_apply_middlewares``: after Serve's own
``RequestIdMiddleware``, so outside it, the first code to see the request). That
variable and the callback are Serve internals: serving/app/ray_private.py holds them.
The proxy hands the ASGI scope, headers included, to the replica pickled
(``ASGIProxyRequest.serialized_replica_arg``, ray/serve/_private/proxy_request_response.py),
which is how the stamp reaches ``request.headers``.

Trust: the middleware replaces any stamp a client sent. A replica trusts the header only
when its own environment names slotune's callback (the cluster's processes share the
variable: ``serving.app.cluster.RAY_ENV_DEFAULTS`` sets it for slotune's own cluster, and
a KubeRay cluster sets it in the pod's environment), so without the middleware a client
cannot start its own TTFT clock. Proxy and replica must share a wall clock: on one node
they do; across nodes a skew of the NTP kind (milliseconds) shifts TTFT by that much,
and a stamp from the future or older than :data:`MAX_STAMP_AGE_S` is ignored (the
replica's own clock is used, and counted: ``slotune_arrival_clock_total``).

Where the clock stops: a streamed response's first token is timed where it leaves the
front door, not where the replica produced it. The replica cannot see the token's trip
back (replica -> proxy through Ray's streaming actor call, the proxy's ASGI send), nor
the wait for a second token when the first ends inside a character (a client's first
token is its first text): 5-8 ms at concurrency 1 on a 2-core CPU, 10-30% of the TTFT
(bench/client_ttft.py). So a replica that believed the stamp of a streamed request
hands its TTFT over to the proxy: its response carries :data:`TTFT_HANDOFF_HEADER` (the
replica's metric tags, :func:`handoff_value`), the middleware takes that header off,
and once it has handed the response's first non-empty body chunk to the HTTP server it
observes the TTFT, from its own arrival, on its own monotonic clock, into
``slotune_ttft_seconds`` with those tags (serving/app/serve_metrics.py ``ProxyTtft``),
so the series is the replica's. The replica leaves that request out of
``slotune_ttft_seconds`` and records everything else; its ``slo_met`` verdict still
ends TTFT at the replica's first token. A request that ends before its first chunk goes
out has no TTFT, as for its client. Non-streamed responses keep the replica's end.
The proxy's observation is exported by the node the proxy runs on: read across nodes
through Prometheus, not by scraping one node.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

# The header the proxy's middleware adds: its wall clock (time.time_ns) when the request
# arrived, in integer nanoseconds. Lower case, as ASGI scope headers are.
ARRIVAL_HEADER = "x-slotune-arrival-ns"
_ARRIVAL_HEADER_BYTES = ARRIVAL_HEADER.encode("latin-1")
# A stamp older than this (seconds) is not believed: a clock step or a forged header.
MAX_STAMP_AGE_S = 600.0
# The response header by which a replica hands a streamed request's TTFT to the proxy:
# the tags of its metrics (HANDOFF_TAGS), as compact JSON. Taken off before the client.
TTFT_HANDOFF_HEADER = "x-slotune-ttft-at-proxy"
_HANDOFF_HEADER_BYTES = TTFT_HANDOFF_HEADER.encode("latin-1")
# The tags Ray Serve puts on a replica's metrics (ray/serve/metrics.py
# ``_add_serve_metric_default_tags``), which the proxy's observation must carry.
HANDOFF_TAGS = ("application", "deployment", "replica")
_MAX_TAG_CHARS = 256

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ArrivalStamp:
    """Pure ASGI middleware for Serve's proxy: stamps each HTTP request's arrival, and
    times the first body chunk of a response whose replica hands its TTFT over.

    Replaces any :data:`ARRIVAL_HEADER` the client sent with the proxy's
    ``time.time_ns()`` at the moment the proxy's app is called (headers parsed, body not
    read), before Serve routes the request. Other scopes (lifespan, websocket) pass as is.
    A response that starts with :data:`TTFT_HANDOFF_HEADER` loses the header, and once its
    first non-empty body chunk has been sent, ``observe(seconds, tags)`` gets the time
    since arrival on ``clock`` (monotonic) and the replica's tags.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        observe: Callable[[float, dict[str, str]], None] | None = None,
        wall_ns: Callable[[], int] = time.time_ns,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.app = app
        self.observe = observe
        self.wall_ns = wall_ns
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        arrived = self.clock()
        stamp = str(self.wall_ns()).encode("ascii")
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != _ARRIVAL_HEADER_BYTES]
        headers.append((_ARRIVAL_HEADER_BYTES, stamp))
        scope["headers"] = headers
        tags: dict[str, str] | None = None

        async def timed_send(message: MutableMapping[str, Any]) -> None:
            nonlocal tags
            kind = message.get("type")
            if kind == "http.response.start":
                tags = _take_handoff(message)
            await send(message)
            if tags is not None and kind == "http.response.body" and message.get("body"):
                got, tags = tags, None
                self._observe(self.clock() - arrived, got)

        await self.app(scope, receive, timed_send)

    def _observe(self, seconds: float, tags: dict[str, str]) -> None:
        if self.observe is None:
            return
        try:
            self.observe(max(seconds, 0.0), tags)
        except Exception:  # a metric must never fail the response
            logger.exception("could not record the TTFT at the proxy")


def handoff_value(tags: Mapping[str, str]) -> str:
    """The :data:`TTFT_HANDOFF_HEADER` value for a replica's metric ``tags`` (exactly the
    keys of :data:`HANDOFF_TAGS`)."""
    if set(tags) != set(HANDOFF_TAGS):
        raise ValueError(f"tags={dict(tags)!r}: need exactly the keys {HANDOFF_TAGS}")
    return json.dumps({k: str(tags[k]) for k in HANDOFF_TAGS}, separators=(",", ":"))


def parse_handoff(value: bytes) -> dict[str, str] | None:
    """The tags in a :data:`TTFT_HANDOFF_HEADER` value; None unless it holds exactly the
    keys of :data:`HANDOFF_TAGS` with short string values."""
    try:
        got = json.loads(value.decode("latin-1"))
    except ValueError:
        return None
    if not isinstance(got, dict) or set(got) != set(HANDOFF_TAGS):
        return None
    if not all(isinstance(v, str) and len(v) <= _MAX_TAG_CHARS for v in got.values()):
        return None
    return got


def _take_handoff(message: MutableMapping[str, Any]) -> dict[str, str] | None:
    """Take every :data:`TTFT_HANDOFF_HEADER` off a ``http.response.start`` message; the
    tags of the first, if it parses."""
    headers = list(message.get("headers", ()))
    found = [v for k, v in headers if k.lower() == _HANDOFF_HEADER_BYTES]
    if not found:
        return None
    message["headers"] = [(k, v) for k, v in headers if k.lower() != _HANDOFF_HEADER_BYTES]
    return parse_handoff(bytes(found[0]))


def stamp_age_s(value: str | None, *, now_wall_ns: int) -> float | None:
    """Seconds since the stamp ``value`` (an :data:`ARRIVAL_HEADER` value) by the wall
    clock ``now_wall_ns``; None if there is none, it is not a whole number of ns, it lies
    in the future, or it is older than :data:`MAX_STAMP_AGE_S`."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 20:
        return None
    age = (now_wall_ns - int(value)) / 1e9
    return age if 0.0 <= age <= MAX_STAMP_AGE_S else None


def front_door_arrival(
    headers: Any,
    *,
    trusted: bool,
    now_engine: float,
    now_wall_ns: int,
) -> float | None:
    """The front-door arrival on the engine's clock (``now_engine`` minus the stamp's
    age), or None: stamps not ``trusted`` here, no stamp, or one not believed
    (:func:`stamp_age_s`). ``headers``: a starlette ``Headers`` (or any mapping with
    ``get``)."""
    if not trusted:
        return None
    age = stamp_age_s(headers.get(ARRIVAL_HEADER), now_wall_ns=now_wall_ns)
    return None if age is None else now_engine - age
