"""``slotune compare`` on simulated canary runs: how often a rerun of one version is called
worse (false alarms) and how often a version slower per step is (issue 22).

For each seed and scenario: run A (the whole canary loop and export on the simulator),
a rerun of the same version with another seed, and a version whose every decode step takes
``--slowdown`` times as long; compare A with each, as ``slotune compare`` does.

Usage: ``python bench/compare_sim.py [--scenarios h100-8b l4-8b h100x4-70b] [--seeds 10]
[--slowdown 1.3]``; prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna

from controller.report.compare import compare
from controller.sim.scenarios import SCENARIOS
from controller.tune_simulated import slowed, tune_simulated
from search.calibrate.device import cpu_model_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", default=["h100-8b", "l4-8b", "h100x4-70b"])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--slowdown", type=float, default=1.3)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("controller").setLevel(logging.ERROR)
    t0 = time.time()
    rows = []
    for name in args.scenarios:
        sc = SCENARIOS[name]
        for s in range(args.seeds):
            with tempfile.TemporaryDirectory() as d:
                a = tune_simulated(sc, seed=s, out_dir=Path(d) / "a").report
                r = tune_simulated(sc, seed=s + 100, out_dir=Path(d) / "r").report
                b = tune_simulated(
                    slowed(sc, args.slowdown), seed=s + 200, out_dir=Path(d) / "b"
                ).report
            cr, cb = compare(a, r), compare(a, b)
            rows.append(
                {
                    "scenario": name,
                    "seed": s,
                    "rerun_worse": cr.worse,
                    "slow_worse": cb.worse,
                    "rerun_goodput_ratio": cr.tests[0].statistic if cr.tests else None,
                    "slow_goodput_ratio": cb.tests[0].statistic if cb.tests else None,
                }
            )
    print(
        f"{'scenario':<12} {'rerun worse':>12} {'slow worse':>11} {'rerun B/A goodput':>20}"
        f" {'slow B/A goodput':>18}"
    )
    summary = {}
    for name in args.scenarios:
        rs = [x for x in rows if x["scenario"] == name]
        rr = [x["rerun_goodput_ratio"] for x in rs if x["rerun_goodput_ratio"] is not None]
        sr = [x["slow_goodput_ratio"] for x in rs if x["slow_goodput_ratio"] is not None]
        summary[name] = {
            "rerun_flagged": sum(x["rerun_worse"] for x in rs),
            "slow_flagged": sum(x["slow_worse"] for x in rs),
            "seeds": len(rs),
            "rerun_ratio_min_med_max": [min(rr), statistics.median(rr), max(rr)] if rr else None,
            "slow_ratio_min_med_max": [min(sr), statistics.median(sr), max(sr)] if sr else None,
        }
        m = summary[name]

        def span(v):
            return "-" if v is None else f"{v[0]:.2f} / {v[1]:.2f} / {v[2]:.2f}"

        print(
            f"{name:<12} {m['rerun_flagged']:>7}/{m['seeds']:<4} {m['slow_flagged']:>6}/"
            f"{m['seeds']:<4} {span(m['rerun_ratio_min_med_max']):>20}"
            f" {span(m['slow_ratio_min_med_max']):>18}"
        )
    print("(goodput ratios: min / median / max over seeds)")
    out = {
        "bench": "compare_sim",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_model_name(),
        "slowdown": args.slowdown,
        "wall_s": round(time.time() - t0, 1),
        "summary": summary,
        "rows": rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
