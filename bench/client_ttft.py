"""TTFT as the client sees it vs the server's histograms: the front-door clock and the replica's.

Starts slotune's app on a local Ray the way slotune does (``serving.app.cluster.start_local_ray``:
loopback, token auth, Serve's proxy stamping each request's arrival), then for each
concurrency drives closed-loop streaming load with slotune's load generator
(``controller.load``, which records each request's client-side TTFT: first SSE byte of
text minus send time) and reads, from the increase of Ray's exported histograms over the
same requests, the server's TTFT p50/p99 on both clocks:

- ``front door``: ``slotune_ttft_seconds`` (what the tuner reads): for these streamed
  requests, from the proxy's arrival stamp to when the first chunk left the proxy, both
  on the proxy's clock (the replica hands the observation over: serving/app/front_door.py);
- ``replica``: ``slotune_replica_ttft_seconds``, from the replica's own arrival to its
  first token (the clock ``slotune_ttft_seconds`` used before the front door), same run.

Server quantiles are PromQL's ``histogram_quantile`` over the contract's buckets (≤ 10%
apart; interpolated); client quantiles are exact. The admission limit (``--ongoing``) is
below the top concurrency so requests queue in Serve's router, the case a replica clock
misses. Bounded: ``--requests`` per concurrency and a time cap, loopback only.

    .venv/bin/python bench/client_ttft.py [--model tiny] [--requests 300]
        [--concurrency 1 8] [--ongoing 4] [--batch 4]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "bench-client-ttft"
TARGET = 0.10  # |server / client - 1| at p99


def _scrape(url: str):
    import httpx

    from metrics.snapshot import parse_exposition

    return parse_exposition(httpx.get(url, timeout=30).text, time_s=time.time(), url=url)


def _server_quantiles(start, end, name: str) -> tuple[float, float, float]:
    """(p50, p99, count) of histogram ``name`` over the app's increase between scrapes."""
    from metrics import names
    from metrics.quantile import histogram_quantile
    from metrics.snapshot import bucket_window

    bucket, _, _ = names.histogram_samples(name)
    b = bucket_window(start, end, bucket, {"application": APP}) or {}
    n = b.get(math.inf, 0.0)
    return histogram_quantile(0.5, b), histogram_quantile(0.99, b), n


def _wait_count(metrics_url: str, start, want: float, timeout_s: float = 20.0):
    """A scrape whose TTFT counts (both clocks) have grown by ``want`` since ``start``."""
    from metrics import names

    deadline = time.monotonic() + timeout_s
    while True:
        end = _scrape(metrics_url)
        ok = all(
            _server_quantiles(start, end, n)[2] >= want
            for n in (names.TTFT_SECONDS, names.REPLICA_TTFT_SECONDS)
        )
        if ok or time.monotonic() > deadline:
            return end
        time.sleep(0.5)


