"""``slotune simulate``: run the tuner against the simulated fleet of a scenario.

Answers "what would this fleet do?" for hardware this machine does not have:
the roofline seeds the tuner, the simulator (serving/sim/simulator.py, the engine's own
scheduler on a virtual clock) measures each trial, and the command prints the
measured curve, the chosen point and why the search stopped. Exit code 3 when
no point met the SLO (a canary gate), 2 on bad input.

``--scenario local`` is this deployment as ``slotune tune`` runs it by default: this
machine's calibration and its served-step model (``slotune calibrate --served``; see
controller/sim/served.py), the canary's default workload and SLO, and the same search plan
(box, seeds, TPOT model) ``slotune tune`` makes from them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from controller.cli import flags
from controller.cli.paths import output_dir, study_storage
from controller.errors import BadInput, NoFeasiblePoint
from controller.sim.scenarios import (
    HELD_OUT_SCENARIOS,
    SCENARIOS,
    SLOW_SCENARIOS,
    resolve_scenario,
)
from controller.sim.served import LOCAL
from controller.sim.target import SimTarget
from metrics.observation import Slo
from search.space import Knobs
from search.stop_rule import PointSummary, StopRule
from search.tuner import SAMPLERS, Tuner, TunerTrial

NAMES = [*SCENARIOS, *SLOW_SCENARIOS, *HELD_OUT_SCENARIOS, LOCAL]  # what --scenario takes

if TYPE_CHECKING:
    from controller.sim.scenarios import Scenario
    from controller.tune_plan import SearchPlan

logger = logging.getLogger(__name__)


def _fmt(x: object, scale: float = 1.0, digits: int = 1) -> str:
    if isinstance(x, (int, float)) and math.isfinite(x):
        return f"{x * scale:.{digits}f}"
    return "-"


def simulate_cmd(
    scenario: str = typer.Option(
        "h100-8b",
        "--scenario",
        "-s",
        help=f"One of: {', '.join(NAMES)} (local: this deployment, from `slotune calibrate"
        " --served`).",
    ),
    served: Path = typer.Option(
        None,
        "--served",
        help="local: the served-step model JSON (default: this machine's cached one).",
    ),
    model: str = typer.Option(None, "--model", help="Override the scenario's model."),
    hardware: str = typer.Option(
        None, "--hardware", help="Override the device (catalogue name or JSON)."
    ),
    tp: int = typer.Option(None, "--tp", help="Override the tensor-parallel degree."),
    slo_ttft_ms: float = typer.Option(None, "--slo-ttft-ms", help="p99 TTFT SLO (ms)."),
    slo_tpot_ms: float = typer.Option(None, "--slo-tpot-ms", help="p99 TPOT SLO (ms)."),
    max_trials: int = typer.Option(20, "--max-trials", help="Trial budget."),
    sampler: str = typer.Option("gp", "--sampler", help=f"One of: {', '.join(SAMPLERS)}."),
    no_seed: bool = typer.Option(False, "--no-seed", help="Search without the roofline seed."),
    seed: int = typer.Option(0, "--seed", help="Seed of the simulator and the sampler."),
    study: str = typer.Option(
        None, "--study", help="Optuna study storage: a journal file or a URL (default: memory)."
    ),
    study_name: str = typer.Option(None, "--study-name", help="Study name (default: scenario)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object, not the table."),
    out: Path = typer.Option(
        None,
        "--out",
        help="Run the whole canary loop and export its report here (curve.json, plots,"
        " report.html: what `slotune compare` reads), its study in OUT/study.journal.",
    ),
    price_per_hour: float = typer.Option(
        None, "--price-per-hour", help="With --out: USD per device-hour, for $/Mtok."
    ),
    curve_points: int = typer.Option(
        0, "--curve-points", help="With --out: the curve sweep's batches after the search."
    ),
) -> None:
    """Tune a simulated fleet: print the measured curve and the chosen point."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    flags.seed("--seed", seed)
    flags.at_least("--max-trials", max_trials, 1)
    flags.at_least("--tp", tp, 1)
    for flag, ms in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if ms is not None:
            flags.positive_ms(flag, ms)
    flags.at_least("--curve-points", curve_points, 0)
    flags.price("--price-per-hour", price_per_hour)
    if out is None and (price_per_hour is not None or curve_points):
        raise BadInput("--price-per-hour and --curve-points go with --out (the exported run)")
    if out is not None:
        out = output_dir("--out", out)
        study = study or str(out / "study.journal")
    if study is not None:
        study_storage("--study", study, must_exist=False)
    if served is not None and scenario != LOCAL:
        raise BadInput(f"--served {served}: only --scenario {LOCAL} reads a served model")
    plan = None
    try:
        if scenario == LOCAL:
            sc, plan = _local(served)
        else:
            sc = resolve_scenario(scenario)
        changes: dict[str, object] = {}
        if model is not None:
            changes["model"] = model
        if hardware is not None:
            changes["hardware"] = hardware
        if tp is not None:
            changes["tp"] = tp
        # Same flags and units as `slotune tune` and `slotune roofline`.
        ttft_slo = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0
        tpot_slo = None if slo_tpot_ms is None else slo_tpot_ms / 1000.0
        if ttft_slo is not None or tpot_slo is not None:
            changes["slo"] = Slo(
                ttft_p99_s=sc.slo.ttft_p99_s if ttft_slo is None else ttft_slo,
                tpot_p99_s=sc.slo.tpot_p99_s if tpot_slo is None else tpot_slo,
            )
        if changes:
            sc = replace(sc, **changes, name=f"{sc.name}-custom")
        if sampler not in SAMPLERS:
            raise ValueError(f"--sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")
        target = SimTarget(sc, seed=seed)
        seeds, model_tpot = target.seed_knobs(), target.model_tpot_s
        space = target.space
        if plan is not None:  # the local scenario: the plan slotune tune makes
            seeds, model_tpot, space = list(plan.seeds), plan.model_tpot_s, plan.space
        tuner = Tuner(
            space=space,
            slo=target.slo,
            storage=study,
            study_name=study_name or sc.name,
            seed_knobs=[] if no_seed else seeds,
            model_tpot_s=None if no_seed else model_tpot,
            sampler=sampler,
            seed=seed,
            stop_rule=StopRule(max_trials=max_trials),
        )
    except ValueError as e:
        raise BadInput(str(e)) from None

    d = target.describe()
    if out is not None:  # the canary loop itself, its report exported
        from controller.tune_simulated import run_simulated

        outcome = run_simulated(
            target,
            tuner,
            out_dir=out,
            max_trials=max_trials,
            usd_per_hour=price_per_hour,
            curve_points=curve_points,
        )
        reason: str | None = outcome.stop_reason
    else:
        while not tuner.should_stop():
            knobs = tuner.propose()
            tuner.report(knobs, target.measure(knobs))
        reason = tuner.stop_reason()
    records = tuner.trials()
    best = tuner.best() or tuner.best(confirmed=False)
    if as_json:
        typer.echo(json.dumps(_result(d, records, reason, best), indent=2, default=str))
    else:
        _print_table(target, d, records, reason, best)
    if out is not None:
        typer.echo(f"report: {out / 'report.html'}")
    if best is None:
        raise NoFeasiblePoint(
            f"no knob met p99 TTFT <= {target.slo.ttft_p99_s:g}s and TPOT <="
            f" {target.slo.tpot_p99_s:g}s in {len(records)} trials"
        )


