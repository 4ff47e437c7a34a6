"""Reading one measurement window's Observation: from Prometheus-format metrics, by two
scrapes of an endpoint (:class:`ScrapeWindow`) or a Prometheus server's PromQL
(:class:`PromQLWindow`), with the freshness rules that keep a verdict off stale data; or,
under the ``client`` metrics profile, from the load generator's own records
(:class:`ClientWindow`). A failure to read is
:class:`~controller.target_errors.TargetUnavailable` (retried)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Protocol

from controller.load.result import LoadResult, RequestRecord, client_observation
from controller.target_errors import TargetUnavailable
from metrics.observation import Observation, Slo

log = logging.getLogger(__name__)


class WindowReader(Protocol):
    """Reads the server-side Observation of [begin, end] from a metrics source."""

    def begin(self) -> Any: ...

    def end(self, token: Any, *, start_s: float, end_s: float) -> Observation: ...


class ScrapeWindow:
    """Two scrapes of a Prometheus text endpoint (``metrics.sources.ScrapeSource``)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def begin(self) -> Any:
        return _transient(self.source.snapshot)

    def end(self, token: Any, *, start_s: float, end_s: float) -> Observation:
        snap = _transient(self.source.snapshot)
        return _transient(lambda: self.source.observe(token, snap))


class PromQLWindow:
    """A Prometheus server's view of the window (``metrics.sources.PromQLSource``).

    What Prometheus holds lags the serving process twice: the exporter publishes its
    counters every ``report_lag_s`` (Ray: ``RAY_metrics_report_interval_ms``, 1 s here),
    and Prometheus scrapes every scrape interval. So the window is read only once a
    sample taken at least ``report_lag_s`` after its end is stored (waiting up to
    ``fresh_timeout_s``, else the window is unavailable: retried, never judged), and
    read shifted by ``report_lag_s`` (the load runs on meanwhile). A window that spans
    fewer than ``min_scrapes`` scrapes is marked stale: ``increase()`` over two or three
    samples extrapolates, and a verdict on it would be a guess.
    """

    def __init__(
        self,
        source: Any,
        *,
        report_lag_s: float = 1.0,
        fresh_timeout_s: float = 30.0,
        min_scrapes: int = 3,
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.source = source
        self.report_lag_s = report_lag_s
        self.fresh_timeout_s = fresh_timeout_s
        self.min_scrapes = min_scrapes
        self.poll_s = poll_s
        self.clock = clock
        self.sleep = sleep

    def begin(self) -> Any:
        return None

    def _series(self) -> str:
        from metrics.profiles import SLOTUNE
        from metrics.sources import counter_selector

        src = self.source
        prof = getattr(src, "profile", SLOTUNE)  # a PromQLSource has one
        return counter_selector(prof.completed, prefix=src.prefix, selector=src.selector)

    def _newest(self) -> float:
        got = _transient(
            lambda: self.source.query(f"max(timestamp({self._series()}))", at=self.clock())
        )
        return float(got[0][1]) if got else -math.inf

    def scrape_interval_s(self) -> float | None:
        """The scrape interval of the targets holding the deployment's series (the longest
        of them; of every active target while the series do not exist yet), from
        Prometheus's ``/api/v1/targets``; None when Prometheus does not say."""
        import httpx

        try:
            instances = {
                (lab.get("job"), lab.get("instance"))
                for lab, _ in self.source.query(
                    f"count by (job, instance) ({self._series()})", at=self.clock()
                )
            }
            r = httpx.get(f"{self.source.url}/api/v1/targets", params={"state": "active"})
            active = r.json()["data"]["activeTargets"]
        except Exception as e:  # best effort: the window checks its scrapes anyway
            log.warning("could not read the scrape interval from %s: %s", self.source.url, e)
            return None
        got = [
            _duration_s(t.get("scrapeInterval", ""))
            for t in active
            if not instances
            or (t.get("labels", {}).get("job"), t.get("labels", {}).get("instance")) in instances
        ]
        known = [g for g in got if g is not None]
        return max(known) if known else None

    def end(self, token: Any, *, start_s: float, end_s: float) -> Observation:
        from dataclasses import replace

        want = end_s + self.report_lag_s
        deadline = self.clock() + self.report_lag_s + self.fresh_timeout_s
        while (newest := self._newest()) < want:
            if self.clock() > deadline:
                seen = "no sample at all" if newest == -math.inf else f"newest {want - newest:.1f}s"
                raise TargetUnavailable(
                    f"Prometheus at {self.source.url} holds no sample of {self._series()} taken "
                    f"after the window ended ({seen} short, {self.fresh_timeout_s:g} s waited): "
                    "is the deployment a scrape target, and the scrape interval short?"
                )
            self.sleep(self.poll_s)
        window = end_s - start_s
        at = want
        obs = _transient(lambda: self.source.observe_range(window_s=window, end_s=at))
        counts = _transient(
            lambda: self.source.query(
                f"count_over_time({self._series()}[{round(window * 1000)}ms])", at=at
            )
        )
        # the longest-lived series: one born inside the window (a first miss) has fewer
        scrapes = max((int(v) for _, v in counts), default=0)
        if scrapes < self.min_scrapes and not obs.stale:
            why = (
                f"only {scrapes} scrape(s) in the {window:.1f} s window (< {self.min_scrapes}): "
                "lengthen --window or shorten the scrape interval"
            )
            obs = replace(obs, stale=True, note="; ".join(x for x in (obs.note, why) if x))
        return obs


class ClientWindow:
    """The ``client`` metrics profile: the window's Observation from the load generator's
    own records, for a server that exports no usable metrics.

    Its :meth:`end` needs the records of the run so far (every request that finished by
    ``end_s``); ``needs_client_records`` tells the window's caller to hand them over. The
    latencies are the client's, network and proxy included (the Observation's ``source``
    and ``note`` say so); goodput is exact per request.
    """

    needs_client_records: ClassVar[bool] = True

    def __init__(self, *, slo: Slo, confidence: float = 0.95) -> None:
        if not 0 < confidence < 1:
            raise ValueError(f"confidence={confidence!r}: must be in (0, 1)")
        self.slo = slo
        self.confidence = confidence

    def begin(self) -> None:
        return None

    def end(
        self,
        token: Any,
        *,
        start_s: float,
        end_s: float,
        records: Sequence[RequestRecord] | None = None,
    ) -> Observation:
        if records is None:
            raise TypeError(
                "ClientWindow.end needs records=: the load generator's records of the run "
                "(pass them where needs_client_records is set)"
            )
        run = LoadResult(start_s=start_s, end_s=end_s, records=tuple(records))
        obs = client_observation(run.between(start_s, end_s), self.slo, confidence=self.confidence)
        return replace(
            obs,
            source="client (metrics profile 'client')",
            note="latencies as the load generator saw them: network and proxy included",
        )


def _duration_s(text: str) -> float | None:
    """A Prometheus duration (``5s``, ``1m30s``, ``500ms``) in seconds; None if not one."""
    import re

    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(int(n) * units[u] for n, u in parts)


def _transient(fn: Any) -> Any:
    """Call ``fn``; a ``MetricsUnavailable`` (or a connection error) becomes TargetUnavailable."""
    from metrics.errors import MetricsUnavailable

    try:
        return fn()
    except (MetricsUnavailable, OSError) as e:
        raise TargetUnavailable(f"metrics unavailable: {e}") from e
