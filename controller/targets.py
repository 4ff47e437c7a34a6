"""What the canary loop tunes: a :class:`Target` applies knobs and measures one window.

:class:`RayServeTarget` is a live server whose knobs reach it through an actuator
(controller/backends/: Serve's REST API, a Serve LLM app, slotune's embedded app, or
none at all), the load generator offers a saturating closed loop at the candidate's
admission limit, and the window's
:class:`~metrics.observation.Observation` is read from Prometheus-format metrics
(Ray's metrics export port scraped directly, or a Prometheus server, through a
``controller.windows.WindowReader``). The load generator's own view of the same window
rides along as a cross-check. A failed apply or window raises one of
``controller.target_errors``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from controller.backends.actuator import (
    UNSETTLED,
    Actuator,
    ActuatorError,
    ActuatorUnavailable,
    ApplyCost,
    Fleet,
)
from controller.load.generator import run_load
from controller.load.result import LoadResult, RequestRecord, client_observation
from controller.load.spec import TraceItem, completions_url, saturating_spec
from controller.target_errors import TargetError, TargetUnavailable
from controller.windows import WindowReader
from metrics.build import with_client_goodput
from metrics.observation import Observation, Slo
from metrics.sequential import Tally, decided
from search.evidence import STOP_MARGIN, counts_of
from serving.sim.workload import LengthDist

if TYPE_CHECKING:
    from search.space import Knobs

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measurement window: the server's Observation and the client's cross-check."""

    observation: Observation
    client: Observation | None = None
    client_errors: int = 0
    note: str = ""
    # Why this window is not data ("" when it is): a replica restarted or changed version
    # during it, or the client saw more errors than WindowPlan allows. The loop discards
    # such a window and measures again (controller/tune.py).
    fault: str = ""


@runtime_checkable
class Target(Protocol):
    """Anything the canary loop can tune (a Ray Serve deployment, the simulator)."""

    def current_knobs(self) -> Knobs | None:
        """The knobs the target runs on now, None if unknown."""
        ...

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost | None:
        """Apply ``knobs`` and return once they are in effect, with what that cost (None:
        nothing to say). ``batch_cap``: the batch limit to write instead of the knobs'
        (a staged search under a restarting batch knob; controller.backends.actuator)."""
        ...

    def measure(self, knobs: Knobs) -> Measurement:
        """Warm up on the applied knobs, then measure one window under saturating load."""
        ...

    def describe(self) -> dict[str, Any]:
        """What is being tuned, for the report (model, hardware, endpoint...)."""
        ...


# A sequential window never stops before this many requests: requests finishing together
# share the engine's state, and a verdict on the first handful would rest on one moment.
SEQUENTIAL_MIN_REQUESTS = 20


@dataclass(frozen=True, kw_only=True)
class WindowPlan:
    """How long to warm up and measure.

    A whole window (``sequential`` False) runs at least ``window_s`` and then until the
    client has seen ``min_requests`` completions (a fixed-n p99 verdict needs ~300 requests
    at 95% confidence) or ``max_window_s`` has passed.

    A sequential window stops as soon as its verdict is decided by the anytime-valid
    e-processes of :mod:`metrics.sequential`: every ``look_s`` (from
    :data:`SEQUENTIAL_MIN_REQUESTS` requests on) the client's own records are judged, and
    when they look decided the server's window is read and judged; the window stops when
    the server's verdict is decided. Before its nominal size (``window_s`` and
    ``min_requests``) only a clear violation decides (at 99.5%: a badly violating knob
    costs a few dozen requests); from then on either SLO VIOLATED or both MET at
    ``confidence``. Undecided, it runs until ``budget_requests`` completions, so its length
    follows the deployment's request rate (1000 requests are ~100 s at 10 req/s, ~17 min
    at 1 req/s), or until ``max_window_s``."""

    warmup_s: float = 3.0
    window_s: float = 8.0
    max_window_s: float = 30.0
    min_requests: int = 300
    poll_s: float = 0.25
    sequential: bool = False
    budget_requests: int = 1000
    look_s: float = 1.0
    confidence: float = 0.95
    # Client errors (not rejections) a window tolerates: more than max(max_client_errors,
    # max_client_error_frac of its requests) and the window is discarded as faulty.
    max_client_errors: int = 2
    max_client_error_frac: float = 0.01

    def __post_init__(self) -> None:
        for name in ("warmup_s", "window_s", "max_window_s", "poll_s", "look_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: must be a finite number of seconds >= 0")
        if self.window_s <= 0:
            raise ValueError(f"window_s={self.window_s!r}: must be > 0")
        if self.max_window_s < self.window_s:
            raise ValueError(
                f"max_window_s={self.max_window_s!r}: must be >= window_s={self.window_s}"
            )
        if not (isinstance(self.min_requests, int) and self.min_requests >= 0):
            raise ValueError(f"min_requests={self.min_requests!r}: must be an integer >= 0")
        if not (isinstance(self.budget_requests, int) and self.budget_requests >= 1):
            raise ValueError(f"budget_requests={self.budget_requests!r}: must be an integer >= 1")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence={self.confidence!r}: must be in (0, 1)")
        if not (isinstance(self.max_client_errors, int) and self.max_client_errors >= 0):
            raise ValueError(
                f"max_client_errors={self.max_client_errors!r}: must be an integer >= 0"
            )
        if not (0 <= self.max_client_error_frac <= 1):
            raise ValueError(
                f"max_client_error_frac={self.max_client_error_frac!r}: must be in [0, 1]"
            )

    def error_fault(self, errors: int, requests: int) -> str:
        """Why ``errors`` client errors among ``requests`` void a window ("" if they don't)."""
        bound = max(self.max_client_errors, math.floor(self.max_client_error_frac * requests))
        if errors <= bound:
            return ""
        return f"{errors} client errors in the window (more than {bound} of {requests} requests)"


