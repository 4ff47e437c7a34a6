"""Decode step time and tokens/s of the engine against the local device's roofline.

For each batch B the engine's executor runs one decode step of B requests in
slots 0..B-1, each at position ``context - 1`` (so it reads ``context`` cached
tokens; the cache is filled with random values first: an untouched cache reads
as shared zero pages and hides its traffic). Reported per batch:

- measured step time: the best of the timed reps after warm-up, over
  ``--passes`` passes across all batches, each run right after a pass of the
  calibration (interleaved: both see the same spells of the machine), as the calibration
  takes its figures (on cores shared with other work, or a VM whose speed drifts,
  the best rep is the uncontended one); the median is printed beside it; tokens/s;
- the ideal roofline of the calibrated device, max(bytes / measured bandwidth,
  FLOPs / measured matmul peak), bytes = weights + B * context * KV bytes per
  token; ``fraction`` = roofline / measured (1.0 would be perfect);
- the calibrated model's prediction (search/roofline/curve.py with the decode profile
  ``search/calibrate/device.py`` measures in the same run) and its relative error.

The last line is one JSON object: ``roofline_fraction_batch1``,
``roofline_fraction_max_batch``, ``max_prediction_error`` and the table.

    .venv/bin/python bench/engine.py                      # small, bf16, B = 1..256
    .venv/bin/python bench/engine.py --model tiny --batches 1,8 --plan quick
"""

from __future__ import annotations

import os

# Before torch starts its thread pool. On cores the bench has to itself, OpenMP
# workers that spin between the ~300 small ops of a step instead of sleeping made a
# B=1 step ~2x faster (10.3 vs 20.7 ms, 2 threads, quiet machine). On cores shared
# with other busy processes spinning is a disaster instead (load 10-14: B=1 median
# 574-840 ms ACTIVE against 23-28 ms PASSIVE; at load 1.7 beside one busy Ray
# replica, 10x slower). So: ACTIVE only when the 1-minute load average is under 0.5
# (nothing else running), else PASSIVE; an exported OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE" if os.getloadavg()[0] < 0.5 else "PASSIVE")

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from search.calibrate.device import calibrate
from search.calibrate.plan import PLANS
from search.roofline.curve import Roofline
from search.roofline.hardware import HardwareSpec
from search.roofline.models import ModelSpec
from serving.engine.engine import Engine
from serving.engine.executor import TorchExecutor
from serving.model.config import ModelConfig
from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry, StepPlan

SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


# --model: the serving presets, and an 8B shape (Llama 3.1 8B's, random weights drawn in
# place on the device: nothing is downloaded) for the GPU.
CATALOG = {"tiny": "slotune-tiny", "small": "slotune-small", "8b": "llama-3.1-8b"}
# --paths: how a decode step runs. "engine": the engine's full-row path (on the CPU the C
# kernels; on a GPU eager torch, the baseline); "window": the device path
# (serving/engine/device_decode.py: FlexAttention on CUDA, SDPA over a window on the CPU)
# without CUDA graphs; "graphs": with them (CUDA only);
# "overlap": graphs (on CUDA) with each step launched before the last one's tokens are
# waited for, as the engine runs them there: the time of a step in a steady run.
PATHS = ("engine", "window", "graphs", "overlap")


def config_for(name: str, dtype: str) -> ModelConfig:
    if name in ("tiny", "small"):
        return ModelConfig.from_name(name, dtype=dtype)
    s = ModelSpec.from_name(CATALOG[name])
    return ModelConfig(
        name=name, vocab_size=s.vocab, d_model=s.hidden, n_layers=s.layers, n_heads=s.heads,
        n_kv_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
        max_position=8192, rope_theta=500000.0, dtype=dtype,
    )  # fmt: skip


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The roofline catalog's twin of a model; refuses if the shapes differ."""
    spec = ModelSpec.from_name(CATALOG[cfg.name])
    ours = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size)
    theirs = (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab)
    if ours != theirs:
        raise SystemExit(f"search/roofline/models.py {spec.name} {theirs} != serving preset {ours}")
    return spec