def _local(path: Path | None) -> tuple[Scenario, SearchPlan]:
    """The local scenario and the search plan ``slotune tune`` makes of this deployment:
    the served model at ``path`` (default: the cache of the built-in small app at the
    replica's threads) beside this machine's calibration at those threads."""
    from controller.attach import embedded_threads
    from controller.sim.served import LocalDeployment, local_scenario
    from controller.tune_plan import DEFAULT_MAX_SLOTS, MODELS, plan_search
    from controller.tune_served import load_served, served_path
    from search.calibrate import device as calib
    from search.roofline.hardware import HardwareSpec

    threads = embedded_threads()
    hw_path = calib.default_cache_path(calib.pick_device("cpu"), threads=threads)
    src = path or served_path("cpu", threads, MODELS["small"])
    got = load_served(src)
    if got is None:
        raise ValueError(
            f"--scenario {LOCAL}: no served model at {src} (run: slotune calibrate --served)"
        )
    if not hw_path.is_file():
        raise ValueError(
            f"--scenario {LOCAL}: no calibration at {hw_path} (run slotune tune once, or "
            f"slotune calibrate --threads {threads} --out {hw_path})"
        )
    model = {v: k for k, v in MODELS.items()}.get(got.model)
    if model is None:
        raise ValueError(f"--served {src}: model {got.model!r} is not a built-in app's")
    dep = LocalDeployment(served=got, hardware_path=hw_path, max_batch=DEFAULT_MAX_SLOTS[model])
    sc = local_scenario(dep)
    ctx = round(got.prompt_tokens + got.output_tokens / 2)
    plan = plan_search(
        model=model,
        hardware=HardwareSpec.from_json(hw_path),
        slo=dep.slo,
        price=None,
        max_slots=dep.max_batch,
        context=ctx,
        served=got,
    )
    return sc, plan


