"""Serving overhead: tokens/s through Ray Serve HTTP streaming vs the engine in process.

Both sides run the same model preset, thread count, batch and requests (greedy,
the same prompts, stop at EOS), so they generate the same tokens (counts checked). One
round submits ``--batch`` requests at once (a full decode batch) and times from
the first submission to the last token; after one warm-up round each, rounds
alternate engine / Serve in ABBA order so drift in the load from other work on
the machine hits both alike. The figure is the median of the per-round ratios
(Serve tokens/s ÷ engine tokens/s); target ≥ 0.9.

Ray is started the way slotune starts it (``serving.app.cluster.start_local_ray``):
in particular its workers (the replica, the proxy) run at the niceness of this
process, not Ray's default 15, which would hand any other process on a shared
machine the CPU before the replica and measure the scheduler, not the serving
path. The JSON records the niceness of both engines and the client's CPU share
(near 1.0 would mean the HTTP client, not the server, was the bottleneck).

    .venv/bin/python bench/serve_overhead.py [--model small] [--batch 32] [--max-tokens 64]
        [--stream-interval S] [--also-interval S ...]

``--also-interval`` deploys one more app per stream interval and times each in the
same rounds (an A/B in one run, ``variants`` in the JSON); the headline ratio is the
first app's (the server's defaults unless ``--stream-interval`` is given).

Prints a table, then one JSON line with ``serve_to_engine_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "bench-overhead"


@dataclass(frozen=True, kw_only=True)
class Round:
    tokens: int
    seconds: float
    cpu_s: float = math.nan  # CPU seconds of the processes on the request path
    cpu_parts: tuple[float, ...] = ()  # per process: client, proxy, replica (Serve rounds)
    # Serve rounds: SSE events with choices per request (median; the final one, with
    # the finish reason, included), and the longest gap between two of a request's
    # events (the most a client waited for the next text: pacing, steps and load).
    events_per_request: float = math.nan
    max_event_gap_s: float = math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_ms_per_token(self) -> float:
        return 1e3 * self.cpu_s / self.tokens


def cpu_each(pids: list[int]) -> list[float]:
    """User + system CPU seconds so far of each process (all its threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def cpu_s(pids: list[int]) -> float:
    return sum(cpu_each(pids))


def prompts(n: int) -> list[str]:
    return [f"Request {i}: the quick brown fox jumps over the lazy dog." for i in range(n)]


async def engine_round(engine, texts: list[str], max_tokens: int, stop_ids) -> Round:
    async def one(text: str) -> int:
        n = 0
        ids = engine.tokenizer.encode(text)
        async for _ in engine.generate(
            ids, max_tokens=max_tokens, temperature=0.0, stop_ids=stop_ids
        ):
            n += 1
        return n

    c0, t0 = cpu_s([os.getpid()]), time.perf_counter()
    counts = await asyncio.gather(*(one(t) for t in texts))
    dt = time.perf_counter() - t0
    return Round(tokens=sum(counts), seconds=dt, cpu_s=cpu_s([os.getpid()]) - c0)


async def serve_round(
    url: str, model: str, texts: list[str], max_tokens: int, pids: list[int]
) -> Round:
    import httpx

    async def one(client: httpx.AsyncClient, text: str) -> tuple[int, int, float]:
        body = {
            "model": model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        used, events, last, gap = -1, 0, math.nan, 0.0
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith('data: {"id"') and '"usage"' in line:
                    used = json.loads(line[6:])["usage"]["completion_tokens"]
                elif line.startswith("data: {"):  # an event with text
                    now = time.perf_counter()
                    if events:
                        gap = max(gap, now - last)
                    events, last = events + 1, now
        if used < 0:
            raise RuntimeError("stream ended without a usage chunk")
        return used, events, gap

    limits = httpx.Limits(max_connections=len(texts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        c0, t0 = cpu_each(pids), time.perf_counter()
        got = await asyncio.gather(*(one(client, t) for t in texts))
        dt = time.perf_counter() - t0
        parts = tuple(b - a for a, b in zip(c0, cpu_each(pids), strict=True))
        return Round(
            tokens=sum(n for n, _, _ in got),
            seconds=dt,
            cpu_s=sum(parts),
            cpu_parts=parts,
            events_per_request=statistics.median(e for _, e, _ in got),
            max_event_gap_s=max(g for _, _, g in got),
        )


def proxy_pid() -> int:
    """The pid of Serve's (single, head-node) HTTP proxy actor."""
    import ray

    from serving.app import ray_private

    (proxy,) = ray_private.serve_details(ray_private.serve_client(start=False))["proxies"].values()
    actor = ray.get_actor(proxy["actor_name"], namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests = batch limit")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--stream-interval", type=float, default=None, help="seconds (default: the app's)"
    )
    ap.add_argument(
        "--also-interval",
        type=float,
        nargs="*",
        default=[],
        help="also deploy one app per stream interval (seconds) and time it in the same "
        "rounds (A/B in one run); the headline ratio stays the --stream-interval one",
    )
    a = ap.parse_args()
    from serving.app.cluster import ray_env_defaults

    ray_env_defaults()  # before torch and Ray start: OMP policy, worker niceness

    import httpx
    import ray
    from ray import serve

    from serving.app.cluster import free_loopback_port, start_local_ray
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import delete_app, deploy_app, replica_pids
    from serving.engine.async_engine import AsyncEngine
    from serving.model.config import ModelConfig

    texts = prompts(a.batch)
    engine = AsyncEngine(
        model_config=ModelConfig.from_name(a.model),
        max_slots=a.batch,
        max_batch_size=a.batch,
        device=a.device,
        num_threads=a.torch_threads,
    )
    eos = getattr(engine.tokenizer, "eos_id", None)
    stop_ids = () if eos is None else (eos,)

    port = free_loopback_port()
    start_local_ray(num_cpus=2, metrics_port=free_loopback_port(), http_port=port)
    # One app per stream interval: the first is the headline (--stream-interval, or the
    # app's default), the others (--also-interval) are timed in the same rounds.
    intervals: list[float | None] = [a.stream_interval, *a.also_interval]
    apps = [f"{APP}-{i}" for i in range(len(intervals))]
    for app, interval in zip(apps, intervals, strict=True):
        server = ServerArgs(
            model=a.model,
            max_slots=a.batch,
            device=a.device,
            torch_threads=a.torch_threads,
            **({} if interval is None else {"stream_interval_s": interval}),
        )
        live = LiveConfig(max_batch_size=a.batch, max_ongoing_requests=a.batch)
        deploy_app(server, live, name=app, route_prefix=f"/{app}", max_queued_requests=-1)
    base = f"http://127.0.0.1:{port}"
    urls = [f"{base}/{app}/v1/completions" for app in apps]
    # The request path: this process (the HTTP client), Serve's proxy, the replica.
    proxy = proxy_pid()
    pids = [[os.getpid(), proxy, *replica_pids(app)] for app in apps]
    served = f"slotune-{a.model}"
    stats = httpx.get(f"{base}/{apps[0]}/stats", timeout=30).json()
    niceness = {
        "replica_engine_thread": stats["runtime"]["engine_thread_niceness"],
        "proxy": os.getpriority(os.PRIO_PROCESS, proxy),
    }
    applied = [
        httpx.get(f"{base}/{app}/stats", timeout=30).json()["args"].get("stream_interval_s")
        for app in apps
    ]

    async def serve_all(order: list[int]) -> dict[int, Round]:
        return {k: await serve_round(urls[k], served, texts, a.max_tokens, pids[k]) for k in order}

    async def run() -> list[tuple[Round, list[Round]]]:
        engine.start()
        niceness["engine_in_process"] = os.getpriority(os.PRIO_PROCESS, engine.native_thread_id)
        # Warm-up: one round each (allocator, thread pools, HTTP connections).
        await engine_round(engine, texts, a.max_tokens, stop_ids)
        await serve_all(list(range(len(apps))))
        pairs = []
        order = list(range(len(apps)))
        for i in range(a.rounds):
            if i % 2 == 0:  # ABBA: engine first, then Serve first (apps reversed too)
                e = await engine_round(engine, texts, a.max_tokens, stop_ids)
                got = await serve_all(order)
            else:
                got = await serve_all(order[::-1])
                e = await engine_round(engine, texts, a.max_tokens, stop_ids)
            for k, s in got.items():
                if s.tokens != e.tokens:
                    raise RuntimeError(
                        f"Serve ({apps[k]}) generated {s.tokens} tokens, the engine {e.tokens}"
                    )
            pairs.append((e, [got[k] for k in order]))
        engine.stop()
        return pairs

    try:
        all_pairs = asyncio.run(run())
    finally:
        for app in apps:
            delete_app(app)
        serve.shutdown()
        ray.shutdown()

    def variant(k: int) -> dict:
        ps = [(e, ss[k]) for e, ss in all_pairs]
        rs = [s.tokens_per_s / e.tokens_per_s for e, s in ps]
        return {
            "stream_interval_s": applied[k],
            "serve_to_engine_ratio": round(statistics.median(rs), 4),
            "ratios": [round(r, 4) for r in rs],
            "serve_tokens_per_s": round(statistics.median(s.tokens_per_s for _, s in ps), 1),
            "serve_cpu_ms_per_token": round(
                statistics.median(s.cpu_ms_per_token for _, s in ps), 3
            ),
            "events_per_request": statistics.median(s.events_per_request for _, s in ps),
            # The longest wait for the next text any client saw (all rounds): pacing
            # plus step time plus whatever the machine's load added.
            "max_event_gap_s": round(max(s.max_event_gap_s for _, s in ps), 3),
        }

    variants = [variant(k) for k in range(len(apps))]
    pairs = [(e, ss[0]) for e, ss in all_pairs]
    ratios = [s.tokens_per_s / e.tokens_per_s for e, s in pairs]

    def med_ms(rounds: Iterable[Round]) -> float:
        return round(statistics.median(r.cpu_ms_per_token for r in rounds), 3)

    cpu_ratios = [s.cpu_ms_per_token / e.cpu_ms_per_token for e, s in pairs]
    print(f"model={a.model} batch={a.batch} max_tokens={a.max_tokens} threads={a.torch_threads}")
    print(
        f"{'round':>5} {'engine tok':>10} {'engine tok/s':>12} {'serve tok':>9} "
        f"{'serve tok/s':>11} {'ratio':>6} {'engine cpu ms/tok':>17} {'serve cpu ms/tok':>16}"
    )
    for i, ((e, s), r) in enumerate(zip(pairs, ratios, strict=True)):
        print(
            f"{i:>5} {e.tokens:>10} {e.tokens_per_s:>12.1f} {s.tokens:>9} "
            f"{s.tokens_per_s:>11.1f} {r:>6.3f} {e.cpu_ms_per_token:>17.2f} "
            f"{s.cpu_ms_per_token:>16.2f}"
        )
    if len(variants) > 1:
        print(
            f"{'stream interval s':>17} {'ratio (median)':>14} {'serve cpu ms/tok':>16} "
            f"{'events/request':>14} {'max gap s':>9}"
        )
        for v in variants:
            print(
                f"{v['stream_interval_s']!s:>17} {v['serve_to_engine_ratio']:>14.3f} "
                f"{v['serve_cpu_ms_per_token']:>16.2f} {v['events_per_request']:>14} "
                f"{v['max_event_gap_s']:>9.3f}"
            )
    result = {
        "serve_to_engine_ratio": round(statistics.median(ratios), 4),
        "ratios": [round(r, 4) for r in ratios],
        "engine_tokens_per_s": round(statistics.median(e.tokens_per_s for e, _ in pairs), 1),
        "serve_tokens_per_s": round(statistics.median(s.tokens_per_s for _, s in pairs), 1),
        # CPU per token of the whole request path (client + proxy + replica) over the
        # engine's in process: the overhead in a form other load on the machine moves less.
        "serve_to_engine_cpu_per_token": round(statistics.median(cpu_ratios), 4),
        "engine_cpu_ms_per_token": med_ms(e for e, _ in pairs),
        "serve_cpu_ms_per_token": med_ms(s for _, s in pairs),
        # Serve path CPU ms per token by process (median over rounds).
        "serve_cpu_ms_per_token_by_process": {
            name: round(statistics.median(1e3 * s.cpu_parts[k] / s.tokens for _, s in pairs), 3)
            for k, name in enumerate(("client", "proxy", "replica"))
        },
        # The HTTP client's CPU seconds per wall second (1.0 = one core busy: saturated).
        "client_cpu_share": round(max(s.cpu_parts[0] / s.seconds for _, s in pairs), 3),
        "niceness": niceness,
        "replica_runtime": stats["runtime"],
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "model": a.model,
        "batch": a.batch,
        "max_tokens": a.max_tokens,
        "torch_threads": a.torch_threads,
        "rounds": a.rounds,
        "device": a.device,
        # What the headline app applied (its /stats), not only what was asked for.
        "stream_interval_s": applied[0],
        # Every app timed in the same rounds (the first is the headline).
        "variants": variants,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
