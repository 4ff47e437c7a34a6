"""The production control loop: read a window, decide, act, record; every ``interval_s``.

Passive: it sends no load. Each tick's window is [the previous tick, now], read through a
:class:`~controller.windows.WindowReader` (a Prometheus server, or two scrapes of an endpoint
as a fallback); the replicas are read at both ends (:meth:`Actuator.fleet`), so a window
that spans a restart or a rollout is a fault, and the live knobs are read each tick
(:meth:`Actuator.current`) to spot someone else's change. Then
:func:`~controller.control.decide.decide`, and only a change is applied, once, through the
actuator (which waits for every replica to run it); the next window begins after it took
effect. A read failure of any kind is an inconclusive tick (hold, a warning), never a
decision; an actuator that reports the deployment gone (``ActuatorError``) ends the loop
with :class:`ControlFailed`.

State is saved after every tick (controller/control/store.py), so a controller killed and
restarted resumes on the same knobs; the audit log gets one line per tick; the
controller's own metrics (``metrics.exporter.ControllerExporter``) show the knobs, the last
window, decisions by action, holds, rollbacks and whether it is degraded.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from controller.backends.actuator import UNSETTLED, Actuator, ActuatorError, Fleet, ForeignChange
from controller.control.decide import (
    Action,
    Decision,
    Signals,
    State,
    acknowledge,
    decide,
)
from controller.control.policy import Policy
from controller.control.store import AuditLog, Lease, load_state, save_state
from controller.windows import WindowReader
from metrics.exporter import ControllerExporter
from metrics.observation import Observation
from search.space import Knobs

log = logging.getLogger(__name__)


class ClusterLease(Protocol):
    """A lease held in the platform (kube_lease.KubeLease): entered for the whole run and
    renewed each tick; ``renew`` returns why this tick must not act when it could not be
    renewed now, and raises once another controller may hold it."""

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> None: ...
    def renew(self) -> str: ...


class ControlFailed(RuntimeError):
    """The loop cannot go on (the deployment is gone, or refuses every change)."""


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    interval_s: float = 60.0  # one window a tick; longer than actuation plus a metric window
    dry_run: bool = False  # decide and record, never apply
    max_ticks: int | None = None  # stop after this many (None: until stopped)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"interval_s={self.interval_s!r}: must be a number of seconds > 0")
        if self.max_ticks is not None and self.max_ticks < 1:
            raise ValueError(f"max_ticks={self.max_ticks!r}: must be an integer >= 1")


def _fleet_fault(before: Fleet | None, after: Fleet | None) -> str:
    if before is None or after is None:
        return "the replicas could not be read at both ends of the window"
    if any(v.startswith(UNSETTLED) for _, _, v in (*before, *after)):
        return "the deployment was mid-update during the window"
    if before != after:
        return "the replicas changed during the window (a restart or a rollout)"
    return ""


def _safe_fleet(actuator: Actuator) -> Fleet | None:
    try:
        return actuator.fleet()
    except ActuatorError:
        raise
    except Exception as e:  # any read failure: this window is a fault
        log.warning("reading the replicas failed: %s", e)
        return None


def initial_state(actuator: Actuator, path: Path) -> State:
    """The saved state when there is one (its knobs kept: no jump), else the live knobs."""
    saved = load_state(path)
    if saved is not None:
        return saved
    try:
        live = actuator.current()
    except ForeignChange as e:  # nothing of slotune's yet to go back to: say so, act on none
        raise ControlFailed(
            f"{e}: set it back (or redeploy) before slotune control starts on this deployment"
        ) from None
    if live is None:
        raise ControlFailed(
            f"{actuator.describe().get('actuator', actuator.name)}: the deployment's knobs "
            "cannot be read, and no saved state says what they are"
        )
    return State(knobs=live)


def run_control(
    *,
    reader: WindowReader,
    actuator: Actuator,
    policy: Policy,
    state_path: Path,
    audit_path: Path,
    config: LoopConfig,
    exporter: ControllerExporter | None = None,
    cluster_lease: ClusterLease | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = lambda s: None,
) -> State:
    """Tick until ``config.max_ticks`` (or forever); returns the last state. Holds the
    state file's lease, and ``cluster_lease`` (renewed every tick) where one is given,
    throughout (:class:`~controller.control.store.LeaseHeld` if either is taken)."""
    with Lease(state_path), cluster_lease or contextlib.nullcontext():
        try:
            state = initial_state(actuator, state_path)
            audit = AuditLog(audit_path)
            if exporter is not None:
                exporter.set_knobs(state.knobs)
                exporter.set_degraded(bool(state.degraded))
            say(
                f"slotune control: starting on {state.knobs}"
                + (" (dry run)" if config.dry_run else "")
            )
            token: Any = _begin(reader)
            t0 = clock()
            before = _safe_fleet(actuator)
            ticks = 0
            while config.max_ticks is None or ticks < config.max_ticks:
                sleep(max(0.0, t0 + config.interval_s - clock()))
                unleased = ""
                if cluster_lease is not None:
                    try:
                        unleased = cluster_lease.renew()
                    except Exception as e:  # lost: never act without it
                        raise ControlFailed(f"the controller's lease: {e}") from None
                now = clock()
                obs, fault = _read(reader, token, t0, now)
                fault = fault or unleased
                after = _safe_fleet(actuator)
                fault = fault or _fleet_fault(before, after)
                drift = ""
                try:
                    live: Knobs | None = actuator.current()
                except ActuatorError as e:
                    raise ControlFailed(f"the deployment cannot be read: {e}") from None
                except ForeignChange as e:
                    live, drift = None, str(e)
                except Exception as e:
                    live, fault = None, fault or f"the deployment's knobs could not be read: {e}"
                marker = ack_path(state_path)
                if marker.exists():  # `slotune control --ack` while this controller runs
                    state = acknowledge(state, live)
                    marker.unlink(missing_ok=True)
                    say(f"acknowledged: degraded latch cleared, running {state.knobs}")
                    if drift:  # slotune writes its own again: no decision on this window
                        fault = fault or _restore(state, actuator, config.dry_run, drift)
                        drift = ""
                try:
                    scaling = actuator.scaling()
                except Exception as e:  # read with the same details as the knobs: no data, hold
                    scaling, fault = None, fault or f"the autoscaler could not be read: {e}"
                d = decide(
                    Signals(observation=obs, live=live, fault=fault, scaling=scaling, drift=drift),
                    state,
                    policy,
                )
                old = state.knobs
                state, applied, error = _act(d, state, actuator, live, config.dry_run)
                save_state(state, state_path)
                row = audit.record(
                    at_s=now,
                    decision=d,
                    before=old,
                    observation=obs,
                    applied=applied,
                    dry_run=config.dry_run,
                    error=error,
                )
                _export(exporter, d, obs, state)
                say(f"{row['outcome']:12s} {row['action']:8s} {d.reason}")
                ticks += 1
                token, t0 = _begin(reader), clock()
                before = after if not applied else _safe_fleet(actuator)
            return state

        except ActuatorError as e:  # the replicas' read: the deployment is gone
            raise ControlFailed(f"the deployment: {e}") from None


def ack_path(state_path: Path) -> Path:
    """Where ``slotune control --ack`` leaves its acknowledgement for a running controller."""
    return state_path.with_name(state_path.name + ".ack")


def _begin(reader: WindowReader) -> Any:
    try:
        return reader.begin()
    except Exception as e:  # the window's end will fail too: a fault then
        log.warning("starting a window failed: %s", e)
        return None


def _read(reader: WindowReader, token: Any, start: float, end: float) -> tuple[Observation, str]:
    """The window's Observation, or an empty one and why it could not be read."""
    try:
        return reader.end(token, start_s=start, end_s=end), ""
    except Exception as e:  # Prometheus down, a timeout, a refused scrape
        log.warning("reading the window failed: %s", e)
        empty = Observation(start_s=start, end_s=end, completed=0, slo_met=0, stale=True)
        return empty, f"the metrics could not be read ({e})"


