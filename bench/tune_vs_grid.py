"""slotune tune against an exhaustive grid, measured on the same live deployment.

Starts a local Ray + Serve (loopback), deploys the built-in model, runs the
canary loop exactly as ``slotune tune`` does (roofline seed, Optuna, stop rule),
then measures a grid of batch sizes (concurrency = batch, and 2x batch) with the
same window plan. Then the tune's pick and the grid's best are measured in
alternation, so both sides of the ratio come from the same conditions.

Prints a table of every trial and grid point, then one JSON line last:
``tune_trials``, ``tune_wall_s``, ``trial_wall_s`` (each trial), ``grid_points``,
``grid_wall_s``, ``grid_best_goodput_rps`` and ``ratio``: the tune's pick and the grid's
best re-measured alternately (``--repeats`` rounds), mean goodput of the pick ÷ mean
goodput of the best (target ≥ 0.9); ``ratio_tune_time`` compares the pick as measured
while tuning with the grid's measurement of its best.

    .venv/bin/python bench/tune_vs_grid.py            # small model, as `slotune tune`
    .venv/bin/python bench/tune_vs_grid.py --model tiny --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller import tune_plan, tune_setup  # noqa: E402
from controller.progress import Progress  # noqa: E402
from controller.report.curve import CurveReport  # noqa: E402
from controller.report.records import TrialRecord  # noqa: E402
from controller.targets import RayServeTarget, RequestShape, WindowPlan  # noqa: E402
from controller.tune import TuneLimits, run_tune  # noqa: E402
from metrics.observation import Slo  # noqa: E402
from search.objective import evaluate  # noqa: E402
from search.points import summarize  # noqa: E402
from search.space import Knobs  # noqa: E402
from search.tuner import Tuner  # noqa: E402
from serving.sim.workload import LengthDist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=sorted(tune_plan.MODELS))
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--max-trials", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=240.0)
    ap.add_argument("--prompt-tokens", type=int, default=16, help="as slotune tune's default")
    ap.add_argument("--output-tokens", type=int, default=8, help="as slotune tune's default")
    ap.add_argument("--quick", action="store_true", help="short windows, a coarse grid")
    ap.add_argument("--repeats", type=int, default=3, help="head-to-head rounds")
    ap.add_argument("--out", default="slotune-out/bench-tune-vs-grid")
    args = ap.parse_args()

    slo = Slo(ttft_p99_s=args.slo_ttft_ms / 1e3, tpot_p99_s=args.slo_tpot_ms / 1e3)
    plan = (
        WindowPlan(warmup_s=1.0, window_s=2.0, max_window_s=15.0)
        if args.quick
        else WindowPlan(warmup_s=2.0, window_s=5.0, max_window_s=30.0)  # slotune tune's defaults
    )
    shape = RequestShape(
        prompt_tokens=LengthDist(mean=args.prompt_tokens),
        output_tokens=LengthDist(mean=args.output_tokens),
    )
    slots = tune_plan.DEFAULT_MAX_SLOTS[args.model]
    t_setup = time.monotonic()
    metrics_port, _ = tune_setup.start_local_ray()
    try:
        device = "cpu"
        import torch

        if torch.cuda.is_available():
            device = "cuda"
        threads = tune_setup.embedded_threads()  # the replica's torch threads: calibrate at them
        hw, hw_note = tune_plan.hardware_spec(device, quiet=False, threads=threads)
        searched = tune_plan.plan_search(
            model=args.model,
            hardware=hw,
            slo=slo,
            price=None,
            max_slots=slots,
            context=args.prompt_tokens + args.output_tokens // 2,
        )
        from serving.app.config import LiveConfig, ServerArgs
        from serving.app.deploy import deploy_app

        first = searched.seeds[0]
        deploy_app(
            ServerArgs(model=args.model, max_slots=slots, device=device, torch_threads=threads),
            LiveConfig(
                max_batch_size=first.max_batch_size,
                ttft_p99_s=slo.ttft_p99_s,
                tpot_p99_s=slo.tpot_p99_s,
                max_ongoing_requests=first.max_concurrency,
            ),
            name="slotune",
            max_queued_requests=-1,
        )
        reader, _ = tune_setup.make_reader(
            slo=slo,
            app="slotune",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            prometheus_url=None,
            prefix="ray_",
        )
        target = RayServeTarget(
            url=tune_setup.serve_url("slotune"), app_name="slotune", slo=slo, reader=reader,
            plan=plan, shape=shape,
        )  # fmt: skip
        setup_s = time.monotonic() - t_setup
        out = Path(args.out)
        tuner = Tuner(
            space=searched.space,
            slo=slo,
            storage=None,
            seed_knobs=searched.seeds,
            model_tpot_s=searched.roofline.step_time_s,
            seed=0,
        )
        a = searched.analysis
        base = CurveReport(slo=slo, trials=(), predicted=searched.predicted,
                           model=args.model, hardware=hw.name, knee_batch=a.knee_batch,
                           ridge_flops_per_byte=a.ridge_flops_per_byte,
                           predicted_batch=searched.seed_batch)  # fmt: skip
        t0 = time.monotonic()
        outcome = run_tune(
            target=target,
            tuner=tuner,
            base=base,
            limits=TuneLimits(max_trials=args.max_trials, time_budget_s=args.time_budget),
            out_dir=out / "tune",
            progress=Progress(),
        )
        tune_wall = time.monotonic() - t0
        chosen = outcome.report.chosen

        # The grid, on the same deployment and window plan.
        top = searched.space.batch_max
        batches = sorted({b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if b <= top} | {top})
        if args.quick:
            batches = [b for b in batches if b in (1, 4, 16, 32, 64, 128) or b == top]
        grid = [Knobs(max_batch_size=b, max_concurrency=b) for b in batches]
        grid += [Knobs(max_batch_size=b, max_concurrency=2 * b) for b in batches if b >= 4]
        rows: list[tuple[Knobs, TrialRecord]] = []

        def measure(k: Knobs, number: int) -> TrialRecord:
            target.apply(k)
            tg = time.monotonic()
            m = target.measure(k)
            ev = evaluate(m.observation, slo)
            return TrialRecord.from_observation(
                number=number, knobs=k, obs=m.observation, feasible=ev.feasible,
                wall_s=time.monotonic() - tg, client=m.client,
            )  # fmt: skip

        t1 = time.monotonic()
        for i, k in enumerate(grid):
            rows.append((k, measure(k, i)))
        grid_wall = time.monotonic() - t1
        # Head to head: the tune's pick and the grid's best, alternating, same conditions.
        feas = [(k, t) for k, t in rows if t.feasible]
        best_k = max(feas, key=lambda kt: kt[1].goodput_rps)[0] if feas else None
        pick = (
            Knobs(max_batch_size=chosen.max_batch_size, max_concurrency=chosen.max_concurrency)
            if chosen is not None
            else None
        )
        duel: dict[str, list[TrialRecord]] = {"pick": [], "best": []}
        if pick is not None and best_k is not None:
            for r in range(args.repeats):
                duel["pick"].append(measure(pick, 100 + 2 * r))
                duel["best"].append(measure(best_k, 101 + 2 * r))
    finally:
        tune_setup.shutdown_local()

    print(f"setup (Ray, deploy, calibration: {hw_note}): {setup_s:.0f} s")
    print("\nslotune tune trials")
    print(f"{'#':>3} {'B':>4} {'C':>4} {'goodput':>8} {'tok/s':>7} {'p99 TTFT':>9} "
          f"{'p99 TPOT':>9} {'ok':>3} {'n':>5} {'wall s':>6}")  # fmt: skip
    for t in outcome.report.trials:
        print(f"{t.number:>3} {t.max_batch_size:>4} {t.max_concurrency:>4} {t.goodput_rps:>8.2f} "
              f"{t.tokens_per_s:>7.0f} {t.p99_ttft_ms:>9.1f} {t.p99_tpot_ms:>9.1f} "
              f"{'yes' if t.feasible else 'no':>3} {t.completed:>5} {t.wall_s:>6.1f}")  # fmt: skip
    print(f"tune: {len(outcome.report.trials)} trials in {tune_wall:.0f} s; "
          f"stop: {outcome.stop_reason}")  # fmt: skip
    print("\ngrid (same deployment, same windows)")
    for k, t in rows:
        print(f"    {k.max_batch_size:>4} {k.max_concurrency:>4} {t.goodput_rps:>8.2f} "
              f"{t.tokens_per_s:>7.0f} {t.p99_ttft_ms:>9.1f} {t.p99_tpot_ms:>9.1f} "
              f"{'yes' if t.feasible else 'no':>3} {t.completed:>5} {t.wall_s:>6.1f}")  # fmt: skip
    best = next((t for k, t in rows if k == best_k), None)
    print(f"\ngrid: {len(rows)} points in {grid_wall:.0f} s; best feasible: "
          + (f"B={best.max_batch_size},C={best.max_concurrency} {best.goodput_rps:.2f} req/s"
             if best else "none"))  # fmt: skip

    def mean(ts: list[TrialRecord]) -> float:
        return sum(t.goodput_rps for t in ts) / len(ts) if ts else math.nan

    pick_g, best_g = mean(duel["pick"]), mean(duel["best"])
    ratio = pick_g / best_g if best_g and best_g > 0 else math.nan
    pick_ok = sum(t.feasible for t in duel["pick"])
    best_ok = sum(t.feasible for t in duel["best"])

    def pooled(ts: list[TrialRecord]) -> str | None:
        """Both SLOs judged on the union of the windows' requests (the tuner's rule)."""
        if not ts:
            return None
        k = Knobs(max_batch_size=ts[0].max_batch_size, max_concurrency=ts[0].max_concurrency)
        p = summarize(k, [t.window_attrs() for t in ts], values=[t.goodput_rps for t in ts],
                      numbers=[t.number for t in ts], slo=slo)  # fmt: skip
        return None if p.pooled is None else p.pooled.value

    pick_pool, best_pool = pooled(duel["pick"]), pooled(duel["best"])
    same = [] if chosen is None else outcome.report.measurements_of(chosen)
    tune_g = mean(same)
    ratio_tune_time = tune_g / best.goodput_rps if best and best.goodput_rps > 0 else math.nan
    print("\nhead to head, alternating (goodput req/s, verdict)")
    for name in ("pick", "best"):
        cells = "  ".join(
            f"{t.goodput_rps:.2f} {'ok' if t.feasible else 'miss'}" for t in duel[name]
        )
        print(f"  {name}: {cells}; pooled: {pooled(duel[name])}")
    print(
        f"pick / grid best goodput: {ratio:.3f} (re-measured, alternating); "
        f"{ratio_tune_time:.3f} (pick as measured while tuning vs the grid's measurement)"
    )
    print(json.dumps({
        "model": args.model,
        "quick": args.quick,
        "output_tokens": args.output_tokens,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "setup_s": round(setup_s, 1),
        "tune_trials": len(outcome.report.trials),
        "tune_wall_s": round(tune_wall, 1),
        "trial_wall_s": [round(t.wall_s, 1) for t in outcome.report.trials],
        "tune_pick": None if pick is None else [pick.max_batch_size, pick.max_concurrency],
        "grid_points": len(rows),
        "grid_wall_s": round(grid_wall, 1),
        "grid_best": None if best is None else [best.max_batch_size, best.max_concurrency],
        "grid_best_goodput_rps": None if best is None else round(best.goodput_rps, 3),
        "pick_goodput_rps_remeasured": None if math.isnan(pick_g) else round(pick_g, 3),
        "best_goodput_rps_remeasured": None if math.isnan(best_g) else round(best_g, 3),
        "pick_feasible_windows": f"{pick_ok}/{len(duel['pick'])}",
        "best_feasible_windows": f"{best_ok}/{len(duel['best'])}",
        "pick_pooled_verdict": pick_pool,
        "best_pooled_verdict": best_pool,
        "ratio": None if math.isnan(ratio) else round(ratio, 3),
        "ratio_tune_time": None if math.isnan(ratio_tune_time) else round(ratio_tune_time, 3),
        "load_average_1m": round(os.getloadavg()[0], 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
