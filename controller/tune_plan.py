"""Before the first trial: the calibrated device, the roofline's prediction and the seeds.

The roofline seed is only as good as the calibration behind it, and a CPU's decode
speed depends on the torch thread count: the calibration must run with the threads the
*replica* runs (one, by default, in a Ray actor), not the CLI process's. Calibrations
are cached per device and thread count.
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import Any

from controller.errors import NoFeasiblePoint

log = logging.getLogger(__name__)

MODELS = {"tiny": "slotune-tiny", "small": "slotune-small"}  # serving preset → roofline model
DEFAULT_SLOTS = {"tiny": 64, "small": 128}


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def cache_paths(calib: Any, dev: Any, threads: int) -> list[Path]:
    """Where a calibration at ``threads`` threads may be cached, the one to write first."""
    if _accepts(calib.default_cache_path, "threads"):
        # only the thread-named cache: older files predate today's calibration kernels
        return [Path(calib.default_cache_path(dev, threads=threads))]
    base = Path(calib.default_cache_path(dev))
    return [base.with_name(f"{base.stem}-{threads}t{base.suffix}"), base]


def cached_threads(path: Path, version: int | None = None) -> int | None:
    """The thread count a cached calibration was measured with (its ``measured`` block);
    None when unreadable or, with ``version``, written by another calibration method."""
    import json

    try:
        measured = json.loads(path.read_text()).get("measured") or {}
        if version is not None and measured.get("version") != version:
            return None
        return int(measured["threads"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def calibrate_at(calib: Any, *, device: str, threads: int) -> Any:
    """``search.calibrate.device.calibrate`` with ``threads`` torch threads: through its
    ``threads`` keyword where it has one, else by setting torch's thread count around it."""
    import torch

    plan = calib.PLANS["full"]
    if _accepts(calib.calibrate, "threads"):
        return calib.calibrate(device=device, plan=plan, threads=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return calib.calibrate(device=device, plan=plan)
    finally:
        torch.set_num_threads(before)


def hardware_spec(device: str, *, quiet: bool, threads: int | None = None) -> tuple[Any, str]:
    """The HardwareSpec of this device calibrated at ``threads`` torch threads (default:
    this process's), measured once and cached."""
    import torch

    from search.calibrate import device as calib
    from search.roofline.hardware import HardwareSpec

    dev = calib.pick_device(device)
    threads = int(threads or torch.get_num_threads())
    if threads < 1:
        raise ValueError(f"threads={threads!r}: must be >= 1")
    paths = cache_paths(calib, dev, threads)
    for path in paths:
        # a cache of an older calibration method is measured again, not reused
        got = cached_threads(path, getattr(calib, "CALIBRATION_VERSION", None))
        if got == threads or (got is not None and dev.type == "cuda"):
            return HardwareSpec.from_json(path), f"calibration at {threads} thread(s), {path}"
    path = paths[0]
    if not quiet:
        print(
            f"slotune: calibrating {dev} at {threads} torch thread(s) (the replica's), once; "
            f"cached at {path} ...",
            file=sys.stderr,
        )
    cal = calibrate_at(calib, device=device, threads=threads)
    cal.spec.to_json(path, extra=cal.measured)
    return cal.spec, f"calibrated now at {threads} thread(s) ({cal.elapsed_s:.0f} s), {path}"


def plan_search(
    *, model: str, hardware: Any, slo: Any, price: float | None, max_slots: int, context: int
) -> dict[str, Any]:
    """The roofline's prediction, the search box it bounds and the seed knobs."""
    from controller.report.records import PredictedPoint
    from search.roofline.curve import Roofline
    from search.roofline.models import resolve_model
    from search.roofline.operating_point import analyze
    from search.space import Knobs, SearchSpace

    roof = Roofline(
        model=resolve_model(MODELS[model]), hardware=hardware, dtype="bf16", context=context
    )
    cap = max(1, min(max_slots, roof.max_batch_memory))
    a = analyze(roof, slo_tpot_s=slo.tpot_p99_s, max_batch=cap, usd_per_hour=price)
    try:
        space = SearchSpace.bounded(
            step_time_s=roof.step_time_s, max_batch_memory=cap, slo=slo, headroom_max=2.0
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
    return {
        "roofline": roof,
        "analysis": a,
        "space": space,
        "seeds": seeds,
        "predicted": tuple(PredictedPoint.of(p) for p in a.curve),
        "seed_batch": b,
    }
