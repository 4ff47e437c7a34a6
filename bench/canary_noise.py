"""The default canary beside a noisy neighbour, against a baseline revision (issue 19).

``slotune tune`` on its embedded defaults (``make demo``; only ``--out`` and ``--quiet``
added) runs ``--runs`` times per variant while a neighbour the bench starts and stops keeps
one core ``--duty`` busy (it quits by itself at a deadline or when the bench is gone).
``new`` is this checkout; ``baseline`` is ``--baseline REV`` in a ``git worktree`` with its
own ``make venv`` (both reused). Runs alternate A B B A so that the machine's drift hits both.

Then each distinct chosen point (curve.json's ``operating_point``) is measured once, quietly,
on this checkout's own set-up (``controller.tune_setup.prepare`` on the CLI's defaults) in a
window of >= ``--truth-requests`` requests: ``feasible`` when its p99 TTFT and TPOT verdicts
(``--truth-by``) are all MET, ``infeasible`` when one is VIOLATED, else ``unclear``. A run
passes when it exits 0 with a feasible point; the issue asks for >= 9 of 10.

Prints a row per run, the truths and a summary per variant, then one JSON line last.
Loopback only; each run is bounded by ``--run-timeout-s`` (then SIGINT, TERM, KILL).

    .venv/bin/python bench/canary_noise.py                           # 10 + 10 runs, ~1-2 h
    .venv/bin/python bench/canary_noise.py --runs 1 --only baseline  # smoke test, ~5 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.noisy_neighbour import Neighbour, NoiseSpec  # noqa: E402
from bench.point_truth import BY, check_truth, line  # noqa: E402

VARIANTS = ("new", "baseline")
PASS_SHARE = 0.9  # issue 19: a truly feasible point in >= 9 of 10 runs


# --- the checkouts
@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    root: Path  # the checkout it runs from
    rev: str  # git describe of that checkout

    @property
    def slotune(self) -> Path:
        return self.root / ".venv" / "bin" / "slotune"


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def baseline_variant(rev: str, where: Path | None, venv_timeout_s: float) -> Variant:
    """``rev`` in a worktree (``where``, default $TMPDIR/slotune-baseline-SHA), its ``.venv``
    built by ``make venv``; both reused when present and on ``rev``."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    wt = where or Path(tempfile.gettempdir()) / f"slotune-baseline-{sha[:12]}"
    if wt.exists():
        if git("rev-parse", "HEAD", cwd=wt) != sha:
            raise SystemExit(f"--baseline-dir {wt}: exists but is not at {rev} ({sha[:12]})")
    else:
        git("worktree", "add", "--detach", str(wt), sha)
    log = wt / "make-venv.log"
    print(f"baseline {rev}: {wt}; make venv (log {log}) ...", file=sys.stderr, flush=True)
    with log.open("w") as f:
        rc = subprocess.run(
            ["make", "venv"], cwd=wt, stdout=f, stderr=subprocess.STDOUT, timeout=venv_timeout_s
        ).returncode
    if rc != 0:
        raise SystemExit(f"make venv in {wt} failed (exit {rc}); see {log}")
    return Variant(name="baseline", root=wt, rev=git("describe", "--always", "--dirty", cwd=wt))


def schedule(runs: int, only: str) -> list[tuple[int, str]]:
    """(round, variant) in A B B A order, so slow drift of the machine hits both alike."""
    names = VARIANTS if only == "both" else (only,)
    out: list[tuple[int, str]] = []
    for i in range(runs):
        out += [(i, n) for n in (names if i % 2 == 0 else names[::-1])]
    return out


# --- one canary run
@dataclass(frozen=True, kw_only=True)
class RunResult:
    variant: str
    round: int
    exit_code: int | None  # None: killed at the time limit
    chosen: tuple[int, int] | None  # (max_batch_size, max_concurrency)
    wall_s: float
    trials: int
    stop_reason: str
    duty: float
    out: Path


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to the run's own process group (it writes its report), then TERM, then KILL."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_canary(
    v: Variant, rnd: int, *, out: Path, noise: NoiseSpec, timeout_s: float, keep_ray: bool
) -> RunResult:
    out.mkdir(parents=True)
    ray_tmp = out / "t"  # short: Ray's socket paths live under it (AF_UNIX: ~107 chars)
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    cmd = [str(v.slotune), "tune", "--out", str(out / "report"), "--quiet"]
    rc: int | None = None
    with (out / "log.txt").open("wb") as log, Neighbour(noise) as nb:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=v.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  {v.name} round {rnd}: past {timeout_s:.0f} s, stopping", file=sys.stderr)
        finally:
            if proc.poll() is None:
                stop_group(proc)
        wall = time.monotonic() - t0
    if not keep_ray:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    chosen, trials, stop = read_report(out / "report" / "curve.json")
    return RunResult(
        variant=v.name,
        round=rnd,
        exit_code=rc,
        chosen=chosen,
        wall_s=wall,
        trials=trials,
        stop_reason=stop,
        duty=nb.duty,
        out=out,
    )


