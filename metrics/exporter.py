"""The controller's own metrics, served with prometheus_client on a port the user chooses.

Current knobs, trials run, best goodput, the last window's goodput, quantiles and SLO
verdicts, whether metrics are stale, and rollbacks. Each exporter has its own
``CollectorRegistry`` (tests pass theirs), so two exporters never collide.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from metrics import names
from metrics.observation import Observation, SloVerdict, Verdict

logger = logging.getLogger(__name__)


def _knob_items(knobs: Mapping[str, Any] | Any) -> dict[str, float]:
    if dataclasses.is_dataclass(knobs) and not isinstance(knobs, type):
        knobs = dataclasses.asdict(knobs)
    if not isinstance(knobs, Mapping):
        raise ValueError(f"knobs={knobs!r}: need a mapping or a dataclass of numbers")
    out: dict[str, float] = {}
    for k, v in knobs.items():
        if not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"knob {k}={v!r}: exported knobs must be numbers")
        out[str(k)] = float(v)
    return out


class ControllerExporter:
    """Gauges and counters describing what the controller is doing."""

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.knob = Gauge(
            names.CONTROLLER_KNOB, "Current value of each tuned knob.", [names.LABEL_KNOB],
            registry=reg,
        )  # fmt: skip
        self.trials = Counter(
            names.CONTROLLER_TRIALS_TOTAL, "Trials (measured windows) run.", registry=reg
        )
        self.best_goodput = Gauge(
            names.CONTROLLER_BEST_GOODPUT_RPS,
            "Goodput of the best feasible point so far, requests/s (NaN before one).",
            registry=reg,
        )
        self.goodput = Gauge(
            names.CONTROLLER_GOODPUT_RPS, "Goodput of the last observed window, requests/s.",
            registry=reg,
        )  # fmt: skip
        self.verdict = Gauge(
            names.CONTROLLER_SLO_VERDICT,
            "1 for the current verdict of each SLO (met/violated/insufficient), else 0.",
            [names.LABEL_SLO, names.LABEL_VERDICT],
            registry=reg,
        )
        self.quantile = Gauge(
            names.CONTROLLER_QUANTILE_SECONDS,
            "The SLO quantile of the last window, seconds (NaN when unknown).",
            [names.LABEL_SLO],
            registry=reg,
        )
        self.stale = Gauge(
            names.CONTROLLER_STALE, "1 when the last window's metrics were stale.", registry=reg
        )
        self.rollbacks = Counter(
            names.CONTROLLER_ROLLBACKS_TOTAL, "Rollbacks to the last good point.", registry=reg
        )
        self.decisions = Counter(
            names.CONTROLLER_DECISIONS_TOTAL,
            "slotune control's decisions, by action and outcome.",
            [names.LABEL_ACTION, names.LABEL_OUTCOME],
            registry=reg,
        )
        self.degraded = Gauge(
            names.CONTROLLER_DEGRADED,
            "1 while slotune control is latched degraded after a rollback (until --ack).",
            registry=reg,
        )
        self.outliers = Gauge(
            names.CONTROLLER_OUTLIERS,
            "Replicas whose p99 TPOT was far above the others' in the last window.",
            registry=reg,
        )
        self.tpot_band = Gauge(
            names.CONTROLLER_TPOT_BAND,
            "The TPOT band slotune control steered by, shares of the SLO (edge: tighten, "
            "loosen); lowered where the windows spread wide.",
            ["edge"],
            registry=reg,
        )
        self.tpot_spread = Gauge(
            names.CONTROLLER_TPOT_SPREAD,
            "Spread of p99 TPOT from window to window where the limit held the batch "
            "(sd / mean; NaN before it is known).",
            registry=reg,
        )
        self.best_goodput.set(math.nan)
        self.set_tpot_band(math.nan, math.nan, math.nan)
        self.goodput.set(math.nan)
        for slo in ("ttft", "tpot"):
            self._set_verdict(slo, None)
            self.quantile.labels(slo=slo).set(math.nan)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # --- what the controller reports -------------------------------------------------
    def set_knobs(self, knobs: Mapping[str, Any] | Any) -> None:
        """Knob values from a mapping or a dataclass (e.g. ``search.space.Knobs``)."""
        for k, v in _knob_items(knobs).items():
            self.knob.labels(knob=k).set(v)

    def trial_done(self, n: int = 1) -> None:
        self.trials.inc(n)

    def set_best_goodput(self, rps: float) -> None:
        self.best_goodput.set(rps)

    def rollback(self) -> None:
        self.rollbacks.inc()

    def decision(self, action: str, outcome: str) -> None:
        self.decisions.labels(action=action, outcome=outcome).inc()

    def set_outliers(self, n: int) -> None:
        self.outliers.set(n)

    def set_tpot_band(self, tighten_at: float, loosen_below: float, spread: float) -> None:
        self.tpot_band.labels(edge="tighten").set(tighten_at)
        self.tpot_band.labels(edge="loosen").set(loosen_below)
        self.tpot_spread.set(spread)

    def set_degraded(self, degraded: bool) -> None:
        self.degraded.set(1.0 if degraded else 0.0)

    def observe(self, obs: Observation) -> None:
        """Export the last window: goodput, SLO quantiles, verdicts, staleness."""
        self.goodput.set(obs.goodput_rps)
        self.stale.set(1.0 if obs.stale else 0.0)
        for slo, v in (("ttft", obs.ttft_verdict), ("tpot", obs.tpot_verdict)):
            self._set_verdict(slo, v)
            self.quantile.labels(slo=slo).set(v.estimate_s if v is not None else math.nan)

    def _set_verdict(self, slo: str, v: SloVerdict | None) -> None:
        current = v.verdict if v is not None else Verdict.INSUFFICIENT
        for verdict in Verdict:
            self.verdict.labels(slo=slo, verdict=verdict.value).set(
                1.0 if verdict is current else 0.0
            )

    # --- serving --------------------------------------------------------------------
    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int = 0, *, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` (0 picks a free port); returns the bound port."""
        if self._server is not None:
            raise RuntimeError("exporter already serving; close() it first")
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port!r}: must be in 0..65535")
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve controller metrics on {addr}:{port}: {e}") from e
        bound = int(self._server.server_port)
        logger.info("controller metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self._thread = None
