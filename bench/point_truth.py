"""The truth of operating points: each measured once, quietly, in one long window (issue 19).

Starts the canary's own set-up as ``slotune tune`` with no arguments does it
(``controller.tune_setup.prepare_builtin`` on the CLI's defaults: a local Ray, the built-in model,
its metrics; loopback only), then for each point applies the knobs and measures one window
of the canary's saturating closed loop until ``--min-requests`` requests have completed
(or ``--max-window-s``). Its p99 TTFT and TPOT verdicts (``metrics.samples`` on the client's
records; the server's Observation) decide: ``feasible`` when all those of ``--by`` are MET,
``infeasible`` when one is VIOLATED, ``unclear`` otherwise (too few samples, a faulty
window). bench/canary_noise.py judges the points its runs chose with it.

    .venv/bin/python bench/point_truth.py 16,16 8,8     # B,C each; ~1-2 min a point
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BY = ("server", "client", "both")  # whose verdicts decide (server: what the canary judges)


def cli_default(name: str) -> Any:
    """The default of ``slotune tune``'s parameter ``name`` (typer's ``OptionInfo.default``),
    so that the truth is measured on the load the default canary offers."""
    from controller.cli.tune import tune

    return inspect.signature(tune).parameters[name].default.default


def truth_of(verdicts: list[Any]) -> str:
    """``feasible`` if every ``SloVerdict`` is MET, ``infeasible`` if one is VIOLATED, else
    ``unclear`` (INSUFFICIENT samples, or no verdict at all)."""
    from metrics.observation import Verdict

    vs = [None if v is None else v.verdict for v in verdicts]
    if Verdict.VIOLATED in vs:
        return "infeasible"
    return "feasible" if vs and all(v is Verdict.MET for v in vs) else "unclear"


def judged(m: Any, *, by: str, wall_s: float) -> dict[str, Any]:
    """A ``controller.targets.Measurement``'s truth by ``by`` and its figures: each verdict
    as [verdict, p99 ms, samples]; a faulty window is ``unclear``."""
    if by not in BY:
        raise ValueError(f"by={by!r}: choose one of {', '.join(BY)}")
    server = [m.observation.ttft_verdict, m.observation.tpot_verdict]
    client = [None, None] if m.client is None else [m.client.ttft_verdict, m.client.tpot_verdict]
    used = {"server": server, "client": client, "both": server + client}[by]

    def cell(v: Any) -> list[Any] | None:
        return None if v is None else [v.verdict.value, round(v.estimate_s * 1e3, 1), v.samples]

    return {
        "truth": "unclear" if m.fault else truth_of(used),
        "fault": m.fault,
        "server_ttft": cell(server[0]),
        "server_tpot": cell(server[1]),
        "client_ttft": cell(client[0]),
        "client_tpot": cell(client[1]),
        "completed": m.observation.completed,
        "goodput_rps": round(m.observation.goodput_rps, 3),
        "wall_s": round(wall_s, 1),
    }


@contextmanager
def default_canary() -> Iterator[tuple[Any, Any, Any]]:
    """The default canary's set-up, as ``slotune tune`` with no arguments starts it: yields
    (``controller.tune_setup.Setup``, its SLO, its ``RequestShape``), and shuts the local
    Ray down after. Once per process (Ray caches the token a process has loaded)."""
    from controller.attach import shutdown_local
    from controller.cli.tune_backend import ignore_eos
    from controller.targets import RequestShape
    from controller.tune_setup import prepare_builtin
    from metrics.observation import Slo
    from serving.sim.workload import LengthDist

    ttft_ms, tpot_ms = cli_default("slo_ttft_ms"), cli_default("slo_tpot_ms")
    slo = Slo(ttft_p99_s=ttft_ms / 1e3, tpot_p99_s=tpot_ms / 1e3)
    shape = RequestShape(
        prompt_tokens=LengthDist.parse(cli_default("prompt_tokens")),
        output_tokens=LengthDist.parse(cli_default("output_tokens")),
        seed=cli_default("seed"),
        ignore_eos=ignore_eos(None, None, None, True),  # as for the built-in deployment
    )
    # no seed needed: served=False
    prepared = prepare_builtin(
        model=cli_default("model"), slo=slo, shape=shape, quiet=True, served=False
    )
    try:
        yield prepared.setup, slo, shape
    finally:
        shutdown_local()


def check_truth(
    points: list[tuple[int, int]], *, min_requests: int, max_window_s: float, by: str
) -> dict[tuple[int, int], dict[str, Any]]:
    """Each (max_batch_size, max_concurrency) measured once on the default canary's set-up
    (:func:`default_canary`)."""
    from controller.target_errors import TargetError, TargetUnavailable
    from controller.targets import RayServeTarget, WindowPlan
    from search.space import Knobs

    plan = WindowPlan(
        warmup_s=cli_default("warmup_s"),
        window_s=cli_default("window_s"),
        max_window_s=max_window_s,
        min_requests=min_requests,
    )
    out: dict[tuple[int, int], dict[str, Any]] = {}
    with default_canary() as (s, slo, shape):
        target = RayServeTarget(
            url=s.url, slo=slo, reader=s.reader, actuator=s.actuator, plan=plan, shape=shape
        )
        for b, c in points:
            t0, k = time.monotonic(), Knobs(max_batch_size=b, max_concurrency=c)
            try:
                target.apply(k)
                for _ in range(3):  # a faulty window (restart, client errors) is measured again
                    m = target.measure(k)
                    if not m.fault:
                        break
                out[(b, c)] = judged(m, by=by, wall_s=time.monotonic() - t0)
            except (TargetError, TargetUnavailable) as e:
                out[(b, c)] = {"truth": "unclear", "fault": f"{type(e).__name__}: {e}"}
            print(f"  truth B={b} C={c}: {out[(b, c)]['truth']}", file=sys.stderr, flush=True)
    return out


def line(b: int, c: int, t: dict[str, Any]) -> str:
    """One point's truth as a line of the table."""
    if "server_ttft" not in t:
        return f"B={b} C={c}: {t['truth']} ({t['fault']})"
    return (
        f"B={b} C={c}: {t['truth']:<10} server TTFT {t['server_ttft']} TPOT {t['server_tpot']};"
        f" client TTFT {t['client_ttft']} TPOT {t['client_tpot']}; {t['completed']} requests,"
        f" {t['wall_s']:.0f} s {t['fault']}"
    )


def point(text: str) -> tuple[int, int]:
    try:
        b, c = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give B,C (two integers)") from None
    if b < 1 or c < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: B and C must be >= 1")
    return b, c


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("points", nargs="+", type=point, help="max_batch_size,max_concurrency")
    ap.add_argument("--min-requests", type=int, default=1000)
    ap.add_argument("--max-window-s", type=float, default=300.0)
    ap.add_argument("--by", choices=BY, default="server", help="whose verdicts decide")
    args = ap.parse_args(argv)
    if args.min_requests < 1 or not args.max_window_s > 0:
        ap.error("--min-requests and --max-window-s must be positive")
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="pt-"))
    truths = check_truth(
        list(dict.fromkeys(args.points)),
        min_requests=args.min_requests,
        max_window_s=args.max_window_s,
        by=args.by,
    )
    print(f"one quiet window a point, >= {args.min_requests} requests; verdicts by {args.by}")
    for (b, c), t in truths.items():
        print("  " + line(b, c, t))
    print(json.dumps({"bench": "point_truth", "date": time.strftime("%Y-%m-%d %H:%M UTC",
                      time.gmtime()), "by": args.by,
                      "truths": {f"{b},{c}": t for (b, c), t in truths.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
