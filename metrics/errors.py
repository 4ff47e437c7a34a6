"""Typed failures of the metric sources: transient ones are retried, permanent ones stop."""

from __future__ import annotations


class MetricsError(Exception):
    """Base of every metric-source failure."""


class MetricsUnavailable(MetricsError):
    """Transient: endpoint down, timeout, HTTP 5xx, garbled reply. Retry on the next tick."""


class MalformedExposition(MetricsUnavailable):
    """The endpoint answered, but not with Prometheus text exposition.

    Retried like any transient failure (a half-written reply is one); when it persists the
    URL probably points at something that is not a /metrics endpoint.
    """


class QueryRejected(MetricsError):
    """Permanent: Prometheus refused the query (HTTP 400/422). Fix the selector or prefix."""
