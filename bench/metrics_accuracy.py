"""p99 from the contract's bucket layout vs the exact p99 of the raw samples.

For lognormal and bimodal latencies scaled so the exact p99 sits at 0.5x..2x each default SLO
threshold (TTFT 1 s, TPOT 0.1 s), compare ``histogram_quantile(0.99)`` over the default
layout (``names.slo_buckets``) with the nearest-rank p99 of the same samples, and do the
same with prometheus_client's default buckets as the baseline in the same run. Also checks
that the histogram verdict equals the raw-sample verdict (thresholds are bucket bounds).

    .venv/bin/python bench/metrics_accuracy.py [--samples 2000 200000] [--seed 0]

2,000 requests is one 30-60 s window at tens of requests/s; 200,000 isolates the layout.

Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.metrics import Histogram

from metrics import names
from metrics.observation import DEFAULT_SLO
from metrics.quantile import histogram_quantile
from metrics.samples import exact_quantile, verdict_from_histogram, verdict_from_samples

FACTORS = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)
NEAR = (0.8, 1.25)  # "around the threshold"


def shapes(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    def bimodal(slow_frac: float, ratio: float) -> np.ndarray:
        slow = rng.random(n) < slow_frac  # [n]
        fast = rng.lognormal(0.0, 0.3, n)  # [n]
        return np.where(slow, fast * ratio, fast)  # [n]

    return {
        "lognormal s=0.5": rng.lognormal(0.0, 0.5, n),
        "lognormal s=1.0": rng.lognormal(0.0, 1.0, n),
        "bimodal 5% x4": bimodal(0.05, 4.0),  # p99 inside the slow mode
        "bimodal 1.5% x6": bimodal(0.015, 6.0),  # p99 near the slow mode's lower edge
    }


def layout_counts(sorted_x: np.ndarray, bounds: tuple[float, ...]) -> dict[float, float]:
    le = np.searchsorted(sorted_x, np.asarray(bounds), side="right")  # [len(bounds)]
    counts = {b: float(c) for b, c in zip(bounds, le, strict=True)}
    counts[math.inf] = float(sorted_x.size)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[2_000, 200_000])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    slos = {"ttft": DEFAULT_SLO.ttft_p99_s, "tpot": DEFAULT_SLO.tpot_p99_s}
    ours = {
        "ttft": names.slo_buckets([DEFAULT_SLO.ttft_p99_s]),
        "tpot": names.slo_buckets([DEFAULT_SLO.tpot_p99_s]),
    }
    base = tuple(b for b in Histogram.DEFAULT_BUCKETS if math.isfinite(b))

    # Warm up, then time histogram_quantile on the layout (not the point, but cheap to know).
    warm = layout_counts(np.sort(rng.lognormal(0, 1, 1000)), ours["ttft"])
    for _ in range(200):
        histogram_quantile(0.99, warm)
    t0 = time.perf_counter()
    reps = 2000
    for _ in range(reps):
        histogram_quantile(0.99, warm)
    us_per_call = (time.perf_counter() - t0) / reps * 1e6

    rows = []
    verdict_mismatch = 0
    cases = [(n, shape, raw) for n in args.samples for shape, raw in shapes(rng, n).items()]
    for n, shape, raw in cases:
        base_p99 = exact_quantile(raw, 0.99)
        for slo, thr in slos.items():
            for f in FACTORS:
                x = np.sort(raw * (thr * f / base_p99))  # [n]
                exact = exact_quantile(x, 0.99)
                est = histogram_quantile(0.99, layout_counts(x, ours[slo]))
                est_base = histogram_quantile(0.99, layout_counts(x, base))
                hv = verdict_from_histogram(layout_counts(x, ours[slo]), thr, est)
                sv = verdict_from_samples(x, thr)
                verdict_mismatch += hv.verdict is not sv.verdict
                rows.append(
                    {
                        "n": n,
                        "shape": shape,
                        "slo": slo,
                        "p99_over_slo": f,
                        "exact_p99_s": exact,
                        "ours_p99_s": est,
                        "ours_rel_err": abs(est - exact) / exact,
                        "base_rel_err": abs(est_base - exact) / exact,
                        "verdict": hv.verdict.value,
                    }
                )

    print(f"{'n':>7} {'shape':<17} {'slo':<4} {'p99/T':>5} {'exact p99':>10} {'ours':>10} "
          f"{'ours err':>9} {'base err':>9} verdict")  # fmt: skip
    for r in rows:
        print(
            f"{r['n']:>7} {r['shape']:<17} {r['slo']:<4} {r['p99_over_slo']:>5.2f} "
            f"{r['exact_p99_s']:>10.5f} {r['ours_p99_s']:>10.5f} "
            f"{r['ours_rel_err']:>8.2%} {r['base_rel_err']:>8.2%} {r['verdict']}"
        )
    near = [r for r in rows if NEAR[0] <= r["p99_over_slo"] <= NEAR[1]]
    by_n = {
        str(n): {
            "max_rel_err_near_slo": max(r["ours_rel_err"] for r in near if r["n"] == n),
            "baseline_max_rel_err_near_slo": max(r["base_rel_err"] for r in near if r["n"] == n),
        }
        for n in args.samples
    }
    summary = {
        "bench": "metrics_accuracy",
        "samples": args.samples,
        "cases": len(rows),
        "by_samples": by_n,
        "max_rel_err_near_slo": max(r["ours_rel_err"] for r in near),
        "mean_rel_err_near_slo": float(np.mean([r["ours_rel_err"] for r in near])),
        "max_rel_err_all": max(r["ours_rel_err"] for r in rows),
        "baseline_max_rel_err_near_slo": max(r["base_rel_err"] for r in near),
        "baseline_mean_rel_err_near_slo": float(np.mean([r["base_rel_err"] for r in near])),
        "err_ratio_baseline_over_ours_near_slo": float(
            np.mean([r["base_rel_err"] for r in near]) / np.mean([r["ours_rel_err"] for r in near])
        ),
        "verdict_mismatches": verdict_mismatch,
        "near_band": list(NEAR),
        "within_5pct_near_slo": max(r["ours_rel_err"] for r in near) <= 0.05,
        "histogram_quantile_us_per_call": us_per_call,
        "buckets_ttft": len(ours["ttft"]) + 1,
        "buckets_baseline": len(base) + 1,
    }
    print()
    for n, v in by_n.items():
        print(
            f"n={n}: near the SLO (p99/T in {NEAR[0]}..{NEAR[1]}) max error"
            f" {v['max_rel_err_near_slo']:.2%} (baseline {v['baseline_max_rel_err_near_slo']:.2%})"
        )
    print(f"verdict mismatches: {verdict_mismatch}; histogram_quantile {us_per_call:.1f} us/call")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
