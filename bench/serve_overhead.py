"""Serving overhead: tokens/s through Ray Serve HTTP streaming vs the engine in process.

Both sides run the same model preset, thread count, batch and requests (greedy,
the same prompts, stop at EOS), so they generate the same tokens. One round
submits ``--batch`` requests at once (a full decode batch) and times from the
first submission to the last token; rounds alternate engine / Serve so load
from other work on the machine hits both alike. The figure is the median of
the per-round ratios (Serve tokens/s ÷ engine tokens/s); target ≥ 0.9.

    .venv/bin/python bench/serve_overhead.py [--model small] [--batch 32] [--max-tokens 64]

Prints a table, then one JSON line with ``serve_to_engine_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "bench-overhead"


@dataclass(frozen=True, kw_only=True)
class Round:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


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

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(t) for t in texts))
    return Round(tokens=sum(counts), seconds=time.perf_counter() - t0)


async def serve_round(url: str, model: str, texts: list[str], max_tokens: int) -> Round:
    import httpx

    async def one(client: httpx.AsyncClient, text: str) -> int:
        body = {
            "model": model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        used = -1
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith('data: {"id"') and '"usage"' in line:
                    used = json.loads(line[6:])["usage"]["completion_tokens"]
        if used < 0:
            raise RuntimeError("stream ended without a usage chunk")
        return used

    limits = httpx.Limits(max_connections=len(texts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client, t) for t in texts))
        return Round(tokens=sum(counts), seconds=time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests = batch limit")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    for k, v in (
        ("RAY_USAGE_STATS_ENABLED", "0"),
        ("RAY_AUTH_MODE", "disabled"),
        ("OMP_WAIT_POLICY", "PASSIVE"),
    ):
        os.environ.setdefault(k, v)

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    from serving.config import ModelConfig
    from serving.deploy import delete_app, deploy_app
    from serving.engine import AsyncEngine

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

    port = free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 << 20,
        log_to_driver=False,
    )
    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        logging_config=LoggingConfig(enable_access_log=False),
    )
    deploy_app(
        model=a.model,
        name=APP,
        route_prefix="/",
        max_slots=a.batch,
        max_batch_size=a.batch,
        max_ongoing_requests=a.batch,
        max_queued_requests=-1,
        device=a.device,
        torch_threads=a.torch_threads,
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    served = f"slotune-{a.model}"

    async def run() -> list[tuple[Round, Round]]:
        engine.start()
        # Warm-up: one round each (allocator, thread pools, HTTP connections).
        await engine_round(engine, texts, a.max_tokens, stop_ids)
        await serve_round(url, served, texts, a.max_tokens)
        pairs = []
        for _ in range(a.rounds):
            e = await engine_round(engine, texts, a.max_tokens, stop_ids)
            s = await serve_round(url, served, texts, a.max_tokens)
            pairs.append((e, s))
        engine.stop()
        return pairs

    try:
        pairs = asyncio.run(run())
    finally:
        delete_app(APP)
        serve.shutdown()
        ray.shutdown()

    ratios = [s.tokens_per_s / e.tokens_per_s for e, s in pairs]
    print(f"model={a.model} batch={a.batch} max_tokens={a.max_tokens} threads={a.torch_threads}")
    print(
        f"{'round':>5} {'engine tok':>10} {'engine tok/s':>12} {'serve tok':>9} "
        f"{'serve tok/s':>11} {'ratio':>6}"
    )
    for i, ((e, s), r) in enumerate(zip(pairs, ratios, strict=True)):
        print(
            f"{i:>5} {e.tokens:>10} {e.tokens_per_s:>12.1f} {s.tokens:>9} "
            f"{s.tokens_per_s:>11.1f} {r:>6.3f}"
        )
    result = {
        "serve_to_engine_ratio": round(statistics.median(ratios), 4),
        "ratios": [round(r, 4) for r in ratios],
        "engine_tokens_per_s": round(statistics.median(e.tokens_per_s for e, _ in pairs), 1),
        "serve_tokens_per_s": round(statistics.median(s.tokens_per_s for _, s in pairs), 1),
        "model": a.model,
        "batch": a.batch,
        "max_tokens": a.max_tokens,
        "torch_threads": a.torch_threads,
        "rounds": a.rounds,
        "device": a.device,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
