"""Probe a live slotune deployment as a careless client and an attacker would, and count.

On the built-in ``tiny`` model, started the way slotune starts it (loopback Ray with token
auth, serving.app.cluster.start_local_ray), over loopback only, bounded in count and time:

1. **Bad requests**: malformed JSON, wrong types, bad encodings, deep nesting, a lone
   surrogate, oversized bodies, unknown routes and methods, … Each must get a 4xx with an
   OpenAI-style JSON error body, promptly; a reference request after each must succeed.
2. **Overload**: ``--streams`` concurrent streams against an admission limit of 2 and a
   queue of 2. Every request is either completed or refused at once with a JSON body and
   ``Retry-After``; none is lost (accepted, then cut off or never answered).
3. **Disconnects**: ``--disconnects`` streams closed by the client after their first token;
   the server must account for every one of them (completed, if it finished first, or
   aborted: ``slotune_requests_total`` + ``slotune_aborted_requests_total``).

Prints a table and one JSON line last: ``bad_inputs``/``bad_handled``, ``overload_*``,
``disconnects``/``disconnects_counted``, ``lost``.

    .venv/bin/python bench/reliability_probe.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "probe"
REF = {"prompt": "hello", "max_tokens": 2, "temperature": 0}


def bad_inputs() -> list[tuple[str, str, str, dict[str, str], bytes]]:
    """(name, method, path, headers, body): each one a request the server must refuse."""
    j = {"content-type": "application/json"}

    def body(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    deep = b"[" * 20_000 + b"]" * 20_000
    cases: list[tuple[str, str, str, dict[str, str], bytes]] = [
        ("empty body", "POST", "/v1/completions", j, b""),
        ("not json", "POST", "/v1/completions", j, b"prompt=hi"),
        ("truncated json", "POST", "/v1/completions", j, b'{"prompt": "hi"'),
        ("json array", "POST", "/v1/completions", j, b"[1, 2]"),
        ("json string", "POST", "/v1/completions", j, b'"hi"'),
        ("json null", "POST", "/v1/completions", j, b"null"),
        ("deep nesting 20k", "POST", "/v1/completions", j, deep),
        (
            "deep object nesting",
            "POST",
            "/v1/completions",
            j,
            b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
        ),
        ("lone surrogate", "POST", "/v1/completions", j, b'{"prompt": "\\ud800"}'),
        ("invalid utf-8", "POST", "/v1/completions", j, b'{"prompt": "\xff\xfe"}'),
        ("NaN literal", "POST", "/v1/completions", j, b'{"prompt": "hi", "temperature": NaN}'),
        (
            "Infinity literal",
            "POST",
            "/v1/completions",
            j,
            b'{"prompt":"hi","max_tokens":Infinity}',
        ),
        (
            "huge integer",
            "POST",
            "/v1/completions",
            j,
            b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        ),
        ("no prompt", "POST", "/v1/completions", j, body({"max_tokens": 2})),
        ("prompt number", "POST", "/v1/completions", j, body({"prompt": 5})),
        ("prompt null", "POST", "/v1/completions", j, body({"prompt": None})),
        ("prompt object", "POST", "/v1/completions", j, body({"prompt": {"a": 1}})),
        ("prompt list of lists", "POST", "/v1/completions", j, body({"prompt": [[[1]]]})),
        ("empty prompt list", "POST", "/v1/completions", j, body({"prompt": []})),
        (
            "max_tokens negative",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "max_tokens": -1}),
        ),
        ("max_tokens zero", "POST", "/v1/completions", j, body({"prompt": "hi", "max_tokens": 0})),
        (
            "max_tokens float",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "max_tokens": 2.5}),
        ),
        (
            "max_tokens string",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "max_tokens": "2"}),
        ),
        (
            "max_tokens bool",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "max_tokens": True}),
        ),
        (
            "max_tokens past context",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "max_tokens": 10**9}),
        ),
        (
            "temperature negative",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "temperature": -1}),
        ),
        (
            "temperature huge",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "temperature": 1e308}),
        ),
        (
            "temperature string",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "temperature": "hot"}),
        ),
        ("stream string", "POST", "/v1/completions", j, body({"prompt": "hi", "stream": "yes"})),
        (
            "stream_options without stream",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "stream_options": {"include_usage": True}}),
        ),
        (
            "include_usage not bool",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}),
        ),
        (
            "stream_options list",
            "POST",
            "/v1/completions",
            j,
            body({"prompt": "hi", "stream": True, "stream_options": [1]}),
        ),
        ("n = 2", "POST", "/v1/completions", j, body({"prompt": "hi", "n": 2})),
        ("n = 0", "POST", "/v1/completions", j, body({"prompt": "hi", "n": 0})),
        ("unknown model", "POST", "/v1/completions", j, body({"prompt": "hi", "model": "gpt-9"})),
        ("model not string", "POST", "/v1/completions", j, body({"prompt": "hi", "model": 3})),
        ("unhonoured field", "POST", "/v1/completions", j, body({"prompt": "hi", "best_of": 3})),
        ("prompt past context", "POST", "/v1/completions", j, body({"prompt": "x" * 200_000})),
        ("16 MB prompt", "POST", "/v1/completions", j, body({"prompt": "x" * (16 << 20)})),
        ("64 MB body", "POST", "/v1/completions", j, b'{"prompt": "' + b"x" * (64 << 20) + b'"}'),
        ("token ids out of vocab", "POST", "/v1/completions", j, body({"prompt": [10**9]})),
        ("negative token id", "POST", "/v1/completions", j, body({"prompt": [-1]})),
        ("GET on completions", "GET", "/v1/completions", {}, b""),
        ("PUT on completions", "PUT", "/v1/completions", j, body(REF)),
        ("unknown route", "POST", "/v1/nope", j, body(REF)),
        ("path traversal", "GET", "/../../etc/passwd", {}, b""),
        ("text/plain body", "POST", "/v1/completions", {"content-type": "text/plain"}, b"hello"),
    ]
    return cases


async def probe_bad(client: Any, base: str) -> tuple[list[dict[str, Any]], int]:
    rows, ref_ok = [], 0
    for name, method, path, headers, data in bad_inputs():
        t0 = time.perf_counter()
        try:
            r = await client.request(method, base + path, headers=headers, content=data, timeout=30)
            status, text = r.status_code, r.text
        except Exception as e:  # a hang or a dropped connection is a finding, not a crash
            status, text = 0, f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        try:
            err = json.loads(text).get("error")
            json_body = isinstance(err, dict) and "message" in err
        except (ValueError, AttributeError):
            json_body = False
        ref = await client.post(base + "/v1/completions", json=REF, timeout=60)
        ref_ok += ref.status_code == 200
        rows.append(
            {
                "case": name,
                "status": status,
                "json_error": json_body,
                "s": round(dt, 3),
                "handled": 400 <= status < 500,
            }
        )
    return rows, ref_ok


async def one_stream(client: Any, url: str, *, cut_after_first: bool = False) -> dict[str, Any]:
    body = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", url, json=body, timeout=120) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    json_body = "error" in json.loads(text)
                except ValueError:
                    json_body = False
                return {
                    "status": r.status_code,
                    "json_error": json_body,
                    "retry_after": r.headers.get("retry-after"),
                }
            finish = None
            async for line in r.aiter_lines():
                if cut_after_first and line.startswith("data: {"):
                    return {"status": 200, "cut": True}
                m = re.search(r'"finish_reason":\s*"(\w+)"', line)
                if m:
                    finish = m.group(1)
            return {"status": 200, "finish": finish}
    except Exception as e:
        return {"status": 0, "error": f"{type(e).__name__}: {e}"}


def requests_counted(metrics_url: str) -> float:
    """Requests the server accounted for, completed or aborted, over every label (Ray's
    export port): slotune_requests_total + slotune_aborted_requests_total."""
    import httpx

    total = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith(("ray_slotune_requests_total{", "ray_slotune_aborted_requests_total{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def settled_count(metrics_url: str) -> float:
    """The request counter once it stops moving (Ray exports it every second)."""
    n = requests_counted(metrics_url)
    while True:
        await asyncio.sleep(2.5)
        m = requests_counted(metrics_url)
        if m == n:
            return n
        n = m


async def wait_counted(metrics_url: str, want: float, timeout_s: float = 20.0) -> float:
    deadline = time.monotonic() + timeout_s
    n = requests_counted(metrics_url)
    while n < want and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        n = requests_counted(metrics_url)
    return n


async def run(a: argparse.Namespace, base: str, metrics_url: str) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=a.streams + 10)
    async with httpx.AsyncClient(limits=limits) as client:
        bad, ref_ok = await probe_bad(client, base)
        url = base + "/v1/completions"
        before = await settled_count(metrics_url)
        over = await asyncio.gather(*(one_stream(client, url) for _ in range(a.streams)))
        done = sum(o["status"] == 200 and o.get("finish") is not None for o in over)
        accepted = sum(o["status"] == 200 for o in over)
        refused = [o for o in over if o["status"] in (429, 503)]
        await wait_counted(metrics_url, before + accepted)
        await asyncio.sleep(2.5)
        counted_over = requests_counted(metrics_url) - before
        before = await settled_count(metrics_url)
        cuts = []
        for _ in range(a.disconnects // 2):  # two at a time: the admission limit, no refusals
            cuts += await asyncio.gather(
                *(one_stream(client, url, cut_after_first=True) for _ in range(2))
            )
        cut = sum(bool(c.get("cut")) for c in cuts)
        counted_cut = await wait_counted(metrics_url, before + cut) - before
        await asyncio.sleep(2.5)
        counted_cut = requests_counted(metrics_url) - before
    return {
        "bad": bad,
        "reference_ok_after_bad": ref_ok,
        "overload_streams": a.streams,
        "overload_accepted": accepted,
        "overload_completed": done,
        "overload_refused": len(refused),
        "overload_refused_json_retry_after": sum(
            bool(o["json_error"] and o["retry_after"]) for o in refused
        ),
        "overload_other": a.streams - accepted - len(refused),
        "overload_counted_by_server": counted_over,
        "disconnects": cut,
        "disconnects_counted": counted_cut,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--disconnects", type=int, default=50)
    a = ap.parse_args()
    if not (1 <= a.streams <= 500 and 1 <= a.disconnects <= 200):
        raise SystemExit("--streams must be in 1..500 and --disconnects in 1..200")

    from serving.app.cluster import ray_env_defaults

    ray_env_defaults()
    import ray
    from ray import serve

    from search.calibrate.device import cpu_model_name
    from serving.app.cluster import free_loopback_port, start_local_ray
    from serving.app.config import LiveConfig, ServerArgs
    from serving.app.deploy import deploy_app

    port, mport = free_loopback_port(), free_loopback_port()
    start_local_ray(num_cpus=2, metrics_port=mport, http_port=port)
    try:
        deploy_app(
            ServerArgs(model="tiny", max_slots=4),
            LiveConfig(max_batch_size=2, max_ongoing_requests=2),
            name=APP,
            route_prefix=f"/{APP}",
            max_queued_requests=2,
        )
        res = asyncio.run(
            run(a, f"http://127.0.0.1:{port}/{APP}", f"http://127.0.0.1:{mport}/metrics")
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    bad = res.pop("bad")
    print(f"reliability probe, tiny model, CPU: {cpu_model_name()}")
    print(f"{'case':<32} {'status':>6} {'json':>5} {'s':>7}")
    for r in bad:
        print(f"{r['case']:<32} {r['status']:>6} {str(r['json_error']):>5} {r['s']:>7.3f}")
    handled = sum(r["handled"] for r in bad)
    print(
        f"bad requests refused with a 4xx: {handled}/{len(bad)}; "
        f"reference request OK after each: {res['reference_ok_after_bad']}/{len(bad)}"
    )
    for k, v in res.items():
        print(f"{k}: {v}")
    lost = (res["overload_accepted"] - res["overload_completed"]) + res["overload_other"]
    out = {
        "bench": "reliability_probe",
        "cpu": cpu_model_name(),
        "bad_inputs": len(bad),
        "bad_handled": handled,
        "bad_json_error": sum(r["json_error"] for r in bad),
        "bad_5xx": sum(r["status"] >= 500 for r in bad),
        "bad_no_answer": sum(r["status"] == 0 for r in bad),
        "lost": lost,
        **res,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
