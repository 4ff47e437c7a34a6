"""The canary loop: propose → apply live → warm up → measure one window → report → stop.

:func:`run_tune` owns the loop; the tuner (``search.tuner.Tuner``) owns what to try
next and when the best point is stable; the target applies and measures. Per trial
it records a :class:`~controller.report.curve.TrialRecord` (server-side Observation plus
the load generator's cross-check), appends it to ``trials.jsonl`` and stores it in
the study, so ``slotune export`` rebuilds the report from the study alone.

Faults end the run cleanly: a transient measurement failure is retried
``retries`` times, the wait doubling each time (Ray's metrics agent can take seconds to
answer a scrape under a Serve workload's histograms, and longer after a replica dies:
ray-project/ray#64891), then the run stops; a permanent target failure and Ctrl-C
stop it at once. In every case the pending trial is marked failed, the
best-so-far report is exported, and the deployment is left on the last
known-good knobs: the best feasible point measured, else the knobs it had
before tuning — never an untested or infeasible one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.errors import BadInput
from controller.progress import Progress
from controller.report.curve import CurveReport
from controller.report.files import write_report
from controller.report.records import TrialRecord
from controller.sweep import sweep_knobs
from controller.target_errors import TargetError, TargetUnavailable
from controller.targets import Measurement, Target
from controller.tune_study import (
    STUDY_META_KEY,
    STUDY_SWEEP_PREFIX,
    STUDY_TRIAL_PREFIX,
    save_to_study,
    stored_records,
)
from search.space import Knobs

if TYPE_CHECKING:
    from controller.backends.actuator import ApplyCost
    from search.tuner import Tuner

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TuneLimits:
    """When the loop stops, besides the tuner's own stop rule."""

    max_trials: int = 20
    time_budget_s: float = 300.0
    retries: int = 3  # transient measurement failures per trial before the run stops
    retry_wait_s: float = 2.0  # before the first retry; it doubles for each one after
    remeasures: int = 2  # windows across a fault discarded per trial before the run stops
    # A slow deployment's windows last as long as their request budget needs: the time
    # budget grows to at least `budget_windows` windows of `budget_requests` requests at
    # the request rate measured so far (0: it never grows).
    budget_requests: int = 0
    budget_windows: int = 6
    # Windows of the curve sweep after the search (controller/sweep.py); 0: none.
    curve_points: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_trials, int) and self.max_trials >= 1):
            raise ValueError(f"max_trials={self.max_trials!r}: must be an integer >= 1")
        if not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise ValueError(f"time_budget_s={self.time_budget_s!r}: must be > 0 seconds")
        if not (isinstance(self.retries, int) and self.retries >= 0):
            raise ValueError(f"retries={self.retries!r}: must be an integer >= 0")
        if not (isinstance(self.remeasures, int) and self.remeasures >= 0):
            raise ValueError(f"remeasures={self.remeasures!r}: must be an integer >= 0")
        for name in ("budget_requests", "budget_windows", "curve_points"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"{name}={v!r}: must be an integer >= 0")
        if not (math.isfinite(self.retry_wait_s) and self.retry_wait_s >= 0):
            raise ValueError(f"retry_wait_s={self.retry_wait_s!r}: must be >= 0 seconds")


@dataclass(frozen=True, kw_only=True)
class TuneOutcome:
    report: CurveReport
    stop_reason: str
    aborted: str = ""  # why a fault or Ctrl-C ended the run ("" when it ended normally)
    interrupted: bool = False  # Ctrl-C
    final_knobs: tuple[int, int] | None = None  # (max_batch_size, max_concurrency) left on
    final_note: str = ""
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.report.chosen is not None


class Terminated(KeyboardInterrupt):
    """SIGTERM (a Job deleted, a pod evicted): the same clean exit as Ctrl-C."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """In the main thread, turn SIGTERM into :class:`Terminated` while the loop runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    old = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_tune(
    *,
    target: Target,
    tuner: Tuner,
    base: CurveReport,
    limits: TuneLimits,
    out_dir: str | Path,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    sweep_target: Target | None = None,
) -> TuneOutcome:
    """Tune ``target`` until the stop rule, ``max_trials`` or the time budget; measure the
    curve sweep (``limits.curve_points`` windows, on ``sweep_target`` when given: the same
    deployment with the sweep's window plan); export the report into ``out_dir`` and leave
    the target on the last known-good knobs (also on Ctrl-C and SIGTERM)."""
    with _sigterm_as_interrupt():
        out, shown = Path(out_dir), progress or Progress()
        return _tune(target, tuner, base, limits, out, shown, clock, sleep, sweep_target)


