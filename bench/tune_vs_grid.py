"""slotune tune against an exhaustive grid on the ``@serve.batch`` example (issue 18).

Starts a local Ray with its dashboard (loopback, token auth), deploys
deploy/examples/serve_batch/ through Serve's REST API (``PUT /api/serve/applications/``,
what ``serve deploy`` sends) and tunes it from the outside, as ``slotune tune --app
serve-batch-example --actuator serve --batch-knob user_config.max_batch_size
--metrics-profile client`` does: knobs written live into the app's config (the batch limit
reaches ``reconfigure`` → ``set_max_batch_size``; ``max_ongoing_requests`` is the admission
limit), latencies read from the load generator's own records (the app exports none).

1. The grid: every batch limit in ``--grid-batches`` at concurrency = batch and
   ``--grid-headroom`` × batch, one window each (the same WindowPlan as the tune's
   trials); its best feasible goodput and its wall time.
2. The tune: the canary loop (``controller.tune.run_tune``, unseeded: the example gives no
   model config), given ``--tune-share`` of the grid's wall time as its budget.
3. Head to head: the tune's pick and the grid's best re-measured alternately
   (``--repeats`` rounds), so both sides of the goodput ratio come from the same conditions.

Prints the grid, the trials and the duel, then one JSON line last: ``ratio_goodput`` (the
pick's mean re-measured goodput ÷ the grid best's; target ≥ 0.9), ``ratio_wall`` (tune
wall ÷ grid wall; target ≤ 1/3), ``ratio_goodput_tune_time`` (the pick as the tune pooled
it ÷ the grid's own window of its best), the CPU, the load average and the date.

    .venv/bin/python bench/tune_vs_grid.py                  # ~8-10 min on 2 cores
    .venv/bin/python bench/tune_vs_grid.py --grid-only      # the curve, to choose SLOs
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.backends.serve import ServeActuator  # noqa: E402
from controller.backends.serve_rest import ServeRest, declarative_apps  # noqa: E402
from controller.progress import Progress  # noqa: E402
from controller.report.curve import CurveReport  # noqa: E402
from controller.report.records import TrialRecord  # noqa: E402
from controller.targets import RayServeTarget, RequestShape, WindowPlan  # noqa: E402
from controller.tune import TuneLimits, run_tune  # noqa: E402
from controller.tune_plan import unseeded_plan  # noqa: E402
from controller.windows import ClientWindow  # noqa: E402
from metrics.observation import Slo  # noqa: E402
from search.calibrate.device import cpu_model_name  # noqa: E402
from search.objective import evaluate  # noqa: E402
from search.points import summarize  # noqa: E402
from search.space import Knobs  # noqa: E402
from search.tuner import Tuner  # noqa: E402
from serving.app.cluster import free_loopback_port, read_token, start_local_ray  # noqa: E402
from serving.sim.workload import LengthDist  # noqa: E402

CONFIG = ROOT / "deploy/examples/serve_batch/serve_config.yaml"
BATCH_KNOB = "user_config.max_batch_size"
CPU_FLAGS = ("avx2", "avx512_bf16", "amx_bf16", "amx_tile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Chosen from a grid measured on a loaded 2-core AMD EPYC (docs/BENCHMARKS.md, issue 18):
    # B = 6-8 at concurrency B meet both, B = 12 misses TTFT and B = 16 both.
    ap.add_argument("--slo-ttft-ms", type=float, default=400.0, help="p99 TTFT SLO (ms)")
    ap.add_argument("--slo-tpot-ms", type=float, default=20.0, help="p99 TPOT SLO (ms)")
    ap.add_argument("--grid-batches", default="1,2,4,6,8,12,16", help="batch limits of the grid")
    ap.add_argument(
        "--grid-headroom", default="1,1.5", help="concurrency / batch multipliers of the grid"
    )
    ap.add_argument("--max-batch", type=int, default=16, help="the tune's batch bound")
    ap.add_argument("--tune-share", type=float, default=1 / 3, help="tune budget / grid wall")
    ap.add_argument("--tune-budget-s", type=float, default=None, help="overrides --tune-share")
    ap.add_argument("--max-trials", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2, help="head-to-head rounds")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=768, help="the example's args.d_model")
    # The window plan: slotune tune's defaults (--warmup, --window, --max-window, --min-requests).
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=5.0)
    ap.add_argument("--max-window-s", type=float, default=30.0)
    ap.add_argument("--min-requests", type=int, default=300)
    ap.add_argument("--grid-only", action="store_true", help="measure the grid and stop")
    ap.add_argument("--out", default=None, help="the tune's report (default: a temp folder)")
    args = ap.parse_args(argv)
    if not (0 < args.tune_share <= 1):
        ap.error(f"--tune-share {args.tune_share}: must be in (0, 1]")
    try:
        grid_points(args)
    except ValueError as e:
        ap.error(str(e))
    return args


def grid_points(args: argparse.Namespace) -> list[Knobs]:
    """Every (batch, round(headroom · batch)) of the grid flags, in order, no repeats."""
    batches = [int(b) for b in args.grid_batches.split(",")]
    heads = [float(h) for h in args.grid_headroom.split(",")]
    if not batches or min(batches) < 1 or max(batches) > args.max_batch:
        raise ValueError(f"--grid-batches {args.grid_batches}: each in 1..{args.max_batch}")
    if not heads or min(heads) < 1 or max(heads) > 2:
        raise ValueError(f"--grid-headroom {args.grid_headroom}: each in [1, 2]")
    out: list[Knobs] = []
    for h in heads:
        for b in batches:
            k = Knobs(max_batch_size=b, max_concurrency=max(b, round(h * b)))
            if k not in out:
                out.append(k)
    return out


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and the matmul-relevant flags it has (/proc/cpuinfo)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"model": cpu_model_name(), "flags": [f for f in CPU_FLAGS if f in flags]}


def example_app(*, d_model: int, batch: int, concurrency: int) -> dict[str, Any]:
    """The example's serve_config.yaml app, with the grid's first knobs."""
    app = copy.deepcopy(yaml.safe_load(CONFIG.read_text())["applications"][0])
    app["args"]["d_model"] = d_model
    dep = app["deployments"][0]
    dep["user_config"]["max_batch_size"] = batch
    dep["max_ongoing_requests"] = concurrency
    return app


def deploy(rest: ServeRest, app: dict[str, Any]) -> None:
    """PUT the app into the declarative set (others kept) and wait until it serves."""
    details = rest.details()
    apps = [a for a in declarative_apps(details) if a.get("name") != app["name"]]
    rest.put(details, [*apps, app])
    dep = app["deployments"][0]["name"]
    rest.wait(app["name"], dep, lambda d: True, timeout_s=300.0)


def measure(target: RayServeTarget, k: Knobs, slo: Slo, number: int) -> TrialRecord:
    """Apply ``k`` and measure one window as a tune trial does (a faulty window again)."""
    t0 = time.monotonic()
    target.apply(k)
    for _ in range(3):
        m = target.measure(k)
        if not m.fault:
            break
    ev = evaluate(m.observation, slo)
    rec = TrialRecord.from_observation(
        number=number, knobs=k, obs=m.observation, feasible=ev.feasible,
        wall_s=time.monotonic() - t0, client=m.client, note=m.fault,
    )  # fmt: skip
    print(row(rec), file=sys.stderr, flush=True)  # progress; the tables go to stdout at the end
    return rec


def pooled(ts: list[TrialRecord], slo: Slo) -> str | None:
    """Both SLOs judged on the union of the windows' requests (the tuner's rule)."""
    if not ts:
        return None
    k = Knobs(max_batch_size=ts[0].max_batch_size, max_concurrency=ts[0].max_concurrency)
    p = summarize(k, [t.window_attrs() for t in ts], values=[t.goodput_rps for t in ts],
                  numbers=[t.number for t in ts], slo=slo)  # fmt: skip
    return None if p.pooled is None else p.pooled.value


def mean_goodput(ts: list[TrialRecord]) -> float:
    return sum(t.goodput_rps for t in ts) / len(ts) if ts else math.nan


def row(t: TrialRecord) -> str:
    return (
        f"{t.number:>3} {t.max_batch_size:>3} {t.max_concurrency:>3} {t.goodput_rps:>8.2f} "
        f"{t.tokens_per_s:>6.0f} {t.p99_ttft_ms:>8.0f} {t.p99_tpot_ms:>8.1f} "
        f"{'yes' if t.feasible else 'no':>3} {t.completed:>5} {t.wall_s:>6.1f}"
    )


HEADER = (
    f"{'#':>3} {'B':>3} {'C':>3} {'goodput':>8} {'tok/s':>6} {'TTFT p99':>8} "
    f"{'TPOT p99':>8} {'ok':>3} {'n':>5} {'wall s':>6}\n"
    f"{'':>3} {'':>3} {'':>3} {'req/s':>8} {'':>6} {'ms':>8} {'ms':>8}"
)


def rounded(x: float, nd: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def run(args: argparse.Namespace) -> dict[str, Any]:
    slo = Slo(ttft_p99_s=args.slo_ttft_ms / 1e3, tpot_p99_s=args.slo_tpot_ms / 1e3)
    plan = WindowPlan(
        warmup_s=args.warmup_s,
        window_s=args.window_s,
        max_window_s=max(args.window_s, args.max_window_s),
        min_requests=args.min_requests,
    )
    shape = RequestShape(
        prompt_tokens=LengthDist(mean=args.prompt_tokens),
        output_tokens=LengthDist(mean=args.output_tokens),
        ignore_eos=True,
        request_timeout_s=120.0,
    )
    grid = grid_points(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-tune-vs-grid-"))
    res: dict[str, Any] = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    t_setup = time.monotonic()
    http_port = free_loopback_port()
    cluster = start_local_ray(
        num_cpus=2, metrics_port=free_loopback_port(), http_port=http_port, dashboard=True
    )
    import ray
    from ray import serve

    try:
        assert cluster.dashboard_url is not None
        rest = ServeRest(cluster.dashboard_url, token=read_token())
        first = grid[0]
        app = example_app(
            d_model=args.d_model, batch=first.max_batch_size, concurrency=first.max_concurrency
        )
        deploy(rest, app)
        actuator = ServeActuator(
            app=app["name"], batch_knob=BATCH_KNOB, dashboard_url=cluster.dashboard_url, rest=rest
        )
        target = RayServeTarget(
            url=f"http://127.0.0.1:{http_port}", slo=slo, reader=ClientWindow(slo=slo),
            actuator=actuator, plan=plan, shape=shape,
        )  # fmt: skip
        pids = {r[1] for r in actuator.fleet()}
        res["setup_s"] = round(time.monotonic() - t_setup, 1)

        # 1. The grid.
        t1 = time.monotonic()
        rows = [measure(target, k, slo, i) for i, k in enumerate(grid)]
        grid_wall = time.monotonic() - t1
        feas = [t for t in rows if t.feasible]
        best = max(feas, key=lambda t: t.goodput_rps) if feas else None
        res.update(grid=rows, grid_wall_s=grid_wall, best=best)
        if args.grid_only:
            return res

        # 2. The tune, on a share of the grid's time.
        budget = args.tune_budget_s or args.tune_share * grid_wall
        searched = unseeded_plan(
            max_batch=args.max_batch, reason="the @serve.batch example: no model config"
        )
        tuner = Tuner(space=searched.space, slo=slo, storage=None, seed_knobs=searched.seeds,
                      seed=0)  # fmt: skip
        base = CurveReport(
            slo=slo, trials=(), model="serve-batch-example (model not given)",
            hardware=cpu_info()["model"], seed_note=searched.reason,
            backend={**actuator.describe(), "metrics": "client"},
        )  # fmt: skip
        t2 = time.monotonic()
        outcome = run_tune(
            target=target,
            tuner=tuner,
            base=base,
            limits=TuneLimits(max_trials=args.max_trials, time_budget_s=budget),
            out_dir=out / "tune",
            progress=Progress(),
        )
        tune_wall = time.monotonic() - t2
        chosen = outcome.report.chosen
        res.update(tune=outcome, tune_wall_s=tune_wall, tune_budget_s=budget, chosen=chosen)

        # 3. Head to head, alternating: same deployment, same conditions.
        duel: dict[str, list[TrialRecord]] = {"pick": [], "best": []}
        if chosen is not None and best is not None:
            pick_k = Knobs(max_batch_size=chosen.max_batch_size,
                           max_concurrency=chosen.max_concurrency)  # fmt: skip
            best_k = Knobs(max_batch_size=best.max_batch_size, max_concurrency=best.max_concurrency)
            for r in range(args.repeats):
                duel["pick"].append(measure(target, pick_k, slo, 100 + 2 * r))
                duel["best"].append(measure(target, best_k, slo, 101 + 2 * r))
        res["duel"] = duel
        res["restarted"] = {r[1] for r in actuator.fleet()} != pids
    finally:
        serve.shutdown()
        ray.shutdown()
    return res


def report(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    cpu = cpu_info()
    slo = Slo(ttft_p99_s=args.slo_ttft_ms / 1e3, tpot_p99_s=args.slo_tpot_ms / 1e3)
    print(f"@serve.batch example, d_model {args.d_model}, {args.prompt_tokens} in / "
          f"{args.output_tokens} out; SLO p99 TTFT {args.slo_ttft_ms:g} ms, p99 TPOT "
          f"{args.slo_tpot_ms:g} ms; {cpu['model']} ({', '.join(cpu['flags']) or 'no'} "
          f"avx2/bf16/amx flags); set-up {res['setup_s']:.0f} s")  # fmt: skip
    print("\ngrid (one window per point)\n" + HEADER)
    for t in res["grid"]:
        print(row(t))
    best: TrialRecord | None = res["best"]
    grid_wall = res["grid_wall_s"]
    print(f"grid: {len(res['grid'])} points in {grid_wall:.0f} s; best feasible: "
          + (f"B={best.max_batch_size} C={best.max_concurrency} {best.goodput_rps:.2f} req/s"
             if best else "none"))  # fmt: skip
    out: dict[str, Any] = {
        "bench": "tune_vs_grid",
        "app": "deploy/examples/serve_batch",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu["model"],
        "cpu_flags": cpu["flags"],
        "load_average_1m": round(os.getloadavg()[0], 1),
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "setup_s": res["setup_s"],
        "grid": [
            [
                t.max_batch_size,
                t.max_concurrency,
                round(t.goodput_rps, 2),
                round(t.p99_tpot_ms, 1),
                round(t.p99_ttft_ms),
                t.feasible,
            ]
            for t in res["grid"]
        ],  # fmt: skip
        "grid_points": len(res["grid"]),
        "grid_wall_s": round(grid_wall, 1),
        "grid_best": None if best is None else [best.max_batch_size, best.max_concurrency],
        "grid_best_goodput_rps": None if best is None else round(best.goodput_rps, 3),
    }
    if args.grid_only:
        return out
    outcome, chosen = res["tune"], res["chosen"]
    trials = outcome.report.trials
    print("\nslotune tune (unseeded, client metrics)\n" + HEADER)
    for t in trials:
        print(row(t))
    tune_wall = res["tune_wall_s"]
    pick = f"B={chosen.max_batch_size} C={chosen.max_concurrency}" if chosen else "none"
    print(f"tune: {len(trials)} trials in {tune_wall:.0f} s (budget {res['tune_budget_s']:.0f} s);"
          f" stop: {outcome.stop_reason}; pick: {pick}")  # fmt: skip
    duel = res["duel"]
    pick_g, best_g = mean_goodput(duel["pick"]), mean_goodput(duel["best"])
    ratio = pick_g / best_g if best_g > 0 else math.nan
    tune_g = mean_goodput(outcome.report.measurements_of(chosen)) if chosen else math.nan
    ratio_tt = tune_g / best.goodput_rps if best and best.goodput_rps > 0 else math.nan
    print("\nhead to head, alternating (goodput req/s, verdict)")
    for name in ("pick", "best"):
        cells = "  ".join(f"{t.goodput_rps:.2f} {'ok' if t.feasible else 'miss'}"
                          for t in duel[name])  # fmt: skip
        print(f"  {name}: {cells}; pooled: {pooled(duel[name], slo)}")
    print(f"tune pick / grid best goodput: {ratio:.3f} (re-measured alternately), "
          f"{ratio_tt:.3f} (as tuned vs the grid's window); tune wall / grid wall: "
          f"{tune_wall / grid_wall:.3f}")  # fmt: skip
    out.update({
        "tune_trials": len(trials),
        "tune_trials_knobs": [[t.max_batch_size, t.max_concurrency] for t in trials],
        "tune_budget_s": round(res["tune_budget_s"], 1),
        "tune_wall_s": round(tune_wall, 1),
        "tune_stop": outcome.stop_reason,
        "tune_pick": None if chosen is None else [chosen.max_batch_size, chosen.max_concurrency],
        "pick_goodput_rps_remeasured": rounded(pick_g),
        "best_goodput_rps_remeasured": rounded(best_g),
        "pick_feasible_windows": f"{sum(t.feasible for t in duel['pick'])}/{len(duel['pick'])}",
        "best_feasible_windows": f"{sum(t.feasible for t in duel['best'])}/{len(duel['best'])}",
        "pick_pooled_verdict": pooled(duel["pick"], slo),
        "best_pooled_verdict": pooled(duel["best"], slo),
        "ratio_goodput": rounded(ratio),
        "ratio_goodput_tune_time": rounded(ratio_tt),
        "ratio_wall": rounded(tune_wall / grid_wall),
        "replica_restarted": res["restarted"],
    })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res = run(args)
    summary = report(args, res)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
