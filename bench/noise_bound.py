"""How many windows ANY tuner needs when every window runs at its own speed.

bench/search_efficiency.py's ``--window-noise-cv`` slows every step of a window by one
lognormal factor f (median 1), and its truth is the noise-free run (f = 1). A tuner that
declares a knob feasible with a stated confidence must therefore bound the deployment's
typical speed, which one window shows only up to its own f. This bench computes, per
scenario, a lower bound on the trials that takes, for a tuner far better informed than
any real one:

- it knows the scenario's noise-free p99 TTFT and TPOT at every knob, up to one unknown
  speed level (the thing windows measure);
- it knows the noise's sigma, and each window reveals that window's log f exactly (as if
  it held infinitely many requests);
- it may declare the one knob within 5% of the oracle's goodput that has the widest margin
  under the SLO: f_max = min(SLO_ttft / p99_ttft, SLO_tpot / p99_tpot) at f = 1, the
  largest slowdown it survives.

Latencies are taken to scale in proportion to f: exact for TPOT (every step is slowed by f)
and lenient for TTFT (queueing grows faster than f), so f_max is if anything too large and
the bound too small. After n windows it declares once the one-sided upper confidence bound
of the level, mean(log f) + z * sigma / sqrt(n), is at most log f_max; the first such n over
Monte Carlo seeds gives the median and the share of seeds done within a trial cap.

Usage: ``python bench/noise_bound.py [--cv 0.15] [--scenarios a b ...] [--cap 30]``.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from scipy.stats import norm

from bench.search_bench import TOLERANCE, Bench
from controller.sim.scenarios import SCENARIOS, SLOW_SCENARIOS, resolve_scenario
from search.space import Knobs


def widest_margin(bench: Bench, oracle: Knobs, og: float) -> tuple[Knobs, float]:
    """The truly feasible knob within TOLERANCE of the oracle's goodput that survives the
    largest slowdown, among the knobs the oracle search evaluated and every batch between
    0.8x the oracle's and its own at the oracle's headroom."""
    b0, c0 = oracle.max_batch_size, oracle.max_concurrency
    space = bench.target.space
    for b in range(max(space.batch_min, int(b0 * 0.8)), b0 + 1):
        bench.truth(space.clip(Knobs(max_batch_size=b, max_concurrency=max(b, round(b * c0 / b0)))))
    best: tuple[Knobs, float] | None = None
    for k, t in bench._truth.items():
        if not (t.feasible and t.goodput >= (1 - TOLERANCE) * og):
            continue
        f_max = bench.slo.ttft_p99_s / t.ttft_p99
        if not math.isnan(t.tpot_p99):
            f_max = min(f_max, bench.slo.tpot_p99_s / t.tpot_p99)
        if best is None or f_max > best[1]:
            best = (k, f_max)
    assert best is not None  # the oracle itself qualifies
    return best


def first_passage(
    f_max: float, sigma: float, confidence: float, cap: int, mc: int, seed: int
) -> np.ndarray:
    """Per Monte Carlo seed: the first n <= cap at which the level's upper bound clears
    log f_max (cap + 1 where it never does)."""
    z = float(norm.ppf(confidence))
    rng = np.random.default_rng(seed)
    logs = rng.normal(0.0, sigma, size=(mc, cap))
    n = np.arange(1, cap + 1)
    upper = np.cumsum(logs, axis=1) / n + z * sigma / np.sqrt(n)
    ok = upper <= math.log(f_max)
    return np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, cap + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cv", type=float, default=None, help="window noise CV (default: each scenario's)"
    )
    ap.add_argument("--scenarios", nargs="+", default=[*SCENARIOS, *SLOW_SCENARIOS])
    ap.add_argument("--cap", type=int, default=30)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--mc", type=int, default=20000, help="Monte Carlo seeds")
    args = ap.parse_args()
    rows = []
    for name in args.scenarios:
        cv = resolve_scenario(name).window_noise_cv if args.cv is None else args.cv
        sigma = math.sqrt(math.log1p(cv * cv))
        bench = Bench(name, 1, window_noise_cv=cv)
        oracle, og = bench.oracle()
        knob, f_max = widest_margin(bench, oracle, og)
        n = first_passage(f_max, sigma, args.confidence, args.cap, args.mc, seed=0)
        median = float(np.median(n))
        within = float(np.mean(n <= args.cap))
        need = (norm.ppf(args.confidence) * sigma / math.log(f_max)) ** 2
        rows.append(
            {
                "scenario": name,
                "cv": cv,
                "oracle": str(oracle),
                "widest_knob": str(knob),
                "f_max": round(f_max, 4),
                "median_trials_bound": median if median <= args.cap else f">{args.cap}",
                "within_cap": round(within, 3),
                "typical_seed_windows": round(need, 1),
            }
        )
        print(
            f"{name:16s} cv {cv:.2f}  oracle {oracle}  widest {knob} survives f<={f_max:.3f}"
            f"  median >= {median if median <= args.cap else f'>{args.cap}'} trials"
            f"  ({within:.0%} of seeds within {args.cap}; (z sigma / ln f_max)^2 = {need:.1f})",
            flush=True,
        )
    print(json.dumps({"confidence": args.confidence, "cap": args.cap, "rows": rows}))


if __name__ == "__main__":
    main()