def _tune(
    target: Target,
    tuner: Tuner,
    base: CurveReport,
    limits: TuneLimits,
    out: Path,
    progress: Progress,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    sweep_target: Target | None = None,
) -> TuneOutcome:
    # the report declares a knob on as many windows as the tuner
    base = replace(base, confirmations=tuner.stop_rule.confirmations)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "trials.jsonl"
    save_to_study(tuner, STUDY_META_KEY, {k: v for k, v in base.to_dict().items() if k != "trials"})
    original = _original_knobs(out, target)
    # A resumed study (same --study) keeps its trials: they count towards max_trials and
    # stay in the report, and a point confirmed feasible before is still known-good.
    records: list[TrialRecord] = stored_records(tuner.study.user_attrs)
    resumed = len(records)
    discarded: list[str] = []
    noisy: dict[Knobs, str] = {}  # knobs whose windows disagreed, and why
    walls: list[float] = []
    stop_reason = ""
    aborted = ""
    sweep_note = ""
    interrupted = False
    t_start = clock()
    total = limits.max_trials
    try:
        while True:
            elapsed = clock() - t_start
            if sum(r.role == "search" for r in records) >= limits.max_trials:
                stop_reason = f"max trials ({limits.max_trials}) reached" + (
                    f", {resumed} of them from the resumed study" if resumed else ""
                )
                break
            # Start a trial only if a typical one still fits in the budget.
            typical = statistics.median(walls) if walls else 0.0
            budget_s = _time_budget(limits, records)
            if elapsed + typical > budget_s:
                stop_reason = f"time budget ({budget_s:.0f} s) spent after {elapsed:.0f} s"
                break
            # Stop on the tuner's rule only with a point to deploy (the report chooses by
            # the tuner's own rule; a tuner stopping at its max_trials without one has
            # nothing to deploy, and the budget is better spent measuring on).
            if tuner.should_stop() and base.with_trials(records).chosen is not None:
                why = tuner.stop_reason()
                stop_reason = f"stop rule: {why}" if why else "stop rule"
                break
            proposal = tuner.proposal()
            knobs, cap = proposal.knobs, proposal.batch_cap
            progress.begin(len(records) + 1, total, knobs)
            t0 = clock()
            restart_s = _restart_seconds(target.apply(knobs, batch_cap=cap))
            m, faults = _measure_clean(target, knobs, cap, limits, progress, sleep)
            told = tuner.report(knobs, m.observation, change_cost_s=restart_s)
            number = told.number
            discarded += [f"trial {number} (B={knobs.max_batch_size}): {f}" for f in faults]
            # the tuner's reason, then what the metrics source said (why stale or thin)
            note = m.note or "; ".join(x for x in (told.reason, m.observation.note) if x)
            if restart_s:
                note = f"batch limit {cap} applied by a replica restart ({restart_s:.0f} s)" + (
                    f"; {note}" if note else ""
                )
            if faults:
                note = f"re-measured after {len(faults)} faulty window(s): {faults[-1]}" + (
                    f"; {note}" if note else ""
                )
            noise = _noise(tuner, knobs)
            if noise:  # said now, with the figures; the tuner measures the knob again
                note = f"environment noisy: {noise}" + (f"; {note}" if note else "")
                progress.message(f"[yellow]environment noisy[/]: {noise}")
                noisy[knobs] = noise
            rec = TrialRecord.from_observation(
                number=number,
                knobs=knobs,
                obs=m.observation,
                feasible=told.feasible,
                wall_s=clock() - t0,
                client=m.client,
                client_errors=m.client_errors,
                note=note,
                remeasured=len(faults),
            )
            records.append(rec)
            walls.append(rec.wall_s)
            with jsonl.open("a") as f:
                f.write(json.dumps({"t_unix": time.time(), **rec.to_dict()}) + "\n")
            save_to_study(tuner, f"{STUDY_TRIAL_PREFIX}{number:05d}", rec.to_dict())
            progress.end(rec, base.with_trials(records).chosen, total)
        sweep_note = _sweep(
            sweep_target or target, tuner, base, records, limits, progress, clock, sleep, jsonl
        )
    except KeyboardInterrupt as e:
        interrupted = True
        aborted = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
    except TargetUnavailable as e:
        aborted = f"measurements unavailable after {limits.retries} retries: {e}"
    except TargetError as e:
        aborted = str(e)
    if aborted:
        stop_reason = f"aborted: {aborted}"
        try:
            tuner.fail_pending(aborted)
        except Exception as e:  # the study must not hide the original fault
            log.warning("could not mark the interrupted trial failed: %s", e)
        progress.message(f"[red]{aborted}[/]: exporting the best so far")
    report = base.with_trials(
        records, stop_reason=stop_reason, backend={**base.backend, **_changes(tuner)}
    )
    final, note = _leave_on_known_good(report, original, target)
    meta = dict(report.meta)
    meta.update(
        {
            "trials": len(records),
            "wall_s": round(clock() - t_start, 1),
            "final_knobs": None if final is None else f"B={final[0]},C={final[1]}",
            "final_note": note,
        }
    )
    if not aborted and sweep_note:
        meta["curve_sweep"] = sweep_note
    if discarded:  # windows across a fault: never data, but the reviewer must know
        meta["discarded_windows"] = f"{len(discarded)}: " + " | ".join(discarded)
    if noisy:  # windows that disagreed beyond sampling error: the environment, not the knob
        meta["noise"] = " | ".join(noisy.values())
    report = report.with_trials(records, meta=meta)
    save_to_study(
        tuner, STUDY_META_KEY, {k: v for k, v in report.to_dict().items() if k != "trials"}
    )
    paths = write_report(report, out)
    paths["trials.jsonl"] = jsonl
    progress.close()
    return TuneOutcome(
        report=report,
        stop_reason=stop_reason,
        aborted=aborted,
        interrupted=interrupted,
        final_knobs=final,
        final_note=note,
        paths=paths,
    )


