"""Where slotune's trials go in one scenario: per-seed trajectories and the declarable band.

For each seed, every trial of the slotune strategy of bench/search_efficiency.py (same
scenario, same common-random-number windows, same truth and oracle): its phase (seed,
guided, remeasure, sampler), the knob, the window's p99 TPOT and request count, both SLO
verdicts, whether the knob is truly feasible and its true goodput over the oracle's, and
the incumbent after it. Then, for the batches around the oracle (headroom 1): how many
seeds would declare the knob if it were measured twice in a row (the bench's first two
windows of that knob), i.e. how often even a tuner that knew where to go on its second
trial would be done in three (seed, the point, its confirmation).

Usage: ``python bench/search_trace.py --scenario cpu-small [--seeds 10] [--band 6]``.
Prints the trajectories and the band table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import optuna
import torch

from controller.sim.scenarios import HELD_OUT_SCENARIOS, SCENARIOS, SLOW_SCENARIOS
from search.space import Knobs
from search.stop_rule import LARGER_BATCH_WITHIN
from search.tuner import Tuner


def _load_bench():
    path = Path(__file__).with_name("search_efficiency.py")
    spec = importlib.util.spec_from_file_location("search_efficiency", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod


def _verdicts(o) -> str:
    def one(v) -> str:
        return v.verdict.value[:3] if v is not None else "-"

    return f"{one(o.ttft_verdict)}/{one(o.tpot_verdict)}"


def trajectories(
    se, bench, seeds: int, cap: int, og: float, larger_batch_within: float = LARGER_BATCH_WITHIN
) -> list[int]:
    counts = []
    for seed in range(seeds):
        trace: list[dict] = []
        n, _ = se.run_strategy(
            bench, "slotune", seed, cap, og, trace=trace, larger_batch_within=larger_batch_within
        )
        counts.append(n)
        print(f"seed {seed}: {n if n <= cap else f'>{cap}'} trials")
        for row in trace:
            rec, o, inc = row["record"], row["observation"], row["incumbent"]
            tr = bench.truth(rec.knobs)
            n_req = o.tpot_verdict.samples if o.tpot_verdict is not None else 0
            print(
                f"  {row['trial']:2d} {rec.phase:9s} {str(rec.knobs):14s}"
                f" p99 TPOT {o.tpot.p99 * 1e3:6.1f} ms  n={n_req:4d} {_verdicts(o)}"
                f"  truly {'feasible' if tr.feasible else 'over SLO'} {tr.goodput / og:4.2f}"
                f"  incumbent {inc[0] if inc else '-'}"
            )
    return counts


def band(bench, oracle: Knobs, og: float, seeds: int, width: int) -> list[dict]:
    """Per batch near the oracle: declared after its first two windows in how many seeds."""
    t = bench.target
    b0 = oracle.max_batch_size
    rows = []
    for b in range(max(t.space.batch_min, b0 - width), min(t.space.batch_max, b0 + 2) + 1):
        k = Knobs(max_batch_size=b, max_concurrency=b)
        tr = bench.truth(k)
        declared = 0
        for seed in range(seeds):
            tuner = Tuner(space=t.space, slo=bench.slo, storage=None, study_name=f"band{seed}")
            for nth in range(2):
                tuner.report(k, bench.measure(k, seed=seed, nth=nth))
            declared += tuner.best() is not None
        good = tr.feasible and tr.goodput >= (1 - 0.05) * og
        rows.append(
            {
                "batch": b,
                "truly_feasible": tr.feasible,
                "goodput_vs_oracle": round(tr.goodput / og, 3),
                "within_5pct": good,
                "tpot_p99_ms": round(tr.tpot_p99 * 1e3, 1),
                "declared_after_two": declared,
            }
        )
        print(
            f"  B={b:4d}: truly {'feasible' if tr.feasible else 'over SLO'},"
            f" goodput {tr.goodput / og:5.3f} of the oracle{' (within 5%)' if good else ''},"
            f" p99 TPOT {tr.tpot_p99 * 1e3:6.1f} ms; declared after two windows in"
            f" {declared}/{seeds} seeds"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scenario",
        default="cpu-small",
        choices=sorted({**SCENARIOS, **SLOW_SCENARIOS, **HELD_OUT_SCENARIOS}),
    )
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--cap", type=int, default=30)
    ap.add_argument("--replicates", type=int, default=4)
    ap.add_argument("--band", type=int, default=6, help="batches below the oracle to check")
    ap.add_argument(
        "--window-noise-cv",
        type=float,
        default=None,
        help="every window's slowdown drawn with this CV instead of the scenario's",
    )
    ap.add_argument(
        "--larger-batch-within",
        type=float,
        default=LARGER_BATCH_WITHIN,
        help="slotune's StopRule.larger_batch_within (as bench/search_efficiency.py)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    se = _load_bench()
    bench = se.Bench(args.scenario, args.replicates, window_noise_cv=args.window_noise_cv)
    oracle, og = bench.oracle()
    t = bench.target
    print(
        f"# {args.scenario}: seed {t.seed_knobs()[0]}, oracle {oracle} goodput {og:.2f} rps,"
        f" SLO p99 TTFT {t.slo.ttft_p99_s} s / TPOT {t.slo.tpot_p99_s * 1e3:.0f} ms"
    )
    counts = trajectories(se, bench, args.seeds, args.cap, og, args.larger_batch_within)
    print("declarable band (headroom 1):")
    rows = band(bench, oracle, og, args.seeds, args.band)
    arr = np.asarray(counts, dtype=float)
    print(
        json.dumps(
            {
                "bench": "search_trace",
                "scenario": args.scenario,
                "seeds": args.seeds,
                "oracle_knobs": oracle.as_dict(),
                "slotune_trials": counts,
                "slotune_median": float(np.median(arr)),
                "band": rows,
            },
            separators=(",", ":"),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
