"""Where ``slotune tune`` runs: start a local Ray or attach to one, deploy the built-in
model or check the given deployment, and pick the metrics source of its windows.

:func:`prepare` does all of it before the first trial and returns a :class:`Prepared`:
the :class:`Setup` it attached to or started, the calibrated hardware and the planned
search (:class:`controller.tune_plan.SearchPlan`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from controller.attach import (
    attach_ray,
    check_deployment,
    cluster_dashboard_url,
    embedded_threads,
    ray_metrics_url,
    replica_threads,
    serve_details,
    serve_url,
    start_local_ray,
)
from controller.errors import BadInput
from controller.tune_plan import (
    DEFAULT_MAX_SLOTS,
    SearchPlan,
    hardware_spec,
    own_app_bounds,
    plan_for_app,
    plan_search,
)

if TYPE_CHECKING:
    from controller.backends.actuator import Actuator
    from controller.targets import RequestShape
    from controller.windows import WindowReader
    from metrics.observation import Slo
    from search.roofline.hardware import HardwareSpec
    from search.roofline.models import ModelSpec

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Where the deployment is and how to read it (what the run attached to or started)."""

    app: str
    url: str  # HTTP base of the app
    reader: WindowReader
    reader_desc: str
    started_ray: bool
    device: str
    actuator: Actuator  # how knob changes reach the deployment (controller/backends/)


def make_reader(
    *,
    slo: Slo,
    app: str,
    metrics_url: str | None,
    prometheus_url: str | None,
    prefix: str | None,
    profile: str | None,
    under_ray: bool,
    known: str | None = None,
) -> tuple[WindowReader, str]:
    """The window reader of the metrics ``profile`` (``metrics.profiles``) at ``metrics_url``
    or ``prometheus_url`` (under Ray, the node's export port when neither is given).

    Without ``profile`` (or ``prefix``) a first scrape of the endpoint detects them; if it
    holds no known family the profile is ``known`` (what the deployment is known to export,
    e.g. slotune's own app), else ``client``: the load generator's own records. ``prefix``
    defaults to ``ray_`` under Ray and to none elsewhere."""
    from controller.windows import ClientWindow, PromQLWindow, ScrapeWindow
    from metrics.profiles import profile as profile_named
    from metrics.sources import PromQLSource, ScrapeSource

    client = (ClientWindow(slo=slo), "the load generator's own records (client profile)")
    if profile == "client":
        return client
    if prometheus_url is None and metrics_url is None:
        if not under_ray:
            return client
        metrics_url = ray_metrics_url()
    default_prefix = "ray_" if under_ray else ""
    if prometheus_url is None and (profile is None or prefix is None):
        found = _detect(metrics_url)
        if found is not None and profile in (None, found[0]):
            profile, prefix = found[0], prefix if prefix is not None else found[1]
    profile = profile or known
    if profile is None:
        log.warning("no known metrics family at %s: reading the client's records", metrics_url)
        return client
    prefix = default_prefix if prefix is None else prefix
    prof = profile_named(profile)
    # Ray labels the metrics of a Serve replica with its application; others have no label
    # that names it (vLLM and SGLang label their model).
    sel = {"application": app} if profile == "slotune" and prefix == "ray_" else {}
    try:
        if prometheus_url:
            src = PromQLSource(prometheus_url, slo=slo, prefix=prefix, selector=sel, profile=prof)
            return PromQLWindow(src), f"Prometheus {prometheus_url} ({profile} profile)"
        assert metrics_url is not None
        scrape = ScrapeSource(metrics_url, slo=slo, prefix=prefix, selector=sel, profile=prof)
        return ScrapeWindow(scrape), f"scrape {metrics_url} ({profile} profile)"
    except ValueError as e:
        raise BadInput(f"metrics source: {e}") from None


def _detect(url: str) -> tuple[str, str] | None:
    """(profile, prefix) of what ``url`` exports now; None if unknown or unreachable."""
    import httpx

    from metrics.errors import MalformedExposition
    from metrics.profiles import detect_snapshot
    from metrics.snapshot import parse_exposition

    try:
        text = httpx.get(url, timeout=5.0).text
        return detect_snapshot(parse_exposition(text, time_s=0.0))
    except (httpx.HTTPError, MalformedExposition) as e:
        log.warning("could not detect the metrics profile at %s: %s", url, e)
        return None


class SetupFailed(RuntimeError):
    """Starting, attaching or deploying failed (exit 1 with the reason)."""


