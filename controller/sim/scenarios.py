"""The simulator's scenarios: named devices, how far real steps fall short of the peak
roofline (:class:`Efficiency`), and each scenario's model, SLO and saturating load.

The built-in scenarios (:data:`SCENARIOS`) are the search-efficiency benchmark's; the
held-out ones (:data:`HELD_OUT_SCENARIOS`) were not used to design the tuner and run only
when named. :class:`controller.sim.target.SimTarget` turns a scenario into a target.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from metrics.observation import Slo
from search.roofline.hardware import HardwareSpec
from serving.sim.workload import LengthDist, Workload

logger = logging.getLogger(__name__)

GB = 1e9
# "local-cpu" without a cached calibration: nominal figures of a 2-core Xeon with AMX
# (where they come from: docs/controller.md). Results then depend on no measurement.
LOCAL_CPU = HardwareSpec(
    name="local-cpu-nominal",
    peak_flops={"bf16": 2.8e12, "fp32": 445e9},
    mem_bandwidth=24.5 * GB,
    mem_capacity=24 * 2**30,
    source="nominal figures of a 2-core Xeon with AMX (docs/controller.md)",
)
# The cpu-small scenario's device, stated here so that the benchmark gives the same figures
# on any machine: the peaks `slotune calibrate` measured on a 2-core AMD EPYC VM
# (docs/controller.md). Peaks only (no decode tables): the scenario's Efficiency says how
# far real decode steps fall short of them.
VM_EPYC_CPU = HardwareSpec(
    name="vm-cpu-amd-epyc-2c",
    peak_flops={"bf16": 272e9, "fp32": 59e9},
    mem_bandwidth=25.4 * GB,
    mem_capacity=24 * 2**30,
    source="slotune calibrate on the 2-core AMD EPYC VM, 2026-12-02 (peaks stated in the scenario)",
)
# Devices a scenario may name besides the catalogue (resolve_hardware) and "local-cpu".
SCENARIO_HARDWARE: dict[str, HardwareSpec] = {VM_EPYC_CPU.name: VM_EPYC_CPU}


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """How far a real step falls short of the peak roofline.

    ``true = overhead_s + roofline(decode, kv, prefill * prefill_interference) / f(B)``
    with ``f`` interpolated in log B from ``at_batch_1`` to ``at_ref_batch`` (held beyond).
    """

    at_batch_1: float = 0.6
    at_ref_batch: float = 0.4
    ref_batch: int = 256
    overhead_s: float = 0.0
    prefill_interference: float = 1.0

    def __post_init__(self) -> None:
        for name in ("at_batch_1", "at_ref_batch"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name}={v!r}: a fraction of peak must be in (0, 1]")
        if not (isinstance(self.ref_batch, int) and self.ref_batch >= 2):
            raise ValueError(f"ref_batch={self.ref_batch!r}: must be an integer >= 2")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError(f"overhead_s={self.overhead_s!r}: must be >= 0 seconds")
        if not (math.isfinite(self.prefill_interference) and self.prefill_interference >= 1):
            raise ValueError(f"prefill_interference={self.prefill_interference!r}: must be >= 1")

    def factor(self, batch: int) -> float:
        if batch <= 1:
            return self.at_batch_1
        t = min(1.0, math.log(batch) / math.log(self.ref_batch))
        return math.exp((1 - t) * math.log(self.at_batch_1) + t * math.log(self.at_ref_batch))


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    model: str
    # A catalogue name, a JSON path, a SCENARIO_HARDWARE name, "local-cpu" (this machine's
    # cached calibration, else LOCAL_CPU: results then depend on the machine), or the
    # HardwareSpec itself (controller/sim/served.py: this machine's peak roofline).
    hardware: str | HardwareSpec
    tp: int = 1
    dtype: str = "bf16"
    slo: Slo
    workload: Workload  # its rate is replaced by load_factor x predicted capacity
    load_factor: float = 1.0
    efficiency: Efficiency = field(default_factory=Efficiency)
    max_len: int = 1024  # KV slot length (capacity is counted at it)
    prefill_chunk: int = 256
    warmup_s: float = 3.0
    window_s: float = 30.0
    step_noise_cv: float = 0.05
    window_noise_cv: float = 0.03
    headroom_max: float = 4.0
    # A calibrated device's roofline already predicts real steps: the truth departs less.
    calibrated_efficiency: Efficiency | None = None
    calibrated_window_s: float | None = None
    # The TPOT SLO is at least this multiple of the predicted single-stream step (0: off),
    # so a scenario on a device of unknown speed keeps a meaningful operating point.
    min_tpot_slo_x_single: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.load_factor) and self.load_factor > 0):
            raise ValueError(f"load_factor={self.load_factor!r}: must be > 0")
        longest = self.workload.prompt.max_tokens + self.workload.output.max_tokens
        if longest > self.max_len:
            raise ValueError(
                f"max_len={self.max_len}: the longest prompt + answer ({longest} tokens)"
                " must fit in a slot"
            )


# Short chat turns: prompts ~128 tokens, answers ~48 (keeps a window cheap to simulate).
_CHAT = dict(
    prompt=LengthDist.lognormal(mean=128, cv=0.6, lo=16, hi=512),
    output=LengthDist.lognormal(mean=48, cv=0.5, lo=4, hi=256),
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="cpu-small",
            model="slotune-small",
            hardware=VM_EPYC_CPU.name,
            slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.06),
            # Short prompts: a CPU at 272 GFLOP/s spends ~25 ms prefilling 16 tokens.
            workload=Workload(
                rate_rps=1.0,
                prompt=LengthDist.lognormal(mean=16, cv=0.5, lo=4, hi=64),
                output=LengthDist.lognormal(mean=64, cv=0.5, lo=8, hi=256),
            ),
            max_len=512,
            window_s=60.0,
            # From the same calibration: bf16 decode matmuls ran at 8.4 GB/s at batch 1
            # (0.33 of the 25.4 GB/s peak) and 262 GFLOP/s at batch 256 (0.96 of 272);
            # per-layer and per-step overheads added 1-10 ms a step (batch 1-64).
            efficiency=Efficiency(
                at_batch_1=0.33, at_ref_batch=0.96, overhead_s=5e-3, prefill_interference=1.5
            ),
            prefill_chunk=32,
            description="built-in ~100M model on a 2-core AMD EPYC VM CPU (bf16)",
        ),
        Scenario(
            name="h100-8b",
            model="llama-3.1-8b",
            hardware="h100-sxm",
            slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.02),
            workload=Workload(rate_rps=1.0, **_CHAT),
            window_s=8.0,
            efficiency=Efficiency(
                at_batch_1=0.8, at_ref_batch=0.5, overhead_s=2e-3, prefill_interference=2.0
            ),
            description="Llama 3.1 8B on one H100 SXM",
        ),
        Scenario(
            name="h100x4-70b",
            model="llama-3.1-70b",
            hardware="h100-sxm",
            tp=4,
            slo=Slo(ttft_p99_s=1.5, tpot_p99_s=0.04),
            workload=Workload(rate_rps=1.0, **_CHAT),
            window_s=30.0,
            efficiency=Efficiency(
                at_batch_1=0.75, at_ref_batch=0.5, overhead_s=3e-3, prefill_interference=2.0
            ),
            description="Llama 3.1 70B on 4 x H100 SXM (TP=4)",
        ),
        Scenario(
            name="l4-8b",
            model="llama-3.1-8b",
            hardware="l4",
            dtype="fp8",
            slo=Slo(ttft_p99_s=2.0, tpot_p99_s=0.06),
            workload=Workload(rate_rps=1.0, **_CHAT),
            window_s=25.0,
            efficiency=Efficiency(
                at_batch_1=0.7, at_ref_batch=0.5, overhead_s=4e-3, prefill_interference=1.5
            ),
            description="Llama 3.1 8B (fp8 weights and KV) on one L4",
        ),
    )
}


# Big models that serve a few requests a second: 70B-class replicas answering at length.
# A 30 s window holds a few dozen requests, too few for any p99 verdict; the canary's
# windows then last as long as their verdict needs (bench/search_efficiency.py --slow).
_LONG = dict(
    prompt=LengthDist.lognormal(mean=256, cv=0.6, lo=32, hi=1024),
    output=LengthDist.lognormal(mean=1500, cv=0.5, lo=128, hi=3072),
)
SLOW_SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="h100x4-70b-long",
            model="llama-3.1-70b",
            hardware="h100-sxm",
            tp=4,
            slo=Slo(ttft_p99_s=2.0, tpot_p99_s=0.035),
            workload=Workload(rate_rps=1.0, **_LONG),
            max_len=4096,
            window_s=30.0,
            efficiency=Efficiency(
                at_batch_1=0.75, at_ref_batch=0.5, overhead_s=3e-3, prefill_interference=2.0
            ),
            description="Llama 3.1 70B on 4 x H100 SXM (TP=4), ~1500-token answers",
        ),
        Scenario(
            name="a100x4-70b-long",
            model="llama-3.1-70b",
            hardware="a100-80gb",
            tp=4,
            slo=Slo(ttft_p99_s=3.0, tpot_p99_s=0.05),
            workload=Workload(rate_rps=1.0, **_LONG),
            max_len=4096,
            window_s=30.0,
            efficiency=Efficiency(
                at_batch_1=0.7, at_ref_batch=0.45, overhead_s=4e-3, prefill_interference=2.0
            ),
            description="Llama 3.1 70B on 4 x A100 80GB (TP=4), ~1500-token answers",
        ),
    )
}


# Held out: scenarios the tuner was NOT tuned on, to show that it finds the oracle on a
# setup it has not been tuned on. Defined before any tuning against them, with a
# model/device/TP/SLO/efficiency mix none of SCENARIOS uses; bench/search_efficiency.py
# runs them only when asked (--scenarios a100-8b h100x8-70b), never in its default set.
HELD_OUT_SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="a100-8b",
            model="llama-3.1-8b",
            hardware="a100-80gb",
            slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.03),
            workload=Workload(rate_rps=1.0, **_CHAT),
            # ~30 req/s: 20 s windows give ~600 requests, as many as the benchmark's smallest
            # (a 10 s window's ~300 cannot call a p99 MET near the SLO; docs/controller.md).
            window_s=20.0,
            efficiency=Efficiency(
                at_batch_1=0.75, at_ref_batch=0.45, overhead_s=3e-3, prefill_interference=1.8
            ),
            description="held out: Llama 3.1 8B on one A100 80GB",
        ),
        Scenario(
            name="h100x8-70b",
            model="llama-3.1-70b",
            hardware="h100-sxm",
            tp=8,
            slo=Slo(ttft_p99_s=1.0, tpot_p99_s=0.025),
            workload=Workload(rate_rps=1.0, **_CHAT),
            window_s=20.0,
            efficiency=Efficiency(
                at_batch_1=0.6, at_ref_batch=0.4, overhead_s=4e-3, prefill_interference=2.5
            ),
            description="held out: Llama 3.1 70B on 8 x H100 SXM (TP=8)",
        ),
    )
}


def local_cpu_hardware() -> tuple[HardwareSpec, str]:
    """``slotune calibrate``'s cached JSON for this CPU when present, else LOCAL_CPU."""
    env = os.environ.get("SLOTUNE_HARDWARE_JSON")
    candidates: list[Path] = [Path(env)] if env else []
    try:
        import torch

        from search.calibrate.device import default_cache_path

        candidates.append(default_cache_path(torch.device("cpu")))
    except Exception as e:  # pragma: no cover - calibrate imports torch, always present
        logger.debug("no calibration cache path: %s", e)
    for p in candidates:
        if p.is_file():
            return HardwareSpec.from_json(p), f"calibrated ({p})"
    return LOCAL_CPU, "nominal figures (no calibration cache)"


def resolve_scenario(name: str) -> Scenario:
    """A benchmark scenario, a slow one or a held-out one, by name."""
    known = {**SCENARIOS, **SLOW_SCENARIOS, **HELD_OUT_SCENARIOS}
    if name not in known:
        raise ValueError(f"scenario {name!r}: choose one of {sorted(known)}")
    return known[name]
