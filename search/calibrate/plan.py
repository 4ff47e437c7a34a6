"""How much :func:`search.calibrate.device.calibrate` measures: named plans (full, quick)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CalibrationPlan:
    """How much to measure. Presets: ``full`` (~30-45 s on 2 CPU cores), ``quick`` (tests).

    Calibrate under the OpenMP wait policy and thread count the served process
    will run (``calibrate(threads=...)``; the measured block records both). With
    more than one thread the policy matters: on cores shared with other work
    spinning threads made skinny GEMMs 10-100x slower (PASSIVE there; the CLI sets
    it), on cores a process has to itself spinning (ACTIVE) made a B=1 step ~2x
    faster. With one thread (a Ray replica) it does not matter.
    """

    name: str = "full"
    bandwidth_bytes: int = 1 << 30
    matmul_n: int = 2048
    weight_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # KV rates and per-layer and per-step overheads (the layers and the step outside
    # them timed whole) at these batches, interpolated log-log between them (factors
    # of 4 apart, where 8 left 16 and 32 to an interpolation over 8x), held flat
    # beyond the largest. 256 is measured, not extrapolated: held flat from 64, the
    # prediction of a small-model B=256 step came out 17-28% low. 2: the last batch the
    # whole-layer C call serves on AVX-512 (its layers run faster than their parts).
    kv_batches: tuple[int, ...] = (1, 2, 4, 16, 64, 256)
    context: int = 256
    reps: int = 2  # timed calls per point and pass at least (a big batch exceeds budget_s in one)
    budget_s: float = 0.06  # per point and pass: keep trying for a quiet moment this long
    passes: int = 3  # over all decode-shape points, spread in time; the best of each kept
    max_s: float = 40.0  # no further pass once past this (a busy machine stretches it)

    def __post_init__(self) -> None:
        if self.bandwidth_bytes < 1 << 20:
            raise ValueError(f"bandwidth_bytes={self.bandwidth_bytes}: must be >= 1 MiB")
        for name in ("matmul_n", "context", "reps", "passes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        for name in ("weight_batches", "kv_batches"):
            v = getattr(self, name)
            if not v or any(b < 1 for b in v) or list(v) != sorted(set(v)):
                raise ValueError(f"{name}={v!r}: must be ascending distinct batches >= 1")

    @classmethod
    def from_name(cls, name: str) -> CalibrationPlan:
        if name not in PLANS:
            raise ValueError(f"calibration plan {name!r}: allowed: {', '.join(PLANS)}")
        return PLANS[name]


PLANS = {
    "full": CalibrationPlan(),
    "quick": CalibrationPlan(
        name="quick",
        bandwidth_bytes=256 << 20,
        matmul_n=1024,
        weight_batches=(1, 8, 64),
        kv_batches=(1, 8),
        context=64,
        reps=2,
        budget_s=0.0,
        passes=1,
    ),
}
