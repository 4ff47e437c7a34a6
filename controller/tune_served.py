"""Calibrating the serving path: TPOT through the replica, HTTP streaming and the load
generator at a few batch sizes, fitted to a served-step model
(:class:`search.calibrate.served.ServedModel`) and cached beside the device's calibration.

:func:`measure_served` drives the canary's own windows (:class:`controller.targets.RayServeTarget`)
at ``max_batch_size = max_concurrency = B`` for each B of :data:`SERVED_BATCHES` with the
canary's workload; :func:`served_for` returns the cached model for this model, device,
thread count and workload, else measures it; :func:`served_plan` replans a built-in app's
search with it (``controller.tune_setup.prepare`` calls it once the app is deployed).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from controller.targets import RayServeTarget, WindowPlan
from controller.tune_plan import MODELS, SearchPlan, plan_search
from search.calibrate.served import ServedModel, ServedPoint, served_cache_path

if TYPE_CHECKING:
    from controller.backends.actuator import Actuator
    from controller.targets import RequestShape
    from controller.windows import WindowReader
    from metrics.observation import Observation, Slo
    from search.roofline.hardware import HardwareSpec
    from search.roofline.models import ModelSpec

log = logging.getLogger(__name__)

SERVED_BATCHES = (1, 4, 10, 16)
# Short windows: a fit, not an SLO verdict (~14-22 s a batch, ~70 s for four; B=10 sits
# between B=4 and B=16, where the SLO knee of the demo lies). 300 requests a window: with
# 150, two calibrations six minutes apart put B=16 at 157 and 217 tokens/s, and the
# canary's own windows between them at 186-199 (2026-12-05, docs/BENCHMARKS.md).
SERVED_WINDOW = WindowPlan(warmup_s=2.0, window_s=12.0, max_window_s=20.0, min_requests=300)


def _point(batch: int, obs: Observation, client: Observation | None) -> ServedPoint | None:
    """The window as a served point: the server's view (what the tuner judges), the client's
    where the server's lacks a TPOT; None when neither has one."""
    for o in (obs, client):
        if o is None:
            continue
        p50, p99 = o.tpot.p50, o.tpot.p99
        if math.isfinite(p50) and math.isfinite(p99) and p50 > 0 and p99 > 0:
            return ServedPoint(
                batch=batch,
                tpot_p50_s=p50,
                tpot_p99_s=p99,
                ttft_p99_s=o.ttft.p99,
                tokens_per_s=o.tokens_per_s,
                goodput_rps=o.goodput_rps,
                completed=o.completed,
            )
    return None


def measure_served(
    target: RayServeTarget,
    *,
    model: str,
    device: str,
    threads: int,
    shape: RequestShape,
    batches: Sequence[int] = SERVED_BATCHES,
    say: Callable[[str], None] | None = None,
) -> ServedModel:
    """Measure one window per batch on ``target`` (its plan and shape as given) and fit.
    A faulty window is measured once more; RuntimeError when fewer than two batches gave
    a TPOT (a line needs two)."""
    from search.space import Knobs

    t0 = time.monotonic()
    points: list[ServedPoint] = []
    for b in batches:
        k = Knobs(max_batch_size=b, max_concurrency=b)
        target.apply(k)
        m = target.measure(k)
        if m.fault:
            log.warning("served calibration at B=%d: %s; measuring again", b, m.fault)
            m = target.measure(k)
        p = None if m.fault else _point(b, m.observation, m.client)
        if p is None:
            log.warning("served calibration at B=%d: no TPOT measured (%s)", b, m.note or m.fault)
            continue
        points.append(p)
        if say is not None:
            say(
                f"  B={b}: p50 TPOT {p.tpot_p50_s * 1e3:.1f} ms, p99 {p.tpot_p99_s * 1e3:.1f} ms"
                f" ({p.completed} requests, {p.tokens_per_s:.0f} tokens/s)"
            )
    if len(points) < 2:
        raise RuntimeError(
            f"served calibration: only {len(points)} of batches {list(batches)} gave a TPOT"
        )
    return ServedModel.fit(
        points,
        model=model,
        device=device,
        threads=threads,
        prompt_tokens=shape.prompt_tokens.mean,
        output_tokens=shape.output_tokens.mean,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        elapsed_s=round(time.monotonic() - t0, 1),
    )


