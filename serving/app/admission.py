"""Admission in the replica: at most ``limit`` requests in the engine, at most ``queue``
waiting for a place (first come, first served), and anything beyond refused at once.

Ray Serve's own backpressure (``max_queued_requests``) answers from the proxy, in plain
text, and its count is per router, so a replica behind it sees its stated limits
overshot. Admitting here makes the limits exact for this replica and the refusal an
OpenAI-style JSON 429 with ``Retry-After`` (serving/app/completions.py), and puts the time
spent waiting here in the replica's TTFT and queue-wait histograms (time in Serve's
router never was). Ray 2.60's Serve-level limits, for comparison: ``max_queued_requests``
is counted by each router on its own (ray/serve/_private/router.py,
``num_queued_requests``), so with several routers (each HTTP proxy, each handle) the
queue a replica sees is a multiple of it; the refusal is ``BackPressureError``, whose
message the proxy sends as plain text (ray/serve/_private/http_util.py), with the status
and ``Retry-After`` of ``BackpressureConfig`` (ray/serve/config.py; 503 by default).

The limit is the replica's own (``user_config.max_ongoing_requests``: the embedded path,
serving/app/deploy.py) or, when that is unset, ``default_limit()``: the deployment's own
``max_ongoing_requests`` (serving/app/server.py reads it live from Serve's replica
context), so a deployment tuned through Serve's config alone (controller/backends/serve.py)
admits what its config says. It is read at every decision, because Serve changes it
without calling the replica's ``reconfigure`` when the ``user_config`` stays the same.

A place is a :class:`Ticket`: released exactly once, by whoever finishes with the request
(a stream's end, its cancellation) or, failing all of those, when the ticket is garbage
collected, so a response that never started cannot leak a place.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from collections import deque
from collections.abc import Callable


class Overloaded(Exception):
    """Every place and every queue position is taken; ``retry_after_s`` is a hint."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Ticket:
    """One place in the engine; :meth:`release` it when the request is done."""

    def __init__(self, admission: Admission) -> None:
        self._t0 = time.monotonic()
        self._finalizer = weakref.finalize(self, admission._release, self._t0)

    def release(self) -> None:
        self._finalizer()  # runs the release once, whoever calls first


class Admission:
    """``limit`` requests at a time (None: ``default_limit()``, and no limit without one);
    ``queue`` more may wait (None: any).

    Used from one event loop; :meth:`set_limits` may be called from any thread."""

    def __init__(
        self,
        *,
        limit: int | None = None,
        queue: int | None = None,
        default_limit: Callable[[], int | None] | None = None,
    ) -> None:
        self.limit = limit
        self.queue = queue
        self._default_limit = default_limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mean_s = 1.0  # a running mean of the time a request holds its place

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def effective_limit(self) -> int | None:
        """The limit in force now: ``limit``, else ``default_limit()`` (None: no limit)."""
        if self.limit is not None or self._default_limit is None:
            return self.limit
        return self._default_limit()

    def _has_place(self) -> bool:
        limit = self.effective_limit
        return limit is None or self.running < limit

    def set_limits(self, *, limit: int | None, queue: int | None) -> None:
        """New limits from now on; waiters a larger limit makes room for are admitted."""
        self.limit, self.queue = limit, queue
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._admit_waiting)

    def retry_after_s(self) -> int:
        """Seconds until a place is likely free: the queue ahead drains at ``limit``
        requests per mean holding time; at least 1, at most 60."""
        per_place = self._mean_s / max(1, self.effective_limit or 1)
        return int(min(60, max(1, math.ceil(per_place * (self.waiting + 1)))))

    async def acquire(self) -> Ticket:
        """A place, at once or after the requests queued before this one;
        :class:`Overloaded` at once if none is free and the queue is full. A waiter whose
        client leaves (cancellation) gives its position, or the place it just got, back."""
        self._loop = asyncio.get_running_loop()
        self._admit_waiting()  # a default limit may have grown since the last release
        if self._has_place() and not self._waiters:
            self.running += 1
            return Ticket(self)
        if self.queue is not None and self.waiting >= self.queue:
            raise Overloaded(
                f"the server is at its limit of {self.effective_limit} requests with "
                f"{self.waiting} queued (its queue holds {self.queue}): retry later",
                retry_after_s=self.retry_after_s(),
            )
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(fut)
        try:
            await fut  # the releaser counted us in running before it woke us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(time.monotonic())  # admitted, then cancelled: give it back
            else:
                self._waiters.remove(fut)
            raise
        return Ticket(self)

    def _release(self, t0: float) -> None:
        if self._loop is not None and not self._on_loop():
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits any more
                self._loop.call_soon_threadsafe(self._release, t0)
            return
        self.running -= 1
        self._mean_s += 0.1 * (time.monotonic() - t0 - self._mean_s)
        self._admit_waiting()

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _admit_waiting(self) -> None:
        while self._waiters and self._has_place():
            fut = self._waiters.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)
