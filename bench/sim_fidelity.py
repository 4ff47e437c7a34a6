"""Simulator fidelity on this deployment: `slotune simulate -s local` against the live canary.

Runs the simulator's ``local`` scenario (this machine's calibration and served-step model,
the canary's default workload and SLO: controller/sim/served.py) and then ``slotune tune``
with its demo defaults (bounded by ``--time-budget``), and prints the predicted and the
found operating point (batch, goodput) and their ratios; the target is within 20% in
both. The simulator runs ``--sim-seeds`` times and predicts the median of its choices (one
seed's choice on the goodput plateau is partly its own noise, as one live run's is); the
live canary runs without its curve sweep (``--curve-points 0``), which does not choose.
Needs a served calibration (``slotune calibrate --served``) unless ``--served``; the live
run measures one first if none is cached. ``--calibrate`` measures it afresh first, so
that the simulator and the live canary see the machine in the same state (a calibration
taken beside another job, hours before, makes the simulator slower than the canary it is
compared with); it first waits, up to 4 minutes, for the 1-minute load average to fall
under 1, so that a run begun as the one before winds down does not calibrate a busy
machine. The load average is printed before and after (live figures on shared cores move
with it).

    .venv/bin/python bench/sim_fidelity.py [--calibrate | --served PATH] [--time-budget 240]
        [--sim-seeds 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SLOTUNE = [sys.executable, "-m", "controller"]


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def simulate(served: str | None, seed: int) -> dict:
    cmd = [*SLOTUNE, "simulate", "-s", "local", "--json", "--seed", str(seed)]
    if served:
        cmd += ["--served", served]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode not in (0, 3):
        raise SystemExit(f"slotune simulate failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def settle(below: float = 1.0, most_s: float = 240.0) -> float:
    """Wait until the 1-minute load average is under ``below`` (at most ``most_s``): a
    calibration taken while the previous run's Ray processes still wind down measures a
    slower machine than the live canary then meets (12-07: the two runs begun at a load of
    2.5-3.0 predicted 0.58-0.75 of the live batch or goodput; of the five begun at 1.5 or
    less, four were within 20% in both). Returns the seconds waited."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= below and time.monotonic() - t0 < most_s:
        time.sleep(5.0)
    return time.monotonic() - t0


def calibrate() -> None:
    cmd = [*SLOTUNE, "calibrate", "--served"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(
            f"slotune calibrate --served failed ({out.returncode}): {out.stderr[-2000:]}"
        )


def live(time_budget: float, out_dir: Path) -> dict:
    cmd = [*SLOTUNE, "tune", "--quiet", "--out", str(out_dir), "--time-budget", str(time_budget)]
    cmd += ["--curve-points", "0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode not in (0, 3):
        raise SystemExit(f"slotune tune failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads((out_dir / "curve.json").read_text())


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def served_calibration() -> dict:
    """The cached served calibration the runs used (when and how long it took), if any."""
    from controller.attach import embedded_threads
    from controller.tune_served import served_path

    try:
        d = json.loads(served_path("cpu", embedded_threads(), "slotune-small").read_text())
    except (OSError, ValueError):
        return {}
    return {k: d.get(k) for k in ("version", "measured_at", "elapsed_s")}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--served", help="served model JSON (default: this machine's cache)")
    ap.add_argument(
        "--calibrate", action="store_true", help="measure the served calibration afresh first"
    )
    ap.add_argument("--time-budget", type=float, default=240.0, help="slotune tune's budget")
    ap.add_argument("--out", help="where the live run's report goes (default: a new temp dir)")
    ap.add_argument(
        "--sim-seeds",
        type=int,
        default=8,
        help="simulator seeds; the prediction is their median batch and goodput",
    )
    args = ap.parse_args()
    if args.calibrate and args.served:
        raise SystemExit(
            "--calibrate measures this machine's cached calibration: not with --served"
        )
    waited = settle() if args.calibrate else 0.0
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    if args.calibrate:
        calibrate()
    if args.sim_seeds < 1:
        raise SystemExit(f"--sim-seeds {args.sim_seeds}: need at least 1")
    t0 = time.monotonic()
    sims = [simulate(args.served, seed) for seed in range(args.sim_seeds)]
    t_sim = time.monotonic() - t0
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="slotune-fidelity-"))
    t1 = time.monotonic()
    rep = live(args.time_budget, out_dir)
    t_live = time.monotonic() - t1
    # Each seed's choice: (batch, concurrency, goodput); the prediction is the median.
    picks = [
        (c["max_batch_size"], c["max_concurrency"], c["goodput_rps"])
        for c in (sim.get("chosen") for sim in sims)
        if c
    ]
    op = rep.get("operating_point") or {}
    row = {
        "cpu": cpu(),
        "started": started,
        "commit": commit(),
        "settle_s": round(waited, 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "served_calibration": served_calibration(),
        "sim_seed_batch_roofline": sims[0].get("seed_batch"),
        "live_seed_batch": rep.get("predicted_batch"),
        "sim_picks": picks,
        "sim_batch": statistics.median(b for b, _, _ in picks) if picks else None,
        "live_batch": op.get("max_batch_size"),
        "sim_goodput_rps": statistics.median(g for _, _, g in picks) if picks else None,
        "live_goodput_rps": op.get("goodput_rps"),
        "sim_s": round(t_sim, 1),
        "live_s": round(t_live, 1),
        "live_report": str(out_dir),
    }
    row["batch_ratio"] = ratio(row["sim_batch"], row["live_batch"])
    row["goodput_ratio"] = ratio(row["sim_goodput_rps"], row["live_goodput_rps"])
    print(f"CPU: {row['cpu']}; {started}, commit {row['commit']}")
    print(
        f"load average before {row['load_before']} (after waiting {row['settle_s']:.0f} s for "
        f"it to fall under 1), after {row['load_after']}"
    )
    print("live trials (B, C, goodput req/s, p99 TPOT ms, p99 TTFT ms, feasible):")
    for t in rep.get("trials") or []:
        print(
            f"  {t.get('max_batch_size')} {t.get('max_concurrency')} "
            f"{t.get('goodput_rps', float('nan')):.2f} {t.get('p99_tpot_ms', float('nan')):.1f} "
            f"{t.get('p99_ttft_ms', float('nan')):.0f} {t.get('feasible')}"
        )
    print(
        f"simulator, {len(sims)} seeds (B, C, goodput req/s): "
        + ", ".join(f"{b} {c} {g:.2f}" for b, c, g in picks)
        + f" ({len(sims) - len(picks)} with no point)"
    )
    print(f"{'':>10} {'batch':>6} {'goodput req/s':>14}  (sim: the seeds' medians)")
    for who in ("sim", "live"):
        g = row[f"{who}_goodput_rps"]
        print(f"{who:>10} {row[f'{who}_batch']!s:>6} {'-' if g is None else f'{g:.2f}':>14}")
    for k in ("batch_ratio", "goodput_ratio"):
        v = row[k]
        ok = v is not None and abs(v - 1) <= 0.2
        print(f"{k}: {'-' if v is None else f'{v:.2f}'} ({'within' if ok else 'outside'} 20%)")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
