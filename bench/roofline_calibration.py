"""Does the calibrated roofline predict the built-in model's real decode step?

Calibrates this device (``search.calibrate.device``, the same code as ``slotune
calibrate``), then times real decode steps of serving's ``small`` model (random
weights, KV cache filled so no zero pages hide its traffic) at several batch
sizes, and prints predicted / measured for the calibrated roofline and for the
ideal roofline built from the same run's measured peak bandwidth and FLOP/s
(that ratio is the MBU/MFU-style efficiency of eager torch here).

    .venv/bin/python bench/roofline_calibration.py [--dtype bf16] [--context 256]
        [--batches 1,4,16,64] [--reps 5] [--quick]

Prints a table, then one JSON line last.
"""

from __future__ import annotations

import os

# Before torch: spinning OpenMP workers on idle cores, sleeping ones on busy cores
# (see bench/engine.py); an exported OMP_WAIT_POLICY wins.
os.environ.setdefault(
    "OMP_WAIT_POLICY", "ACTIVE" if os.getloadavg()[0] < len(os.sched_getaffinity(0)) else "PASSIVE"
)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search.calibrate.device import calibrate
from search.calibrate.plan import PLANS, CalibrationPlan
from search.roofline.curve import Roofline
from search.roofline.hardware import HardwareSpec
from search.roofline.models import ModelSpec
from search.roofline.profile import DecodeProfile
from serving.model.config import ModelConfig
from serving.model.transformer import Transformer

SERVING_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


