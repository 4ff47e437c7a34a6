"""Production windows for the exported curve: the windows ``slotune control`` measured,
read back from its audit log (``controller.control.store.AuditLog``, one JSON line a
tick) as :class:`~controller.report.records.TrialRecord` rows with ``role="production"``.

Each tick's observation was measured *before* that tick decided, so its knobs are the
tick's ``from`` knobs. A window is drawn beside the search's trials, never searched: the
report chooses its operating point among the search's trials alone.

Ticks whose window says nothing about a knob are skipped and counted, never dropped
silently: no observation, a stale one (the metrics could not be read), no completed
request, or a drift pause (the deployment ran someone else's knobs, not ``from``).

The audit lines carry the verdicts the controller judged against *its* SLO, not the SLO
itself, which may differ from the study's. A window is drawn as feasible only when both
of its verdicts are met *and* its p99s are within the report's SLO (``slo``); a met
window over the report's SLO is drawn infeasible, with a note saying so.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from controller.report.records import TrialRecord, ms_of
from metrics.observation import Slo, Verdict
from search.space import Knobs

log = logging.getLogger(__name__)

# Why a tick is not drawn, in the order they are checked.
NO_OBSERVATION = "no observation"
STALE = "stale"
NO_REQUESTS = "no completed requests"
PAUSED = "paused on someone else's knobs"
_EXPECTED = "expected a slotune control audit line"


@dataclass(frozen=True, kw_only=True)
class ProductionWindows:
    """What one audit log gave: the windows drawn, and how many ticks were skipped, why."""

    path: Path
    records: tuple[TrialRecord, ...]
    ticks: int  # audit lines read
    skipped: Mapping[str, int] = field(default_factory=dict)  # reason → ticks

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line: what was merged and what was skipped."""
        why = ", ".join(f"{n} {reason}" for reason, n in self.skipped.items())
        return (
            f"merged {len(self.records)} production windows from {self.path} "
            f"({self.skipped_total} of {self.ticks} ticks skipped{': ' + why if why else ''})"
        )


class _Line:
    """One audit line being read: its fields, checked, each error naming file and line."""

    def __init__(self, path: Path, number: int, row: Any) -> None:
        self.where = f"{path} line {number}"
        if not isinstance(row, dict):
            self.fail(f"a JSON {type(row).__name__}, not an object")
        self.row: dict[str, Any] = row

    def fail(self, what: str) -> NoReturn:
        raise ValueError(f"{self.where}: {what}; {_EXPECTED}")

    def get(self, d: Mapping[str, Any], key: str, kind: str, in_: str = "") -> Any:
        """``d[key]``, checked to be ``kind``: "number" (finite), "count" (an integer >= 0),
        "bool", "str" or "object"; a trailing "?" allows null."""
        name = f"{in_}.{key}" if in_ else key
        if key not in d:
            self.fail(f"no {name!r}")
        v = d[key]
        base = kind.rstrip("?")
        if v is None and kind.endswith("?"):
            return None
        ok = {
            "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "count": isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
            "object": isinstance(v, dict),
        }[base]
        if not ok:
            allowed = _KINDS[base] + (" or null" if kind.endswith("?") else "")
            self.fail(f"{name}={v!r}: must be {allowed}")
        return v

    def knobs(self) -> Knobs:
        d = self.get(self.row, "from", "object")
        try:
            return Knobs(max_batch_size=d["max_batch_size"], max_concurrency=d["max_concurrency"])
        except KeyError as e:
            self.fail(f"no 'from.{e.args[0]}'")
        except ValueError as e:
            self.fail(f"from: {e}")

    def verdict(self, obs: Mapping[str, Any], key: str) -> tuple[str, float, int]:
        """(verdict, p99 in seconds, samples); ("none", NaN, 0) when not judged."""
        v = self.get(obs, key, "object?", "observation")
        if v is None:
            return "none", math.nan, 0
        name = f"observation.{key}"
        word = self.get(v, "verdict", "str", name)
        allowed = [x.value for x in Verdict]
        if word not in allowed:
            self.fail(f"{name}.verdict={word!r}: must be one of {', '.join(allowed)}")
        p99 = self.get(v, "p99_s", "number?", name)
        samples = self.get(v, "samples", "count", name)
        return word, math.nan if p99 is None else float(p99), samples


