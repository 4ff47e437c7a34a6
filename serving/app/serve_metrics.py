"""The metric contract (metrics/names.py) emitted from a Ray Serve replica.

Ray exports ``ray.serve.metrics`` on its metrics export port with a ``ray_``
prefix and the labels ``application``, ``deployment``, ``replica`` added (see
docs/serving.md for the exact exported names). Ray gauges expire when not
re-set, so :class:`GaugeRefresher` re-sets them from the engine's stats on a
short period.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from metrics import names
from metrics.observation import DEFAULT_SLO, Slo
from serving.app.front_door import HANDOFF_TAGS, handoff_value

logger = logging.getLogger(__name__)

GAUGE_PERIOD_S = 0.5  # below Ray's 1 s minimum report interval
TTFT_DESCRIPTION = (
    "Time from arrival at Serve's HTTP proxy (else at the replica) to the first token "
    "(streamed: when it left the proxy), seconds."
)


class TimingLike(Protocol):
    """What the engine's ``on_finish`` hands over (serving.scheduler.plan.RequestTiming)."""

    ttft_s: float | None
    tpot_s: float | None  # None for a single token
    queue_wait_s: float | None
    generated_tokens: int


class StatsLike(Protocol):
    """What ``AsyncEngine.stats()`` returns (serving.engine.engine.EngineStats)."""

    running: int
    waiting: int
    kv_usage: float
    max_batch_size: int


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _tpot(timing: TimingLike) -> float:
    """The request's TPOT, NaN when it has none (a single token, or not known)."""
    t = timing.tpot_s
    return t if timing.generated_tokens >= 2 and _finite(t) else math.nan  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class BucketLayout:
    """Histogram bounds: the contract's cluster-wide layout (``metrics.names``).

    Ray keeps the first layout registered under a name and drops later histograms of
    that name with other bounds, so the layout must not depend on a replica's SLO. It
    holds the defaults and the round SLO values exactly and is ≤10% apart elsewhere;
    :meth:`exact_for` says whether an SLO's verdict is exact or bracketed.
    """

    ttft: tuple[float, ...] = names.TTFT_BUCKETS
    tpot: tuple[float, ...] = names.TPOT_BUCKETS
    queue_wait: tuple[float, ...] = names.QUEUE_WAIT_BUCKETS

    @classmethod
    def for_slo(cls, slo: Slo) -> BucketLayout:
        layout = cls()
        if not layout.exact_for(slo):
            logger.warning(
                "SLO (TTFT %s s, TPOT %s s) is not a bucket bound of the cluster-wide layout: "
                "verdicts are bracketed by the neighbouring bounds (round values such as %s s "
                "and %s s are exact)",
                slo.ttft_p99_s,
                slo.tpot_p99_s,
                DEFAULT_SLO.ttft_p99_s,
                DEFAULT_SLO.tpot_p99_s,
            )
        return layout

    def exact_for(self, slo: Slo) -> bool:
        return slo.ttft_p99_s in self.ttft and slo.tpot_p99_s in self.tpot


