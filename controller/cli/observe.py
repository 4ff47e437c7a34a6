"""``slotune observe``: read one window from a metrics endpoint or Prometheus and print it.

The first thing to run against a new deployment: it shows whether the prefix and the label
selector find the contract's metrics, and what the controller would see.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import typer

from controller.cli.flags import http_url, slo_from_ms
from metrics.errors import MetricsError
from metrics.observation import DEFAULT_SLO, Observation
from metrics.sources import PromQLSource, ScrapeSource

MAX_WINDOW_S = 86_400.0  # one day: a longer wait is a typo, not a window


def _selector(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise typer.BadParameter(f"selector {p!r}: write label=value, e.g. deployment=LLM")
        out[k] = v
    return out


def _jsonable(obs: Observation) -> dict[str, object]:
    d = dataclasses.asdict(obs)
    d.update(
        window_s=obs.window_s,
        goodput_rps=obs.goodput_rps,
        throughput_rps=obs.throughput_rps,
        tokens_per_s=obs.tokens_per_s,
        feasible=obs.feasible,
    )

    def clean(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if hasattr(x, "value") and not isinstance(x, (int, float, str)):
            return x.value  # an enum
        return x

    return {k: clean(v) for k, v in d.items()}  # type: ignore[misc]


def _table(obs: Observation) -> str:
    lines = [
        f"source      {obs.source}",
        f"window      {obs.window_s:.2f} s   staleness {obs.staleness_s:.2f} s"
        f"{'   STALE: ' + obs.note if obs.stale else ''}",
        f"requests    {obs.completed} completed, {obs.slo_met} met both SLOs, "
        f"{obs.rejected} rejected ({obs.overloaded} for want of room)",
        f"goodput     {obs.goodput_rps:.3f} req/s   throughput {obs.throughput_rps:.3f} req/s   "
        f"{obs.tokens_per_s:.1f} tokens/s",
    ]
    for name, p, v in (("ttft", obs.ttft, obs.ttft_verdict), ("tpot", obs.tpot, obs.tpot_verdict)):
        line = f"{name}        p50 {p.p50:.4f}  p90 {p.p90:.4f}  p99 {p.p99:.4f} s"
        if v is not None:
            line += (
                f"   {v.verdict.value} (threshold {v.threshold_s:g} s, {v.samples} samples, "
                f"exceed <= {v.exceed_fraction_upper:.4f} at {v.confidence:.0%})"
            )
        lines.append(line)
    if obs.note and not obs.stale:
        lines.append(f"note        {obs.note}")
    lines.append(f"feasible    {obs.feasible}")
    return "\n".join(lines)


def observe(
    url: str = typer.Argument(..., help="A /metrics URL, or a Prometheus server with --promql."),
    window_s: float = typer.Option(10.0, "--window", help="Window length, seconds."),
    prefix: str = typer.Option(
        None, help="Name prefix: 'ray_' on Ray's export port (default with --promql), else ''."
    ),
    selector: list[str] = typer.Option([], "--selector", "-l", help="label=value, repeatable."),
    promql: bool = typer.Option(False, "--promql", help="Query a Prometheus server's API."),
    slo_ttft_ms: float = typer.Option(
        DEFAULT_SLO.ttft_p99_s * 1e3, "--slo-ttft-ms", help="p99 TTFT SLO (ms)."
    ),
    slo_tpot_ms: float = typer.Option(
        DEFAULT_SLO.tpot_p99_s * 1e3, "--slo-tpot-ms", help="p99 TPOT SLO (ms)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object, not the table."),
) -> None:
    """Observe one window of a deployment's metrics and print what the controller would see."""
    try:
        slo = slo_from_ms(slo_ttft_ms, slo_tpot_ms)
        http_url("URL", url)
        sel = _selector(selector)
        if not (math.isfinite(window_s) and 0 < window_s <= MAX_WINDOW_S):
            raise typer.BadParameter(
                f"--window {window_s!r}: must be a number of seconds in (0, {MAX_WINDOW_S:g}]"
            )
        if promql:
            src = PromQLSource(
                url, slo=slo, prefix="ray_" if prefix is None else prefix, selector=sel
            )
            obs = src.observe_range(window_s=window_s)
        else:
            scrape = ScrapeSource(url, slo=slo, prefix=prefix or "", selector=sel)
            start = scrape.snapshot()
            time.sleep(window_s)
            obs = scrape.observe(start, scrape.snapshot())
    except ValueError as e:
        if isinstance(e, typer.BadParameter):
            raise
        raise typer.BadParameter(str(e)) from e
    except MetricsError as e:
        print(f"slotune: metrics unavailable: {e}", file=sys.stderr)
        raise typer.Exit(1) from e
    print(json.dumps(_jsonable(obs)) if as_json else _table(obs))


def register(app: typer.Typer) -> None:
    app.command("observe")(observe)
