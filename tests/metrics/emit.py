"""A stand-in for serving's emission: the contract's families on a prometheus_client registry."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from metrics import names
from metrics.observation import DEFAULT_SLO, Slo

LABELS = ("application", "deployment", "replica")


class Emitter:
    def __init__(self, *, slo: Slo, prefix: str = "", labelnames: Sequence[str] = LABELS) -> None:
        self.slo = slo
        self.registry = CollectorRegistry()
        self.labelnames = tuple(labelnames)
        reg, ln = self.registry, list(labelnames)
        self.ttft = Histogram(
            prefix + names.TTFT_SECONDS, "ttft", ln, registry=reg,
            buckets=names.slo_buckets([DEFAULT_SLO.ttft_p99_s, slo.ttft_p99_s]),
        )  # fmt: skip
        self.tpot = Histogram(
            prefix + names.TPOT_SECONDS, "tpot", ln, registry=reg,
            buckets=names.slo_buckets([DEFAULT_SLO.tpot_p99_s, slo.tpot_p99_s]),
        )  # fmt: skip
        self.requests = Counter(
            prefix + names.REQUESTS_TOTAL, "requests", [*ln, names.LABEL_SLO_MET], registry=reg
        )
        self.tokens = Counter(prefix + names.GENERATED_TOKENS_TOTAL, "tokens", ln, registry=reg)
        self.rejected = Counter(
            prefix + names.REJECTED_TOTAL, "rejected", [*ln, names.LABEL_REASON], registry=reg
        )
        self.running = Gauge(prefix + names.RUNNING_REQUESTS, "running", ln, registry=reg)
        self.waiting = Gauge(prefix + names.WAITING_REQUESTS, "waiting", ln, registry=reg)

    def touch(self, **labels: str) -> None:
        """Create every series at zero (so a scrape before any request sees them)."""
        self.ttft.labels(**labels)
        self.tpot.labels(**labels)
        for met in ("true", "false"):
            self.requests.labels(**labels, slo_met=met)
        self.tokens.labels(**labels)
        for reason in names.REJECTED_REASONS:
            self.rejected.labels(**labels, reason=reason)

    def record(self, ttft: float, tpot: float, tokens: int, **labels: str) -> bool:
        met = bool(self.slo.met(ttft, tpot))
        self.ttft.labels(**labels).observe(ttft)
        self.tpot.labels(**labels).observe(tpot)
        self.requests.labels(**labels, slo_met="true" if met else "false").inc()
        self.tokens.labels(**labels).inc(tokens)
        return met

    def batch(self, running: float, waiting: float, **labels: str) -> None:
        """The decode batch and the queue now (the replica's gauges)."""
        self.running.labels(**labels).set(running)
        self.waiting.labels(**labels).set(waiting)

    def reject(self, reason: str = names.REASON_OVERLOADED, **labels: str) -> None:
        self.rejected.labels(**labels, reason=reason).inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def latencies(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """TTFT around 0.3 s and TPOT around 40 ms, a few percent above the default SLOs."""
    ttft = rng.lognormal(np.log(0.3), 0.6, n)  # [n]
    tpot = rng.lognormal(np.log(0.04), 0.35, n)  # [n]
    return ttft, tpot
