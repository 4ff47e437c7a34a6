"""How fast the simulator runs: simulated seconds per real second, per search scenario.

For every scenario of bench/search_efficiency.py (controller/sim_target.py) it runs
the simulator at the knobs a search visits (batch 1, 2, 4, ... up to the search's
largest, admission limit = batch, plus twice the batch at the roofline seed), with
the scenario's true step-time function, and reports simulated seconds per real
second over all those windows (the slowest knob too) and the share of the time
spent inside the step-time function (controller code, not the simulator's).

``--against REF`` also runs serving/sim.py and serving/scheduler.py as they were at
the git commit REF, interleaved with the current ones in the same process (A/B
order alternating), so the ratio holds under a loaded machine; the two must give
identical results, which is checked and printed.

Usage: ``python bench/sim_speed.py [--quick] [--reps 3] [--against REF]``. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.sim_target import SCENARIOS, SimTarget  # noqa: E402
from search.space import Knobs  # noqa: E402
from serving import sim as current_sim  # noqa: E402
from serving.scheduler import StepPlan  # noqa: E402

REF_MODULES = ("scheduler", "sim", "workload", "step_plan")


def load_reference(ref: str) -> ModuleType:
    """serving/sim.py (and the serving modules it imports) as they were at git ``ref``."""
    pkg = f"_sim_ref_{abs(hash(ref)) % 10**8}"
    tmp = Path(tempfile.mkdtemp(prefix="sim_speed_")) / pkg
    tmp.mkdir()
    (tmp / "__init__.py").write_text("")
    for name in REF_MODULES:
        r = subprocess.run(
            ["git", "show", f"{ref}:serving/{name}.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            continue  # a module the reference did not have
        src = r.stdout
        for other in REF_MODULES:
            src = src.replace(f"from serving.{other} import", f"from {pkg}.{other} import")
        (tmp / f"{name}.py").write_text(src)
    sys.path.insert(0, str(tmp.parent))
    return importlib.import_module(f"{pkg}.sim")


def knobs_for(target: SimTarget, quick: bool) -> list[Knobs]:
    hi = target.space.batch_max
    batches: list[int] = []
    b = 1
    while b < hi:
        batches.append(b)
        b *= 4 if quick else 2
    batches.append(hi)
    out = [Knobs(max_batch_size=b, max_concurrency=b) for b in batches]
    seed_b = min(target.seed_batch, hi)
    out.append(Knobs(max_batch_size=seed_b, max_concurrency=2 * seed_b))
    return out


class Timed:
    """The scenario's step-time function, with the time spent inside it."""

    def __init__(self, fn: Callable[[StepPlan], float]) -> None:
        self.fn = fn
        self.spent = 0.0

    def __call__(self, plan: StepPlan) -> float:
        t0 = time.perf_counter()
        dt = self.fn(plan)
        self.spent += time.perf_counter() - t0
        return dt


def run_one(mod: ModuleType, target: SimTarget, k: Knobs, seed: int, timed: bool):
    cfg = target.sim_config
    fn: Callable[[StepPlan], float] = Timed(target.step_time) if timed else target.step_time
    t0 = time.perf_counter()
    r = mod.simulate(
        max_batch_size=min(k.max_batch_size, cfg.max_slots),
        max_concurrency=max(k.max_concurrency, min(k.max_batch_size, cfg.max_slots)),
        workload=target.workload,
        step_time=fn,
        config=cfg,
        slo=target.slo,
        seed=seed,
    )
    wall = time.perf_counter() - t0
    return r, wall, (fn.spent if isinstance(fn, Timed) else None)


def _fingerprint(r: object) -> tuple:
    """A result as text: the variants' timing classes are distinct types, and NaN != NaN."""
    return (repr(r.observation), repr([t.__dict__ for t in r.timings]), r.steps, r.sim_s)  # type: ignore[attr-defined]