def _sweep(
    target: Target,
    tuner: Tuner,
    base: CurveReport,
    records: list[TrialRecord],
    limits: TuneLimits,
    progress: Progress,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    jsonl: Path,
) -> str:
    """Measure the curve sweep's windows (controller/sweep.py) into ``records``; what it
    did, in words, for the report ("" when no sweep was asked for). A fault during the
    sweep ends the sweep, not the run: the search's result stands, and the words say how
    far the sweep got."""
    if not limits.curve_points or base.with_trials(records).chosen is None:
        return "" if not limits.curve_points else "not run: no operating point to draw around"
    knobs_list, why = sweep_knobs(
        [r for r in records if r.role == "search"], limits.curve_points, tuner.space
    )
    if not knobs_list:
        return f"not run: {why}"
    first = max(r.number for r in records) + 1
    t0 = clock()
    for i, knobs in enumerate(knobs_list):
        progress.message(f"curve sweep {i + 1}/{len(knobs_list)}: {knobs}")
        t1 = clock()
        try:
            target.apply(knobs)
            m, faults = _measure_clean(target, knobs, None, limits, progress, sleep)
        except (TargetUnavailable, TargetError) as e:
            log.warning("curve sweep stopped at %s: %s", knobs, e)
            progress.message(f"[yellow]curve sweep stopped[/]: {e}")
            return (
                f"stopped after {i} of {len(knobs_list)} windows, at {knobs}: {e}"
                f" ({clock() - t0:.0f} s)"
            )
        rec = TrialRecord.from_observation(
            number=first + i,
            knobs=knobs,
            obs=m.observation,
            feasible=m.observation.feasible,
            wall_s=clock() - t1,
            client=m.client,
            client_errors=m.client_errors,
            note="; ".join(x for x in (m.note, m.observation.note) if x),
            remeasured=len(faults),
            role="sweep",
        )
        records.append(rec)
        with jsonl.open("a") as f:
            f.write(json.dumps({"t_unix": time.time(), **rec.to_dict()}) + "\n")
        save_to_study(tuner, f"{STUDY_SWEEP_PREFIX}{rec.number:05d}", rec.to_dict())
    batches = ", ".join(str(min(k.max_batch_size, k.max_concurrency)) for k in knobs_list)
    return f"{len(knobs_list)} windows at B={batches}, {clock() - t0:.0f} s after the search"


def _noise(tuner: Tuner, knobs: Knobs) -> str:
    """Why ``knobs``'s windows look noisy to the tuner ("" when they agree)."""
    return next((p.noise for p in tuner.points() if p.knobs == knobs and p.noise), "")


def _time_budget(limits: TuneLimits, records: list[TrialRecord]) -> float:
    """The time budget: ``limits.time_budget_s``, or on a slow deployment
    ``budget_windows`` windows of ``budget_requests`` at the median request rate measured
    so far, whichever is longer."""
    rates = [
        t.completed / t.window_s
        for t in records
        if t.completed > 0 and math.isfinite(t.window_s) and t.window_s > 0
    ]
    if not (limits.budget_requests and limits.budget_windows and rates):
        return limits.time_budget_s
    window = limits.budget_requests / statistics.median(rates)
    return max(limits.time_budget_s, limits.budget_windows * window)


def _changes(tuner: Tuner) -> dict[str, Any]:
    """How the batch limit moved during the search, for the report (nothing when it was
    changed live: only a restarting or an unapplied batch limit is worth a line)."""
    summary = tuner.change_summary()
    if summary.mode == "live":
        return {}
    out: dict[str, Any] = {"batch_limit": summary.mode, "batch_caps": list(summary.caps)}
    if summary.mode == "restart":
        out.update(restarts=summary.batch_changes, restart_s=round(summary.change_cost_s, 1))
    return out


