"""What a calibrated device achieves at decode shapes: the tables ``slotune calibrate``
measures and the roofline reads (rates and overheads by batch size)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: must be a number")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r}: must be a positive finite number")


def check_non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: must be a number")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class DecodeProfile:
    """What one dtype achieves at decode shapes on a calibrated device.

    ``weight_rate``: batch -> bytes of weight consumed per second by the
    linear layers (B x K @ K x N GEMMs over a working set larger than the
    caches), so linear time = weight bytes / rate(B). It folds in both the
    bandwidth a GEMV really streams and the FLOP/s a skinny GEMM really gets.
    ``kv_rate``: batch -> KV-cache bytes read per second by attention at
    decode shapes (one query token per sequence).
    ``layer_overhead_s``: batch -> seconds one decoder layer spends outside its
    linears and its attention core (norms, rotary, cache writes, reshapes,
    residual adds: eager dispatch and small kernels).
    ``step_overhead_s``: batch -> seconds per step outside the layers and the
    lm_head (embedding and rotary lookups, the mask, final norm, fp32 logits,
    argmax).
    """

    weight_rate: Mapping[int, float]
    kv_rate: Mapping[int, float]
    layer_overhead_s: Mapping[int, float] = field(default_factory=dict)
    step_overhead_s: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("weight_rate", "kv_rate", "layer_overhead_s", "step_overhead_s"):
            table = getattr(self, name)
            if not table and name in ("weight_rate", "kv_rate"):
                raise ValueError(f"{name}={table!r}: needs at least one batch -> rate entry")
            clean: dict[int, float] = {}
            for b, r in table.items():
                bi = int(b)
                if bi < 1:
                    raise ValueError(f"{name}: batch {b!r} must be >= 1")
                check_positive(f"{name}[{bi}]", r)
                clean[bi] = float(r)
            object.__setattr__(self, name, MappingProxyType(dict(sorted(clean.items()))))

    @staticmethod
    def _interp(table: Mapping[int, float], batch: float) -> float:
        """Rate at ``batch``: log-log interpolation inside the table.

        Beyond the largest measured batch the time per row is taken as constant
        (compute-bound GEMMs scale linearly in rows); below the smallest the
        rate at the smallest batch holds (a weight read cannot get cheaper).
        """
        keys = list(table)
        if batch <= keys[0]:
            return table[keys[0]]
        if batch >= keys[-1]:
            return table[keys[-1]] * keys[-1] / batch
        for lo, hi in zip(keys, keys[1:], strict=False):
            if lo <= batch <= hi:
                t = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return math.exp((1 - t) * math.log(table[lo]) + t * math.log(table[hi]))
        raise AssertionError("unreachable")  # pragma: no cover

    def weight_rate_at(self, batch: float) -> float:
        return self._interp(self.weight_rate, batch)

    @classmethod
    def _flat(cls, table: Mapping[int, float], batch: float) -> float:
        keys = list(table)
        if batch >= keys[-1]:
            return table[keys[-1]]
        return cls._interp(table, batch)

    def kv_rate_at(self, batch: float) -> float:
        """KV bytes/s at ``batch``; held flat outside the measured batches."""
        return self._flat(self.kv_rate, batch)

    def layer_overhead_at(self, batch: float) -> float:
        """Seconds per layer outside linears and attention; flat outside the table."""
        return self._flat(self.layer_overhead_s, batch) if self.layer_overhead_s else 0.0

    def step_overhead_at(self, batch: float) -> float:
        """Seconds per step outside the layers and the lm_head; flat outside the table."""
        return self._flat(self.step_overhead_s, batch) if self.step_overhead_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "weight_rate": {str(k): v for k, v in self.weight_rate.items()},
            "kv_rate": {str(k): v for k, v in self.kv_rate.items()},
            "layer_overhead_s": {str(k): v for k, v in self.layer_overhead_s.items()},
            "step_overhead_s": {str(k): v for k, v in self.step_overhead_s.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecodeProfile:
        return cls(
            weight_rate={int(k): float(v) for k, v in d["weight_rate"].items()},
            kv_rate={int(k): float(v) for k, v in d["kv_rate"].items()},
            layer_overhead_s={
                int(k): float(v) for k, v in (d.get("layer_overhead_s") or {}).items()
            },
            step_overhead_s={int(k): float(v) for k, v in (d.get("step_overhead_s") or {}).items()},
        )
