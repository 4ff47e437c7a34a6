"""Another client's latency while three clients keep 16 MB requests in flight (issue 17).

The built-in ``tiny`` model, started the way slotune starts it (serving.app.cluster), on
loopback. A "victim" client sends short completions one after another and records each
latency, in three phases of the same length: quiet, abused (three attacker processes each
posting a 16 MB prompt again and again, so three are always in flight; each uploads at
``--upload-mb-s``, 12.5 MB/s by default, a client on a 100 Mbit/s link, or unpaced: as
fast as loopback and the two shared cores go; with ``--chunked`` the uploads carry no
``Content-Length``, so the server must cut them off as they stream), quiet again. The
figure is the victim's p99 (and p50) under abuse over the quiet phases' (their mean), measured
in one run; the target is <= 1.5x. The attackers' answers (413 expected) are counted.

A control phase runs as many busy-looping processes as there are attackers and sends
nothing: on a machine whose cores the attackers share with the server (2 here), it is what
their mere CPU use costs the victim, so "abused / CPU hogs" near 1 or below says the server
adds nothing to it.

Bounded: ``--requests`` per phase (default 150), a 60 s timeout per request; the attackers
stop with the abused phase.

    .venv/bin/python bench/abuse.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "abuse"
BIG = 16 << 20


def attacker(  # type: ignore[type-arg]
    url: str, stop: mp.Event, counts: mp.Queue, mb_s: float, chunked: bool, size: int
) -> None:
    """Post a ``size``-byte prompt again and again until ``stop``; upload at ``mb_s`` MB/s
    (a client across a network), or as fast as loopback goes when 0; ``chunked``: with no
    ``Content-Length`` (Transfer-Encoding: chunked)."""
    import httpx

    body = b'{"prompt": "' + b"x" * size + b'", "max_tokens": 4}'
    step = 256 << 10

    def paced():
        for i in range(0, len(body), step):
            yield body[i : i + step]
            time.sleep(step / (mb_s * 1e6))

    headers = {"content-type": "application/json"}
    if not chunked:
        headers["content-length"] = str(len(body))
    seen: dict[str, int] = {}
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            try:
                content = paced() if mb_s > 0 else body
                if chunked and mb_s <= 0:
                    content = iter([body[i : i + step] for i in range(0, len(body), step)])
                r = client.post(url, content=content, headers=headers)
                key = str(r.status_code)
            except httpx.HTTPError as e:
                key = type(e).__name__
            seen[key] = seen.get(key, 0) + 1
    counts.put(seen)


def hog(stop: mp.Event) -> None:  # type: ignore[type-arg]
    """Burn a core until ``stop`` (the control: CPU use with no requests)."""
    while not stop.is_set():
        sum(range(10_000))


def run_alongside(target, args_of, n: int, url: str, requests: int) -> tuple[list[float], list]:
    """The victim's latencies while ``n`` processes run ``target(*args_of(stop))``."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=target, args=args_of(stop)) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # under way
    out = victim(url, requests)
    stop.set()
    return out, procs


def victim(url: str, n: int) -> list[float]:
    import httpx

    out = []
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            t0 = time.perf_counter()
            r = client.post(url, json={"prompt": f"hello {i}", "max_tokens": 4, "temperature": 0})
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"the victim's request {i} got {r.status_code}: {r.text[:200]}")
            out.append(dt)
    return out


