"""How fast the simulator runs: simulated seconds per second, per search scenario.

For every scenario of bench/search_efficiency.py (controller/sim/scenarios.py) it runs
the simulator at the knobs a search visits (batch 1, 2, 4, ... up to the search's
largest, admission limit = batch, plus twice the batch at the roofline seed), with
the scenario's true step-time function, and reports simulated seconds per second of
this process's CPU time (the figure a loaded, shared machine distorts least) and of
wall-clock time, the slowest knob, and the share of the time spent inside the
step-time function (controller code, not the simulator's).

Variants, interleaved in one process (the order alternating), all on the same seeds,
and checked to give identical results: ``runs`` (serving/sim/simulator.py with the decode-run
fast path and the scalar mirror of the step time, controller/sim/decode_run.py: what
``SimTarget.run`` hands it), ``stepwise`` (the mirror, timing every step), ``plain``
(``SimTarget.step_time`` itself, every step: the truth the others must equal) and,
with ``--against REF``, serving/, controller/sim/decode_run.py and metrics/samples.py as they
were at git commit REF, the way that commit's ``SimTarget.run`` used them (the baseline the
speed-ups are relative to). The current variants run the compiled build of the simulator's
modules when there is one (serving/native.py; the JSON's ``native`` says whether), the
reference always its Python sources: ``--against HEAD`` measures what compiling gives.

Usage: ``python bench/sim_speed.py [--quick] [--reps 3] [--against REF]``. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.sim.decode_run import DecodeRunStepTime  # noqa: E402
from controller.sim.scenarios import SCENARIOS  # noqa: E402
from controller.sim.target import SimTarget  # noqa: E402
from search.space import Knobs  # noqa: E402
from serving import native  # noqa: E402
from serving.scheduler.plan import StepPlan  # noqa: E402
from serving.sim import simulator as current_sim  # noqa: E402

REF_MODULES = (
    "scheduler",
    "sched_state",
    "sim",
    "workload",
    "step_plan",
    "seq_state",
    "sim_observation",
)  # serving/<name>.py
REF_CONTROLLER = "sim_decode_run"  # controller/<name>.py, when the reference has it
REF_METRICS = ("samples",)  # metrics/<name>.py: the verdicts a window's observation computes


@dataclass(frozen=True)
class Reference:
    sim: ModuleType  # serving/sim/simulator.py at the reference
    runs: type | None  # its DecodeRunStepTime (None: it had none)


def load_reference(ref: str) -> Reference:
    """serving/sim/simulator.py (with the serving modules it imports),
    controller/sim/decode_run.py and metrics/samples.py as they were at git ``ref``,
    imported under a private package name."""
    pkg = f"_sim_ref_{abs(hash(ref)) % 10**8}"
    tmp = Path(tempfile.mkdtemp(prefix="sim_speed_")) / pkg
    tmp.mkdir()
    (tmp / "__init__.py").write_text("")
    files = [(f"serving/{n}.py", n) for n in REF_MODULES]
    files.append((f"controller/{REF_CONTROLLER}.py", REF_CONTROLLER))
    files += [(f"metrics/{n}.py", n) for n in REF_METRICS]
    have = []
    for path, name in files:
        r = subprocess.run(
            ["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True, text=True, check=False
        )
        if r.returncode != 0:
            continue  # a module the reference did not have
        src = r.stdout
        for other in REF_MODULES:
            src = src.replace(f"from serving.{other} import", f"from {pkg}.{other} import")
        for other in REF_METRICS:
            src = src.replace(f"from metrics.{other} import", f"from {pkg}.{other} import")
        (tmp / f"{name}.py").write_text(src)
        have.append(name)
    sys.path.insert(0, str(tmp.parent))
    sim = importlib.import_module(f"{pkg}.sim")
    runs = None
    if REF_CONTROLLER in have:
        runs = importlib.import_module(f"{pkg}.{REF_CONTROLLER}").DecodeRunStepTime
    return Reference(sim=sim, runs=runs)


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


StepTimeFn = Callable[[StepPlan], float]


@dataclass(frozen=True)
class Variant:
    label: str
    sim: ModuleType  # a module with simulate()
    step_time: Callable[[SimTarget], StepTimeFn]  # the step-time function to hand it


class StepOnly:
    """A step-time function without its ``decode_run`` (the simulator steps every plan)."""

    def __init__(self, fn: StepTimeFn) -> None:
        self.fn = fn

    def __call__(self, plan: StepPlan) -> float:
        return self.fn(plan)


def _plain(target: SimTarget) -> StepTimeFn:
    return target.step_time


def _stepwise(target: SimTarget) -> StepTimeFn:
    return StepOnly(DecodeRunStepTime(target))


class Timed:
    """A step-time function, with the time spent inside it."""

    def __init__(self, fn: Callable[[StepPlan], float]) -> None:
        self.fn = fn
        self.spent = 0.0

    def __call__(self, plan: StepPlan) -> float:
        t0 = time.perf_counter()
        dt = self.fn(plan)
        self.spent += time.perf_counter() - t0
        return dt


def run_one(v: Variant, target: SimTarget, k: Knobs, seed: int, timed: bool = False):
    cfg = target.sim_config
    fn = v.step_time(target)
    if timed:
        fn = Timed(fn)
    t0, c0 = time.perf_counter(), time.process_time()
    r = v.sim.simulate(
        max_batch_size=min(k.max_batch_size, cfg.max_slots),
        max_concurrency=max(k.max_concurrency, min(k.max_batch_size, cfg.max_slots)),
        workload=target.workload,
        step_time=fn,
        config=cfg,
        slo=target.slo,
        seed=seed,
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return r, wall, cpu, (fn.spent if isinstance(fn, Timed) else None)


def _fingerprint(r: object) -> tuple:
    """A result as text: the variants' timing classes are distinct types, and NaN != NaN."""
    return (repr(r.observation), repr([t.__dict__ for t in r.timings]), r.steps, r.sim_s)  # type: ignore[attr-defined]


