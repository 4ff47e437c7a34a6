"""The ``local`` scenario: this deployment as ``slotune tune`` runs it by default, simulated.

slotune's own ``small`` model on this machine's calibrated roofline (the replica's thread
count), the canary's default workload (16 prompt, 8 output tokens, closed loop at each
trial's concurrency: an open load far above capacity with no queue stands in for it) and
SLO, and the served-step model (search/calibrate/served.py) folded into the simulator's
:class:`~controller.sim.scenarios.Efficiency`: its factor and overhead are fitted so that a
decode step of B sequences takes the served p50 TPOT at B (:func:`served_efficiency`), and
the step noise is set from the measured p99/p50 spread (:func:`served_noise_cv`).
:class:`~controller.sim.target.SimTarget` itself is unchanged; the tuner is told the
served model (``slotune simulate -s local``), as ``slotune tune`` is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from controller.sim.scenarios import Efficiency, Scenario
from metrics.observation import DEFAULT_SLO, Slo
from search.calibrate.served import ServedModel
from search.roofline.curve import Roofline
from serving.sim.workload import LengthDist, Workload

LOCAL = "local"
P99_Z = 2.326  # standard normal quantile of 0.99
OVERHEAD_GRID = 24  # overheads tried between 0 and the served intercept


@dataclass(frozen=True, kw_only=True)
class LocalDeployment:
    """What the ``local`` scenario is built from: the served model, the device calibration
    JSON it sits beside, and the canary's defaults (controller/cli/tune.py)."""

    served: ServedModel
    hardware_path: Path
    slo: Slo = DEFAULT_SLO
    max_batch: int = 128  # the built-in small app's KV slots (tune_plan.DEFAULT_MAX_SLOTS)
    max_len: int = 512
    window_s: float = 30.0  # tune's --max-window (its windows aim at 300 requests)
    warmup_s: float = 2.0  # tune's --warmup
    headroom_max: float = 2.0  # tune_plan.HEADROOM_MAX

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch, int) and self.max_batch >= 1):
            raise ValueError(f"max_batch={self.max_batch!r}: must be an integer >= 1")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s={self.window_s!r}: must be > 0 seconds")


def served_efficiency(served: ServedModel, roofline: Roofline, *, max_batch: int) -> Efficiency:
    """The :class:`Efficiency` whose decode step ``overhead + roof(B) / f(B)`` comes closest
    (largest relative miss over B = 1..``max_batch``) to the served p50 TPOT line, with
    ``f`` pinned to the line at B=1 and B=``max_batch`` for each overhead tried."""
    ref = max(2, max_batch)
    batches = sorted({1, 2, 4, 8, 16, 32, 64, ref} & set(range(1, ref + 1)))
    want = {b: served.tpot_p50_s(b) for b in batches}
    roof = {b: roofline.step_time_s(b) for b in batches}
    best: tuple[float, Efficiency] | None = None
    for i in range(OVERHEAD_GRID):
        ov = served.p50_intercept_s * i / OVERHEAD_GRID
        f1 = roof[1] / (want[1] - ov)
        fr = roof[ref] / (want[ref] - ov)
        if not (0 < f1 <= 1 and 0 < fr <= 1):
            continue
        eff = Efficiency(at_batch_1=f1, at_ref_batch=fr, ref_batch=ref, overhead_s=ov)
        miss = max(abs((ov + roof[b] / eff.factor(b)) / want[b] - 1) for b in batches)
        if best is None or miss < best[0]:
            best = (miss, eff)
    if best is None:
        raise ValueError(
            f"the served p50 TPOT ({served.tpot_p50_s(1) * 1e3:.1f} ms at B=1) is below the "
            f"calibrated roofline's step ({roof[1] * 1e3:.1f} ms): no efficiency <= 1 fits"
        )
    return best[1]


def served_noise_cv(served: ServedModel) -> float:
    """Per-step noise whose mean over a request's decode steps spreads p99/p50 as measured
    (the median ratio over the measured points), within [0.02, 0.9]."""
    steps = max(1.0, served.output_tokens - 1)
    ratios = sorted(p.tpot_p99_s / p.tpot_p50_s for p in served.points)
    r = ratios[len(ratios) // 2]
    return min(0.9, max(0.02, math.log(max(r, 1.0)) / P99_Z * math.sqrt(steps)))


def local_scenario(dep: LocalDeployment) -> Scenario:
    """The scenario of this deployment (see the module doc)."""
    from search.roofline.hardware import HardwareSpec
    from search.roofline.models import resolve_model

    s = dep.served
    prompt, output = round(s.prompt_tokens), round(s.output_tokens)
    roof = Roofline(
        model=resolve_model(s.model),
        hardware=HardwareSpec.from_json(dep.hardware_path),
        dtype="bf16",
        context=max(1, round(prompt + output / 2)),
    )
    eff = served_efficiency(s, roof, max_batch=dep.max_batch)
    return Scenario(
        name=LOCAL,
        model=s.model,
        hardware=str(dep.hardware_path),
        slo=dep.slo,
        workload=Workload(
            rate_rps=1.0,
            prompt=LengthDist(kind="fixed", mean=prompt, lo=1, hi=prompt),
            output=LengthDist(kind="fixed", mean=output, lo=1, hi=output),
        ),
        load_factor=1.0,  # the roofline's capacity at its own point: far above the served
        efficiency=eff,
        calibrated_efficiency=eff,
        max_len=dep.max_len,
        warmup_s=dep.warmup_s,
        window_s=dep.window_s,
        step_noise_cv=served_noise_cv(s),
        window_noise_cv=0.03,
        headroom_max=dep.headroom_max,
        description=f"this deployment: {s.model} served on {s.device} ({s.threads} thread(s)); "
        + s.describe(),
    )