def read_report(path: Path) -> tuple[tuple[int, int] | None, int, str]:
    """(chosen knobs, trial count, stop reason) from a run's curve.json (None, 0, why)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, 0, f"no report ({type(e).__name__})"
    op = d.get("operating_point")
    chosen = None if op is None else (int(op["max_batch_size"]), int(op["max_concurrency"]))
    return chosen, len(d.get("trials") or []), str(d.get("stop_reason", ""))


def calibrate_quietly() -> str:
    """The device's calibration (cached under ~/.cache/slotune), measured now if missing, at
    the built-in replica's threads, as prepare() would: so no run calibrates beside the noise."""
    from controller.attach import embedded_threads
    from controller.tune_plan import hardware_spec
    from controller.tune_setup import local_device

    return hardware_spec(local_device(), quiet=False, threads=embedded_threads())[1]


# --- the summary
def summary(results: list[RunResult], truths: dict[tuple[int, int], dict[str, Any]]) -> dict:
    """Per variant: runs, exit codes, passes (exit 0 and a truly feasible point)."""
    out: dict[str, Any] = {}
    for name in VARIANTS:
        rs = [r for r in results if r.variant == name]
        if not rs:
            continue
        passes = sum(
            r.exit_code == 0
            and r.chosen is not None
            and truths.get(r.chosen, {}).get("truth") == "feasible"
            for r in rs
        )
        duties = [r.duty for r in rs if math.isfinite(r.duty)]
        out[name] = {
            "runs": len(rs),
            "passes": passes,
            "target_met": passes >= math.ceil(PASS_SHARE * len(rs) - 1e-9),
            "exit_codes": {
                str(k): v
                for k, v in sorted(
                    Counter("timeout" if r.exit_code is None else r.exit_code for r in rs).items(),
                    key=lambda kv: str(kv[0]),
                )
            },
            "chosen": [None if r.chosen is None else list(r.chosen) for r in rs],
            "truths": [
                None if r.chosen is None else truths.get(r.chosen, {}).get("truth") for r in rs
            ],
            "median_wall_s": round(sorted(r.wall_s for r in rs)[len(rs) // 2], 1),
            "mean_duty": round(sum(duties) / len(duties), 3) if duties else None,
        }
    return out


def row(r: RunResult, truth: str) -> str:
    rc = "T/O" if r.exit_code is None else str(r.exit_code)
    b, c = r.chosen if r.chosen else ("-", "-")
    return (
        f"{r.round:>3} {r.variant:<8} {rc:>4} {b!s:>3} {c!s:>3} {truth:<10} "
        f"{r.wall_s:>6.0f} {r.trials:>6} {r.duty:>5.2f}  {r.stop_reason[:60]}"
    )


HEADER = (
    f"{'#':>3} {'variant':<8} {'exit':>4} {'B':>3} {'C':>3} {'truth':<10} "
    f"{'wall s':>6} {'trials':>6} {'duty':>5}  stop"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per variant")
    ap.add_argument("--only", choices=("new", "baseline", "both"), default="both")
    ap.add_argument("--baseline", default="6de84e2", help="the git revision of today's code")
    ap.add_argument("--baseline-dir", type=Path, default=None, help="its worktree (reused)")
    ap.add_argument("--duty", type=float, default=0.5, help="the neighbour's share of one core")
    ap.add_argument("--period-ms", type=float, default=100.0, help="its busy + idle period")
    ap.add_argument("--run-timeout-s", type=float, default=900.0, help="each run's limit")
    ap.add_argument("--truth-requests", type=int, default=1000, help="per truth window")
    ap.add_argument("--truth-max-window-s", type=float, default=300.0)
    ap.add_argument(
        "--truth-by",
        choices=BY,
        default="server",
        help="whose p99 verdicts decide the truth (server: what the canary judges)",
    )
    ap.add_argument("--no-truth", action="store_true", help="skip the quiet re-measurement")
    ap.add_argument("--out", type=Path, default=None, help="bench folder (default: a temp one)")
    ap.add_argument("--keep-ray-logs", action="store_true", help="keep each run's RAY_TMPDIR")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: must be >= 1")
    if args.run_timeout_s <= 0 or args.truth_max_window_s <= 0 or args.truth_requests < 1:
        ap.error("--run-timeout-s, --truth-max-window-s and --truth-requests must be positive")
    try:
        args.noise = NoiseSpec(
            duty=args.duty, period_s=args.period_ms / 1e3, deadline_s=args.run_timeout_s + 120.0
        )
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = args.out or Path(tempfile.mkdtemp(prefix="cn-"))
    variants: dict[str, Variant] = {}
    if args.only in ("new", "both"):
        variants["new"] = Variant(name="new", root=ROOT, rev=git("describe", "--always", "--dirty"))
    if args.only in ("baseline", "both"):
        variants["baseline"] = baseline_variant(args.baseline, args.baseline_dir, 1200.0)
    print(f"calibration: {calibrate_quietly()}", file=sys.stderr, flush=True)
    results: list[RunResult] = []
    t0 = time.monotonic()
    for rnd, name in schedule(args.runs, args.only):
        r = run_canary(
            variants[name],
            rnd,
            out=bench / f"{rnd:02d}-{name}",
            noise=args.noise,
            timeout_s=args.run_timeout_s,
            keep_ray=args.keep_ray_logs,
        )
        results.append(r)
        print(row(r, "?"), file=sys.stderr, flush=True)
    runs_wall = time.monotonic() - t0
    points = sorted({r.chosen for r in results if r.chosen is not None})
    os.environ["RAY_TMPDIR"] = str(bench / "tt")  # the truth check's Ray, in this process
    truths = (
        {}
        if args.no_truth or not points
        else check_truth(
            points,
            min_requests=args.truth_requests,
            max_window_s=args.truth_max_window_s,
            by=args.truth_by,
        )
    )
    report(args, variants, results, truths, bench, runs_wall)


def report(
    args: argparse.Namespace,
    variants: dict[str, Variant],
    results: list[RunResult],
    truths: dict[tuple[int, int], dict[str, Any]],
    bench: Path,
    runs_wall: float,
) -> None:
    from search.calibrate.device import cpu_model_name

    cpu, date = cpu_model_name(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"slotune tune (embedded defaults) beside a neighbour at {args.duty:g} of one core "
        f"({args.period_ms:g} ms period); {cpu}; {date}; folder {bench}"
    )
    for v in variants.values():
        print(f"  {v.name}: {v.rev} at {v.root}")
    print("\n" + HEADER)
    for r in results:
        truth = "-" if r.chosen is None else truths.get(r.chosen, {}).get("truth", "unchecked")
        print(row(r, truth))
    print(
        f"\ntruth: one quiet window per chosen point, >= {args.truth_requests} requests, "
        f"verdicts by {args.truth_by} (verdict, p99 ms, samples)"
    )
    for (b, c), t in sorted(truths.items()):
        print("  " + line(b, c, t))
    summ = summary(results, truths)
    print("\nsummary (pass: exit 0 with a truly feasible point)")
    for name, s in summ.items():
        print(
            f"  {name}: {s['passes']}/{s['runs']} passes (target >= {PASS_SHARE:.0%}: "
            f"{'met' if s['target_met'] else 'NOT met'}); exit codes {s['exit_codes']}; "
            f"median wall {s['median_wall_s']:.0f} s; neighbour duty {s['mean_duty']}"
        )
    print(
        json.dumps(
            {
                "bench": "canary_noise",
                "date": date,
                "cpu": cpu,
                "load_average_1m": round(os.getloadavg()[0], 1),
                "duty_target": args.duty,
                "period_ms": args.period_ms,
                "runs_per_variant": args.runs,
                "revisions": {n: v.rev for n, v in variants.items()},
                "runs_wall_s": round(runs_wall, 1),
                "truth_by": args.truth_by,
                "truths": {f"{b},{c}": t for (b, c), t in sorted(truths.items())},
                "variants": summ,
            }
        )
    )


if __name__ == "__main__":
    main()
