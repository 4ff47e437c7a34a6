"""What ``slotune tune``'s backend flags choose, and how the report names it: the search's
knob costs from the actuator, ``ignore_eos``'s default, the roofline's hardware check, the
model, device and price the report names, windows long enough for the metrics source."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from controller.errors import BadInput
from controller.report.cost import catalog_price
from controller.tune_setup import local_device

if TYPE_CHECKING:
    from controller.backends.actuator import Actuator
    from controller.targets import WindowPlan
    from controller.tune_plan import SearchPlan
    from controller.windows import WindowReader
    from search.roofline.hardware import HardwareSpec
    from search.roofline.models import ModelSpec
    from search.stages import KnobCosts


def check_hardware(name: str | None) -> None:
    """A catalogue name or a calibration file, checked before anything starts."""
    from controller.tune_plan import LOCAL_HARDWARE
    from search.roofline.hardware import resolve_hardware

    if name is None or name == LOCAL_HARDWARE:
        return
    try:
        resolve_hardware(name)
    except ValueError as e:
        raise BadInput(f"--hardware {name}: {e}") from None


def checkpoint(path: Path | None, *, builtin: bool) -> tuple[str | None, ModelSpec | None]:
    """``--checkpoint``: the folder as the built-in app's replica loads it (absolute) and
    the model the roofline assumes, from its config.json (read the one way an
    ``--model-config`` is: controller.tune_plan.roofline_model); (None, None) when not
    given. An ``--app`` serves its own model, so it takes no checkpoint."""
    from controller.cli.paths import checkpoint_dir
    from controller.tune_plan import roofline_model

    if path is None:
        return None, None
    if not builtin:
        raise BadInput(
            f"--checkpoint {path}: is what the built-in app serves; an --app serves its own "
            "model (give --model-config for its roofline)"
        )
    folder = checkpoint_dir("--checkpoint", path)
    try:
        spec = roofline_model(folder, None)
    except ValueError as e:
        raise BadInput(f"--checkpoint {path}: {e}") from None
    assert spec is not None  # a folder was given
    return folder, spec


def served_name(given: str | None, *, builtin: bool) -> str | None:
    """The id the built-in app serves: ``--served-model``, which the requests then name
    too (the app refuses any other); None: its default. Checked before anything starts;
    another app's id is its own business."""
    from serving.app.config import check_served_model_name

    if given is None or not builtin:
        return None
    try:
        check_served_model_name(given)
    except ValueError:
        raise BadInput(
            f"--served-model {given!r}: must be a non-empty model id without whitespace"
        ) from None
    return given


def ignore_eos(
    given: bool | None, actuator: str | None, profile: str | None, builtin: bool
) -> bool:
    """``--ignore-eos``, else on for servers known to honour it (slotune's own, vLLM,
    SGLang, Ray Serve LLM) and off for an unknown one (it might refuse the field)."""
    from controller.load.spec import honours_ignore_eos

    if given is not None:
        return given
    if builtin or actuator == "serve-llm":
        return True
    return profile is not None and honours_ignore_eos(profile)


def knob_costs(actuator: Actuator) -> KnobCosts:
    """How the search may move the batch limit, from what changing it costs there."""
    from search.stages import KnobCosts

    effects = actuator.effects()
    if "max_batch_size" in effects.restart:
        return KnobCosts(batch="restart")
    if "max_batch_size" not in effects.live:
        return KnobCosts(batch="fixed")
    return KnobCosts()


def model_label(searched: SearchPlan, builtin: str | None, where: str | None) -> str:
    """The report's model: the built-in one, else the deployment and the model its
    roofline assumed (or that none was given)."""
    if builtin is not None:
        return builtin
    if searched.roofline is not None:
        return f"{where} ({searched.roofline.model.name})"
    return f"{where} (model not given)"


def hardware_detail(hw: HardwareSpec | None, note: str, device: str) -> dict[str, object]:
    """The report's device figures and where they came from."""
    if hw is None:
        return {"source": note, "device": device}
    return {
        "source": note,
        "memory_bandwidth_gb_s": round(hw.mem_bandwidth / 1e9, 1),
        "bf16_peak_tflops": round(hw.peak_flops.get("bf16", math.nan) / 1e12, 2),
        "device": device,
    }


def price(given: float | None, *, embedded: bool) -> tuple[float | None, str]:
    """The device price and where it came from: the flag; else, for the built-in
    deployment on a catalogued GPU, the catalog's indicative rate; else none."""
    if given is not None:
        return given, "--price-per-hour"
    if embedded and local_device() == "cuda":
        import torch

        found = catalog_price(torch.cuda.get_device_name())
        if found is not None:
            return found
    return None, "not given"


def fit_to_scrapes(plan: WindowPlan, reader: WindowReader, *, quiet: bool) -> WindowPlan:
    """Through a Prometheus server, a window must span ``reader.min_scrapes`` scrapes (else
    it is stale and judged by nobody): lengthen the least window to that, and wait for a
    fresh sample up to three scrape intervals."""
    from controller.windows import PromQLWindow

    if not isinstance(reader, PromQLWindow):
        return plan
    interval = reader.scrape_interval_s()
    if interval is None:
        return plan
    reader.fresh_timeout_s = max(reader.fresh_timeout_s, 3 * interval)
    need = reader.min_scrapes * interval + reader.report_lag_s
    if plan.window_s >= need:
        return plan
    if not quiet:
        typer.echo(
            f"slotune: Prometheus scrapes every {interval:g} s: windows of at least {need:g} s "
            f"(--window {plan.window_s:g} was too short to judge)",
            err=True,
        )
    return replace(plan, window_s=need, max_window_s=max(plan.max_window_s, need))
