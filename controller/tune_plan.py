"""Before the first trial: the model and the device the roofline assumes, its prediction,
the search box and the seeds.

The roofline seeds the search only when it knows what the deployment serves: the model's
shapes (a Hugging Face ``config.json`` through ``--model-config``, or a catalogue name; for
slotune's own built-in deployment, its preset) and the device (``--hardware NAME`` from the
catalogue, or this machine's calibration where the replicas run here). Without either the
search runs unseeded over a box the user bounds, and :attr:`SearchPlan.reason` says why: a
roofline of some other model is never used in its place.

The roofline seed is only as good as the calibration behind it, and a CPU's decode
speed depends on the torch thread count: the calibration must run with the threads the
*replica* runs (one, by default, in a Ray actor), not the CLI process's. Calibrations
are cached per device and thread count.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.errors import NoFeasiblePoint
from controller.report.records import PredictedPoint

if TYPE_CHECKING:
    from metrics.observation import Slo
    from search.calibrate.served import ServedModel
    from search.roofline.curve import Roofline
    from search.roofline.hardware import HardwareSpec
    from search.roofline.models import ModelSpec
    from search.roofline.operating_point import RooflineAnalysis
    from search.space import Knobs, SearchSpace

log = logging.getLogger(__name__)

MODELS = {"tiny": "slotune-tiny", "small": "slotune-small"}  # serving preset → roofline model
DEFAULT_MAX_SLOTS = {"tiny": 64, "small": 128}
DEFAULT_MAX_BATCH = 256  # the batch bound of an unseeded search unless the user gives one
HEADROOM_MAX = 2.0  # max_concurrency / max_batch_size, seeded or not
LOCAL_HARDWARE = "local"  # --hardware local: calibrate this machine (the replicas run here)
NO_MODEL = (
    "unseeded: no --model-config or catalogue model given; the roofline needs the model's shapes"
)


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


# ---- what the roofline assumes ---------------------------------------------------------


def roofline_model(model_config: str | None, model_name: str | None) -> ModelSpec | None:
    """The model the deployment serves, for the roofline: ``model_config`` a Hugging Face
    ``config.json`` (or the directory holding it; a catalogue name is accepted too),
    ``model_name`` a catalogue name or a ModelSpec JSON file; None when neither is given.
    A ValueError names the file and field at fault (the caller adds the flag)."""
    from search.roofline.models import CATALOG, MODEL_NAMES, ModelSpec, resolve_model

    if model_config is not None and model_name is not None:
        raise ValueError("a model config and a catalogue model were both given: give one")
    if model_config is not None:
        if model_config in CATALOG and not Path(model_config).exists():
            return CATALOG[model_config]
        if not Path(model_config).exists():
            raise ValueError(
                f"{model_config!r}: no such file, and not a catalogue model "
                f"({', '.join(MODEL_NAMES)})"
            )
        return ModelSpec.from_hf_config(model_config)
    if model_name is not None:
        return resolve_model(model_name)
    return None


def roofline_hardware(
    name: str | None, *, replicas_here: bool, device: str, threads: int, quiet: bool
) -> tuple[HardwareSpec | None, str]:
    """The device the roofline assumes and where its figures come from.

    ``name``: a catalogue name or a hardware JSON file (``slotune calibrate``'s), or
    ``local`` to calibrate this machine's ``device`` at the replica's ``threads``. Without
    a name, this machine is calibrated only when ``replicas_here`` (slotune started the
    deployment here): a remote app's devices are not this machine's, so the device is then
    unknown (None, and the reason the search runs unseeded)."""
    from search.roofline.hardware import HARDWARE_NAMES, resolve_hardware

    if name == LOCAL_HARDWARE or (name is None and replicas_here):
        return hardware_spec(device, quiet=quiet, threads=threads)
    if name is None:
        return None, (
            "unseeded: no --hardware given and the app's replicas are not known to run on "
            "this machine; the roofline needs the device's bandwidth and FLOP/s (give "
            f"--hardware with one of {', '.join(HARDWARE_NAMES)}, a calibration JSON, or "
            f"{LOCAL_HARDWARE} when the replicas run here)"
        )
    hw = resolve_hardware(name)
    return hw, f"{hw.name}: {hw.source or name}"


# ---- the plan ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SearchPlan:
    """The search box and the first knobs to measure; when ``seeded``, the roofline's
    prediction for the deployment behind them. ``reason`` says, for the report, what the
    seed came from or why there is none."""

    space: SearchSpace
    seeds: tuple[Knobs, ...]  # seeded: the operating point first, then x0.5 and x1.5
    seeded: bool
    reason: str
    roofline: Roofline | None = None
    analysis: RooflineAnalysis | None = None
    predicted: tuple[PredictedPoint, ...] = ()  # the predicted curve, for the report
    seed_batch: int | None = None  # the model's operating point (1 when none meets the SLO)
    # The served-step model (search/calibrate/served.py) when this deployment's serving path
    # was calibrated: it then gives the seed and the tuner's TPOT model; the roofline still
    # bounds the box (a lower bound on any real step).
    served: ServedModel | None = None

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("reason='': a plan says what its seed came from or why none")
        known = (self.roofline, self.analysis, self.seed_batch)
        if self.seeded and any(v is None for v in known):
            raise ValueError("seeded=True: needs the roofline, its analysis and seed_batch")
        if not self.seeded and (
            any(v is not None for v in known) or self.predicted or self.served is not None
        ):
            raise ValueError("seeded=False: an unseeded plan carries no roofline prediction")

    @property
    def model_tpot_s(self) -> Callable[[int], float] | None:
        """The TPOT model the tuner's guide is given (None: unseeded): the served-step
        model when calibrated, else the roofline's step time by batch."""
        if self.served is not None:
            return self.served.tpot_s
        return self.roofline.step_time_s if self.roofline is not None else None

    @property
    def model_curve(self) -> tuple[PredictedPoint, ...]:
        """The TPOT the tuner's model predicts at every batch of the box, for the report's
        predicted-vs-measured column (the roofline's curve when no served model)."""
        if self.served is None:
            return self.predicted
        return tuple(
            PredictedPoint(
                batch=b,
                tpot_s=self.served.tpot_s(b),
                tokens_per_s=b / self.served.tpot_s(b),
                bound="served",
            )
            for b in range(1, self.space.batch_max + 1)
        )


def plan_for(
    *,
    model: ModelSpec | None,
    hardware: HardwareSpec | None,
    tp: int = 1,
    slo: Slo,
    price: float | None,
    max_batch: int = DEFAULT_MAX_BATCH,
    context: int,
    reason: str = "",
    served: ServedModel | None = None,
) -> SearchPlan:
    """Plan the search of ``model`` served on ``tp`` x ``hardware`` at ``context`` tokens:
    the batch goes up to what both ``max_batch`` and the device memory hold, and the seeds
    are the operating point and its neighbours: the ``served`` model's (the largest batch
    whose predicted p99 TPOT meets the SLO) when given, else the roofline's. With no model
    or no hardware, an unseeded plan over batch 1..``max_batch`` (``reason``, else a
    default, says why).

    ValueError: a ``tp`` the model or device does not allow, or weights that do not fit
    (the message says which ``--tp`` would); NoFeasiblePoint: even batch 1 misses the TPOT
    SLO on the roofline (a lower bound on any real step on catalogue hardware)."""
    from search.roofline.curve import Roofline
    from search.roofline.operating_point import analyze
    from search.space import Knobs, SearchSpace

    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: must be an integer >= 1")
    if model is None or hardware is None:
        why = reason or (NO_MODEL if model is None else "unseeded: no hardware given")
        return unseeded_plan(max_batch=max_batch, reason=why)
    roof = Roofline(model=model, hardware=hardware, tp=tp, dtype="bf16", context=context)
    largest_batch = max(1, min(max_batch, roof.max_batch_memory))
    a = analyze(roof, slo_tpot_s=slo.tpot_p99_s, max_batch=largest_batch, usd_per_hour=price)
    try:
        space = SearchSpace.bounded(
            step_time_s=roof.step_time_s,
            max_batch_memory=largest_batch,
            slo=slo,
            headroom_max=HEADROOM_MAX,
        )
    except ValueError as e:
        raise NoFeasiblePoint(f"the roofline rules out every batch: {e}") from None
    op = a.operating_point
    b = op.batch if op is not None else 1
    if served is not None:
        sb = served.largest_batch_within(slo.tpot_p99_s, max_batch=space.batch_max)
        b = sb if sb is not None else 1
    seeds = [space.clip(Knobs(max_batch_size=b, max_concurrency=b))]
    for f in (0.5, 1.5):
        bb = max(1, round(b * f))
        k = space.clip(Knobs(max_batch_size=bb, max_concurrency=bb))
        if k not in seeds:
            seeds.append(k)
    cal = ", calibrated" if roof.calibrated else ""
    met = op is not None if served is None else served.tpot_s(1) <= slo.tpot_p99_s
    at = f"its operating point B={b}" if met else "B=1 (no batch meets the TPOT SLO)"
    on = f"the roofline of {model.name} on {tp} x {hardware.name}{cal}, context {context}"
    if served is not None:
        roof_b = op.batch if op is not None else 1
        on = f"the served-step model ({served.describe()}; the roofline's point: B={roof_b})"
    return SearchPlan(
        space=space,
        seeds=tuple(seeds),
        seeded=True,
        reason=f"seeded at {at} on {on}",
        roofline=roof,
        analysis=a,
        predicted=tuple(PredictedPoint.of(p) for p in a.curve),
        seed_batch=b,
        served=served,
    )


def unseeded_plan(*, max_batch: int, reason: str, points: int = 3) -> SearchPlan:
    """Batch 1..``max_batch`` and headroom up to :data:`HEADROOM_MAX`, no prediction; the
    start knobs are ``points`` batches log-spaced inside the box, the middle one first
    (deterministic, unlike a sampler's random start, and spread over the decades)."""
    from search.space import Knobs, SearchSpace

    space = SearchSpace(batch_min=1, batch_max=max_batch, headroom_max=HEADROOM_MAX)
    seeds: list[Knobs] = []
    fractions = sorted((i / (points + 1) for i in range(1, points + 1)), key=lambda f: abs(f - 0.5))
    for f in fractions:
        b = max(1, round(math.exp(f * math.log(max_batch))))
        k = Knobs(max_batch_size=b, max_concurrency=b)
        if k not in seeds:
            seeds.append(k)
    log.info("%s; start knobs %s", reason, ", ".join(map(str, seeds)))
    return SearchPlan(space=space, seeds=tuple(seeds), seeded=False, reason=reason)


def plan_search(
    *,
    model: str,
    hardware: HardwareSpec,
    slo: Slo,
    price: float | None,
    max_slots: int,
    context: int,
    served: ServedModel | None = None,
    spec: ModelSpec | None = None,
) -> SearchPlan:
    """Plan the search of the built-in ``model`` preset (``tiny``/``small``: slotune's own
    deployment, so the preset is what is served), or of ``spec`` when the app serves a
    checkpoint (its config.json's shapes), on ``hardware`` at ``context`` tokens: the
    batch goes up to what both ``max_slots`` and the device memory hold; seeded by the
    ``served`` model when this serving path was calibrated."""
    from search.roofline.models import resolve_model

    return plan_for(
        model=spec or resolve_model(MODELS[model]),
        hardware=hardware,
        tp=1,
        slo=slo,
        price=price,
        max_batch=max_slots,
        context=context,
        served=served,
    )


def own_app_bounds(
    cfg: dict[str, Any], model: ModelSpec | None, max_batch: int | None
) -> tuple[ModelSpec | None, int]:
    """For a deployment of slotune's own app: the model its args name (known, not assumed)
    unless the user gave one, and a batch bound within its KV slots (a larger batch limit
    would be refused by every replica's reconfigure)."""
    from search.roofline.models import resolve_model
    from serving.app.config import ServerArgs

    try:
        args = ServerArgs.from_args(cfg.get("args"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"app args of slotune's own app: {e}") from None
    if model is None and args.model in MODELS:
        model = resolve_model(MODELS[args.model])
    return model, min(max_batch or DEFAULT_MAX_BATCH, args.max_slots)


def plan_for_app(
    model: ModelSpec | None,
    hardware: str | None,
    tp: int,
    max_batch: int | None,
    *,
    slo: Slo,
    price: float | None,
    context: int,
    replicas_here: bool,
    device: str,
    threads: int,
    quiet: bool,
) -> tuple[HardwareSpec | None, SearchPlan]:
    """An existing deployment's plan: the roofline of ``model`` on ``hardware`` x ``tp``
    when both are known (never silently the built-in preset), else unseeded with why."""
    hw, note = None, NO_MODEL
    if model is not None:
        hw, note = roofline_hardware(
            hardware, replicas_here=replicas_here, device=device, threads=threads, quiet=quiet
        )
    try:
        return hw, plan_for(
            model=model,
            hardware=hw,
            tp=tp,
            slo=slo,
            price=price,
            max_batch=max_batch or DEFAULT_MAX_BATCH,
            context=context,
            reason="" if hw is not None else note,
        )
    except ValueError as e:
        raise ValueError(f"--model-config/--hardware/--tp: {e}") from None
