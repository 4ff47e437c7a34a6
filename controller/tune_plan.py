"""Before the first trial: the calibrated device, the roofline's prediction and the seeds.

The roofline seed is only as good as the calibration behind it, and a CPU's decode
speed depends on the torch thread count: the calibration must run with the threads the
*replica* runs (one, by default, in a Ray actor), not the CLI process's. Calibrations
are cached per device and thread count.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from controller.errors import NoFeasiblePoint
from controller.report.records import PredictedPoint

if TYPE_CHECKING:
    from metrics.observation import Slo
    from search.roofline.curve import Roofline
    from search.roofline.hardware import HardwareSpec
    from search.roofline.operating_point import RooflineAnalysis
    from search.space import Knobs, SearchSpace

log = logging.getLogger(__name__)

MODELS = {"tiny": "slotune-tiny", "small": "slotune-small"}  # serving preset → roofline model
DEFAULT_MAX_SLOTS = {"tiny": 64, "small": 128}


def cached_threads(path: Path, version: int | None = None) -> int | None:
    """The thread count a cached calibration was measured with (its ``measured`` block);
    None when unreadable or, with ``version``, written by another calibration method."""
    try:
        measured = json.loads(path.read_text()).get("measured") or {}
        if version is not None and measured.get("version") != version:
            return None
        return int(measured["threads"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def hardware_spec(
    device: str, *, quiet: bool, threads: int | None = None
) -> tuple[HardwareSpec, str]:
    """The HardwareSpec of this device calibrated at ``threads`` torch threads (default:
    this process's), measured once and cached under a name that carries the thread count."""
    import torch

    from search.calibrate import device as calib
    from search.roofline.hardware import HardwareSpec

    dev = calib.pick_device(device)
    threads = int(threads or torch.get_num_threads())
    if threads < 1:
        raise ValueError(f"threads={threads!r}: must be >= 1")
    path = Path(calib.default_cache_path(dev, threads=threads))
    # a cache of an older calibration method is measured again, not reused
    got = cached_threads(path, calib.CALIBRATION_VERSION)
    if got == threads or (got is not None and dev.type == "cuda"):
        return HardwareSpec.from_json(path), f"calibration at {threads} thread(s), {path}"
    if not quiet:
        print(
            f"slotune: calibrating {dev} at {threads} torch thread(s) (the replica's), once; "
            f"cached at {path} ...",
            file=sys.stderr,
        )
    cal = calib.calibrate(device=device, plan=calib.PLANS["full"], threads=threads)
    cal.spec.to_json(path, extra=cal.measured)
    return cal.spec, f"calibrated now at {threads} thread(s) ({cal.elapsed_s:.0f} s), {path}"


@dataclass(frozen=True, kw_only=True)
class SearchPlan:
    """The roofline's prediction for the deployment, the search box it bounds and the seeds."""

    roofline: Roofline
    analysis: RooflineAnalysis
    space: SearchSpace
    seeds: tuple[Knobs, ...]  # the roofline's operating point first, then x0.5 and x1.5
    predicted: tuple[PredictedPoint, ...]  # the predicted curve, for the report
    seed_batch: int  # the roofline's operating point (1 when none meets the SLO)


def plan_search(
    *,
    model: str,
    hardware: HardwareSpec,
    slo: Slo,
    price: float | None,
    max_slots: int,
    context: int,
) -> SearchPlan:
    """Plan the search of the built-in ``model`` on ``hardware`` at ``context`` tokens: the
    batch goes up to what both ``max_slots`` and the device memory hold."""
    from search.roofline.curve import Roofline
    from search.roofline.models import resolve_model
    from search.roofline.operating_point import analyze
    from search.space import Knobs, SearchSpace

    roof = Roofline(
        model=resolve_model(MODELS[model]), hardware=hardware, dtype="bf16", context=context
    )
    largest_batch = max(1, min(max_slots, roof.max_batch_memory))
    a = analyze(roof, slo_tpot_s=slo.tpot_p99_s, max_batch=largest_batch, usd_per_hour=price)
    try:
        space = SearchSpace.bounded(
            step_time_s=roof.step_time_s, max_batch_memory=largest_batch, slo=slo, headroom_max=2.0
        )
    except ValueError as e:
        raise NoFeasiblePoint(f"the roofline rules out every batch: {e}") from None
    b = a.operating_point.batch if a.operating_point is not None else 1
    seeds = [space.clip(Knobs(max_batch_size=b, max_concurrency=b))]
    for f in (0.5, 1.5):
        bb = max(1, round(b * f))
        k = space.clip(Knobs(max_batch_size=bb, max_concurrency=bb))
        if k not in seeds:
            seeds.append(k)
    return SearchPlan(
        roofline=roof,
        analysis=a,
        space=space,
        seeds=tuple(seeds),
        predicted=tuple(PredictedPoint.of(p) for p in a.curve),
        seed_batch=b,
    )