def time_step(
    eng: Engine | TorchExecutor,
    batch: int,
    context: int,
    reps: int,
    budget_s: float,
    overlap: bool = False,
) -> list[float]:
    """Seconds of each timed decode step after warm-up (``eng``: an engine, or one of the
    executors over its model and cache)."""
    gen = torch.Generator().manual_seed(batch)
    toks = torch.randint(0, eng.model.config.vocab_size, (batch,), generator=gen).tolist()
    plan = StepPlan(
        decode=tuple(
            DecodeEntry(request_id=f"b{i}", slot=i, position=context - 1, token=toks[i])
            for i in range(batch)
        )
    )
    temps = {f"b{i}": 0.0 for i in range(batch)}
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    if overlap:
        assert isinstance(eng, TorchExecutor)
        return time_overlapped(eng, plan, temps, reps, budget_s, sync)
    for _ in range(2):  # warm-up
        eng.execute(plan, temps)
    sync()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < reps or (time.perf_counter() < t_end and len(times) < 4 * reps):
        t0 = time.perf_counter()
        eng.execute(plan, temps)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def time_overlapped(
    ex: TorchExecutor, plan: StepPlan, temps: dict, reps: int, budget_s: float, sync
) -> list[float]:
    """Seconds a step of a run of overlapped steps (each launched with the step before as
    pending, its tokens taken from that step's draws on the device, then the step before
    waited for), per run of ``reps`` steps after warm-up."""
    unknown = StepPlan(decode=tuple(replace(e, token=None) for e in plan.decode))

    def run(n: int) -> None:
        prev = ex.launch(plan, temps)
        for _ in range(n):
            cur = ex.launch(unknown, temps, pending=prev)
            prev.wait()
            prev = cur
        prev.wait()

    run(2)  # warm-up (captures the graph)
    sync()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 12):
        t0 = time.perf_counter()
        run(reps)
        sync()
        times.append((time.perf_counter() - t0) / (reps + 1))
    return times