def _restart_seconds(cost: ApplyCost | None) -> float:
    """Seconds a knob change spent restarting replicas (0 for a live change)."""
    return cost.seconds if cost is not None and cost.restarted else 0.0


def _measure_clean(
    target: Target,
    knobs: Knobs,
    cap: int | None,
    limits: TuneLimits,
    progress: Progress,
    sleep: Callable[[float], None],
) -> tuple[Measurement, list[str]]:
    """A window with no fault in it, and the faults of the windows discarded before it.

    A window during which a replica restarted or changed version, or with too many
    client errors (:attr:`Measurement.fault`), is not data: the knobs are applied again
    (which waits until every replica runs them) and the window measured again, at most
    ``limits.remeasures`` times; then the run stops (:class:`TargetUnavailable`)."""
    faults: list[str] = []
    while True:
        m = _measure_with_retries(target, knobs, limits, progress, sleep)
        if not m.fault:
            return m, faults
        faults.append(m.fault)
        log.warning("window on %s discarded: %s", knobs, m.fault)
        if len(faults) > limits.remeasures:
            raise TargetUnavailable(
                f"{len(faults)} windows on {knobs} in a row spanned a fault, the last: {m.fault}"
            )
        progress.message(
            f"[yellow]window discarded[/]: {m.fault}; re-applying {knobs} and measuring again "
            f"({len(faults)}/{limits.remeasures})"
        )
        target.apply(knobs, batch_cap=cap)


def _measure_with_retries(
    target: Target,
    knobs: Knobs,
    limits: TuneLimits,
    progress: Progress,
    sleep: Callable[[float], None],
) -> Measurement:
    for attempt in range(limits.retries + 1):
        try:
            return target.measure(knobs)
        except TargetUnavailable as e:
            if attempt == limits.retries:
                raise
            progress.message(
                f"[yellow]{e}[/]: retrying the window ({attempt + 1}/{limits.retries})"
            )
            log.warning("transient measurement failure (%s); retry %d", e, attempt + 1)
            sleep(limits.retry_wait_s * 2**attempt)
    raise AssertionError("unreachable")


def _leave_on_known_good(
    report: CurveReport, original: Knobs | None, target: Target
) -> tuple[tuple[int, int] | None, str]:
    """Apply the best feasible point measured, else the knobs from before tuning."""
    chosen = report.chosen
    if chosen is not None:
        knobs = Knobs(max_batch_size=chosen.max_batch_size, max_concurrency=chosen.max_concurrency)
        why = (
            f"left on the best feasible point measured: max_batch_size={chosen.max_batch_size}"
            f" max_concurrency={chosen.max_concurrency} (trial {chosen.number})"
        )
    elif original is not None:
        knobs = original
        why = "no feasible point: restored the knobs the deployment had before tuning"
    else:
        return None, "no feasible point and no earlier knobs known: deployment not changed"
    try:
        target.apply(knobs)
    except KeyboardInterrupt:
        why = f"interrupted while applying {knobs}: check the deployment"
    except Exception as e:  # report it: the run's result still stands
        why = f"could not apply {knobs} ({e}): check the deployment"
    log.info(why)
    return (knobs.max_batch_size, knobs.max_concurrency), why


ORIGINAL_KNOBS_FILE = "original_knobs.json"


def _original_knobs(out: Path, target: Target) -> Knobs | None:
    """The knobs the deployment ran before tuning, recorded in ``out`` before any change.

    The first run into ``out`` reads them from the target and saves them (written to a
    temporary file, synced, then renamed); a later run into the same ``out`` (a rerun
    after ``slotune tune`` was killed) reads them back instead of taking the live knobs,
    which may be the killed run's last, untested trial."""
    path = out / ORIGINAL_KNOBS_FILE
    app = str(target.describe().get("app", ""))
    if path.exists():
        try:
            rec = json.loads(path.read_text())
            knobs = rec["knobs"]
            saved_app = str(rec.get("app", ""))
            found = None if knobs is None else Knobs(**knobs)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BadInput(f"{path}: not a record of knobs slotune saved ({e})") from None
        if saved_app != app:
            raise BadInput(
                f"{path}: holds the knobs app {saved_app!r} had before tuning, not app "
                f"{app!r}; give another --out"
            )
        log.info("knobs from before tuning, as first recorded in %s: %s", path, found)
        return found
    found = target.current_knobs()
    rec = {
        "app": app,
        "knobs": None if found is None else asdict(found),
        "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(rec, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return found