def served_path(device: str, threads: int, model: str) -> Path:
    """Where this machine's served calibration of ``model`` at ``threads`` is cached."""
    from search.calibrate import device as calib

    hw = calib.default_cache_path(calib.pick_device(device), threads=threads)
    return served_cache_path(hw, model)


def load_served(path: Path) -> ServedModel | None:
    """The cached model at ``path``; None when absent, unreadable or of another version."""
    try:
        return ServedModel.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("served calibration %s not used: %s", path, e)
        return None


def save_served(served: ServedModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(served.to_dict(), indent=2) + "\n")


def cached_served(
    *, device: str, threads: int, model: str, shape: RequestShape
) -> tuple[ServedModel | None, Path]:
    """The cached served model that fits this workload (else None), and its path."""
    path = served_path(device, threads, model)
    got = load_served(path)
    if got is not None and not got.matches(
        prompt_tokens=shape.prompt_tokens.mean, output_tokens=shape.output_tokens.mean
    ):
        log.info("served calibration %s was measured with another workload: not used", path)
        got = None
    return got, path


def served_for(
    target: RayServeTarget,
    *,
    device: str,
    threads: int,
    model: str,
    shape: RequestShape,
    quiet: bool,
) -> tuple[ServedModel, str]:
    """The served model of ``model`` (a roofline name) on this machine at ``threads`` for
    this workload: cached, else measured on ``target`` now (its window plan, e.g.
    :data:`SERVED_WINDOW`) and cached. Returns it and a
    note for the report."""
    got, path = cached_served(device=device, threads=threads, model=model, shape=shape)
    if got is not None:
        return got, f"served calibration {path}"
    say = None if quiet else (lambda s: print(s, file=sys.stderr))
    if say is not None:
        say(f"slotune: calibrating the serving path at B={list(SERVED_BATCHES)}, once; {path}")
    from search.calibrate import device as calib

    label = calib.device_label(calib.pick_device(device))
    served = measure_served(
        target, model=model, device=label, threads=threads, shape=shape, say=say
    )
    save_served(served, path)
    return served, f"served calibration measured now ({served.elapsed_s:.0f} s), {path}"


def served_key(model: str, spec: ModelSpec | None) -> str:
    """The name a served calibration is cached under: the preset's roofline model, or the
    checkpoint's model name made file-safe (a Hub snapshot's name is ``org/name``)."""
    if spec is None:
        return MODELS[model]
    return "checkpoint-" + re.sub(r"[^A-Za-z0-9._-]", "_", spec.name)


def served_plan(
    plan: SearchPlan,
    *,
    url: str,
    target_slo: Slo,
    reader: WindowReader,
    actuator: Actuator,
    shape: RequestShape,
    model: str,
    hardware: HardwareSpec,
    price: float | None,
    max_slots: int,
    context: int,
    device: str,
    threads: int,
    quiet: bool,
    spec: ModelSpec | None = None,
) -> SearchPlan:
    """``plan`` of the built-in ``model`` preset (tiny/small), or of ``spec`` when the app
    serves a checkpoint, seeded by the served model (cached, else measured now on the
    deployed app at ``url``); ``plan`` unchanged when the calibration fails (logged)."""
    target = RayServeTarget(
        url=url,
        slo=target_slo,
        reader=reader,
        actuator=actuator,
        plan=SERVED_WINDOW,
        shape=shape,
    )
    try:
        served, _ = served_for(
            target,
            device=device,
            threads=threads,
            model=served_key(model, spec),
            shape=shape,
            quiet=quiet,
        )
    except Exception as e:  # a failed calibration leaves the roofline's seed, not a failed run
        log.warning("served calibration failed (%s): seeding from the roofline", e)
        return plan
    return plan_search(
        model=model,
        hardware=hardware,
        slo=target_slo,
        price=price,
        max_slots=max_slots,
        context=context,
        served=served,
        spec=spec,
    )
