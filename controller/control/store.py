"""What production control keeps outside the process: its state, its lease and its audit log.

- :func:`save_state` / :func:`load_state`: the :class:`~controller.control.decide.State` as
  JSON, written to a temporary file and renamed over the old one, so a controller killed
  with SIGKILL at any moment leaves the last complete state, and its successor resumes on
  the same knobs (no jump).
- :class:`Lease`: one controller per deployment. An exclusive ``flock`` on
  ``<state>.lock``, held for the process's life and released by the kernel when it dies
  (SIGKILL included), so a stale lease never blocks a restart; a second controller gets
  :class:`LeaseHeld` naming the holder's pid. (On Kubernetes the same role falls to a
  ``coordination.k8s.io`` Lease, not built yet.)
- :class:`AuditLog`: one JSON line per decision, appended and flushed.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from controller.control.decide import Decision, State
from metrics.observation import Observation
from search.space import Knobs

STATE_VERSION = 1


def _knobs(d: Any) -> Knobs | None:
    return None if d is None else Knobs(**d)


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _level(x: list[Any]) -> tuple[float, float, float, float]:
    """One window of the level; its answer length unknown (NaN) where the file has none
    (null, or a file written before the level kept it)."""
    n = x[3] if len(x) > 3 and x[3] is not None else math.nan
    return float(x[0]), float(x[1]), float(x[2]), float(n)


def state_to_dict(s: State) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "knobs": s.knobs.as_dict(),
        "last_good": None if s.last_good is None else s.last_good.as_dict(),
        "degraded": s.degraded,
        "rolled_back": s.rolled_back,
        "calm_since": s.calm_since,
        "last_change_s": _num(s.last_change_s),
        "last_end_s": _num(s.last_end_s),
        "burn": [list(b) for b in s.burn],
        "level": [[e, a, b, _num(n)] for e, a, b, n in s.level],
        "spread": list(s.spread),
        "bound_end_s": _num(s.bound_end_s),
        "raised_from": None if s.raised_from is None else s.raised_from.as_dict(),
        "ceiling": None if s.ceiling is None else list(s.ceiling),
        "ticks": s.ticks,
        "holds": s.holds,
        "rollbacks": s.rollbacks,
    }


def state_from_dict(d: dict[str, Any]) -> State:
    if d.get("version") != STATE_VERSION:
        raise ValueError(f"state version {d.get('version')!r}: this slotune reads {STATE_VERSION}")

    def t(x: float | None) -> float:
        return -math.inf if x is None else float(x)

    return State(
        knobs=Knobs(**d["knobs"]),
        last_good=_knobs(d.get("last_good")),
        degraded=str(d.get("degraded", "")),
        rolled_back=bool(d.get("rolled_back", False)),
        calm_since=d.get("calm_since"),
        last_change_s=t(d.get("last_change_s")),
        last_end_s=t(d.get("last_end_s")),
        burn=tuple((float(a), int(b), int(c)) for a, b, c in d.get("burn", ())),
        level=tuple(_level(x) for x in d.get("level", ())),
        spread=tuple(float(x) for x in d.get("spread", ())),
        bound_end_s=t(d.get("bound_end_s")),
        raised_from=_knobs(d.get("raised_from")),
        ceiling=None if d.get("ceiling") is None else (int(d["ceiling"][0]), t(d["ceiling"][1])),
        ticks=int(d.get("ticks", 0)),
        holds=int(d.get("holds", 0)),
        rollbacks=int(d.get("rollbacks", 0)),
    )


def save_state(state: State, path: Path) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file beside it, fsynced, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state_to_dict(state), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_state(path: Path) -> State | None:
    """The state at ``path``; None when there is none. ValueError (naming the file) when it
    cannot be read as one: a controller never guesses its last known-good knobs."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return state_from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"state file {path}: not a slotune control state ({e})") from None


class LeaseHeld(RuntimeError):
    """Another controller holds this deployment's lease."""


class Lease:
    """An exclusive lock on ``<state path>.lock`` for the life of the process."""

    def __init__(self, state_path: Path) -> None:
        self.path = state_path.with_name(state_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LeaseHeld(
                f"another slotune control holds {self.path} (pid {holder}): one controller "
                "per deployment"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _summary(o: Observation) -> dict[str, Any]:
    def v(x: Any) -> dict[str, Any] | None:
        if x is None:
            return None
        return {"verdict": x.verdict.value, "p99_s": _num(x.estimate_s), "samples": x.samples}

    return {
        "start_s": o.start_s,
        "end_s": o.end_s,
        "completed": o.completed,
        "slo_met": o.slo_met if o.slo_met_known else None,
        "rejected": o.rejected,
        "overloaded": o.overloaded,
        "generated_tokens": o.generated_tokens,
        "running": _num(o.running),
        "waiting": _num(o.waiting),
        "replica_tpot": [
            {"replica": r, "p99_s": _num(p99), "requests": n} for r, p99, n in o.replica_tpot
        ],
        "ttft": v(o.ttft_verdict),
        "tpot": v(o.tpot_verdict),
        "stale": o.stale,
        "note": o.note,
    }


class AuditLog:
    """Appends one JSON line per decision to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def record(
        self,
        *,
        at_s: float,
        decision: Decision,
        before: Knobs,
        observation: Observation | None,
        applied: bool,
        dry_run: bool,
        error: str = "",
    ) -> dict[str, Any]:
        row = {
            "time_s": at_s,
            "outcome": decision.outcome.value,
            "action": decision.action.value,
            "from": before.as_dict(),
            "to": decision.knobs.as_dict(),
            "reason": decision.reason,
            "applied": applied,
            "dry_run": dry_run,
            "predicted_tpot_s": _num(decision.predicted_tpot_s),
            "observation": None if observation is None else _summary(observation),
            "degraded": decision.state.degraded,
            "outliers": list(decision.outliers),
        }
        if error:
            row["error"] = error
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        return row
