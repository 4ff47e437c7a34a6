"""How many trials each search strategy needs to find the operating point.

For every scenario (controller/sim/scenarios.py) and seed, each strategy proposes
knobs, one simulated window is measured per trial (noisy, with the SLO
verdicts a real deployment gives), and we count the trials until the strategy's
*incumbent* (what it would deploy: its best feasible point by the noisy
measurements) is truly feasible and within 5% of the oracle's goodput.

Truth and oracle: a knob's true goodput and feasibility come from a window
``TRUTH_WINDOW_SCALE`` (8) times as long without measurement noise (no per-window
slowdown; per-step jitter stays, it is part of the latency distribution), with a
fixed seed: truly feasible means its p99 TTFT and p99 TPOT (exact, over the
thousands of requests of that run) are within the SLO. The truth is long so
that it is the knob's behaviour, not one realization of it: the p99 of one
window's arrivals and lengths varies by a few percent from run to run, and a
truth two windows long flipped knobs within that much of the SLO. It is the p99
itself, not a MET verdict on it: a verdict asks a finite sample for a margin
(at 95% confidence, roughly 0.8% of 7,000 requests over the SLO instead of 1%)
whose size is set by the truth run's length, not by the knob. The oracle is the best
truly feasible knob of a dense grid on the same simulator: batch on a 1.12x log
lattice at headroom 1, then every integer batch from -6% to +12% of its best,
then headroom 1.1..4 at it.

Strategies: slotune (roofline seed + corrected brackets, re-measured incumbent,
then GPSampler with constraints); the same tuner without the seed; Optuna's
default TPE; random; a vLLM auto_tune-style grid: the cross product of fixed
lists of powers of two, batch 1, 2, 4, ... up to the space's largest batch and
concurrency 1, 2, 4, ... up to its largest admission limit, pruning only
concurrency < batch (an admission limit below the batch can never fill it), swept
batch then concurrency ascending ("grid"); and, reported beside it, the narrower
band of concurrency 1x/2x/4x the batch ("grid-band"). Baselines keep
their best single measurement as the incumbent (no re-measurement); slotune
declares only a point whose anytime-valid pooled verdicts are MET (search.stop_rule).
The row ``slotune-1w`` scores the same
slotune runs by the baselines' incumbent (the best knob measured feasible in one
window), so its ratios compare like with like; the ``slotune`` row is what it deploys.
Measurements use common random numbers: the n-th measurement of a knob in a seed
draws one of ``--replicates`` pre-simulated windows, shared by all strategies (it also
keeps the benchmark cheap). A strategy that has not succeeded by its trial cap is counted as cap+1
(shown as ">cap"; the table also gives how many seeds got there).

Usage: ``python bench/search_efficiency.py [--quick] [--seeds 20] [--jobs 2]``;
``--scenarios a100-8b h100x8-70b`` runs the held-out scenarios (not in the default set).
Prints a table, then one JSON line. The scenarios state their devices, so a seed
gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import optuna
import torch

from bench.search_bench import (
    GRIDS,
    SINGLE_SUFFIX,
    STRATEGIES,
    TOLERANCE,
    Bench,
    grid_knobs,
)
from controller.sim.scenarios import HELD_OUT_SCENARIOS, SCENARIOS, SLOW_SCENARIOS
from search.space import Knobs
from search.stop_rule import LARGER_BATCH_WITHIN, StopRule
from search.tuner import Tuner

WHOLE = "slotune-whole"  # slotune on windows that always run their whole length (ablation)


def run_strategy(
    bench: Bench,
    strategy: str,
    seed: int,
    cap: int,
    oracle_goodput: float,
    trace: list[dict] | None = None,
    larger_batch_within: float = LARGER_BATCH_WITHIN,
    single: dict | None = None,
    spent: dict | None = None,
) -> tuple[int, bool]:
    """Trials until the incumbent is truly feasible and within 5% of the oracle (a tuner's
    trials are appended to ``trace`` when given: bench/search_trace.py). For slotune,
    ``single`` (when given) gets ``trials``: the same count for the incumbent the baselines
    are scored by, the best knob measured feasible in one window (``Tuner.best(confirmed=
    False)``), from the same run. ``spent`` (when given) gets ``seconds``: the measured
    window time until then (simulated seconds; all of the cap's when it never got there)."""
    t = bench.target
    counts: dict[Knobs, int] = {}

    def good(k: Knobs | None) -> bool:
        if k is None:
            return False
        tr = bench.truth(k)
        return tr.feasible and tr.goodput >= (1 - TOLERANCE) * oracle_goodput

    if strategy in GRIDS:
        # Like auto_tune, the grid is swept to its end before it picks; the count is the
        # first trial at which its best-so-far would already have been good enough.
        best: tuple[float, Knobs] | None = None
        for i, k in enumerate(grid_knobs(bench, strategy)[:cap], start=1):
            o = bench.measure(k, seed=seed, nth=0)
            if o.feasible and (best is None or o.goodput_rps > best[0]):
                best = (o.goodput_rps, k)
            if good(best[1] if best else None):
                return i, True
        return cap + 1, False
    ours = strategy in ("slotune", "gp-unseeded")
    rule = StopRule(
        max_trials=10_000,
        confirmations=StopRule().confirmations if ours else 1,
        larger_batch_within=larger_batch_within if ours else 0.0,
    )
    tuner = Tuner(
        space=t.space,
        slo=bench.slo,
        storage=None,
        study_name=f"{bench.name}-{strategy}-{seed}",
        seed_knobs=t.seed_knobs() if strategy == "slotune" else [],
        model_tpot_s=t.model_tpot_s if strategy == "slotune" else None,
        sampler={"slotune": "gp", "gp-unseeded": "gp"}.get(strategy, strategy),
        seed=seed,
        stop_rule=rule,
    )
    track_single = single is not None and strategy == "slotune"
    found: int | None = None
    single_at: int | None = None
    seconds = 0.0
    for i in range(1, cap + 1):
        k = tuner.propose()
        n = counts.get(k, 0)
        counts[k] = n + 1
        rec = tuner.report(k, o := bench.measure(k, seed=seed, nth=n))
        if found is None:
            seconds += o.window_s
        inc = tuner.best()
        if trace is not None:
            trace.append({"trial": i, "record": rec, "observation": o, "incumbent": inc})
        if found is None and good(inc[0] if inc else None):
            found = i
        if track_single and single_at is None:
            one = tuner.best(confirmed=False)
            if good(one[0] if one else None):
                single_at = i
        if found is not None and (not track_single or single_at is not None):
            break
    if track_single and single is not None:
        single["trials"] = single_at if single_at is not None else cap + 1
    if spent is not None:
        spent["seconds"] = seconds
    return (found, True) if found is not None else (cap + 1, False)


def run_scenario(
    name: str,
    seeds: int,
    cap: int,
    replicates: int,
    larger_batch_within: float = LARGER_BATCH_WITHIN,
    window_noise_cv: float | None = None,
) -> dict:
    """Every strategy on one scenario (a process of its own with --jobs), and slotune
    again with whole windows (``slotune-whole``: the sequential-verdict ablation)."""
    torch.set_num_threads(1)  # GPSampler's small fits: threads only spin on shared cores
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    bench = Bench(name, replicates, window_noise_cv=window_noise_cv)
    whole = Bench(name, replicates, sequential=False, window_noise_cv=window_noise_cv)
    s0 = time.perf_counter()
    ok, og = bench.oracle()
    desc = bench.target.describe()
    print(
        f"# {name}: {desc['description']}; hardware {desc['hardware']} from"
        f" {desc['hardware_source']}; seed B={desc['seed_batch']}, oracle {ok}"
        f" goodput {og:.2f} rps (oracle {time.perf_counter() - s0:.0f}s)",
        flush=True,
    )
    res: dict[str, dict] = {}

    def summary(strat: str, trials: list[int], scap: int, secs: list[float] = ()) -> None:
        arr = np.asarray(trials, dtype=float)
        reached = int(sum(n <= scap for n in trials))
        res[strat] = {
            "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)),
            "reached": reached,
            "runs": seeds,
            "cap": scap,
            "censored": reached < seeds,
        }
        if secs:  # simulated seconds of measuring until there (all of the cap's if never)
            res[strat]["median_measured_s"] = round(float(np.median(secs)), 1)
        print(
            f"  {name} {strat:13s} median {res[strat]['median']:5.1f}"
            f"  p90 {res[strat]['p90']:5.1f}  reached {reached}/{seeds} (cap {scap})"
            + (f"  measured {res[strat]['median_measured_s']:.0f} s" if secs else ""),
            flush=True,
        )

    for strat in (*STRATEGIES, WHOLE):
        on = whole if strat == WHOLE else bench
        scap = len(grid_knobs(on, strat)) if strat in GRIDS else cap
        trials, singles, secs = [], [], []
        for seed in range(seeds):
            one: dict = {}
            spent: dict = {}
            n, _ = run_strategy(
                on,
                "slotune" if strat == WHOLE else strat,
                seed,
                scap,
                og,
                larger_batch_within=larger_batch_within,
                single=None if strat == WHOLE else one,
                spent=spent,
            )
            trials.append(n)
            secs.append(spent.get("seconds", float("nan")))
            if "trials" in one:
                singles.append(one["trials"])
        summary(strat, trials, scap, secs if strat in ("slotune", WHOLE) else [])
        if singles:
            summary(f"{strat}{SINGLE_SUFFIX}", singles, scap)
    sl = res["slotune"]["median"]
    sl1 = res[f"slotune{SINGLE_SUFFIX}"]["median"]
    return {
        **{k: v for k, v in desc.items() if k != "description"},
        "oracle_knobs": ok.as_dict(),
        "oracle_goodput_rps": round(og, 3),
        "strategies": res,
        "ratio_vs_tpe": round(res["tpe"]["median"] / sl, 2),
        "ratio_vs_grid": round(res["grid"]["median"] / sl, 2),
        "ratio_vs_band_grid": round(res["grid-band"]["median"] / sl, 2),
        # A baseline whose median hit its cap: the ratio is only a lower bound.
        "ratio_vs_tpe_is_lower_bound": res["tpe"]["median"] > res["tpe"]["cap"],
        "ratio_vs_grid_is_lower_bound": res["grid"]["median"] > res["grid"]["cap"],
        "ratio_vs_band_grid_is_lower_bound": res["grid-band"]["median"] > res["grid-band"]["cap"],
        "ratio_vs_gp_unseeded": round(res["gp-unseeded"]["median"] / sl, 2),
        # slotune scored as the baselines are (best knob feasible in one window), same runs
        "ratio_vs_grid_as_scored_alike": round(res["grid"]["median"] / sl1, 2),
        "ratio_vs_tpe_as_scored_alike": round(res["tpe"]["median"] / sl1, 2),
        "sim_windows": bench.sim_windows,
        "truth_windows": bench.truth_windows,
        "measurements": bench.lookups,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="h100-8b x 3 seeds, cap 12, 2 replicates (CI)"
    )
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument(
        "--scenarios",
        nargs="*",
        default=None,
        choices=sorted({**SCENARIOS, **SLOW_SCENARIOS, **HELD_OUT_SCENARIOS}),
        help="default: every benchmark scenario; the held-out ones"
        f" ({', '.join(HELD_OUT_SCENARIOS)}) run only when named",
    )
    ap.add_argument(
        "--slow",
        action="store_true",
        help=f"the slow scenarios, a few requests a second ({', '.join(SLOW_SCENARIOS)})",
    )
    ap.add_argument(
        "--window-noise-cv",
        type=float,
        default=None,
        help="every window's slowdown drawn with this CV instead of the scenario's (e.g. 0.15)",
    )
    ap.add_argument("--replicates", type=int, default=4)
    ap.add_argument("--cap", type=int, default=30, help="trial cap for the samplers")
    ap.add_argument("--jobs", type=int, default=1, help="scenarios run in parallel processes")
    ap.add_argument(
        "--larger-batch-within",
        type=float,
        default=LARGER_BATCH_WITHIN,
        help="slotune's StopRule.larger_batch_within (0: deploy the best pooled goodput)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # GPSampler's small fits: threads only spin on 2 shared cores
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    names = args.scenarios or (
        ["h100-8b"] if args.quick else list(SLOW_SCENARIOS) if args.slow else list(SCENARIOS)
    )
    seeds = 3 if args.quick else args.seeds
    cap = 12 if args.quick else args.cap
    replicates = 2 if args.quick else args.replicates
    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, len(names)))
    work = [
        (n, seeds, cap, replicates, args.larger_batch_within, args.window_noise_cv) for n in names
    ]
    if jobs == 1:
        results = [run_scenario(*w) for w in work]
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(jobs) as pool:
            results = pool.starmap(run_scenario, work)
    out: dict[str, dict] = dict(zip(names, results, strict=True))
    wall = time.perf_counter() - t0
    print()
    cols = [*STRATEGIES, f"slotune{SINGLE_SUFFIX}", WHOLE]
    hdr = f"{'scenario':12s} {'oracle':>16s} " + " ".join(f"{s:>15s}" for s in cols)
    print(hdr)
    print("-" * len(hdr))
    for name, r in out.items():
        cells = []
        for s in cols:
            st = r["strategies"][s]
            gt = ">" if st["median"] > st["cap"] else ""
            cell = f"{gt}{st['median']:.1f}/{st['p90']:.0f} {st['reached']}/{st['runs']}"
            cells.append(cell.rjust(15))
        okn = r["oracle_knobs"]
        ok_s = f"B={okn['max_batch_size']},C={okn['max_concurrency']}"
        print(f"{name:12s} {ok_s:>16s} " + " ".join(cells))
    print(
        "(cells: median/p90 trials until the incumbent is truly feasible and within 5% of the"
        " oracle, then seeds that got there by the cap; a seed that did not counts cap+1;"
        " '>' = beyond the cap for at least half the seeds; grid: powers of two, batch x"
        " concurrency >= batch, ascending; grid-band: concurrency 1/2/4 x batch;"
        f" slotune{SINGLE_SUFFIX}: slotune's runs scored as the baselines are, by the best"
        " knob feasible in one window instead of the one it declares; slotune-whole: slotune"
        " on windows that always run their whole length, the sequential-verdict ablation)"
    )
    for name, r in out.items():
        seq = r["strategies"]["slotune"]["median_measured_s"]
        full = r["strategies"][WHOLE]["median_measured_s"]
        r["measured_s_sequential_over_whole"] = round(seq / full, 3) if full else None
        print(
            f"{name:12s} median measuring until found: sequential {seq:.0f} s, whole windows"
            f" {full:.0f} s (ratio {r['measured_s_sequential_over_whole']})"
        )
    summary = {
        "bench": "search_efficiency",
        "quick": args.quick,
        "seeds": seeds,
        "cap": cap,
        "replicates": replicates,
        "jobs": jobs,
        "larger_batch_within": args.larger_batch_within,
        "window_noise_cv": args.window_noise_cv,
        "worst_median_trials": max(r["strategies"]["slotune"]["median"] for r in out.values()),
        "min_ratio_vs_tpe": min(r["ratio_vs_tpe"] for r in out.values()),
        "min_ratio_vs_grid": min(r["ratio_vs_grid"] for r in out.values()),
        "min_ratio_vs_band_grid": min(r["ratio_vs_band_grid"] for r in out.values()),
        "min_ratio_vs_grid_as_scored_alike": min(
            r["ratio_vs_grid_as_scored_alike"] for r in out.values()
        ),
        "min_ratio_vs_tpe_as_scored_alike": min(
            r["ratio_vs_tpe_as_scored_alike"] for r in out.values()
        ),
        "wall_s": round(wall, 1),
        "scenarios": out,
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
