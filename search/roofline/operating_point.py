"""Where to operate on the roofline's curve: the largest batch that meets the TPOT SLO
and fits in memory, what it yields, what it costs, and why (two or three lines)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from search.roofline.curve import MAX_DEFAULT_BATCH, CurvePoint, Roofline

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OperatingPoint:
    batch: int
    tpot_s: float
    tokens_per_s: float
    usd_per_million_tokens: float | None  # None when no price is known
    limited_by: str  # "slo" | "memory" | "max_batch"

    def to_dict(self) -> dict[str, object]:
        return {
            "batch": self.batch,
            "tpot_ms": self.tpot_s * 1e3,
            "tokens_per_s": self.tokens_per_s,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "limited_by": self.limited_by,
        }


def usd_per_million_tokens(usd_per_hour: float, devices: int, tokens_per_s: float) -> float:
    """(device $/h * devices) / (tokens/s * 3600) * 1e6."""
    return usd_per_hour * devices / (tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True, kw_only=True)
class RooflineAnalysis:
    roofline: Roofline
    slo_tpot_s: float
    max_batch: int
    usd_per_hour: float
    operating_point: OperatingPoint | None
    curve: list[CurvePoint] = field(default_factory=list)

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.roofline.ridge_flops_per_byte

    @property
    def kv_bytes_per_token(self) -> int:
        return self.roofline.kv_bytes_per_token

    @property
    def knee_batch(self) -> int:
        return self.roofline.knee_batch

    @property
    def max_batch_memory(self) -> int:
        return self.roofline.max_batch_memory

    def at(self, batch: int) -> CurvePoint:
        return self.curve[batch - 1]

    def explain(self) -> list[str]:
        """Two or three lines: where to operate and why."""
        r = self.roofline
        op = self.operating_point
        knee = r.knee_batch
        ridge = f"ridge {r.ridge_flops_per_byte:.0f} FLOP/byte"
        cross = r.compute_crossover_batch
        if r.knee_bound == "compute":
            first = (
                f"Decode is memory-bound up to the knee at B={knee}, where the compute bound "
                f"overtakes it ({ridge}): past it each added sequence adds latency and little "
                "throughput."
            )
        else:
            where = (
                f"it turns compute-bound only at B={cross} ({ridge})"
                if cross
                else f"at this context it never turns compute-bound ({ridge})"
            )
            first = (
                f"Decode is memory-bound: {where}; the knee is at B={knee}, where the KV cache "
                "read per step outweighs the weights, so each added sequence buys less."
            )
        lines = [first]
        slo_ms = self.slo_tpot_s * 1e3
        if op is None:
            one = self.at(1)
            lines.append(
                f"No batch meets TPOT <= {slo_ms:g} ms: even B=1 takes {one.tpot_s * 1e3:.1f} ms; "
                "raise --tp, use a faster device, or relax the SLO."
            )
            return lines
        cost = (
            f", ${op.usd_per_million_tokens:.4f} per million output tokens"
            if op.usd_per_million_tokens is not None
            else ""
        )
        lines.append(
            f"Operate at B={op.batch}: TPOT {op.tpot_s * 1e3:.2f} ms <= {slo_ms:g} ms, "
            f"{op.tokens_per_s:,.0f} tokens/s{cost}."
        )
        if op.limited_by == "memory":
            lines.append(
                f"The KV cache caps it (B <= {r.max_batch_memory} at context {r.context}), not "
                "the SLO: shorter contexts, more --tp or more memory would allow more."
            )
        elif op.limited_by == "slo":
            nxt = self.at(op.batch + 1)
            lines.append(
                f"The SLO caps it: B={op.batch + 1} would take {nxt.tpot_s * 1e3:.2f} ms"
                + (
                    " (past the knee each sequence costs more latency)."
                    if op.batch >= knee
                    else " (below the knee, so the SLO is tight for this hardware)."
                )
            )
        else:
            lines.append(f"Limited by --max-batch {self.max_batch}; raise it to look further.")
        return lines

    def to_dict(self) -> dict[str, object]:
        r = self.roofline
        single = self.at(1)
        return {
            "model": r.model.name,
            "hardware": r.hardware.name,
            "tp": r.tp,
            "dtype": r.dtype,
            "context": r.context,
            "calibrated": r.calibrated,
            "slo_tpot_ms": self.slo_tpot_s * 1e3,
            "usd_per_hour": self.usd_per_hour,
            "ridge_flops_per_byte": self.ridge_flops_per_byte,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "knee_batch": self.knee_batch,
            "knee_bound": r.knee_bound,
            "compute_crossover_batch": r.compute_crossover_batch,
            "max_batch_memory": self.max_batch_memory,
            "weight_bytes_per_device": r.weight_bytes_per_device,
            "single_stream": {"tpot_ms": single.tpot_s * 1e3, "tokens_per_s": single.tokens_per_s},
            "operating_point": None
            if self.operating_point is None
            else self.operating_point.to_dict(),
            "explanation": self.explain(),
            "curve": [p.to_dict() for p in self.curve],
        }


def analyze(
    roofline: Roofline,
    *,
    slo_tpot_s: float,
    max_batch: int | None = None,
    usd_per_hour: float | None = None,
) -> RooflineAnalysis:
    """The curve up to ``max_batch`` (default: what memory holds, at most 1024), and the
    largest batch whose TPOT meets the SLO and whose KV cache fits."""
    if isinstance(slo_tpot_s, bool) or not isinstance(slo_tpot_s, (int, float)):
        raise ValueError(f"slo_tpot_s={slo_tpot_s!r}: must be a number of seconds")
    if not (math.isfinite(slo_tpot_s) and slo_tpot_s > 0):
        raise ValueError(f"slo_tpot_s={slo_tpot_s!r}: must be a positive number of seconds")
    price = roofline.hardware.usd_per_hour if usd_per_hour is None else usd_per_hour
    if not (math.isfinite(price) and price >= 0):
        raise ValueError(f"usd_per_hour={price!r}: must be a number >= 0")
    roofline.check_fits()
    cap = roofline.max_batch_memory
    if max_batch is None:
        max_batch = min(cap, MAX_DEFAULT_BATCH)
    elif isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: must be a positive integer")
    curve = roofline.curve(max_batch)
    # An explicit max_batch may go past the memory cap: those points are drawn, not chosen.
    best = None
    for p in curve:
        if p.fits and p.tpot_s <= slo_tpot_s:
            best = p
    op = None
    if best is not None:
        if best.batch == cap:
            limited = "memory"
        elif best.batch == max_batch:
            limited = "max_batch"
        else:
            limited = "slo"
        op = OperatingPoint(
            batch=best.batch,
            tpot_s=best.tpot_s,
            tokens_per_s=best.tokens_per_s,
            usd_per_million_tokens=(
                usd_per_million_tokens(price, roofline.tp, best.tokens_per_s) if price > 0 else None
            ),
            limited_by=limited,
        )
    return RooflineAnalysis(
        roofline=roofline,
        slo_tpot_s=float(slo_tpot_s),
        max_batch=max_batch,
        usd_per_hour=price,
        operating_point=op,
        curve=curve,
    )
