"""One scrape of a Prometheus text endpoint, and the increases between two scrapes.

Samples are looked up by *sample* name (``x_bucket``, ``x_total``), not by family name, so
the reader does not depend on how an exporter types a family (Ray once exposed counters as
gauges). Increases follow PromQL's counter-reset rule per series; series are summed across
replicas and label sets that match a selector.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as om_text_string_to_metric_families,
)
from prometheus_client.parser import text_string_to_metric_families

from metrics.errors import MalformedExposition
from metrics.quantile import counter_increase

logger = logging.getLogger(__name__)

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Every sample of one scrape, by sample name then label set."""

    time_s: float  # unix seconds, when the reply arrived
    samples: Mapping[str, Mapping[Labels, float]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    url: str = ""

    def series(self, name: str, selector: Mapping[str, str]) -> dict[Labels, float]:
        """The series of ``name`` whose labels include every ``selector`` pair."""
        want = set(selector.items())
        return {lab: v for lab, v in self.samples.get(name, {}).items() if want <= lab}

    def has(self, name: str) -> bool:
        return bool(self.samples.get(name))

    def first_present(self, candidates: Iterable[str]) -> str | None:
        return next((n for n in candidates if self.has(n)), None)


def parse_exposition(
    text: str, *, time_s: float, url: str = "", openmetrics: bool = False
) -> Snapshot:
    """Parse Prometheus text exposition (or OpenMetrics) with prometheus_client's parsers.

    Raises :class:`MalformedExposition` with the parser's complaint.
    """
    out: dict[str, dict[Labels, float]] = {}
    parse = om_text_string_to_metric_families if openmetrics else text_string_to_metric_families
    try:
        for family in parse(text):
            for s in family.samples:
                out.setdefault(s.name, {})[frozenset(s.labels.items())] = float(s.value)
    except Exception as e:  # the parser raises ValueError, IndexError, ... on bad input
        raise MalformedExposition(f"{url or 'exposition'}: not Prometheus text format: {e}") from e
    frozen = {k: MappingProxyType(v) for k, v in out.items()}
    return Snapshot(time_s=time_s, samples=MappingProxyType(frozen), url=url)


def counter_window(
    start: Snapshot,
    end: Snapshot,
    candidates: Iterable[str],
    selector: Mapping[str, str],
    *,
    by: str | None = None,
) -> dict[str, float] | None:
    """Summed increase of a counter between two snapshots, optionally grouped by label ``by``.

    The counter is read under the first candidate name present in ``end``; ``None`` when
    none is. A series absent at ``start`` (a new replica) counts from 0; a series whose value
    dropped restarted from 0 (PromQL's reset rule); a series gone at ``end`` is not counted.
    """
    name = end.first_present(candidates)
    if name is None:
        return None
    before = start.series(name, selector)
    totals: dict[str, float] = {}
    for lab, v in end.series(name, selector).items():
        key = dict(lab).get(by, "") if by else ""
        inc = counter_increase(before.get(lab, 0.0), v)
        totals[key] = totals.get(key, 0.0) + inc
    return totals


def bucket_window(
    start: Snapshot, end: Snapshot, bucket_name: str, selector: Mapping[str, str]
) -> dict[float, float] | None:
    """Cumulative bucket increases keyed by upper bound, summed across matching series.

    ``None`` when the histogram is absent at ``end``. Each ``le`` series is its own counter,
    so a reset in one is handled as PromQL does; bounds written two ways (``1`` and ``1.0``)
    are summed into one bound, as PromQL's ``histogram_quantile`` merges them.
    """
    got = bucket_windows_by(start, end, bucket_name, selector, by="")
    return None if got is None else got.get("", {})


def bucket_windows_by(
    start: Snapshot, end: Snapshot, bucket_name: str, selector: Mapping[str, str], *, by: str
) -> dict[str, dict[float, float]] | None:
    """:func:`bucket_window` per value of the label ``by`` (``""``: one group of all)."""
    if not end.has(bucket_name):
        return None
    before = start.series(bucket_name, selector)
    out: dict[str, dict[float, float]] = {}
    for lab, v in end.series(bucket_name, selector).items():
        labels = dict(lab)
        le = labels.get("le")
        try:
            bound = float(le) if le is not None else math.nan
        except ValueError:
            bound = math.nan
        if math.isnan(bound):
            logger.warning("%s: ignoring a bucket series with le=%r", bucket_name, le)
            continue
        group = out.setdefault(labels.get(by, "") if by else "", {})
        group[bound] = group.get(bound, 0.0) + counter_increase(before.get(lab, 0.0), v)
    return out