def local_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # torch is a dependency; be explicit anyway
        return "cpu"


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What :func:`prepare` leaves ready for the first trial."""

    setup: Setup
    hardware: HardwareSpec | None  # what the roofline assumed (None: unknown, unseeded)
    hardware_note: str  # where its figures came from, for the report
    plan: SearchPlan


def prepare(
    *,
    address: str | None,
    app_name: str | None,
    deployment: str | None,
    url: str | None,
    metrics_url: str | None,
    prometheus_url: str | None,
    prefix: str | None,
    slo: Slo,
    model: str,
    max_slots: int,
    price: float | None,
    shape: RequestShape,
    quiet: bool,
    profile: str | None = None,
    actuator: str | None = None,
    batch_knob: str | None = None,
    dashboard_url: str | None = None,
    roofline_model: ModelSpec | None = None,
    hardware: str | None = None,
    tp: int = 1,
    max_batch: int | None = None,
    served: bool = True,
    checkpoint: str | None = None,
    served_model_name: str | None = None,
) -> Prepared:
    """Start or attach, deploy if needed, pick the actuator and the metrics reader, and plan
    the search (``served``: for the built-in model on the Ray it started, seeded from the
    served step, measured once and cached: controller/tune_served.py).

    No ``address``, ``app_name`` or ``actuator``: start a local Ray and deploy the built-in
    ``model`` with ``max_slots`` KV slots (the ``embedded`` actuator; the roofline of that
    model on this device, calibrated at the replica's threads); ``address`` alone: attach
    and deploy it there. The built-in app serves ``checkpoint`` (a local folder) when
    given, its roofline then ``roofline_model`` (the checkpoint's config.json), and answers
    to ``served_model_name`` when given. ``app_name``: an existing application
    (``deployment`` within it), its knobs through ``actuator`` (default ``serve``: Serve's
    REST API at ``dashboard_url``, else the attached cluster's; ``batch_knob`` names the
    batch limit's config path). ``actuator='none'``: no Ray at all, the server at ``url``
    is measured as it is. The metrics: ``profile`` at ``metrics_url`` or ``prometheus_url``
    (detected when not given; see :func:`make_reader`). An existing deployment's roofline is
    ``roofline_model`` on ``hardware`` x ``tp`` (controller.tune_plan.plan_for); without
    them the search is unseeded over batches 1..``max_batch`` and the plan says why."""
    from controller.backends.registry import ACTUATORS

    if actuator is not None and actuator not in ACTUATORS:
        raise BadInput(f"--actuator {actuator}: must be one of {ACTUATORS}")
    context = round(shape.prompt_tokens.mean + shape.output_tokens.mean / 2)
    device = local_device()
    if actuator == "none":
        return _prepare_unmanaged(
            app_name=app_name,
            url=url,
            metrics_url=metrics_url,
            prometheus_url=prometheus_url,
            prefix=prefix,
            profile=profile,
            slo=slo,
            price=price,
            context=context,
            device=device,
            quiet=quiet,
            roof=(roofline_model, hardware, tp, max_batch),
        )
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import IMPORT_PATH, deploy_app
    from serving.app.replicas import DeployError

    app = app_name
    started = False
    if address is None and app is None:
        if actuator not in (None, "embedded"):
            raise BadInput(
                f"--actuator {actuator}: the local Ray slotune starts has no dashboard; "
                "its own app is tuned by the embedded actuator (omit --actuator)"
            )
        if not quiet:
            print("slotune: starting a local Ray and Serve (127.0.0.1) ...", file=sys.stderr)
        metrics_port, _ = start_local_ray()
        started = True
        metrics_url = metrics_url or f"http://127.0.0.1:{metrics_port}/metrics"
    else:
        attach_ray(address)
    name = "embedded" if started else (actuator or "serve")
    rest_url = None
    if name in ("serve", "serve-llm"):
        rest_url = dashboard_url or cluster_dashboard_url()
    known = "slotune" if app is None else None
    details: dict[str, Any] | None = None  # Serve's details, once the app is there
    if app is None:
        threads, threads_from = embedded_threads(), "the built-in deployment"
        hw, hw_note = hardware_spec(device, quiet=quiet, threads=threads)
        hw_note += f"; replica threads from {threads_from}"
        searched = plan_search(
            model=model,
            hardware=hw,
            slo=slo,
            price=price,
            max_slots=max_slots,
            context=context,
            spec=roofline_model,
        )
    else:
        check_deployment(app, deployment)
        details = serve_details(rest_url)
        cfg = (details.get("applications", {}).get(app) or {}).get("deployed_app_config") or {}
        if cfg.get("import_path") == IMPORT_PATH:
            known = "slotune"  # slotune's own app: its metrics are known before any traffic
            roofline_model, max_batch = _checked(own_app_bounds, cfg, roofline_model, max_batch)
        threads, threads_from = replica_threads(app, details)
        hw, searched = _checked(
            plan_for_app,
            roofline_model,
            hardware,
            tp,
            max_batch,
            slo=slo,
            price=price,
            context=context,
            replicas_here=started,
            device=device,
            threads=threads,
            quiet=quiet,
        )
        hw_note = (
            searched.reason if hw is None else f"{searched.reason}; threads from {threads_from}"
        )
    if app is None:
        app = "slotune"
        first = searched.seeds[0]
        if not quiet:
            what = f"the built-in {model!r} model" if checkpoint is None else checkpoint
            print(f"slotune: deploying {what} on {device} ...", file=sys.stderr)
        try:
            deploy_app(
                ServerArgs(
                    model=model,
                    max_slots=max_slots,
                    device=device,
                    torch_threads=threads,
                    checkpoint=checkpoint,
                    served_model_name=served_model_name,
                ),
                LiveConfig(
                    max_batch_size=first.max_batch_size,
                    ttft_p99_s=slo.ttft_p99_s,
                    tpot_p99_s=slo.tpot_p99_s,
                    max_ongoing_requests=first.max_concurrency,
                ),
                name=app,
                max_queued_requests=-1,
            )
        except (DeployError, ValueError) as e:
            raise SetupFailed(f"deploying the built-in model failed: {e}") from e
    reader, desc = make_reader(
        slo=slo,
        app=app,
        metrics_url=metrics_url,
        prometheus_url=prometheus_url,
        prefix=prefix,
        profile=profile,
        under_ray=True,
        known=known,
    )
    setup = Setup(
        app=app,
        url=url or serve_url(app, details or serve_details(rest_url)),
        reader=reader,
        reader_desc=desc,
        started_ray=started,
        device=device,
        actuator=_make_actuator(
            name,
            app=app,
            deployment=deployment,
            batch_knob=batch_knob,
            dashboard_url=rest_url,
            slo=slo,
        ),
    )
    if served and app == "slotune" and started and hw is not None and searched.seeded:
        # slotune's own model on the Ray it started: seed from the served step (the engine
        # in its replica through HTTP streaming), measured once and cached
        from controller.tune_served import served_plan

        searched = served_plan(
            searched,
            url=setup.url,
            target_slo=slo,
            reader=reader,
            actuator=setup.actuator,
            shape=shape,
            model=model,
            hardware=hw,
            price=price,
            max_slots=max_slots,
            context=context,
            device=device,
            threads=threads,
            quiet=quiet,
            spec=roofline_model,
        )
        hw_note = f"{hw_note}; {searched.reason}"
    return Prepared(setup=setup, hardware=hw, hardware_note=hw_note, plan=searched)


def _checked(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)``, its ValueError (a flag's value at fault, named) as BadInput."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        raise BadInput(str(e)) from None


def _make_actuator(name: str, **kw: Any) -> Actuator:
    from controller.backends.actuator import ActuatorError, ActuatorUnavailable
    from controller.backends.registry import make_actuator

    try:
        return make_actuator(name, **kw)
    except (ActuatorError, ActuatorUnavailable, ValueError) as e:
        raise BadInput(f"--actuator {name}: {e}") from None


def prepare_builtin(
    *, model: str, slo: Slo, shape: RequestShape, quiet: bool, served: bool = True
) -> Prepared:
    """:func:`prepare` as a bare ``slotune tune`` does: a local Ray this process starts,
    the built-in ``model`` deployed on it with its default KV slots, no price."""
    return prepare(
        address=None,
        app_name=None,
        deployment=None,
        url=None,
        metrics_url=None,
        prometheus_url=None,
        prefix=None,
        slo=slo,
        model=model,
        max_slots=DEFAULT_MAX_SLOTS[model],
        price=None,
        shape=shape,
        quiet=quiet,
        served=served,
    )


def _prepare_unmanaged(
    *,
    app_name: str | None,
    url: str | None,
    metrics_url: str | None,
    prometheus_url: str | None,
    prefix: str | None,
    profile: str | None,
    slo: Slo,
    price: float | None,
    context: int,
    device: str,
    quiet: bool,
    roof: tuple[ModelSpec | None, str | None, int, int | None],
) -> Prepared:
    """``--actuator none``: a server slotune measures but cannot configure. No Ray: the
    server is ``url``, its metrics ``metrics_url``/``prometheus_url`` (the profile detected
    when not given), else the load generator's own records."""
    from controller.backends.none import NoActuator

    if url is None:
        raise BadInput("--actuator none: give --url, the server's HTTP base")
    app = app_name or "server"
    reader, desc = make_reader(
        slo=slo,
        app=app,
        metrics_url=metrics_url,
        prometheus_url=prometheus_url,
        prefix=prefix,
        profile=profile,
        under_ray=False,
    )
    model, hardware, tp, max_batch = roof
    hw, searched = _checked(
        plan_for_app,
        model,
        hardware,
        tp,
        max_batch,
        slo=slo,
        price=price,
        context=context,
        replicas_here=False,
        device=device,
        threads=embedded_threads(),
        quiet=quiet,
    )
    setup = Setup(
        app=app,
        url=url,
        reader=reader,
        reader_desc=desc,
        started_ray=False,
        device=device,
        actuator=NoActuator(),
    )
    return Prepared(setup=setup, hardware=hw, hardware_note=searched.reason, plan=searched)