def time_decode(model: Transformer, batch: int, context: int, reps: int, budget_s: float) -> float:
    """Fastest decode step of ``batch`` sequences at ``context`` tokens: at least ``reps``
    steps and more (up to 50) within ``budget_s``, as calibration measures its points.

    serving's model reads each slot's whole ``max_len`` row (masked): the cache is
    allocated with ``max_len == context`` so the step reads ``batch * context`` tokens."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1))  # [B, 1]
    positions = torch.full((batch, 1), context - 1, dtype=torch.long)  # [B, 1]
    slots = torch.arange(batch)  # [B]
    best, spent, n = float("inf"), 0.0, 0
    with torch.inference_mode():
        model(tokens, positions, slots, slot_start=0)  # warm-up
        while n < reps or (spent < budget_s and n < 50):
            t0 = time.perf_counter()
            model(tokens, positions, slots, slot_start=0)
            dt = time.perf_counter() - t0
            best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def one_round(args: argparse.Namespace, batches: list[int], model: Transformer) -> dict:
    """Calibrate (or load), then time the real steps right after: one comparison."""
    spec = ModelSpec.from_name("slotune-small")
    t0 = time.perf_counter()
    if args.hardware:
        hw = HardwareSpec.from_json(args.hardware)
    else:
        plan = PLANS["quick" if args.quick else "full"]
        hw = calibrate(plan=plan, model=spec, dtypes=(args.dtype,)).spec
    cal_s = time.perf_counter() - t0
    ideal_hw = HardwareSpec(
        name=hw.name + "-ideal",
        peak_flops=hw.peak_flops,
        mem_bandwidth=hw.mem_bandwidth,
        mem_capacity=hw.mem_capacity,
    )
    cal = Roofline(model=spec, hardware=hw, dtype=args.dtype, context=args.context)
    ideal = Roofline(model=spec, hardware=ideal_hw, dtype=args.dtype, context=args.context)
    rows = []
    for b in batches:
        measured = time_decode(model, b, args.context, args.reps, args.budget_s)
        pred = cal.step_time_s(b)
        ideal_s = ideal.step_time_s(b)
        rows.append(
            {
                "batch": b,
                "measured_ms": measured * 1e3,
                "calibrated_ms": pred * 1e3,
                "calibrated_over_measured": pred / measured,
                "ideal_ms": ideal_s * 1e3,
                "ideal_over_measured": ideal_s / measured,
            }
        )
    return {
        "calibration_s": cal_s,
        "bw_gb_s": hw.mem_bandwidth / 1e9,
        "peak_gflop_s": hw.flops(args.dtype) / 1e9,
        "rows": rows,
        "worst_error": max(abs(r["calibrated_over_measured"] - 1) for r in rows),
    }


def interleaved(args: argparse.Namespace, batches: list[int], model: Transformer) -> list[dict]:
    """Per batch, alternate a one-point calibration and the real step ``args.interleaved``
    times and keep the fastest of each: both see the same moments of a shared machine,
    so this checks the decomposition (linears + attention + overheads) itself."""
    spec = ModelSpec.from_name("slotune-small")
    rows = []
    for b in batches:
        plan = CalibrationPlan(
            name="point",
            bandwidth_bytes=16 << 20,
            matmul_n=256,
            weight_batches=(b,),
            kv_batches=(b,),
            context=args.context,
            reps=2,
            budget_s=0.0,
        )
        best: dict[str, float] = {}
        measured = float("inf")
        for _ in range(args.interleaved):
            prof = calibrate(plan=plan, model=spec, dtypes=(args.dtype,)).spec.decode[args.dtype]
            for key, value in (
                ("weight_rate", prof.weight_rate[b]),
                ("kv_rate", prof.kv_rate[b]),
            ):
                best[key] = max(best.get(key, 0.0), value)
            for key, value in (
                ("layer_s", prof.layer_overhead_s[b]),
                ("step_s", prof.step_overhead_s[b]),
            ):
                best[key] = min(best.get(key, float("inf")), value)
            measured = min(measured, time_decode(model, b, args.context, 2, 0.0))
        hw = HardwareSpec(
            name="point",
            peak_flops={args.dtype: 1e12},
            mem_bandwidth=1e10,
            mem_capacity=1e10,
            decode={
                args.dtype: DecodeProfile(
                    weight_rate={b: best["weight_rate"]},
                    kv_rate={b: best["kv_rate"]},
                    layer_overhead_s={b: best["layer_s"]},
                    step_overhead_s={b: best["step_s"]},
                )
            },
        )
        pred = Roofline(model=spec, hardware=hw, dtype=args.dtype, context=args.context)
        p = pred.step_time_s(b)
        rows.append(
            {
                "batch": b,
                "measured_ms": measured * 1e3,
                "predicted_ms": p * 1e3,
                "predicted_over_measured": p / measured,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(SERVING_DTYPE))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1.0, help="per batch: keep timing this long")
    ap.add_argument("--rounds", type=int, default=3, help="calibrate + measure, this many times")
    ap.add_argument("--quick", action="store_true", help="quick calibration plan")
    ap.add_argument("--hardware", help="use this calibrated JSON instead of calibrating")
    ap.add_argument(
        "--interleaved",
        type=int,
        default=0,
        help="instead: alternate one-point calibrations and real steps this many times",
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    cfg = ModelConfig.from_name("small", dtype=SERVING_DTYPE[args.dtype])
    model = Transformer.random(cfg, seed=0)
    model.prepack()  # as the engine runs it (oneDNN-prepacked linears on CPU bf16)
    model.allocate_cache(max(batches), args.context)
    with torch.no_grad():
        for c in model.caches():
            c.normal_()  # written, so reads hit real memory, not the zero page

    if args.interleaved:
        rows = interleaved(args, batches, model)
        print(
            f"slotune-small {args.dtype}, context {args.context}, {torch.get_num_threads()} "
            f"threads: {args.interleaved} x (one-point calibration, real step), fastest of each"
        )
        print("{:>5} {:>12} {:>13} {:>6}".format("batch", "measured ms", "predicted ms", "ratio"))
        for r in rows:
            print(
                f"{r['batch']:>5} {r['measured_ms']:>12.2f} {r['predicted_ms']:>13.2f} "
                f"{r['predicted_over_measured']:>6.2f}"
            )
        worst = max(abs(r["predicted_over_measured"] - 1) for r in rows)
        print(f"worst |predicted/measured - 1| = {worst:.2f} (target <= 0.25)")
        print(
            json.dumps(
                {
                    "bench": "roofline_calibration_interleaved",
                    "dtype": args.dtype,
                    "context": args.context,
                    "threads": torch.get_num_threads(),
                    "repeats": args.interleaved,
                    "rows": rows,
                    "worst_error": worst,
                }
            )
        )
        return

    rounds = [one_round(args, batches, model) for _ in range(args.rounds)]
    print(
        f"slotune-small {args.dtype}, context {args.context}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds of (calibrate, then time the real decode step: fastest of "
        f">= {args.reps} within {args.budget_s:g} s)"
    )
    head = ("round", "batch", "measured ms", "calibrated ms", "ratio", "ideal ms", "ratio")
    print("{:>5} {:>5} {:>12} {:>14} {:>6} {:>9} {:>6}".format(*head))
    for i, rd in enumerate(rounds):
        for r in rd["rows"]:
            print(
                f"{i:>5} {r['batch']:>5} {r['measured_ms']:>12.2f} {r['calibrated_ms']:>14.2f} "
                f"{r['calibrated_over_measured']:>6.2f} {r['ideal_ms']:>9.2f} "
                f"{r['ideal_over_measured']:>6.2f}"
            )
        print(
            f"      round {i}: calibration {rd['calibration_s']:.1f} s, "
            f"BW {rd['bw_gb_s']:.1f} GB/s, peak {rd['peak_gflop_s']:.0f} GFLOP/s, "
            f"worst error {rd['worst_error']:.2f}"
        )
    median_ratio = {
        b: statistics.median(rd["rows"][j]["calibrated_over_measured"] for rd in rounds)
        for j, b in enumerate(batches)
    }
    print(
        "median calibrated/measured by batch: "
        + ", ".join(f"B={b}: {v:.2f}" for b, v in median_ratio.items())
        + " (target within 0.75-1.25)"
    )
    print(
        json.dumps(
            {
                "bench": "roofline_calibration",
                "dtype": args.dtype,
                "context": args.context,
                "threads": torch.get_num_threads(),
                "rounds": rounds,
                "median_calibrated_over_measured": median_ratio,
                "best_round_worst_error": min(rd["worst_error"] for rd in rounds),
            }
        )
    )


if __name__ == "__main__":
    main()
