"""Where Observations come from: a direct scrape (the embedded default) or Prometheus's API.

Both read the families a metrics profile names (``metrics.profiles``: slotune's own by
default, or vLLM's, SGLang's) under ``names.read_as(name, prefix=...)``, sum across every
replica/label set that matches ``selector``, and agree on the same data
(``tests/metrics/test_sources_prometheus.py``). Failures are typed (``metrics.errors``) or
an Observation marked ``stale`` with a ``note`` — never a crash, never a made-up number.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import time
from collections.abc import Callable, Mapping

import httpx

from metrics import names
from metrics.build import observation_from_histograms
from metrics.errors import MalformedExposition, MetricsUnavailable, QueryRejected
from metrics.observation import Observation, Slo
from metrics.profiles import SLOTUNE, MetricsProfile
from metrics.snapshot import (
    Labels,
    Snapshot,
    bucket_window,
    bucket_windows_by,
    counter_window,
    parse_exposition,
)

logger = logging.getLogger(__name__)

_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _check_common(
    url: str,
    selector: Mapping[str, str] | None,
    timeout_s: float,
    confidence: float,
    profile: MetricsProfile,
    prefix: str,
) -> dict[str, str]:
    if not profile.server_side:
        raise ValueError(
            f"metrics profile {profile.name!r} has no server metrics: build the window's "
            "Observation from the load generator's records instead"
        )
    names.read_as(profile.completed[0], prefix=prefix)  # validates the prefix
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url={url!r}: must start with http:// or https://")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: must be in (0, 1)")
    sel = dict(selector or {})
    for k, v in sel.items():
        if not _LABEL.fullmatch(k) or k.startswith("__") or k == "le":
            raise ValueError(f"selector label {k!r}: must be a plain Prometheus label name")
        if not isinstance(v, str):
            raise ValueError(f"selector {k}={v!r}: label values are strings")
    return sel


def _split_completed(
    by_label: Mapping[str, float], profile: MetricsProfile, notes: list[str]
) -> tuple[float | None, float]:
    met, missed = profile.split_completed(by_label)
    if met is not None:
        met = _count("met", met, notes)
    return met, _count("missed" if profile.counts_slo_met else "completed", missed, notes)


def _get(client: httpx.Client, url: str, params: Mapping[str, str] | None = None) -> httpx.Response:
    try:
        return client.get(url, params=params)
    except httpx.TimeoutException as e:
        raise MetricsUnavailable(f"{url}: timed out ({e})") from e
    except httpx.HTTPError as e:
        raise MetricsUnavailable(f"{url}: unreachable ({type(e).__name__}: {e})") from e


class ScrapeSource:
    """Reads a Prometheus text endpoint directly: Ray's metrics export port or any /metrics.

    ``prefix`` is ``"ray_"`` for Ray's export port and ``""`` (the default) for a plain
    prometheus_client exporter; ``profile`` names the families (slotune's by default).
    Recent snapshots are kept (``snapshots``) so :meth:`observe_recent` can answer for
    "the last ``window_s`` seconds".

    ``timeout_s`` defaults to Prometheus' own scrape timeout, 10 s (``DefaultGlobalConfig``
    in prometheus/config/config.go): Ray's export port renders every series of every
    replica the node has run (6 MB after the Ray tests here, answered in up to 1 s while
    they ran), and under load it answers in seconds (ray-project/ray#64891).
    """

    def __init__(
        self,
        url: str,
        *,
        slo: Slo,
        profile: MetricsProfile = SLOTUNE,
        prefix: str = "",
        selector: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        confidence: float = 0.95,
        max_staleness_s: float = 30.0,
        keep: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.slo = slo
        self.profile = profile
        self.prefix = prefix
        self.selector = _check_common(url, selector, timeout_s, confidence, profile, prefix)
        self.confidence = confidence
        self.max_staleness_s = max_staleness_s
        self.clock = clock
        self.snapshots: collections.deque[Snapshot] = collections.deque(maxlen=keep)
        self._client = httpx.Client(
            timeout=timeout_s, headers={"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1"}
        )

    def close(self) -> None:
        self._client.close()

    def snapshot(self) -> Snapshot:
        """Scrape once. Raises :class:`MetricsUnavailable` (or its :class:`MalformedExposition`)."""
        r = _get(self._client, self.url)
        if r.status_code != 200:
            raise MetricsUnavailable(f"{self.url}: HTTP {r.status_code}")
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("text/html"):
            raise MalformedExposition(f"{self.url}: got an HTML page, not /metrics exposition")
        snap = parse_exposition(
            r.text,
            time_s=self.clock(),
            url=self.url,
            openmetrics=ctype.startswith("application/openmetrics-text"),
        )
        self.snapshots.append(snap)
        return snap

    def observe_recent(self, window_s: float) -> Observation:
        """Scrape now and observe since the newest kept snapshot at least ``window_s`` old.

        With no snapshot that old, the oldest kept one is used (``window_s`` of the result
        says how long the window really was); with none at all the window is empty (stale).
        """
        prev = list(self.snapshots)
        end = self.snapshot()
        older = [s for s in prev if s.time_s <= end.time_s - window_s]
        start = older[-1] if older else (prev[0] if prev else end)
        return self.observe(start, end)

    def observe(self, start: Snapshot, end: Snapshot) -> Observation:
        """The Observation of the window from ``start`` to the later ``end`` snapshot."""
        prof, p, sel = self.profile, self.prefix, self.selector
        notes: list[str] = []  # what makes the window stale
        staleness = max(0.0, self.clock() - end.time_s)
        samples = prof.counter_samples
        req = counter_window(
            start, end, samples(prof.completed, prefix=p), sel, by=prof.completed_by or None
        )
        tok = counter_window(start, end, samples(prof.generated_tokens, prefix=p), sel)
        rej = counter_window(
            start, end, samples(prof.rejected, prefix=p), sel, by=prof.rejected_by or None
        )
        (_, ttft), (tpot_family, tpot) = (
            self._histogram(start, end, fams) for fams in (prof.ttft, prof.tpot)
        )
        wanted = (prof.completed[0], prof.ttft[0], prof.tpot[0])
        missing = [
            names.read_as(n, prefix=p)
            for n, v in zip(wanted, (req, ttft, tpot), strict=True)
            if v is None
        ]
        if missing:
            notes.append(f"missing from {self.url}: {', '.join(missing)}")
            present = sorted(n for n in end.samples if prof.name in n)[:6]
            logger.warning(
                "%s: no %s (profile=%s, prefix=%r; %s samples present: %s)",
                self.url, missing, prof.name, p, prof.name, present or "none",
            )  # fmt: skip
        window = end.time_s - start.time_s
        if window <= 0:
            notes.append("empty window: the two snapshots are the same scrape")
        if staleness > self.max_staleness_s:
            notes.append(f"newest scrape is {staleness:.1f}s old (> {self.max_staleness_s}s)")
        met, missed = _split_completed(req or {}, prof, notes)
        rejected, overloaded = prof.split_rejected(rej or {})
        running, waiting = (
            gauge_mean(start, end, [names.read_as(f, prefix=p) for f in fams], sel, across)
            for fams, across in ((prof.running, "avg"), (prof.waiting, "sum"))
        )
        per_replica = None
        if prof.replica_label and tpot_family is not None:
            bucket = names.histogram_samples(tpot_family, prefix=p)[0]
            per_replica = bucket_windows_by(start, end, bucket, sel, by=prof.replica_label)
        return observation_from_histograms(
            slo=self.slo,
            start_s=start.time_s,
            end_s=end.time_s,
            met=met,
            missed=missed,
            rejected=_count("rejected", rejected, notes),
            overloaded=_count("overloaded", overloaded, notes),
            generated_tokens=_count("generated_tokens", sum((tok or {}).values()), notes),
            ttft_buckets=ttft,
            tpot_buckets=tpot,
            confidence=self.confidence,
            staleness_s=staleness,
            stale=bool(notes),
            source=f"scrape {self.url} ({prof.name})",
            note="; ".join(x for x in [*notes, prof.tpot_remark(tpot_family)] if x),
            running=running,
            waiting=waiting,
            replica_tpot_buckets=per_replica,
        )

    def _histogram(
        self, start: Snapshot, end: Snapshot, families: tuple[str, ...]
    ) -> tuple[str | None, dict[float, float] | None]:
        """The first of ``families`` present at ``end`` and its bucket increases."""
        for fam in families:
            bucket = names.histogram_samples(fam, prefix=self.prefix)[0]
            got = bucket_window(start, end, bucket, self.selector)
            if got is not None:
                return fam, got
        return None, None


def gauge_mean(
    start: Snapshot, end: Snapshot, gauges: list[str], selector: Mapping[str, str], across: str
) -> float:
    """A gauge over a window of two scrapes: each series' mean of its two values, then their
    ``avg`` or ``sum`` across series (replicas); NaN when neither scrape has it."""
    name = end.first_present(gauges) or start.first_present(gauges)
    if name is None:
        return math.nan
    series: dict[Labels, list[float]] = {}
    for snap in (start, end):
        for lab, v in snap.series(name, selector).items():
            series.setdefault(lab, []).append(v)
    means = [sum(v) / len(v) for v in series.values() if all(math.isfinite(x) for x in v)]
    if not means:
        return math.nan
    return sum(means) / len(means) if across == "avg" else sum(means)


def _label_matchers(selector: Mapping[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{k}="{esc(v)}"' for k, v in sorted(selector.items()))


def counter_selector(families: tuple[str, ...], *, prefix: str, selector: Mapping[str, str]) -> str:
    """A PromQL series selector of a counter under every name it may be exposed as
    (``MetricsProfile.counter_samples``), restricted to ``selector``'s labels."""
    return series_selector(MetricsProfile.counter_samples(families, prefix=prefix), selector)


def series_selector(samples: list[str], selector: Mapping[str, str]) -> str:
    """A PromQL selector of the series of any of the sample names ``samples``, restricted to
    ``selector``'s labels."""
    alts = "|".join(re.escape(n) for n in samples)
    extra = _label_matchers(selector)
    return f'{{__name__=~"{alts}"{"," + extra if extra else ""}}}'


class PromQLSource:
    """The same Observation from a Prometheus server's HTTP API (``/api/v1/query``).

    For production, where Prometheus already scrapes every replica on every node. Quantiles
    are Prometheus's own ``histogram_quantile(q, sum by (le) (rate(<h>_bucket{sel}[w])))``;
    counts are ``sum(increase(...[w]))`` (extrapolated to the window by Prometheus, then
    rounded to whole requests); goodput is the ``slo_met="true"`` count over the window
    (unknown, for :class:`ScrapeSource` too, under a profile whose server has no such label).

    As with any PromQL ``increase()``, a series born inside the window (an exporter that
    creates a labelled series at its first increment, e.g. ``slo_met="false"``) loses the
    increments before its first sample; :class:`ScrapeSource` counts such a series from 0.
    Emitters should create their label sets at zero up front.
    """

    def __init__(
        self,
        url: str,
        *,
        slo: Slo,
        profile: MetricsProfile = SLOTUNE,
        prefix: str = "ray_",
        selector: Mapping[str, str] | None = None,
        timeout_s: float = 5.0,
        confidence: float = 0.95,
        max_staleness_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url.rstrip("/")
        self.slo = slo
        self.profile = profile
        self.prefix = prefix
        self.selector = _check_common(url, selector, timeout_s, confidence, profile, prefix)
        self.confidence = confidence
        self.max_staleness_s = max_staleness_s
        self.clock = clock
        self._client = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._client.close()

    def query(self, expr: str, *, at: float) -> list[tuple[dict[str, str], float]]:
        """One instant query: ``[(labels, value)]``. Typed errors, never a crash."""
        api = f"{self.url}/api/v1/query"
        r = _get(self._client, api, {"query": expr, "time": f"{at:.3f}"})
        try:
            body = r.json()
        except ValueError as e:
            raise MetricsUnavailable(f"{api}: HTTP {r.status_code}, reply is not JSON") from e
        if r.status_code in (400, 422) or body.get("errorType") == "bad_data":
            raise QueryRejected(f"Prometheus rejected {expr!r}: {body.get('error', body)}")
        if r.status_code != 200 or body.get("status") != "success":
            raise MetricsUnavailable(f"{api}: HTTP {r.status_code}: {body.get('error', body)}")
        data = body.get("data", {})
        if data.get("resultType") != "vector":
            raise MetricsUnavailable(f"{api}: expected a vector for {expr!r}, got {data}")
        try:
            return [(dict(s["metric"]), float(s["value"][1])) for s in data["result"]]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise MetricsUnavailable(f"{api}: malformed result for {expr!r}") from e

    def _counter_sel(self, families: tuple[str, ...]) -> str:
        return counter_selector(families, prefix=self.prefix, selector=self.selector)

    def _bucket_sel(self, name: str) -> str:
        bucket = names.histogram_samples(name, prefix=self.prefix)[0]
        return f"{bucket}{{{_label_matchers(self.selector)}}}"

    def observe_range(self, *, window_s: float, end_s: float | None = None) -> Observation:
        """The Observation of the ``window_s`` seconds ending at ``end_s`` (now by default)."""
        if not (math.isfinite(window_s) and window_s >= 0.001):
            raise ValueError(f"window_s={window_s!r}: must be at least 0.001 seconds")
        end = self.clock() if end_s is None else end_s
        w = f"[{round(window_s * 1000)}ms]"
        prof = self.profile
        notes: list[str] = []
        reqs = self._counter_sel(prof.completed)
        newest = self.query(f"max(timestamp({reqs}))", at=end)
        if newest:
            staleness = max(0.0, end - newest[0][1])
        else:
            staleness = math.inf
            notes.append(
                f"no series {names.read_as(prof.completed[0], prefix=self.prefix)}"
                f"{{{_label_matchers(self.selector)}}} in Prometheus at {self.url}"
            )
        if math.isfinite(staleness) and staleness > self.max_staleness_s:
            notes.append(f"newest sample is {staleness:.1f}s old (> {self.max_staleness_s}s)")
        by = prof.completed_by
        by_label = {
            lab.get(by, ""): v
            for lab, v in self.query(
                f"sum by ({by}) (increase({reqs}{w}))" if by else f"sum(increase({reqs}{w}))",
                at=end,
            )
        }
        tokens = self._increase(prof.generated_tokens, w, end)
        rejected, overloaded = prof.split_rejected(
            self._increase_by(prof.rejected, prof.rejected_by, w, end)
        )
        running = self._gauge_mean("avg", prof.running, w, end)
        waiting = self._gauge_mean("sum", prof.waiting, w, end)
        hist: dict[str, dict[float, float]] = {}
        est: dict[str, float] = {}
        family: dict[str, str | None] = {}
        for key, fams in (("ttft", prof.ttft), ("tpot", prof.tpot)):
            family[key], hist[key] = None, {}
            for fam in fams:  # the first family Prometheus holds in the window
                got = self.query(f"sum by (le) (increase({self._bucket_sel(fam)}{w}))", at=end)
                if got:
                    family[key] = fam
                    break
            for lab, v in got:
                if "le" in lab:  # le="1" and le="1.0" are one bound, as PromQL merges them
                    b = float(lab["le"])
                    hist[key][b] = hist[key].get(b, 0.0) + v
            est[key] = math.nan
            if family[key] is not None:
                rate = f"sum by (le) (rate({self._bucket_sel(family[key])}{w}))"
                res = self.query(f"histogram_quantile({self.slo.quantile!r}, {rate})", at=end)
                est[key] = res[0][1] if res else math.nan
        per_replica: dict[str, dict[float, float]] = {}
        if prof.replica_label and family["tpot"] is not None:
            rl = prof.replica_label
            sel = self._bucket_sel(family["tpot"])
            for lab, v in self.query(f"sum by ({rl}, le) (increase({sel}{w}))", at=end):
                if "le" in lab:
                    group = per_replica.setdefault(lab.get(rl, ""), {})
                    group[float(lab["le"])] = group.get(float(lab["le"]), 0.0) + v
        met, missed = _split_completed(by_label, prof, notes)
        counts = {
            "rejected": _count("rejected", rejected, notes),
            "overloaded": _count("overloaded", overloaded, notes),
            "tokens": _count("generated_tokens", tokens, notes),
        }
        stale = bool(notes)
        if not hist["ttft"] and not stale:
            # Fresh series but no two samples in the window: nothing to judge (not stale).
            notes.append("no histogram samples in the window")
        return observation_from_histograms(
            slo=self.slo,
            start_s=end - window_s,
            end_s=end,
            met=met,
            missed=missed,
            rejected=counts["rejected"],
            overloaded=counts["overloaded"],
            generated_tokens=counts["tokens"],
            ttft_buckets=hist["ttft"],
            tpot_buckets=hist["tpot"],
            confidence=self.confidence,
            staleness_s=staleness,
            stale=stale,
            source=f"promql {self.url} ({prof.name})",
            note="; ".join(x for x in [*notes, prof.tpot_remark(family["tpot"])] if x),
            ttft_estimate_s=est["ttft"],
            tpot_estimate_s=est["tpot"],
            running=running,
            waiting=waiting,
            replica_tpot_buckets=per_replica,
        )

    def _increase(self, families: tuple[str, ...], w: str, end: float) -> float:
        """``sum(increase(...))`` of a counter over the window; 0 when it has no series."""
        return sum(self._increase_by(families, "", w, end).values())

    def _increase_by(
        self, families: tuple[str, ...], by: str, w: str, end: float
    ) -> dict[str, float]:
        """``sum by (by) (increase(...))`` of a counter over the window, keyed by the label's
        value ("" for every series when ``by`` is empty); empty when it has no series."""
        if not families:
            return {}
        sel = self._counter_sel(families)
        expr = f"sum by ({by}) (increase({sel}{w}))" if by else f"sum(increase({sel}{w}))"
        return {lab.get(by, "") if by else "": v for lab, v in self.query(expr, at=end)}

    def _gauge_mean(self, across: str, families: tuple[str, ...], w: str, end: float) -> float:
        """A gauge's mean over the window, per series, then ``avg`` or ``sum`` across the
        replicas' series; NaN when the server exports no such gauge."""
        if not families:
            return math.nan
        gauges = [names.read_as(f, prefix=self.prefix) for f in families]
        sel = series_selector(gauges, self.selector)
        got = self.query(f"{across}(avg_over_time({sel}{w}))", at=end)
        return got[0][1] if got else math.nan


def _count(name: str, v: float, notes: list[str]) -> float:
    """A window count as given, or 0 with a note (making the window stale) when it is not
    a finite non-negative number (a NaN or negative counter in the exposition)."""
    if math.isfinite(v) and v >= 0:
        return v
    notes.append(f"{name} count is {v!r}: the counters are not valid")
    return 0.0