class ServeMetrics:
    """Histograms, counters and gauges of one replica, emitted through Ray.

    ``metrics_module`` is ``ray.serve.metrics`` in a replica; tests may hand any
    module with the same ``Counter``/``Gauge``/``Histogram`` classes.
    """

    def __init__(
        self, *, slo: Slo, metrics_module: Any = None, tags: Mapping[str, str] | None = None
    ) -> None:
        if metrics_module is None:
            from ray.serve import metrics as metrics_module

            tags = replica_tags() if tags is None else tags  # None: the replica keeps TTFT
        m = metrics_module
        self.slo = slo
        # The TTFT_HANDOFF_HEADER value of this replica: the tags Ray puts on its metrics,
        # so the proxy's TTFT observations land in this replica's series; None: no handoff
        self.handoff = None if tags is None else handoff_value(tags)
        self.buckets = BucketLayout.for_slo(slo)
        self.ttft = m.Histogram(
            names.TTFT_SECONDS, description=TTFT_DESCRIPTION, boundaries=list(self.buckets.ttft)
        )
        self.replica_ttft = m.Histogram(
            names.REPLICA_TTFT_SECONDS,
            description="Time from arrival at the replica to the first token, seconds.",
            boundaries=list(self.buckets.ttft),
        )
        self.tpot = m.Histogram(
            names.TPOT_SECONDS,
            description="Mean time per output token after the first, seconds.",
            boundaries=list(self.buckets.tpot),
        )
        self.queue_wait = m.Histogram(
            names.QUEUE_WAIT_SECONDS,
            description="Time from arrival at Serve's HTTP proxy (else at the replica) to the "
            "start of prefill, seconds.",
            boundaries=list(self.buckets.queue_wait),
        )
        self.requests = m.Counter(
            names.REQUESTS_TOTAL,
            description="Completed requests, by whether they met both SLOs.",
            tag_keys=(names.LABEL_SLO_MET,),
        )
        self.tokens = m.Counter(
            names.GENERATED_TOKENS_TOTAL, description="Output tokens generated."
        )
        self.rejected = m.Counter(
            names.REJECTED_TOTAL,
            description="Requests refused by the replica, by reason.",
            tag_keys=(names.LABEL_REASON,),
        )
        self.aborted = m.Counter(
            names.ABORTED_TOTAL,
            description="Accepted requests (admitted or queued) that did not complete, by reason.",
            tag_keys=(names.LABEL_REASON,),
        )
        self.arrival_clock = m.Counter(
            names.ARRIVAL_CLOCK_TOTAL,
            description="Completion requests by the clock their TTFT started on.",
            tag_keys=(names.LABEL_CLOCK,),
        )
        self.running = m.Gauge(names.RUNNING_REQUESTS, description="Requests in the batch.")
        self.waiting = m.Gauge(names.WAITING_REQUESTS, description="Requests queued.")
        self.kv_usage = m.Gauge(
            names.KV_CACHE_USAGE_RATIO, description="Fraction of KV-cache slots in use."
        )
        self.max_batch_size = m.Gauge(names.MAX_BATCH_SIZE, description="Decode batch limit.")

    def set_slo(self, slo: Slo) -> None:
        self.slo = slo

    def record_finish(
        self, timing: TimingLike, *, serve_delay_s: float = 0.0, ttft_at_proxy: bool = False
    ) -> None:
        """One completed request: latency histograms, slo_met counter, tokens.
        ``serve_delay_s``: from the front door to the replica (``timing`` runs from the
        front door), taken off for the replica-clock TTFT. ``ttft_at_proxy``: the proxy
        observes this request's front-door TTFT (serving/app/front_door.py), so it is left
        out of that histogram here; the ``slo_met`` verdict still uses ``timing``'s."""
        ttft = timing.ttft_s
        tpot = _tpot(timing)
        met = self.slo.met(ttft if _finite(ttft) else math.nan, tpot)  # type: ignore[arg-type]
        if _finite(ttft):
            self._observe_ttft(ttft, serve_delay_s, ttft_at_proxy)  # type: ignore[arg-type]
        if not math.isnan(tpot):
            self.tpot.observe(max(tpot, 0.0))
        if _finite(timing.queue_wait_s):
            self.queue_wait.observe(max(timing.queue_wait_s, 0.0))
        self.requests.inc(1, tags={names.LABEL_SLO_MET: "true" if met else "false"})
        if timing.generated_tokens > 0:
            self.tokens.inc(timing.generated_tokens)

    def record_aborted(
        self,
        *,
        reason: str,
        ttft_s: float | None,
        generated_tokens: int,
        serve_delay_s: float = 0.0,
        ttft_at_proxy: bool = False,
    ) -> None:
        """An accepted request (admitted or queued) that ended early (``reason``: one of
        ``names.ABORTED_REASONS``): its first token, if it had one, counts in TTFT and its
        tokens in the token counter, so a window's latency and throughput do not leave out
        the requests clients gave up on; it is not a completed request (no ``slo_met``
        count, no goodput). ``ttft_at_proxy``: as for :meth:`record_finish` (the proxy
        observed its TTFT if its first chunk went out)."""
        if _finite(ttft_s):
            self._observe_ttft(ttft_s, serve_delay_s, ttft_at_proxy)  # type: ignore[arg-type]
        if generated_tokens > 0:
            self.tokens.inc(generated_tokens)
        self.aborted.inc(1, tags={names.LABEL_REASON: reason})

    def _observe_ttft(self, ttft_s: float, serve_delay_s: float, at_proxy: bool) -> None:
        if not at_proxy:
            self.ttft.observe(max(ttft_s, 0.0))
        delay = serve_delay_s if _finite(serve_delay_s) else 0.0
        self.replica_ttft.observe(max(ttft_s - delay, 0.0))

    def record_arrival_clock(self, *, front_door: bool) -> None:
        """One completion request, by where its TTFT clock started."""
        clock = names.CLOCK_FRONT_DOOR if front_door else names.CLOCK_REPLICA
        self.arrival_clock.inc(1, tags={names.LABEL_CLOCK: clock})

    def record_rejected(self, reason: str) -> None:
        self.rejected.inc(1, tags={names.LABEL_REASON: reason})

    def set_gauges(self, stats: StatsLike) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.max_batch_size.set(stats.max_batch_size)


