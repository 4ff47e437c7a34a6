"""A bounded noisy neighbour: one process keeping one core ``--duty`` busy (issue 19).

Busy-loops ``duty`` of every period and sleeps the rest, until it is told to stop, its
deadline passes or the process that started it is gone, whichever comes first; what it used
is its CPU time ÷ its wall time. :class:`Neighbour` runs it as a child process for the
length of a ``with`` block (bench/canary_noise.py starts one beside each canary run). On
its own it runs for ``--seconds`` and prints the duty it achieved, then one JSON line.

    .venv/bin/python bench/noisy_neighbour.py --duty 0.5 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class NoiseSpec:
    """One core busy ``duty`` of every ``period_s``; the process quits after ``deadline_s``."""

    duty: float = 0.5
    period_s: float = 0.1
    deadline_s: float = 960.0

    def __post_init__(self) -> None:
        if not (isinstance(self.duty, int | float) and 0 <= self.duty <= 1):
            raise ValueError(f"duty={self.duty!r}: must be a share of one core in [0, 1]")
        for name in ("period_s", "deadline_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r}: must be a positive number of seconds")


def burn(spec: NoiseSpec, stop: Any, stats: Any) -> None:
    """The neighbour's body: busy ``duty`` of each period, asleep the rest, until ``stop``
    (a multiprocessing Event) is set, the deadline passes or its parent is gone; ``stats``
    (a shared array of two doubles) holds [CPU seconds, wall seconds] so far."""
    parent, t0, c0 = os.getppid(), time.monotonic(), time.process_time()
    x = 1
    while not stop.is_set() and os.getppid() == parent:
        now = time.monotonic()
        if now - t0 >= spec.deadline_s:
            break
        busy_until = now + spec.duty * spec.period_s
        while time.monotonic() < busy_until:
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        stats[0], stats[1] = time.process_time() - c0, time.monotonic() - t0
        if spec.duty < 1:
            stop.wait((1 - spec.duty) * spec.period_s)
    stats[0], stats[1] = time.process_time() - c0, time.monotonic() - t0


class Neighbour:
    """:func:`burn` in a child process for the length of a ``with`` block (none at duty 0)."""

    def __init__(self, spec: NoiseSpec) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of the parent's threads
        self.spec = spec
        self._stop = ctx.Event()
        self._stats = ctx.Array("d", 2, lock=False)
        self._proc = ctx.Process(
            target=burn, args=(spec, self._stop, self._stats), daemon=True, name="noisy-neighbour"
        )

    def __enter__(self) -> Neighbour:
        if self.spec.duty > 0:
            self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Ask it to stop and wait; kill it if it has not stopped within ~10 s."""
        if self._proc.pid is None:
            return
        self._stop.set()
        self._proc.join(timeout=self.spec.period_s + 10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)

    @property
    def running(self) -> bool:
        return self._proc.is_alive()

    @property
    def duty(self) -> float:
        """The share of one core it used: CPU time ÷ wall time (nan if it never ran)."""
        cpu, wall = self._stats[0], self._stats[1]
        return cpu / wall if wall > 0 else math.nan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duty", type=float, default=0.5, help="share of one core to keep busy")
    ap.add_argument("--period-ms", type=float, default=100.0, help="busy + idle period")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long it runs here")
    args = ap.parse_args(argv)
    try:
        spec = NoiseSpec(duty=args.duty, period_s=args.period_ms / 1e3, deadline_s=args.seconds)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.monotonic()
    with Neighbour(spec) as nb:
        while nb.running and time.monotonic() - t0 < args.seconds + 5:
            time.sleep(0.2)
    print(f"asked {spec.duty:g} of one core for {args.seconds:g} s: used {nb.duty:.3f}")
    print(json.dumps({"bench": "noisy_neighbour", "duty_target": spec.duty,
                      "duty": round(nb.duty, 3), "seconds": args.seconds}))  # fmt: skip


if __name__ == "__main__":
    main()