_KINDS = {
    "number": "a finite number",
    "count": "an integer >= 0",
    "bool": "true or false",
    "str": "a string",
    "object": "an object",
}


def production_records(path: str | Path, *, slo: Slo, first_number: int) -> ProductionWindows:
    """The windows of the audit log at ``path`` as production trial records, numbered from
    ``first_number`` in the log's order. ValueError naming the
    file and line for a line that is not an audit line (bad JSON, a missing or mistyped
    field); OSError when the file cannot be read."""
    p = Path(path)
    records: list[TrialRecord] = []
    skipped: dict[str, int] = {}
    ticks = 0
    with p.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # not a tick (AuditLog writes none)
            ticks += 1
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                why = f"not UTF-8 text (byte {e.start + 1})"
                raise ValueError(f"{p} line {i}: {why}; {_EXPECTED}") from None
            except json.JSONDecodeError as e:
                why = f"not JSON ({e.msg} at column {e.colno})"
                raise ValueError(f"{p} line {i}: {why}; {_EXPECTED}") from None
            line = _Line(p, i, row)
            rec, why = _record(line, slo, first_number + len(records))
            if rec is None:
                skipped[why] = skipped.get(why, 0) + 1
            else:
                records.append(rec)
    out = ProductionWindows(path=p, records=tuple(records), ticks=ticks, skipped=skipped)
    log.info("%s", out.summary())
    return out


def _record(line: _Line, slo: Slo, number: int) -> tuple[TrialRecord | None, str]:
    """The tick's window as a record, or None and why it is skipped."""
    row = line.row
    line.get(row, "time_s", "number")
    outcome = line.get(row, "outcome", "str")
    action = line.get(row, "action", "str")
    dry_run = line.get(row, "dry_run", "bool")
    knobs = line.knobs()
    obs = line.get(row, "observation", "object?")
    if obs is None:
        return None, NO_OBSERVATION
    o = "observation"
    start = line.get(obs, "start_s", "number", o)
    end = line.get(obs, "end_s", "number", o)
    completed = line.get(obs, "completed", "count", o)
    stale = line.get(obs, "stale", "bool", o)
    slo_met = line.get(obs, "slo_met", "count?", o)
    rejected = line.get(obs, "rejected", "count", o)
    # absent from logs written before generated tokens were kept: tokens/s unknown
    tokens = None
    if "generated_tokens" in obs:
        tokens = line.get(obs, "generated_tokens", "count?", o)
    tv, ttft_s, tn = line.verdict(obs, "ttft")
    pv, tpot_s, pn = line.verdict(obs, "tpot")
    if stale:
        return None, STALE
    if completed == 0:
        return None, NO_REQUESTS
    if action == "pause":
        return None, PAUSED
    window = float(end) - float(start)
    if not window > 0:
        line.fail(f"observation.end_s={end!r} is not after start_s={start!r}")
    met = tv == pv == Verdict.MET.value
    over = [
        name
        for name, p99, bound in (("TTFT", ttft_s, slo.ttft_p99_s), ("TPOT", tpot_s, slo.tpot_p99_s))
        if math.isfinite(p99) and p99 > bound
    ]
    note = f"control: {outcome}, {action}" + (" (dry run)" if dry_run else "")
    if met and over:
        note += f"; p99 {' and '.join(over)} over the report's SLO"
    return (
        TrialRecord(
            number=number,
            max_batch_size=knobs.max_batch_size,
            max_concurrency=knobs.max_concurrency,
            tokens_per_s=math.nan if tokens is None else tokens / window,
            goodput_rps=math.nan if slo_met is None else slo_met / window,
            throughput_rps=completed / window,
            completed=completed,
            rejected=rejected,
            p50_ttft_ms=math.nan,
            p99_ttft_ms=ms_of(ttft_s),
            p50_tpot_ms=math.nan,
            p99_tpot_ms=ms_of(tpot_s),
            ttft_verdict=tv,
            tpot_verdict=pv,
            ttft_samples=tn,
            tpot_samples=pn,
            feasible=met and not over,
            window_s=window,
            source="control",
            note=note,
            role="production",
        ),
        "",
    )