def fleet_fault(before: Fleet, after: Fleet) -> str:
    """Why a window that began on replicas ``before`` and ended on ``after`` is not data."""
    if before != after:
        old = ", ".join(f"{r[0]} pid {r[1]} v{r[2]}" for r in before) or "none"
        new = ", ".join(f"{r[0]} pid {r[1]} v{r[2]}" for r in after) or "none"
        return f"the replicas changed during the window (restart or update): [{old}] -> [{new}]"
    unsettled = sorted({r[2] for r in after if r[2].startswith(UNSETTLED)})
    if unsettled:
        return f"the deployment was mid-update during the window ({', '.join(unsettled)})"
    versions = {r[2] for r in after}
    if len(versions) > 1:
        return f"the replicas ran different config versions {sorted(versions)}"
    return ""


@dataclass(frozen=True, kw_only=True)
class RequestShape:
    """What each request of the offered load looks like."""

    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist(mean=32))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist(mean=16))
    trace: tuple[TraceItem, ...] | None = None
    model: str | None = None  # None: the server's default model
    request_timeout_s: float = 60.0
    seed: int = 0
    endpoint: str = "completions"  # controller.load.spec.ENDPOINTS
    prompt_format: str = "text"  # controller.load.spec.PROMPT_FORMATS
    tokenizer: str | None = None  # tokenizer.json: prompts sized in the served model's tokens
    ignore_eos: bool = False  # ask the server for exactly the output lengths


async def measure_window(
    *,
    url: str,
    knobs: Knobs,
    slo: Slo,
    plan: WindowPlan,
    shape: RequestShape,
    reader: WindowReader,
    fleet: Callable[[], Fleet] | None = None,
) -> Measurement:
    """Saturating load at the knobs' admission limit; warm up, then read one window.

    ``fleet`` (if given) is read as the window begins and ends: a difference makes the
    window a fault (:attr:`Measurement.fault`), as do too many client errors."""
    spec = saturating_spec(
        completions_url(url, shape.endpoint),
        max_concurrency=int(knobs.max_concurrency),
        duration_s=plan.warmup_s + plan.max_window_s + 60.0,
        prompt_tokens=shape.prompt_tokens,
        output_tokens=shape.output_tokens,
        trace=shape.trace,
        model=shape.model,
        request_timeout_s=shape.request_timeout_s,
        seed=shape.seed,
        endpoint=shape.endpoint,
        prompt_format=shape.prompt_format,
        tokenizer=shape.tokenizer,
        ignore_eos=shape.ignore_eos,
    )
    stop = asyncio.Event()
    done: list[RequestRecord] = []
    load = asyncio.create_task(run_load(spec, stop=stop, on_record=done.append))
    try:
        await _sleep_unless(load, plan.warmup_s)
        before = await asyncio.to_thread(fleet) if fleet else ()
        token = await asyncio.to_thread(reader.begin)
        t0 = time.time()
        client_records = getattr(reader, "needs_client_records", False)

        async def read(t_end: float) -> Observation:
            # A reader of the client's own records (controller.windows.ClientWindow) gets them.
            extra = {"records": list(done)} if client_records else {}
            return await asyncio.to_thread(reader.end, token, start_s=t0, end_s=t_end, **extra)

        obs: Observation | None = None
        last_look = t0
        while not load.done():
            await asyncio.sleep(plan.poll_s)
            now = time.time()
            elapsed = now - t0
            n = sum(r.ok and r.done_s >= t0 for r in done)
            if elapsed >= plan.max_window_s:
                break
            if not plan.sequential:
                if elapsed >= plan.window_s and n >= plan.min_requests:
                    break
                continue
            if n >= plan.budget_requests:
                break
            if n < SEQUENTIAL_MIN_REQUESTS or now - last_look < plan.look_s:
                continue
            last_look = now
            # before the nominal size, only a clear violation ends the window
            early = elapsed < plan.window_s or n < plan.min_requests
            rule = {
                "q": slo.quantile,
                "confidence": plan.confidence,
                "early": early,
                "margin": STOP_MARGIN,
            }
            if not decided(_client_counts(done, t0, slo), **rule):
                continue
            interim = await read(now)
            server = _server_counts(interim)
            if server is not None and decided(server, **rule):
                obs, t1 = interim, now
                break
        if obs is None:
            t1 = time.time()
            obs = await read(t1)
        after = await asyncio.to_thread(fleet) if fleet else ()
    finally:
        stop.set()
        result: LoadResult = await load
    window = result.between(t0, t1)
    client = client_observation(window, slo)
    client = _with_times(client, t0, t1)
    if not obs.slo_met_known:  # vLLM, SGLang: no SLO-labelled counter, the client counts it
        obs = with_client_goodput(obs, client)
    note = ""
    if obs.completed == 0:
        note = "no completed requests in the window"
        if result.errors:
            first = next(r for r in result.records if not r.ok and not r.rejected)
            note += f" ({result.errors} client errors, e.g. {first.error[:120]})"
    fault = fleet_fault(before, after) or plan.error_fault(
        window.errors, len(window.records) - window.rejected
    )
    return Measurement(
        observation=obs, client=client, client_errors=window.errors, note=note, fault=fault
    )