def cpu_flags() -> str:
    """The CPU features that decide the model's speed here (docs: FIELD-NOTES "The machines
    are not all alike"), from /proc/cpuinfo."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in wanted if f in have) or "none of " + "/".join(wanted)
    except OSError:
        pass
    return "unknown"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=150, help="victim requests per phase")
    ap.add_argument("--attackers", type=int, default=3)
    ap.add_argument(
        "--upload-mb-s",
        type=float,
        default=12.5,
        help="each attacker's upload rate, MB/s (12.5: a 100 Mbit/s client; 0: unpaced)",
    )
    ap.add_argument(
        "--chunked", action="store_true", help="upload without Content-Length (chunked)"
    )
    ap.add_argument(
        "--prompt-mb",
        type=float,
        default=BIG / 1e6,
        help="the attackers' prompt size, MB (a small one shows the cost per request)",
    )
    a = ap.parse_args()
    if not (20 <= a.requests <= 2000 and 1 <= a.attackers <= 8 and 0 <= a.upload_mb_s <= 1e4):
        raise SystemExit(
            "--requests must be in 20..2000, --attackers in 1..8, --upload-mb-s in 0..10000"
        )
    if not 1e-6 <= a.prompt_mb <= 256:
        raise SystemExit(f"--prompt-mb {a.prompt_mb}: must be in 0.000001..256")
    size = int(a.prompt_mb * 1e6)

    from serving.app.cluster import ray_env_defaults

    ray_env_defaults()
    import ray
    from ray import serve

    from search.calibrate.device import cpu_model_name
    from serving.app.cluster import free_loopback_port, start_local_ray
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import deploy_app

    port = free_loopback_port()
    start_local_ray(num_cpus=2, metrics_port=free_loopback_port(), http_port=port)
    try:
        deploy_app(
            ServerArgs(model="tiny", max_slots=8),
            LiveConfig(max_batch_size=4, max_ongoing_requests=8),
            name=APP,
            route_prefix=f"/{APP}",
            max_queued_requests=16,
        )
        url = f"http://127.0.0.1:{port}/{APP}/v1/completions"
        victim(url, 10)  # warm-up
        quiet1 = victim(url, a.requests)
        hogged, procs = run_alongside(hog, lambda stop: (stop,), a.attackers, url, a.requests)
        for p in procs:
            p.join(60)
        counts = mp.get_context("spawn").Queue()
        abused, procs = run_alongside(
            attacker,
            lambda stop: (url, stop, counts, a.upload_mb_s, a.chunked, size),
            a.attackers,
            url,
            a.requests,
        )
        answers: dict[str, int] = {}
        for _ in procs:
            for k, v in counts.get(timeout=120).items():
                answers[k] = answers.get(k, 0) + v
        for p in procs:
            p.join(60)
        quiet2 = victim(url, a.requests)
    finally:
        serve.shutdown()
        ray.shutdown()
    quiet = quiet1 + quiet2
    rows = {
        "quiet (before)": quiet1,
        f"{a.attackers} CPU hogs (control)": hogged,
        f"{a.attackers} x {a.prompt_mb:g} MB in flight": abused,
        "quiet (after)": quiet2,
    }
    pace = f"{a.upload_mb_s:g} MB/s each" if a.upload_mb_s > 0 else "unpaced"
    pace += ", chunked" if a.chunked else ", with Content-Length"
    pace += f", prompts of {a.prompt_mb:g} MB"
    print(
        f"abuse bench, tiny model, CPU: {cpu_model_name()} ({cpu_flags()}, "
        f"{os.cpu_count()} cores); victim: {a.requests} requests a phase; "
        f"attackers upload {pace}"
    )
    print(f"{'phase':<24} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, xs in rows.items():
        print(
            f"{name:<24} {pct(xs, 0.5) * 1e3:>8.1f} {pct(xs, 0.99) * 1e3:>8.1f} "
            f"{max(xs) * 1e3:>8.1f}"
        )
    ratio99 = pct(abused, 0.99) / statistics.mean([pct(quiet1, 0.99), pct(quiet2, 0.99)])
    ratio50 = pct(abused, 0.5) / statistics.mean([pct(quiet1, 0.5), pct(quiet2, 0.5)])
    hog99 = pct(hogged, 0.99) / statistics.mean([pct(quiet1, 0.99), pct(quiet2, 0.99)])
    vs_hog = pct(abused, 0.99) / pct(hogged, 0.99)
    print(f"attackers' answers: {answers}")
    print(f"victim p99 ratio abused/quiet: {ratio99:.2f} (target <= 1.5); p50 ratio {ratio50:.2f}")
    print(f"control: p99 ratio CPU hogs/quiet {hog99:.2f}; abused/CPU hogs {vs_hog:.2f}")
    print(
        json.dumps(
            {
                "bench": "abuse",
                "cpu": cpu_model_name(),
                "cpu_flags": cpu_flags(),
                "chunked": a.chunked,
                "requests_per_phase": a.requests,
                "attackers": a.attackers,
                "upload_mb_s": a.upload_mb_s,
                "prompt_mb": a.prompt_mb,
                "p99_ratio": round(ratio99, 3),
                "p50_ratio": round(ratio50, 3),
                "cpu_hog_p99_ratio": round(hog99, 3),
                "p99_ratio_vs_cpu_hog": round(vs_hog, 3),
                "quiet_p99_ms": round(pct(quiet, 0.99) * 1e3, 2),
                "abused_p99_ms": round(pct(abused, 0.99) * 1e3, 2),
                "attacker_answers": answers,
                "meets_target": ratio99 <= 1.5,
            }
        )
    )


if __name__ == "__main__":
    main()
