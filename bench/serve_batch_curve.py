"""The throughput / latency curve of the ``@serve.batch`` example (deploy/examples/serve_batch).

Deploys the example through Serve's declarative path (its serve_config.yaml under another
name), then for each batch limit L: sets ``user_config.max_batch_size = L`` in place (no
restart: the replica pid is checked), offers a closed loop of concurrency L with slotune's
load generator (fixed prompt and output lengths, ``ignore_eos``), warms up, and measures a
window: output tokens/s, p50/p99 TPOT and p99 TTFT over the requests that finished in it,
as a client sees them (what ``--metrics-profile client`` reads), plus the batch sizes the
replica reports Serve formed. With L requests in a closed loop and static batching,
each batch is about L requests decoded together, so TPOT ≈ one step at batch L.

    .venv/bin/python bench/serve_batch_curve.py [--limits 1,2,4,8,16] [--window-s 20]
        [--warmup-s 4] [--max-tokens 64] [--prompt-tokens 32] [--d-model 768]

Prints a table, then one JSON line. p99 of fewer than ~100 requests is close to the
slowest request: each row gives its sample count.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.load.generator import run_load
from controller.load.spec import LoadSpec
from metrics.samples import exact_quantile
from search.calibrate.device import cpu_model_name
from serving.app import ray_private
from serving.app.cluster import free_loopback_port, start_local_ray
from serving.sim.workload import LengthDist

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy/examples/serve_batch/serve_config.yaml"
APP = "bench-serve-batch"
PREFIX = "/bench-serve-batch"


def _apply(app_config: dict[str, Any]) -> None:
    """Put the app in Serve's declarative set, keeping the others (what ``serve deploy``
    sends; Ray's private client API through serving/app/ray_private.py)."""
    client = ray_private.serve_client(start=True)
    apps = ray_private.declarative_app_configs(client)
    apps[APP] = app_config
    ray_private.deploy_apps(client, list(apps.values()))


def _config(limit: int, d_model: int, wait_s: float | None) -> dict[str, Any]:
    app = copy.deepcopy(yaml.safe_load(CONFIG.read_text())["applications"][0])
    app.update(name=APP, route_prefix=PREFIX)
    app["args"]["d_model"] = d_model
    user_config = app["deployments"][0]["user_config"]
    user_config["max_batch_size"] = limit
    if wait_s is not None:
        user_config["batch_wait_timeout_s"] = wait_s
    app["deployments"][0]["max_ongoing_requests"] = 64
    return app


def _stats(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/stats", timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()


def _wait_for(base: str, limit: int, timeout_s: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            s = _stats(base)
            if s["max_batch_size"] == limit:
                return s
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"max_batch_size={limit} not applied within {timeout_s} s")


def _measure(base: str, limit: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = LoadSpec(
        url=base + "/v1/completions",
        mode="closed",
        concurrency=limit,
        max_requests=1_000_000,
        duration_s=args.warmup_s + args.window_s,
        prompt_tokens=LengthDist(mean=args.prompt_tokens),
        output_tokens=LengthDist(mean=args.max_tokens),
        ignore_eos=True,
        request_timeout_s=120.0,
    )
    httpx.post(base + "/stats/reset", timeout=30, trust_env=False).raise_for_status()
    result = asyncio.run(run_load(spec))
    t0 = result.start_s + args.warmup_s
    window = result.between(t0, result.end_s)
    ok = [r for r in window.records if r.ok]
    tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
    stats = _stats(base)
    steps = {int(k): v for k, v in stats["step_rows"].items()}
    return {
        "limit": limit,
        "requests": len(ok),
        "errors": sum(not r.ok for r in window.records),
        "tokens_per_s": sum(r.output_tokens for r in ok) / (result.end_s - t0),
        "tpot_p50_s": exact_quantile(tpot, 0.5),
        "tpot_p99_s": exact_quantile(tpot, 0.99),
        "ttft_p99_s": exact_quantile([r.ttft_s for r in ok], 0.99),
        "mean_step_rows": sum(k * v for k, v in steps.items()) / max(1, sum(steps.values())),
        "batch_sizes": stats["batch_sizes"],
        "pid": stats["pid"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limits", default="1,2,4,8,16")
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument(
        "--batch-wait-s", type=float, default=None, help="user_config.batch_wait_timeout_s"
    )
    args = p.parse_args()
    limits = [int(x) for x in args.limits.split(",")]

    http_port = free_loopback_port()
    start_local_ray(num_cpus=2, metrics_port=free_loopback_port(), http_port=http_port)
    base = f"http://127.0.0.1:{http_port}{PREFIX}"
    _apply(_config(limits[0], args.d_model, args.batch_wait_s))
    first = _wait_for(base, limits[0])
    rows = []
    for limit in limits:
        _apply(_config(limit, args.d_model, args.batch_wait_s))
        _wait_for(base, limit)
        rows.append(_measure(base, limit, args))
    restarted = any(r["pid"] != first["pid"] for r in rows)

    print(f"@serve.batch example, d_model={args.d_model}, 1 torch thread, {cpu_model_name()}")
    print(f"closed loop, concurrency = limit, {args.prompt_tokens} in / {args.max_tokens} out")
    print(f"{'limit':>5} {'n':>5} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p99':>9}")
    for r in rows:
        print(
            f"{r['limit']:>5} {r['requests']:>5} {r['tokens_per_s']:>8.1f} "
            f"{r['tpot_p50_s'] * 1e3:>7.1f}ms {r['tpot_p99_s'] * 1e3:>7.1f}ms "
            f"{r['ttft_p99_s'] * 1e3:>7.0f}ms  batches {r['batch_sizes']}"
        )
    base_tps = rows[0]["tokens_per_s"]
    print(
        json.dumps(
            {
                "bench": "serve_batch_curve",
                "cpu": cpu_model_name(),
                "d_model": args.d_model,
                "max_tokens": args.max_tokens,
                "prompt_tokens": args.prompt_tokens,
                "window_s": args.window_s,
                "replica_restarted": restarted,
                "speedup_vs_first": [round(r["tokens_per_s"] / base_tps, 2) for r in rows],
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