def _client_counts(records: list[RequestRecord], t0: float, slo: Slo) -> list[Tally]:
    """The client's TTFT and TPOT tallies of the requests finished since ``t0``."""
    ok = [r for r in records if r.ok and r.done_s >= t0]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
    out = []
    for xs, thr in ((ttft, slo.ttft_p99_s), (tpot, slo.tpot_p99_s)):
        over = sum(x > thr for x in xs)
        out.append((len(xs), over, over))
    return out


def _server_counts(obs: Observation) -> list[Tally] | None:
    """The counts behind the server's two verdicts (None: some are unknown, or the window
    is stale: then it decides nothing)."""
    if obs.stale:
        return None
    out = []
    for v in (obs.ttft_verdict, obs.tpot_verdict):
        c = counts_of(v)
        if c is None:
            return None
        out.append((c.total, c.above, c.above_at_most))
    return out


def _with_times(obs: Observation, start_s: float, end_s: float) -> Observation:
    from dataclasses import replace

    return replace(obs, start_s=start_s, end_s=end_s)


async def _sleep_unless(task: asyncio.Task[Any], seconds: float) -> None:
    if seconds > 0:
        await asyncio.wait({task}, timeout=seconds)
    if task.done() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


class RayServeTarget:
    """A live server tuned through an :class:`~controller.backends.actuator.Actuator`: the
    actuator applies the knobs and reports the replicas, this target drives the load and
    reads the windows."""

    def __init__(
        self,
        *,
        url: str,
        slo: Slo,
        reader: WindowReader,
        actuator: Actuator | None = None,
        app_name: str | None = None,
        plan: WindowPlan | None = None,
        shape: RequestShape | None = None,
        describe: dict[str, Any] | None = None,
        apply_timeout_s: float = 60.0,
    ) -> None:
        """``actuator`` applies the knobs; without one, ``app_name`` is slotune's own app
        on the cluster this process is attached to (the embedded actuator)."""
        if actuator is None:
            if app_name is None:
                raise ValueError("RayServeTarget: give an actuator or an app_name")
            from controller.backends.embedded import EmbeddedActuator

            actuator = EmbeddedActuator(app=app_name, slo=slo, apply_timeout_s=apply_timeout_s)
        self.url = url
        self.actuator = actuator
        self.slo = slo
        self.reader = reader
        self.plan = plan or WindowPlan()
        self.shape = shape or RequestShape()
        self._describe = dict(describe or {})
        self.last_cost: ApplyCost | None = None  # what the latest apply() cost

    def current_knobs(self) -> Knobs | None:
        return self.actuator.current()

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost:
        try:
            self.last_cost = self.actuator.apply(knobs, batch_cap=batch_cap)
            return self.last_cost
        except ActuatorError as e:
            raise TargetError(str(e)) from e
        except ActuatorUnavailable as e:
            raise TargetUnavailable(str(e)) from e

    def measure(self, knobs: Knobs) -> Measurement:
        return asyncio.run(
            measure_window(
                url=self.url,
                knobs=knobs,
                slo=self.slo,
                plan=self.plan,
                shape=self.shape,
                reader=self.reader,
                fleet=self.fleet,
            )
        )

    def fleet(self) -> Fleet:
        """The replicas as the actuator sees them (id, pid, config version)."""
        try:
            return self.actuator.fleet()
        except (ActuatorUnavailable, ActuatorError) as e:  # no verdict on this window
            raise TargetUnavailable(str(e)) from e

    def describe(self) -> dict[str, Any]:
        return {
            "target": "ray-serve",
            "url": self.url,
            **self.actuator.describe(),
            **self._describe,
        }