def predicted_parts(r: Roofline, batch: int) -> dict[str, float]:
    """The calibrated prediction of one decode step split as search/roofline/curve.py adds it up
    (tp=1): ms in the layers' linears, attention, the per-layer overhead (all layers), the
    lm_head, and the step outside the layers beyond the lm_head."""
    m, prof = r.model, r.hardware.decode[r.dtype]
    head = m.embedding_params * r.bytes_per_elem
    kv = batch * r.context * r.kv_bytes_per_token_per_device
    return {
        "linears_ms": (r.weight_bytes_read_per_device - head) / prof.weight_rate_at(batch) * 1e3,
        "attention_ms": kv / prof.kv_rate_at(batch) * 1e3,
        "layer_overhead_ms": prof.layer_overhead_at(batch) * m.layers * 1e3,
        "lm_head_ms": head / prof.weight_rate_at(batch) * 1e3,
        "step_overhead_ms": prof.step_overhead_at(batch) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=tuple(CATALOG))
    ap.add_argument(
        "--paths", default="engine", help=f"decode paths to time, comma-separated: {PATHS}"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(SHORT_DTYPE))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=1.0, help="extra timing time per batch")
    ap.add_argument(
        "--passes", type=int, default=3, help="passes over all batches (the budget is split)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads"
    )
    ap.add_argument("--plan", default="full", choices=tuple(PLANS), help="calibration plan")
    ap.add_argument("--hardware", default=None, help="a calibrated HardwareSpec JSON to use")
    args = ap.parse_args()
    if args.passes < 1 or args.reps < 1:
        raise SystemExit(f"--passes={args.passes}, --reps={args.reps}: must be >= 1")
    batches = [int(b) for b in args.batches.split(",")]
    paths = args.paths.split(",")
    bad = [p for p in paths if p not in PATHS] or (
        ["graphs"] if "graphs" in paths and not args.device.startswith("cuda") else []
    )
    if bad or paths[0] != "engine":
        raise SystemExit(
            f"--paths {args.paths}: must start with 'engine', then any of {PATHS[1:]} "
            "('graphs' on CUDA only; 'overlap' runs graphs where they are)"
        )
    cfg = config_for(args.model, args.dtype)
    dt = SHORT_DTYPE[args.dtype]
    spec = spec_for(cfg)

    eng = Engine(
        model=Transformer.for_timing(cfg, device=args.device),
        max_slots=max(batches),
        max_batch_size=max(batches),
        max_len=args.context,
        device=args.device,
        num_threads=args.threads,
        device_decode=False,  # "engine": the full-row path, the baseline
    )
    runners: dict[str, Engine | TorchExecutor] = {"engine": eng}
    for p in paths[1:]:  # over the same model and cache
        runners[p] = TorchExecutor(
            model=eng.model, device=eng.device, max_len=args.context, device_decode=True,
            cuda_graphs=p != "window" and eng.device.type == "cuda",
        )  # fmt: skip
    with torch.no_grad():
        for c in eng.model.caches():
            c.normal_()  # a cache never written reads as zero pages: fill it
    threads = torch.get_num_threads()
    # Passes over all batches, each batch's best kept: a slow spell of the machine (other
    # work, the VM's neighbours) then spoils one pass of a batch, not the batch, and
    # measured and predicted times are the same statistic (the device's uncontended
    # speed). With a calibration in the run, pass i runs right after the calibration's
    # pass i (its after_pass hook), so both sample the same stretch of time: this VM's
    # speed drifts by 20-40% over tens of seconds, and a calibration minutes before the
    # steps judged the drift, not the prediction.
    times: dict[int, list[float]] = {b: [] for b in batches}  # the engine path's
    path_times: dict[str, dict[int, list[float]]] = {p: {b: [] for b in batches} for p in paths}
    per_pass = -(-args.reps // args.passes)  # at least --reps in all
    passes_done = 0

    def step_pass(*_: object) -> None:
        nonlocal passes_done
        if passes_done < args.passes:
            for b in batches:
                for p, runner in runners.items():
                    budget = args.budget_s / args.passes
                    path_times[p][b] += time_step(
                        runner, b, args.context, per_pass, budget, overlap=p == "overlap"
                    )
                times[b] = path_times["engine"][b]
            passes_done += 1

    if args.hardware:
        hw = HardwareSpec.from_json(args.hardware)
        cal_s = 0.0
    else:
        cal = calibrate(
            device=args.device,
            plan=PLANS[args.plan],
            model=spec,
            dtypes=(dt,),
            threads=threads,
            after_pass=step_pass,
        )
        hw, cal_s = cal.spec, cal.elapsed_s
    while passes_done < args.passes:  # no calibration, or one with fewer passes
        step_pass()
    ideal = Roofline(model=spec, hardware=hw.without_calibration(), dtype=dt, context=args.context)
    calibrated = Roofline(model=spec, hardware=hw, dtype=dt, context=args.context)

    bpe = cfg.bytes_per_param

    def mbu(batch: int, seconds: float) -> float:
        """Bytes a step must read (weights + the KV present) / step time / peak bandwidth."""
        need = spec.weight_bytes_read_per_step(
            bpe
        ) + batch * args.context * spec.kv_bytes_per_token(bpe)
        return need / seconds / hw.mem_bandwidth

    rows = []
    for b in batches:
        measured, median = min(times[b]), statistics.median(times[b])
        by_path = {
            p: {"measured_ms": min(path_times[p][b]) * 1e3,
                "median_ms": statistics.median(path_times[p][b]) * 1e3,
                "mbu": mbu(b, min(path_times[p][b])),
                "speedup_vs_engine": measured / min(path_times[p][b])}
            for p in paths
        }  # fmt: skip
        roof = ideal.step_time_s(b)
        pred = calibrated.step_time_s(b) if calibrated.calibrated else float("nan")
        rows.append(
            {
                "batch": b,
                "measured_ms": measured * 1e3,
                "median_ms": median * 1e3,
                "tokens_per_s": b / measured,
                "roofline_ms": roof * 1e3,
                "roofline_fraction": roof / measured,
                "bound": ideal.bound_at(b),
                "predicted_ms": pred * 1e3,
                "prediction_error": (pred - measured) / measured,
                "predicted_parts": predicted_parts(calibrated, b) if calibrated.calibrated else {},
                "paths": by_path,
            }
        )

    print(
        f"engine decode step: {cfg.name} ({cfg.n_params / 1e6:.0f}M params) {args.dtype}, "
        f"context {args.context}, {args.device}, {threads} torch threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}); "
        f"device {hw.mem_bandwidth / 1e9:.1f} GB/s, {hw.flops(dt) / 1e9:.0f} GFLOP/s {dt}"
        + (f" (calibrated in {cal_s:.0f} s)" if cal_s else f" ({args.hardware})")
    )
    print(
        f"{'B':>5} {'step ms':>9} {'median':>8} {'tok/s':>9} {'roof ms':>8} {'fraction':>8} "
        f"{'bound':>7} {'pred ms':>8} {'error':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['measured_ms']:>9.2f} {r['median_ms']:>8.2f} "
            f"{r['tokens_per_s']:>9.0f} "
            f"{r['roofline_ms']:>8.2f} {r['roofline_fraction']:>8.2f} {r['bound']:>7} "
            f"{r['predicted_ms']:>8.2f} {r['prediction_error']:>+7.0%}"
        )
    print(f"MBU (bytes a step must read / step time / {hw.mem_bandwidth / 1e9:.1f} GB/s), by path:")
    print(f"{'B':>5} " + " ".join(f"{p + ' ms':>10} {'MBU':>5} {'x eng':>6}" for p in paths))
    for r in rows:
        print(f"{r['batch']:>5} " + " ".join(
            f"{v['measured_ms']:>10.3f} {v['mbu']:>5.2f} {v['speedup_vs_engine']:>6.2f}"
            for v in r["paths"].values()))  # fmt: skip
    errors = [abs(r["prediction_error"]) for r in rows]
    print(
        json.dumps(
            {
                "bench": "engine",
                "model": cfg.name,
                "dtype": args.dtype,
                "device": args.device,
                "threads": threads,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                "load_avg_1m": os.getloadavg()[0],
                "context": args.context,
                "passes": args.passes,
                "paths": paths,
                "mbu_batch1": {p: rows[0]["paths"][p]["mbu"] for p in paths},
                "roofline_fraction_batch1": rows[0]["roofline_fraction"],
                "roofline_fraction_max_batch": rows[-1]["roofline_fraction"],
                "max_prediction_error": max(errors),
                "first_batch": rows[0]["batch"],
                "max_batch": rows[-1]["batch"],
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