def _arrival_clocks(start, end) -> dict[str, float]:
    from metrics import names
    from metrics.snapshot import counter_window

    got = counter_window(
        start,
        end,
        names.counter_samples(names.ARRIVAL_CLOCK_TOTAL),
        {"application": APP},
        by=names.LABEL_CLOCK,
    )
    return got or {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=300, help="per concurrency (50..3000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ongoing", type=int, default=4, help="admission limit (max_ongoing)")
    p.add_argument("--batch", type=int, default=4, help="decode batch limit")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--cap-s", type=float, default=240.0, help="time cap per concurrency")
    a = p.parse_args()
    if not 50 <= a.requests <= 3000 or not all(1 <= c <= 64 for c in a.concurrency):
        raise SystemExit("--requests must be in 50..3000 and --concurrency values in 1..64")

    from serving.app.cluster import ray_env_defaults

    ray_env_defaults()
    import ray
    from ray import serve

    from controller.load.generator import run_load_sync
    from controller.load.spec import LoadSpec
    from metrics import names
    from metrics.samples import exact_quantile
    from search.calibrate.device import cpu_model_name
    from serving.app.cluster import free_loopback_port, start_local_ray
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import deploy_app
    from serving.sim.workload import LengthDist

    http_port, metrics_port = free_loopback_port(), free_loopback_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    start_local_ray(num_cpus=2, metrics_port=metrics_port, http_port=http_port)
    rows = []
    try:
        deploy_app(
            ServerArgs(model=a.model, max_slots=max(8, a.batch)),
            LiveConfig(max_batch_size=a.batch, max_ongoing_requests=a.ongoing),
            name=APP,
            route_prefix=f"/{APP}",
            max_queued_requests=-1,  # Serve's router queues without bound: the case in point
        )
        url = f"http://127.0.0.1:{http_port}/{APP}/v1/completions"

        def spec(concurrency: int, n: int) -> LoadSpec:
            return LoadSpec(
                url=url,
                concurrency=concurrency,
                max_requests=n,
                duration_s=a.cap_s,
                prompt_tokens=LengthDist(mean=a.prompt_tokens),
                output_tokens=LengthDist(mean=a.output_tokens),
                ignore_eos=True,
                seed=concurrency,
            )

        # warm-up, not counted: its observations must have reached the export port before
        # the first window's start, or they land in it
        start = _scrape(metrics_url)
        warm = run_load_sync(spec(2, 20))
        start = _wait_count(metrics_url, start, sum(r.ok for r in warm.records))
        for c in a.concurrency:
            result = run_load_sync(spec(c, a.requests))
            ok = [r for r in result.records if r.ok and r.first_token_s is not None]
            end = _wait_count(metrics_url, start, len(ok))
            client = [r.ttft_s for r in ok]
            f50, f99, fn = _server_quantiles(start, end, names.TTFT_SECONDS)
            r50, r99, rn = _server_quantiles(start, end, names.REPLICA_TTFT_SECONDS)
            rows.append(
                {
                    "concurrency": c,
                    "requests_ok": len(ok),
                    "requests_failed": len(result.records) - len(ok),
                    "client_p50_ms": exact_quantile(client, 0.5) * 1e3,
                    "client_p99_ms": exact_quantile(client, 0.99) * 1e3,
                    "front_door_p50_ms": f50 * 1e3,
                    "front_door_p99_ms": f99 * 1e3,
                    "front_door_count": fn,
                    "replica_p50_ms": r50 * 1e3,
                    "replica_p99_ms": r99 * 1e3,
                    "replica_count": rn,
                    "arrival_clocks": _arrival_clocks(start, end),
                }
            )
            start = end
    finally:
        serve.shutdown()
        ray.shutdown()

    cpu = cpu_model_name()
    print(
        f"client TTFT vs server histograms, model {a.model}, CPU: {cpu} ({os.cpu_count()} "
        f"cores); admission {a.ongoing}, batch {a.batch}, prompt {a.prompt_tokens}, "
        f"output {a.output_tokens} tokens, {a.requests} streamed requests per concurrency"
    )
    head = (
        f"{'conc':>4} {'n':>5} | {'client p50':>10} {'p99':>7} | {'front p50':>9} {'p99':>7} "
        f"{'p99/cl':>6} | {'replica p50':>11} {'p99':>7} {'p99/cl':>6}"
    )
    print(head)
    for r in rows:
        r["front_door_p99_ratio"] = r["front_door_p99_ms"] / r["client_p99_ms"]
        r["front_door_p50_ratio"] = r["front_door_p50_ms"] / r["client_p50_ms"]
        r["replica_p99_ratio"] = r["replica_p99_ms"] / r["client_p99_ms"]
        r["replica_p50_ratio"] = r["replica_p50_ms"] / r["client_p50_ms"]
        print(
            f"{r['concurrency']:>4} {r['requests_ok']:>5} | {r['client_p50_ms']:>10.1f} "
            f"{r['client_p99_ms']:>7.1f} | {r['front_door_p50_ms']:>9.1f} "
            f"{r['front_door_p99_ms']:>7.1f} {r['front_door_p99_ratio']:>6.3f} | "
            f"{r['replica_p50_ms']:>11.1f} {r['replica_p99_ms']:>7.1f} "
            f"{r['replica_p99_ratio']:>6.3f}"
        )
    within = all(abs(r["front_door_p99_ratio"] - 1) <= TARGET for r in rows)
    print(f"front-door p99 within {TARGET:.0%} of the client's at every concurrency: {within}")
    for r in rows:
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 3)
    print(
        json.dumps(
            {
                "bench": "client_ttft",
                "cpu": cpu,
                "model": a.model,
                "admission": a.ongoing,
                "batch": a.batch,
                "prompt_tokens": a.prompt_tokens,
                "output_tokens": a.output_tokens,
                "rows": rows,
                "target_p99_ratio_within": TARGET,
                "meets_target": within,
            }
        )
    )


if __name__ == "__main__":
    main()
