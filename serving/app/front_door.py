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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

# The header the proxy's middleware adds: its wall clock (time.time_ns) when the request
# arrived, in integer nanoseconds. Lower case, as ASGI scope headers are.
ARRIVAL_HEADER = "x-slotune-arrival-ns"
_ARRIVAL_HEADER_BYTES = ARRIVAL_HEADER.encode("latin-1")
# A stamp older than this (seconds) is not believed: a clock step or a forged header.
MAX_STAMP_AGE_S = 600.0

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ArrivalStamp:
    """Pure ASGI middleware for Serve's proxy: stamps each HTTP request's arrival.

    Replaces any :data:`ARRIVAL_HEADER` the client sent with the proxy's
    ``time.time_ns()`` at the moment the proxy's app is called (headers parsed, body not
    read), before Serve routes the request. Other scopes (lifespan, websocket) pass as is.
    """

    def __init__(self, app: ASGIApp, *, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.app = app
        self.wall_ns = wall_ns

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http":
            stamp = str(self.wall_ns()).encode("ascii")
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != _ARRIVAL_HEADER_BYTES]
            headers.append((_ARRIVAL_HEADER_BYTES, stamp))
            scope["headers"] = headers
        await self.app(scope, receive, send)


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
