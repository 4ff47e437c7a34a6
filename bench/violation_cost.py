"""What a violating trial costs: the canary's sequential window against a whole window (issue 19).

On the default canary's set-up (``slotune tune`` with no arguments: the built-in model on a
local Ray, loopback only; bench/point_truth.py ``default_canary``), each knob of
``--points`` is measured ``--repeats`` times with each of two window plans, alternating
their order:

- ``whole``: the window 6de84e2's ``slotune tune`` measured (warm-up 2 s, at least 5 s and
  300 requests, at most 30 s; read once at the end);
- ``sequential``: today's ``slotune tune`` window on its defaults (judged every second by
  the anytime-valid e-processes; before 2 s and 300 requests only a clear violation at
  99.5% ends it; at most 800 requests or 900 s).

The default knobs are the issue's: B=77 (the roofline seed then, a clear violation: p99
TTFT 2.9 s against 1 s) and B=20 (a mild one). Prints one row per window, a summary per
knob (median seconds per plan, their ratio: sequential over whole), then one JSON line.
Seconds are the whole ``measure`` call (warm-up, window, reads), on this machine, now.

    .venv/bin/python bench/violation_cost.py                  # ~3-4 min
    .venv/bin/python bench/violation_cost.py --points 77,77 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.point_truth import cli_default, default_canary, point  # noqa: E402
from search.calibrate.device import cpu_model_name  # noqa: E402

PLANS = ("whole", "sequential")


def plans() -> dict[str, Any]:
    """The two window plans (see the module doc)."""
    from controller.targets import WindowPlan

    budget = cli_default("budget_requests")
    min_requests = cli_default("min_requests")
    return {
        "whole": WindowPlan(warmup_s=2.0, window_s=5.0, max_window_s=30.0, min_requests=300),
        "sequential": WindowPlan(
            warmup_s=cli_default("warmup_s"),
            window_s=cli_default("window_s"),
            max_window_s=cli_default("max_window_s"),
            min_requests=min_requests,
            sequential=True,
            budget_requests=max(budget, min_requests),
        ),
    }


def _verdicts(obs: Any) -> str:
    def one(v: Any) -> str:
        return "-" if v is None else f"{v.verdict.value} p99 {v.estimate_s * 1e3:.0f} ms"

    return f"TTFT {one(obs.ttft_verdict)}, TPOT {one(obs.tpot_verdict)}"


def run(points: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    from controller.targets import RayServeTarget
    from search.space import Knobs

    rows: list[dict[str, Any]] = []
    with default_canary() as (s, slo, shape):
        targets = {
            name: RayServeTarget(
                url=s.url, slo=slo, reader=s.reader, actuator=s.actuator, plan=plan, shape=shape
            )
            for name, plan in plans().items()
        }
        for b, c in points:
            k = Knobs(max_batch_size=b, max_concurrency=c)
            targets["whole"].apply(k)
            for r in range(repeats):
                for name in PLANS if r % 2 == 0 else PLANS[::-1]:
                    t0 = time.monotonic()
                    m = targets[name].measure(k)
                    wall = time.monotonic() - t0
                    obs = m.observation
                    row = {
                        "batch": b,
                        "concurrency": c,
                        "plan": name,
                        "repeat": r,
                        "seconds": round(wall, 2),
                        "window_s": round(obs.window_s, 2),
                        "completed": obs.completed,
                        "verdicts": _verdicts(obs),
                        "fault": m.fault,
                    }
                    rows.append(row)
                    print(
                        f"  B={b:<3} C={c:<3} {name:<10} {wall:6.1f} s, {obs.completed:4d}"
                        f" requests: {row['verdicts']}{' FAULT ' + m.fault if m.fault else ''}",
                        flush=True,
                    )
    summary = {}
    for b, c in points:
        med = {
            name: statistics.median(
                x["seconds"]
                for x in rows
                if (x["batch"], x["concurrency"], x["plan"]) == (b, c, name) and not x["fault"]
            )
            for name in PLANS
        }
        summary[f"{b},{c}"] = {**med, "ratio": round(med["sequential"] / med["whole"], 3)}
        print(
            f"B={b} C={c}: median {med['sequential']:.1f} s sequential,"
            f" {med['whole']:.1f} s whole: ratio {summary[f'{b},{c}']['ratio']:.2f}"
        )
    return {"rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", type=point, default=[(77, 77), (20, 20)])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be >= 1")
    t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load = os.getloadavg()[0]
    out = run(args.points, args.repeats)
    print(
        json.dumps(
            {
                "bench": "violation_cost",
                "started_utc": t0,
                "cpu": cpu_model_name(),
                "cores": os.cpu_count(),
                "load_before": round(load, 2),
                "load_after": round(os.getloadavg()[0], 2),
                "repeats": args.repeats,
                **out,
            },
            separators=(",", ":"),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