def _restore(state: State, actuator: Actuator, dry_run: bool, drift: str) -> str:
    """After ``--ack`` of a foreign change slotune's knobs cannot show (``drift``): write
    slotune's own config for its knobs again (not when dry); why this tick then holds."""
    if dry_run:
        return f"acknowledged ({drift}); a dry run writes nothing"
    try:
        actuator.apply(state.knobs)
    except ActuatorError as e:
        raise ControlFailed(f"applying {state.knobs} after --ack failed: {e}") from None
    except Exception as e:  # transient: the next tick sees the change still, and pauses
        log.warning("writing %s again after --ack failed: %s", state.knobs, e)
        return f"acknowledged ({drift}); writing slotune's config again failed: {e}"
    return f"acknowledged ({drift}); slotune's config for {state.knobs} written again"


def _act(
    d: Decision, state: State, actuator: Actuator, live: Knobs | None, dry_run: bool
) -> tuple[State, bool, str]:
    """Apply a change (not when dry or already live); the state to keep, whether it was
    applied, and an error. A refused change keeps the old knobs."""
    if not d.changes:
        return d.state, False, ""
    if dry_run:
        # a recommendation only: the deployment still runs the old knobs
        return replace(d.state, knobs=state.knobs, last_change_s=state.last_change_s), False, ""
    if live == d.knobs:
        return d.state, False, ""
    try:
        cost = actuator.apply(d.knobs)
    except ActuatorError as e:
        raise ControlFailed(f"applying {d.knobs} failed: {e}") from None
    except Exception as e:  # transient: keep the old knobs, try next tick
        log.warning("applying %s failed: %s", d.knobs, e)
        return replace(d.state, knobs=state.knobs, last_change_s=state.last_change_s), False, str(e)
    return d.state, cost.changed, ""


def _export(exporter: ControllerExporter | None, d: Decision, obs: Observation, s: State) -> None:
    if exporter is None:
        return
    exporter.set_knobs(s.knobs)
    exporter.observe(obs)
    exporter.decision(d.action.value, d.outcome.value)
    exporter.set_degraded(bool(s.degraded))
    exporter.set_outliers(len(d.outliers))
    if math.isfinite(d.tpot_band[0]):  # a tick that read no band leaves the last one shown
        exporter.set_tpot_band(*d.tpot_band)
    if d.action is Action.ROLLBACK:
        exporter.rollback()