def replica_tags() -> dict[str, str] | None:
    """The tags Ray Serve puts on this replica's metrics (ray/serve/metrics.py
    ``_add_serve_metric_default_tags``: deployment, replica tag, application), from the
    public ``serve.get_replica_context()``; None outside a replica or without an app name
    (then Serve adds no application tag, and the replica keeps its TTFT)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        ctx = serve.get_replica_context()
    except RayServeException:
        return None
    if not ctx.app_name:
        return None
    return {"application": ctx.app_name, "deployment": ctx.deployment, "replica": ctx.replica_tag}


class ProxyTtft:
    """``slotune_ttft_seconds`` as Serve's HTTP proxy observes it: the TTFT of streamed
    requests whose replica handed it over (serving/app/front_door.py), with that replica's
    tags, so Ray's metrics agent adds it to the replica's own series (a histogram
    recorded from several processes with the same tags is one series:
    ray/_private/telemetry/open_telemetry_metric_recorder.py ``set_metric_value``).

    ``metrics_module``: ``ray.util.metrics`` in the proxy (made at the first observation,
    with the name, bounds and tag keys the replicas register); tests may hand another.
    """

    def __init__(self, *, metrics_module: Any = None) -> None:
        self._module = metrics_module
        self._histogram: Any = None
        self._lock = threading.Lock()

    def observe(self, seconds: float, tags: dict[str, str]) -> None:
        if self._histogram is None:  # once; every streamed request passes here
            with self._lock:
                if self._histogram is None:
                    m = self._module
                    if m is None:
                        from ray.util import metrics as m
                    self._histogram = m.Histogram(
                        names.TTFT_SECONDS,
                        description=TTFT_DESCRIPTION,
                        boundaries=list(names.TTFT_BUCKETS),
                        tag_keys=HANDOFF_TAGS,
                    )
        self._histogram.observe(max(seconds, 0.0), tags=tags)


class GaugeRefresher:
    """A daemon thread re-setting the gauges every ``period_s`` (Ray gauges expire)."""

    def __init__(
        self,
        *,
        metrics: ServeMetrics,
        stats: Callable[[], StatsLike],
        period_s: float = GAUGE_PERIOD_S,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s={period_s!r}: must be > 0")
        self._metrics = metrics
        self._stats = stats
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slotune-gauges", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._period_s + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._metrics.set_gauges(self._stats())
            except Exception:  # a transient failure: retried next period
                logger.exception("could not refresh gauges")
            self._stop.wait(self._period_s)
