"""``slotune simulate``: run the tuner against the simulated fleet of a scenario.

Answers "what would this fleet do?" for hardware this machine does not have:
the roofline seeds the tuner, the simulator (serving/sim/simulator.py, the engine's own
scheduler on a virtual clock) measures each trial, and the command prints the
measured curve, the chosen point and why the search stopped. Exit code 3 when
no point met the SLO (a canary gate), 2 on bad input.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import typer

from controller.cli import flags
from controller.cli.paths import study_storage
from controller.errors import BadInput, NoFeasiblePoint
from controller.sim.scenarios import HELD_OUT_SCENARIOS, SCENARIOS, resolve_scenario
from controller.sim.target import SimTarget
from metrics.observation import Slo
from search.space import Knobs
from search.stop_rule import PointSummary, StopRule
from search.tuner import SAMPLERS, Tuner, TunerTrial

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
        help=f"One of: {', '.join([*SCENARIOS, *HELD_OUT_SCENARIOS])}.",
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
    if study is not None:
        study_storage("--study", study, must_exist=False)
    try:
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
        tuner = Tuner(
            space=target.space,
            slo=target.slo,
            storage=study,
            study_name=study_name or sc.name,
            seed_knobs=[] if no_seed else target.seed_knobs(),
            model_tpot_s=None if no_seed else target.model_tpot_s,
            sampler=sampler,
            seed=seed,
            stop_rule=StopRule(max_trials=max_trials),
        )
    except ValueError as e:
        raise BadInput(str(e)) from None

    d = target.describe()
    while not tuner.should_stop():
        knobs = tuner.propose()
        tuner.report(knobs, target.measure(knobs))
    records = tuner.trials()
    reason = tuner.stop_reason()
    best = tuner.best() or tuner.best(confirmed=False)
    if as_json:
        typer.echo(json.dumps(_result(d, records, reason, best), indent=2, default=str))
    else:
        _print_table(target, d, records, reason, best)
    if best is None:
        raise NoFeasiblePoint(
            f"no knob met p99 TTFT <= {target.slo.ttft_p99_s:g}s and TPOT <="
            f" {target.slo.tpot_p99_s:g}s in {len(records)} trials"
        )


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
        f" load {d['rate_rps']} req/s; KV capacity {d['kv_capacity']} sequences;"
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
