"""One measured trial (:class:`TrialRecord`: a CSV row, a JSONL line) and one point of
the roofline's predicted curve (:class:`PredictedPoint`), as the exported report
holds them. Flat and JSON-round-trippable, so ``slotune export`` rebuilds a report
from a study's stored records."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from metrics.observation import Observation, Verdict


def json_num(x: Any) -> Any:
    """NaN/inf → None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_num(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_num(v) for v in x]
    return x


def ms_of(seconds: float) -> float:
    return seconds * 1e3 if math.isfinite(seconds) else math.nan


ROLES = ("search", "sweep", "production")


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One measured trial, flat (one CSV row; one JSONL line)."""

    number: int
    max_batch_size: int
    max_concurrency: int
    tokens_per_s: float
    goodput_rps: float
    throughput_rps: float
    completed: int
    rejected: int
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    ttft_verdict: str  # met | violated | insufficient | none
    tpot_verdict: str
    ttft_samples: int
    tpot_samples: int
    feasible: bool
    window_s: float
    wall_s: float = math.nan  # the whole trial: apply, warm-up, window
    source: str = ""
    # The load generator's own view of the same window (cross-check; NaN when absent).
    client_completed: int = 0
    client_p99_ttft_ms: float = math.nan
    client_p99_tpot_ms: float = math.nan
    client_rejected: int = 0
    client_errors: int = 0
    note: str = ""  # why not feasible, or what went wrong
    remeasured: int = 0  # windows of this trial discarded across a fault before this one
    # The p99 TPOT the tuner's model predicted at this batch (the served-step model when
    # calibrated, else the roofline's step); NaN: not recorded (the report then reads it
    # off its model curve: CurveReport.predicted_tpot_s).
    predicted_tpot_s: float = math.nan
    # What the tuner stores of the window (``search.points.observation_attrs`` plus
    # ``feasible``): the request counts behind each verdict, so the report pools a
    # knob's windows exactly as the tuner does. Not a CSV column. None: not known.
    evidence: Mapping[str, Any] | None = None
    # Why the window was measured: "search" (a tuner trial: the operating point is chosen
    # among these alone), "sweep" (``slotune tune --curve-points``: drawn, not searched) or
    # "production" (a ``slotune control`` window merged by ``slotune export``: passive).
    role: str = "search"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}: must be one of {', '.join(ROLES)}")

    @classmethod
    def from_observation(
        cls,
        *,
        number: int,
        knobs: Any,
        obs: Observation,
        feasible: bool,
        wall_s: float = math.nan,
        client: Observation | None = None,
        client_errors: int = 0,
        note: str = "",
        remeasured: int = 0,
        predicted_tpot_s: float = math.nan,
        role: str = "search",
    ) -> TrialRecord:
        def verdict(v: Any) -> tuple[str, int]:
            return ("none", 0) if v is None else (Verdict(v.verdict).value, int(v.samples))

        from search.points import observation_attrs

        tv, tn = verdict(obs.ttft_verdict)
        pv, pn = verdict(obs.tpot_verdict)
        return cls(
            number=number,
            max_batch_size=int(knobs.max_batch_size),
            max_concurrency=int(knobs.max_concurrency),
            tokens_per_s=float(obs.tokens_per_s),
            goodput_rps=float(obs.goodput_rps),
            throughput_rps=float(obs.throughput_rps),
            completed=int(obs.completed),
            rejected=int(obs.rejected),
            p50_ttft_ms=ms_of(obs.ttft.p50),
            p99_ttft_ms=ms_of(obs.ttft.p99),
            p50_tpot_ms=ms_of(obs.tpot.p50),
            p99_tpot_ms=ms_of(obs.tpot.p99),
            ttft_verdict=tv,
            tpot_verdict=pv,
            ttft_samples=tn,
            tpot_samples=pn,
            feasible=bool(feasible),
            window_s=float(obs.window_s),
            wall_s=float(wall_s),
            source=obs.source,
            client_completed=int(client.completed) if client else 0,
            client_p99_ttft_ms=ms_of(client.ttft.p99) if client else math.nan,
            client_p99_tpot_ms=ms_of(client.tpot.p99) if client else math.nan,
            client_rejected=int(client.rejected) if client else 0,
            client_errors=int(client_errors),
            note=note,
            remeasured=int(remeasured),
            predicted_tpot_s=float(predicted_tpot_s),
            evidence={**observation_attrs(obs), "feasible": bool(feasible)},
            role=role,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: json_num(v) for k, v in asdict(self).items()}

    def window_attrs(self) -> dict[str, Any]:
        """The window as the tuner stores it: :attr:`evidence` where known, else rebuilt
        from the flat fields without request counts (pooling then falls back to a
        majority vote of windows, as the tuner does for such a study)."""
        if self.evidence is not None:
            return dict(self.evidence)
        slo_met = self.goodput_rps * self.window_s
        return {
            "feasible": self.feasible,
            "goodput_rps": self.goodput_rps,
            "throughput_rps": self.throughput_rps,
            "slo_met": round(slo_met) if math.isfinite(slo_met) else 0,
            "window_s": self.window_s,
            "ttft_p99_s": self.p99_ttft_ms / 1e3 if math.isfinite(self.p99_ttft_ms) else None,
            "tpot_p99_s": self.p99_tpot_ms / 1e3 if math.isfinite(self.p99_tpot_ms) else None,
            "ttft_verdict": self.ttft_verdict,
            "tpot_verdict": self.tpot_verdict,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrialRecord:
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.type in ("float",) and v is None:
                v = math.nan
            kw[f.name] = v
        return cls(**kw)

    @property
    def verdict(self) -> str:
        if self.feasible:
            return "met"
        if "violated" in (self.ttft_verdict, self.tpot_verdict):
            return "violated"
        return "insufficient"


@dataclass(frozen=True, kw_only=True)
class PredictedPoint:
    """One point of the roofline's predicted curve."""

    batch: int
    tpot_s: float
    tokens_per_s: float
    bound: str = ""  # "memory" | "compute"

    @classmethod
    def of(cls, p: Any) -> PredictedPoint:
        """From a ``search.roofline.curve.CurvePoint`` (or any object or dict with these fields)."""
        get = p.get if isinstance(p, Mapping) else lambda k, d=None: getattr(p, k, d)
        return cls(
            batch=int(get("batch")),
            tpot_s=float(get("tpot_s")),
            tokens_per_s=float(get("tokens_per_s")),
            bound=str(get("bound", "") or ""),
        )