def _result(
    d: dict[str, object],
    records: list[TunerTrial],
    reason: str | None,
    best: tuple[Knobs, PointSummary] | None,
) -> dict[str, object]:
    result: dict[str, object] = {**d, "stop_reason": reason, "trials": len(records)}
    result["chosen"] = None
    if best is not None:
        knobs, p = best
        result["chosen"] = {
            **knobs.as_dict(),
            "goodput_rps": p.goodput_rps,
            "measurements": p.measurements,
            "ttft_p99_s": p.ttft_p99_s,
            "tpot_p99_s": p.tpot_p99_s,
        }
    return result


def _print_table(
    target: SimTarget,
    d: dict[str, object],
    records: list[TunerTrial],
    reason: str | None,
    best: tuple[Knobs, PointSummary] | None,
) -> None:
    typer.echo(
        f"{d['description']}: {d['model']} on {d['hardware']} x{d['tp']} ({d['hardware_source']})"
    )
    typer.echo(
        f"SLO p99 TTFT {target.slo.ttft_p99_s:g}s, TPOT {target.slo.tpot_p99_s * 1e3:g}ms;"
        + (
            f" load {d['rate_rps']} req/s;"
            if d["rate_rps"] is not None
            else " load: a closed loop, one client per admission slot;"
        )
        + f" KV capacity {d['kv_capacity']} sequences;"
        f" roofline operating point B={d['seed_batch']}"
    )
    typer.echo("")
    typer.echo(
        f"{'trial':>5} {'phase':>9} {'batch':>6} {'conc':>6} {'goodput/s':>10}"
        f" {'p99 TTFT ms':>12} {'p99 TPOT ms':>12} {'feasible':>8}"
    )
    for r in records:
        o = r.observation
        typer.echo(
            f"{r.number:>5} {r.phase:>9} {r.knobs.max_batch_size:>6} {r.knobs.max_concurrency:>6}"
            f" {_fmt(r.goodput_rps, 1, 2):>10} {_fmt(o.get('ttft_p99_s'), 1e3):>12}"
            f" {_fmt(o.get('tpot_p99_s'), 1e3):>12} {'yes' if r.feasible else 'no':>8}"
        )
    typer.echo("")
    typer.echo(f"stopped: {reason}")
    if best is not None:
        knobs, p = best
        typer.echo(
            f"chosen: max_batch_size={knobs.max_batch_size}"
            f" max_concurrency={knobs.max_concurrency} goodput {p.goodput_rps:.2f} req/s"
            f" (measured {p.measurements}x), p99 TTFT {p.ttft_p99_s * 1e3:.0f} ms,"
            f" p99 TPOT {p.tpot_p99_s * 1e3:.1f} ms"
        )


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