def bench_scenario(
    name: str, variants: dict[str, ModuleType], reps: int, quick: bool
) -> dict[str, object]:
    target = SimTarget(SCENARIOS[name])
    knobs = knobs_for(target, quick)
    names = list(variants)
    sim_s = {v: 0.0 for v in names}
    wall = {v: 0.0 for v in names}
    steps = {v: 0 for v in names}
    worst = {v: float("inf") for v in names}
    fn_s = 0.0
    fn_wall = 0.0
    identical = True
    for rep in range(reps):
        for i, k in enumerate(knobs):
            order = names if (rep + i) % 2 == 0 else names[::-1]
            results = {}
            for v in order:
                r, w, spent = run_one(variants[v], target, k, seed=1000 + rep, timed=False)
                results[v] = r
                sim_s[v] += r.sim_s
                wall[v] += w
                steps[v] += r.steps
                worst[v] = min(worst[v], r.sim_s / w)
            first = results[names[0]]
            identical &= all(_fingerprint(r) == _fingerprint(first) for r in results.values())
        # The step-time share, from a separate timed pass (the timer costs a little).
        for k in knobs:
            _, w, spent = run_one(variants[names[0]], target, k, seed=1000 + rep, timed=True)
            fn_s += spent or 0.0
            fn_wall += w
    out: dict[str, object] = {
        "knobs": len(knobs),
        "windows": reps * len(knobs),
        "identical": identical,
        "step_time_share": round(fn_s / fn_wall, 3),
    }
    for v in names:
        out[v] = {
            "sim_s_per_s": round(sim_s[v] / wall[v], 1),
            "worst_knob_sim_s_per_s": round(worst[v], 1),
            "steps_per_s": round(steps[v] / wall[v]),
            "sim_s": round(sim_s[v], 1),
            "wall_s": round(wall[v], 3),
        }
    if len(names) == 2:
        a, b = names
        out["speedup"] = round(wall[b] / wall[a], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer knobs, one repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--against", default=None, help="git ref of a reference simulator (A/B)")
    ap.add_argument("--scenarios", nargs="*", default=None, choices=sorted(SCENARIOS))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    variants: dict[str, ModuleType] = {"current": current_sim}
    if args.against:
        variants[f"ref:{args.against}"] = load_reference(args.against)
    reps = 1 if args.quick else args.reps
    names = args.scenarios or list(SCENARIOS)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = {n: bench_scenario(n, variants, reps, args.quick) for n in names}
    load1 = os.getloadavg()
    hdr = f"{'scenario':12s} " + " ".join(f"{v + ' sim s/s':>22s}" for v in variants)
    hdr += f" {'worst knob':>11s} {'steps/s':>9s} {'step_time':>9s} {'identical':>9s}"
    if len(variants) == 2:
        hdr += f" {'speedup':>8s}"
    print(hdr)
    print("-" * len(hdr))
    for n, r in res.items():
        cur = r["current"]
        assert isinstance(cur, dict)
        row = f"{n:12s} " + " ".join(
            f"{r[v]['sim_s_per_s']:22.0f}"  # type: ignore[index]
            for v in variants
        )
        row += f" {cur['worst_knob_sim_s_per_s']:11.0f} {cur['steps_per_s']:9d}"
        row += f" {r['step_time_share']:9.0%} {str(r['identical']):>9s}"
        if "speedup" in r:
            row += f" {r['speedup']:7.2f}x"
        print(row)
    print(
        "(sim s/s: simulated seconds per real second over every window; worst knob: the"
        " slowest window; step_time: share of the time inside the scenario's step-time"
        f" function; load average {load0[0]:.2f} before, {load1[0]:.2f} after)"
    )
    summary = {
        "bench": "sim_speed",
        "quick": args.quick,
        "reps": reps,
        "against": args.against,
        "loadavg_1m": [round(load0[0], 2), round(load1[0], 2)],
        "wall_s": round(time.perf_counter() - t0, 1),
        "min_sim_s_per_s": min(r["current"]["sim_s_per_s"] for r in res.values()),  # type: ignore[index]
        "all_identical": all(r["identical"] for r in res.values()),
        "scenarios": res,
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
