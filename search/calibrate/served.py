"""The served-step model: what a token costs through the whole serving path on this machine.

The roofline and the decode calibration (:mod:`search.calibrate.device`) time the bare decode
step. A served token costs more: the engine in its Ray Serve replica, the HTTP stream of each
token through Serve's proxy, the prefills of the requests that replace finished ones (with
short answers a large share of the work: the workload's :attr:`ServedModel.prefill_share`),
and the load generator on the same cores. ``slotune calibrate --served`` (or the first
``slotune tune`` of the built-in app) measures p50 and p99 TPOT at a few batch sizes (closed
loop at concurrency = batch, the canary's own windows) and fits

    TPOT(B) = intercept_s + slope_s * B        (p99, what the SLO and the tuner judge)

by least squares in relative error; the p50 gets its own line
(:attr:`ServedModel.p50_intercept_s` ...), for the simulator. A straight line because,
on the measured CPUs, the per-sequence cost of serving (streaming, scheduling, prefill
share) dwarfs the curvature of the bare step below the knee; the measured points and the
fit's largest residual are stored beside it so a bad fit shows. The model holds for the
workload it was measured with (:meth:`ServedModel.matches`).

Pure: the measuring is the controller's (``controller/tune_served.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump on any change to what the stored figures mean; an older cache is measured again.
# 2: four batches (1, 4, 10, 16; was 1, 4, 16), whose request rates the simulator fits.
# 3: windows of 300 requests (was 150): the rates and p99s of the shorter ones were noisier
# than the simulator's fit to them (controller/tune_served.py).
SERVED_VERSION = 3
WORKLOAD_TOLERANCE = 0.1  # a workload within 10% in mean prompt and output tokens matches


def _finite_positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={v!r}: must be a positive finite number")


@dataclass(frozen=True, kw_only=True)
class ServedPoint:
    """One measured window at ``batch`` = max_batch_size = max_concurrency. Its
    ``tokens_per_s`` is what the serving path delivered (the simulator fits its request
    rate to it: controller/sim/served.py)."""

    batch: int
    tpot_p50_s: float
    tpot_p99_s: float
    ttft_p99_s: float = math.nan
    tokens_per_s: float = math.nan
    goodput_rps: float = math.nan
    completed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch={self.batch!r}: must be an integer >= 1")
        _finite_positive("tpot_p50_s", self.tpot_p50_s)
        _finite_positive("tpot_p99_s", self.tpot_p99_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (v if not (isinstance(v, float) and not math.isfinite(v)) else None)
            for k, v in self.__dict__.items()
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServedPoint:
        def num(k: str) -> float:
            v = d.get(k)
            return math.nan if v is None else float(v)

        return cls(
            batch=int(d["batch"]),
            tpot_p50_s=num("tpot_p50_s"),
            tpot_p99_s=num("tpot_p99_s"),
            ttft_p99_s=num("ttft_p99_s"),
            tokens_per_s=num("tokens_per_s"),
            goodput_rps=num("goodput_rps"),
            completed=int(d.get("completed") or 0),
        )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of least squares in relative error (weights 1/y**2: a 10 ms
    point counts as much as a 100 ms one), both >= 0: a negative slope (noise over a flat
    cost) gives the weighted mean as intercept; a negative intercept, the line through the
    origin."""
    if len(xs) != len(ys) or not xs or any(y <= 0 for y in ys):
        raise ValueError(f"fit_line: {len(xs)} xs and {len(ys)} ys; need as many, >= 1, y > 0")
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    if slope <= 0:
        return my, 0.0
    intercept = my - slope * mx
    if intercept < 0:
        num = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
        return 0.0, num / sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    return intercept, slope


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """TPOT by batch through the whole serving path, fitted to :attr:`points`."""

    model: str  # the roofline model name of what was served (e.g. slotune-small)
    device: str  # search.calibrate.device.device_label
    threads: int  # torch threads of the replica
    prompt_tokens: float  # mean prompt tokens of the workload measured
    output_tokens: float  # mean output tokens
    points: tuple[ServedPoint, ...]
    intercept_s: float
    slope_s: float
    p50_intercept_s: float
    p50_slope_s: float
    measured_at: str = ""
    elapsed_s: float = 0.0
    version: int = SERVED_VERSION

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model='': name the model that was served")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads={self.threads!r}: must be an integer >= 1")
        _finite_positive("prompt_tokens", self.prompt_tokens)
        _finite_positive("output_tokens", self.output_tokens)
        if not self.points:
            raise ValueError("points=(): a served model needs at least one measured point")
        for name in ("intercept_s", "slope_s", "p50_intercept_s", "p50_slope_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: must be a finite number >= 0")
        if self.intercept_s + self.slope_s <= 0:
            raise ValueError("intercept_s + slope_s = 0: TPOT at batch 1 must be > 0")

    @classmethod
    def fit(
        cls,
        points: Sequence[ServedPoint],
        *,
        model: str,
        device: str,
        threads: int,
        prompt_tokens: float,
        output_tokens: float,
        measured_at: str = "",
        elapsed_s: float = 0.0,
    ) -> ServedModel:
        pts = tuple(sorted(points, key=lambda p: p.batch))
        bs = [float(p.batch) for p in pts]
        a, b = fit_line(bs, [p.tpot_p99_s for p in pts])
        a50, b50 = fit_line(bs, [p.tpot_p50_s for p in pts])
        return cls(
            model=model,
            device=device,
            threads=threads,
            prompt_tokens=float(prompt_tokens),
            output_tokens=float(output_tokens),
            points=pts,
            intercept_s=a,
            slope_s=b,
            p50_intercept_s=a50,
            p50_slope_s=b50,
            measured_at=measured_at,
            elapsed_s=elapsed_s,
        )

    # ---- predictions ------------------------------------------------------------------

    def tpot_s(self, batch: int) -> float:
        """Predicted p99 TPOT at ``batch`` (closed loop at concurrency = batch)."""
        return self.intercept_s + self.slope_s * max(1, batch)

    def tpot_p50_s(self, batch: int) -> float:
        return self.p50_intercept_s + self.p50_slope_s * max(1, batch)

    def largest_batch_within(self, tpot_s: float, *, max_batch: int) -> int | None:
        """The largest batch <= ``max_batch`` whose predicted p99 TPOT is <= ``tpot_s``."""
        if self.tpot_s(1) > tpot_s:
            return None
        if self.slope_s <= 0:
            return max_batch
        return max(1, min(max_batch, math.floor((tpot_s - self.intercept_s) / self.slope_s)))

    @property
    def prefill_share(self) -> float:
        """Prompt tokens over all tokens of a request of the workload measured."""
        return self.prompt_tokens / (self.prompt_tokens + self.output_tokens)

    @property
    def max_residual(self) -> float:
        """The fit's largest relative miss at a measured point (p99)."""
        return max(abs(self.tpot_s(p.batch) / p.tpot_p99_s - 1) for p in self.points)

    def matches(self, *, prompt_tokens: float, output_tokens: float) -> bool:
        """Whether a workload of these means is the one measured (within 10% in each)."""
        return all(
            abs(got / want - 1) <= WORKLOAD_TOLERANCE
            for got, want in (
                (prompt_tokens, self.prompt_tokens),
                (output_tokens, self.output_tokens),
            )
        )

    def describe(self) -> str:
        return (
            f"served TPOT p99 = {self.intercept_s * 1e3:.1f} ms + {self.slope_s * 1e3:.2f} ms x B"
            f" (measured at B={','.join(str(p.batch) for p in self.points)}, largest miss "
            f"{self.max_residual:.0%}; prompt {self.prompt_tokens:g} / output "
            f"{self.output_tokens:g} tokens, prefill share {self.prefill_share:.2f})"
        )

    # ---- storage ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": self.model,
            "device": self.device,
            "threads": self.threads,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_share": self.prefill_share,
            "fit": {
                "tpot_p99_s": {"intercept": self.intercept_s, "slope_per_seq": self.slope_s},
                "tpot_p50_s": {
                    "intercept": self.p50_intercept_s,
                    "slope_per_seq": self.p50_slope_s,
                },
                "max_residual": self.max_residual,
            },
            "points": [p.to_dict() for p in self.points],
            "measured_at": self.measured_at,
            "elapsed_s": self.elapsed_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServedModel:
        """ValueError when malformed or written by another version of the method."""
        if d.get("version") != SERVED_VERSION:
            raise ValueError(
                f"served calibration version {d.get('version')!r}: this slotune reads "
                f"{SERVED_VERSION}; measure again (slotune calibrate --served)"
            )
        try:
            fit = d["fit"]
            return cls(
                model=str(d["model"]),
                device=str(d["device"]),
                threads=int(d["threads"]),
                prompt_tokens=float(d["prompt_tokens"]),
                output_tokens=float(d["output_tokens"]),
                points=tuple(ServedPoint.from_dict(p) for p in d["points"]),
                intercept_s=float(fit["tpot_p99_s"]["intercept"]),
                slope_s=float(fit["tpot_p99_s"]["slope_per_seq"]),
                p50_intercept_s=float(fit["tpot_p50_s"]["intercept"]),
                p50_slope_s=float(fit["tpot_p50_s"]["slope_per_seq"]),
                measured_at=str(d.get("measured_at") or ""),
                elapsed_s=float(d.get("elapsed_s") or 0.0),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"served calibration: malformed ({e!r})") from None


def served_cache_path(hardware_path: Path, model: str) -> Path:
    """Beside the device's calibration JSON (its host, device and thread count in the
    name): ``<that name>-served-<model>.json``."""
    return hardware_path.with_name(f"{hardware_path.stem}-served-{model}.json")
