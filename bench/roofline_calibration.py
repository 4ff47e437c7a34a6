"""Does the calibrated roofline predict the built-in model's real decode step?

Calibrates this device (``search.calibrate``, the same code as ``slotune
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no spinning threads

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search.calibrate import PLANS, calibrate
from search.hardware import HardwareSpec
from search.models import ModelSpec
from search.roofline import Roofline
from serving.config import ModelConfig
from serving.model import Transformer

SERVING_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


def time_decode(model: Transformer, batch: int, context: int, reps: int) -> float:
    """Median seconds of one decode step of ``batch`` sequences at ``context`` tokens.

    serving's model reads each slot's whole ``max_len`` row (masked): allocate the
    cache with ``max_len == context`` so the step reads ``batch * context`` tokens."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1))  # [B, 1]
    positions = torch.full((batch, 1), context - 1, dtype=torch.long)  # [B, 1]
    slots = torch.arange(batch)  # [B]
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            t0 = time.perf_counter()
            model(tokens, positions, slots, slot_start=0)
            if i:  # the first call is the warm-up
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(SERVING_DTYPE))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="quick calibration plan")
    ap.add_argument("--hardware", help="use this calibrated JSON instead of calibrating")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    spec = ModelSpec.from_name("slotune-small")

    t0 = time.perf_counter()
    if args.hardware:
        hw = HardwareSpec.from_json(args.hardware)
    else:
        hw = calibrate(
            plan=PLANS["quick" if args.quick else "full"], model=spec, dtypes=(args.dtype,)
        ).spec
    cal_s = time.perf_counter() - t0
    ideal_hw = HardwareSpec(
        name=hw.name + "-ideal",
        peak_flops=hw.peak_flops,
        mem_bandwidth=hw.mem_bandwidth,
        mem_capacity=hw.mem_capacity,
    )
    cal = Roofline(model=spec, hardware=hw, dtype=args.dtype, context=args.context)
    ideal = Roofline(model=spec, hardware=ideal_hw, dtype=args.dtype, context=args.context)

    cfg = ModelConfig.from_name("small", dtype=SERVING_DTYPE[args.dtype])
    model = Transformer.random(cfg, seed=0)
    model.allocate_cache(max(batches), args.context)
    with torch.no_grad():
        for c in model.caches():
            c.normal_()  # [S, L, Hkv, D]: written, so reads hit real memory

    rows = []
    for b in batches:
        measured = time_decode(model, b, args.context, args.reps)
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

    print(
        f"slotune-small {args.dtype}, context {args.context}, {torch.get_num_threads()} threads; "
        f"calibration {cal_s:.1f} s; BW {hw.mem_bandwidth / 1e9:.1f} GB/s, "
        f"{args.dtype} peak {hw.flops(args.dtype) / 1e9:.0f} GFLOP/s"
    )
    head = ("batch", "measured ms", "calibrated ms", "ratio", "ideal ms", "ratio")
    print("{:>5} {:>12} {:>14} {:>6} {:>9} {:>6}".format(*head))
    for r in rows:
        print(
            f"{r['batch']:>5} {r['measured_ms']:>12.2f} {r['calibrated_ms']:>14.2f} "
            f"{r['calibrated_over_measured']:>6.2f} {r['ideal_ms']:>9.2f} "
            f"{r['ideal_over_measured']:>6.2f}"
        )
    worst = max(abs(r["calibrated_over_measured"] - 1) for r in rows)
    print(f"worst |calibrated/measured - 1| = {worst:.2f} (target <= 0.25)")
    print(
        json.dumps(
            {
                "bench": "roofline_calibration",
                "dtype": args.dtype,
                "context": args.context,
                "threads": torch.get_num_threads(),
                "calibration_s": cal_s,
                "rows": rows,
                "worst_calibrated_error": worst,
            }
        )
    )


if __name__ == "__main__":
    main()