def bench_scenario(name: str, variants: list[Variant], reps: int, quick: bool) -> dict:
    target = SimTarget(SCENARIOS[name])
    knobs = knobs_for(target, quick)
    acc = {v.label: {"sim_s": 0.0, "wall": 0.0, "cpu": 0.0, "steps": 0} for v in variants}
    worst = {v.label: math.inf for v in variants}
    identical = True
    for rep in range(reps):
        for i, k in enumerate(knobs):
            order = variants if (rep + i) % 2 == 0 else variants[::-1]
            prints = set()
            for v in order:
                r, w, c, _ = run_one(v, target, k, seed=1000 + rep)
                a = acc[v.label]
                a["sim_s"] += r.sim_s
                a["wall"] += w
                a["cpu"] += c
                a["steps"] += r.steps
                worst[v.label] = min(worst[v.label], r.sim_s / w)
                prints.add(_fingerprint(r))
            identical &= len(prints) == 1
    # Where the step-by-step variant's time goes: a separate timed pass (the timer costs).
    stepwise = next((v for v in variants if v.label == "stepwise"), variants[0])
    spent = total = 0.0
    for k in knobs:
        _, w, _, fn_s = run_one(stepwise, target, k, seed=1000, timed=True)
        spent += fn_s or 0.0
        total += w
    out: dict = {
        "knobs": len(knobs),
        "windows_per_variant": reps * len(knobs),
        "identical": identical,
        "step_time_share": round(spent / total, 3),
    }
    for v in variants:
        a = acc[v.label]
        out[v.label] = {
            "sim_s_per_s": round(a["sim_s"] / a["wall"], 1),
            "sim_s_per_cpu_s": round(a["sim_s"] / max(a["cpu"], 1e-9), 1),
            "worst_knob_sim_s_per_s": round(worst[v.label], 1),
            "steps_per_s": round(a["steps"] / a["wall"]),
            "sim_s": round(a["sim_s"], 1),
            "wall_s": round(a["wall"], 3),
            "cpu_s": round(a["cpu"], 3),
        }
    base = variants[-1].label
    out["baseline"] = base
    for v in variants[:-1]:
        out[f"speedup_cpu_{v.label}"] = round(acc[base]["cpu"] / max(acc[v.label]["cpu"], 1e-9), 2)
        out[f"speedup_wall_{v.label}"] = round(acc[base]["wall"] / acc[v.label]["wall"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer knobs, one repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--against", default=None, help="git ref of a reference simulator (A/B)")
    ap.add_argument("--scenarios", nargs="*", default=None, choices=sorted(SCENARIOS))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    variants = [
        Variant("runs", current_sim, DecodeRunStepTime),
        Variant("stepwise", current_sim, _stepwise),
        Variant("plain", current_sim, _plain),
    ]
    if args.against:
        ref = load_reference(args.against)
        variants.append(Variant(f"ref:{args.against}", ref.sim, ref.runs or _plain))
    reps = 1 if args.quick else args.reps
    names = args.scenarios or list(SCENARIOS)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = {n: bench_scenario(n, variants, reps, args.quick) for n in names}
    load1 = os.getloadavg()
    labels = [v.label for v in variants]
    hdr = f"{'scenario':12s} " + " ".join(f"{lb:>16s}" for lb in labels)
    hdr += f" {'worst knob':>10s} {'step_time':>9s} {'same':>5s} "
    hdr += " ".join(f"{'x ' + lb:>12s}" for lb in labels[:-1])
    print(
        f"simulated seconds per CPU second (wall-clock figures in the JSON); baseline {labels[-1]}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n, r in res.items():
        row = f"{n:12s} " + " ".join(f"{r[lb]['sim_s_per_cpu_s']:16.0f}" for lb in labels)
        row += f" {r['runs']['worst_knob_sim_s_per_s']:10.0f} {r['step_time_share']:9.0%}"
        row += f" {str(r['identical']):>5s} "
        row += " ".join(f"{r[f'speedup_cpu_{lb}']:11.2f}x" for lb in labels[:-1])
        print(row)
    print(
        "(runs: serving/sim/simulator.py with the decode-run fast path and the scalar mirror"
        " (controller/sim/decode_run.py, SimTarget.run today); stepwise: the mirror timing"
        " every step; plain: SimTarget.step_time every step; worst knob: the slowest window"
        " of 'runs', wall clock; step_time: share of the stepwise time inside the step-time"
        " function; same: every variant gave identical results;"
        f" load average {load0[0]:.2f} before, {load1[0]:.2f} after;"
        f" simulator modules: {native.status()['why']})"
    )
    summary = {
        "bench": "sim_speed",
        "quick": args.quick,
        "reps": reps,
        "against": args.against,
        "native": native.status(),
        "loadavg_1m": [round(load0[0], 2), round(load1[0], 2)],
        "wall_s": round(time.perf_counter() - t0, 1),
        "min_sim_s_per_cpu_s": min(r["runs"]["sim_s_per_cpu_s"] for r in res.values()),
        "min_sim_s_per_s": min(r["runs"]["sim_s_per_s"] for r in res.values()),
        "all_identical": all(r["identical"] for r in res.values()),
        "scenarios": res,
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
