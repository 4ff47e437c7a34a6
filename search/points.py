"""What the tuner knows about each knob: one window's stored attributes, and their summary.

:func:`observation_attrs` is what a trial stores of its Observation (Optuna user
attributes, so a resumed study knows it too), including the request counts behind
each SLO verdict (:func:`search.evidence.counts_of`). :func:`summarize_all` turns every
window of every knob into one :class:`~search.stop_rule.PointSummary` per knob: goodput
over its pooled windows, worst p99s, and both SLOs judged anytime-validly on the union of
its fresh windows' requests plus what its neighbours lend under the monotone model
(:func:`search.evidence.judge`). Stale windows lend no requests. Windows of one knob that
disagree beyond sampling error, or a knob violating TPOT below a batch that met it, are
noise: the knob is reported noisy, and its windows are judged one by one, a majority
deciding. A study written before the counts were stored (or an Observation whose verdicts
state no bounds) falls back to a majority vote of windows. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from metrics.binned import to_attr
from metrics.observation import Observation, Slo, SloVerdict, Verdict
from metrics.sequential import sequential_verdict
from search.evidence import Counts, Judgement, borrow_bin, combine, counts_of, disagreement, judge
from search.space import Knobs
from search.stop_rule import PointSummary

Attrs = Mapping[str, Any]


def _num(x: float) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _mean(xs: Any) -> float:
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _counts_attr(v: SloVerdict | None) -> list[float] | None:
    c = counts_of(v)
    return c.as_list() if c is not None else None


def observation_attrs(obs: Observation) -> dict[str, Any]:
    """The attributes a trial stores of its window (JSON-serialisable)."""

    def verdict(v: SloVerdict | None) -> str:
        return v.verdict.value if v is not None else "none"

    return {
        "goodput_rps": _num(obs.goodput_rps),
        "throughput_rps": _num(obs.throughput_rps),
        "tokens_per_s": _num(obs.tokens_per_s),
        "ttft_p99_s": _num(obs.ttft.p99),
        "tpot_p99_s": _num(obs.tpot.p99),
        "ttft_p50_s": _num(obs.ttft.p50),
        "tpot_p50_s": _num(obs.tpot.p50),
        "ttft_verdict": verdict(obs.ttft_verdict),
        "tpot_verdict": verdict(obs.tpot_verdict),
        "completed": obs.completed,
        "slo_met": obs.slo_met,
        "rejected": obs.rejected,
        "window_s": _num(obs.window_s),
        "stale": obs.stale,
        # [total, above, above_at_most, confidence] behind each verdict (None: unknown),
        # so that the windows of one knob pool exactly.
        "ttft_counts": _counts_attr(obs.ttft_verdict),
        "tpot_counts": _counts_attr(obs.tpot_verdict),
        # the window's latencies per bucket (metrics.binned), what two runs are compared on
        "ttft_hist": to_attr(obs.ttft_hist),
        "tpot_hist": to_attr(obs.tpot_hist),
    }


# Windows of one knob whose fractions over a threshold differ with a p-value below this
# (search.evidence.disagreement) are called noisy: the environment changed between them.
NOISE_P = 1e-3
# A verdict that rests on one window whose p99 lies within this fraction of the SLO is
# held (INSUFFICIENT, PointSummary.marginal) until a second window: a slowdown of that
# size between windows (a neighbour on the machine, a noisy host) flips it. Where the
# requests' latencies are alike (long answers: a TPOT averaged over 1,500 tokens) the
# window's p99 is its level, and a 3% slower window turns all of them over the SLO at once:
# then one window judges the environment, not the knob.
NOISE_BAND = 0.05

Window = tuple[Attrs, float, int]  # stored attributes, objective value, trial number


def _fresh(windows: Sequence[Attrs], key: str) -> list[Counts] | None:
    """The counts of ``key``'s verdict in each fresh window (None: some window's counts
    are unknown; stale windows lend no requests)."""
    counts = [Counts.from_list(a.get(f"{key}_counts")) for a in windows]
    if any(c is None or "stale" not in a for a, c in zip(windows, counts, strict=True)):
        return None
    return [c for a, c in zip(windows, counts, strict=True) if c is not None and not a["stale"]]


def _load(knobs: Knobs, key: str) -> int | None:
    """Where ``knobs`` sits in the monotone order of ``key``'s SLO (None: outside it).

    Under a saturating load the running batch is the batch limit, and TPOT grows with it
    whatever the admission limit. TTFT grows with the batch only without a queue (with one,
    a larger batch also drains the queue faster): only ``C == B`` knobs are ordered."""
    if key == "tpot":
        return knobs.max_batch_size
    return knobs.max_concurrency if knobs.max_concurrency == knobs.max_batch_size else None


def _judge_one(
    knobs: Knobs, key: str, own: list[Counts], others: Mapping[Knobs, list[Counts]], q: float
) -> Judgement | None:
    here = _load(knobs, key)
    bins: dict[int, list[Counts]] = {}
    if here is not None:
        for k, cs in others.items():
            there = _load(k, key)
            if k != knobs and there is not None and there != here:
                bins.setdefault(borrow_bin(here, there), []).extend(cs)
    if not own:  # only stale windows: no evidence of its own, none to borrow into
        return None
    return judge(own, q=q, neighbours=bins)


def _noise(knobs: Knobs, windows: Sequence[Attrs], counts: Mapping[str, list[Counts]]) -> str:
    """Why ``knobs``'s windows look noisy, with the figures ("" when they agree)."""
    notes = []
    for key, cs in counts.items():
        pval = disagreement(cs)
        if pval < NOISE_P:
            p99s = "/".join(
                f"{1e3 * v:.0f}" if isinstance(v := a.get(f"{key}_p99_s"), (int, float)) else "?"
                for a in windows
            )
            over = ", ".join(f"{c.above}/{c.total}" for c in cs)
            notes.append(
                f"{key.upper()} windows of {knobs} disagree beyond sampling error: p99 {p99s} ms,"
                f" over the SLO {over} requests (p={pval:.1g})"
            )
    return "; ".join(notes)


def summarize_all(groups: Mapping[Knobs, Sequence[Window]], *, slo: Slo) -> list[PointSummary]:
    """One :class:`PointSummary` per knob of ``groups`` (its windows), each SLO judged on
    its own windows' requests and its neighbours' under the monotone model
    (:func:`search.evidence.judge`); see :func:`summarize`."""
    fresh: dict[str, dict[Knobs, list[Counts]]] = {"ttft": {}, "tpot": {}}
    known = True
    for k, ws in groups.items():
        for key in fresh:
            cs = _fresh([a for a, _, _ in ws], key)
            if cs is None:
                known = False
            else:
                fresh[key][k] = cs
    out = []
    for k, ws in groups.items():
        judged: dict[str, Judgement | None] | None = None
        if known:
            judged = {
                key: _judge_one(k, key, fresh[key][k], fresh[key], slo.quantile) for key in fresh
            }
        out.append(
            summarize(
                k,
                [a for a, _, _ in ws],
                values=[v for _, v, _ in ws],
                numbers=[n for _, _, n in ws],
                slo=slo,
                judged=judged,
                noise=_noise(k, [a for a, _, _ in ws], {key: fresh[key][k] for key in fresh})
                if known
                else "",
            )
        )
    return _contradictions(out)


def _contradictions(points: list[PointSummary]) -> list[PointSummary]:
    """A knob VIOLATED on TPOT while a larger batch MET it contradicts the monotone model:
    noise, not evidence. Its VIOLATED becomes undecided and says why."""
    out = []
    for p in points:
        tpot_violated = p.tpot is not None and p.tpot.verdict is Verdict.VIOLATED
        if p.pooled is Verdict.VIOLATED and tpot_violated:
            heavier = [
                q.knobs
                for q in points
                if q.knobs.max_batch_size > p.knobs.max_batch_size and q.tpot_ok
            ]
            if heavier:
                why = (
                    f"{p.knobs} violated TPOT while {min(heavier, key=lambda k: k.max_batch_size)}"
                    " met it: against the monotone model, the environment was noisy"
                )
                p = replace(
                    p,
                    pooled=Verdict.INSUFFICIENT,
                    noise="; ".join(x for x in (p.noise, why) if x),
                )
        out.append(p)
    return out


def _majority(windows: Sequence[Attrs], key: str, q: float) -> Verdict:
    """``key``'s verdict by a majority of fresh windows, each judged anytime-validly on its
    own requests: MET or VIOLATED when more than half say so, else INSUFFICIENT."""
    votes = [
        sequential_verdict(
            c.total, c.above, q=q, confidence=c.confidence, above_at_most=c.above_at_most
        ).verdict
        for c in _fresh(windows, key) or []
    ]
    for v in (Verdict.MET, Verdict.VIOLATED):
        if 2 * votes.count(v) > len(votes):
            return v
    return Verdict.INSUFFICIENT


def summarize(
    knobs: Knobs,
    windows: Sequence[Attrs],
    *,
    values: Sequence[float],
    numbers: Sequence[int],
    slo: Slo,
    judged: Mapping[str, Judgement | None] | None = None,
    noise: str = "",
) -> PointSummary:
    """Every window of ``knobs`` (stored attributes, objective values, trial numbers) as
    one :class:`PointSummary` (see the module doc). ``judged``: each SLO's verdict as
    :func:`summarize_all` judged it with the neighbours' requests (None: on this knob's
    windows alone); ``noise``: why its windows look noisy. A noisy knob's windows are not
    pooled: each is judged on its own requests and a majority of windows decides (two
    windows that disagree leave it undecided, to be measured again)."""
    if not windows or not len(windows) == len(values) == len(numbers):
        raise ValueError(
            f"{len(windows)} windows, {len(values)} values, {len(numbers)} trial numbers:"
            " need one of each per window, at least one"
        )
    met = sum(1 for a in windows if a.get("feasible", False))

    def worst(key: str) -> float:
        vals = [a.get(key) for a in windows]
        return math.nan if any(v is None for v in vals) else max(vals)

    ttft_p99, tpot_p99 = worst("ttft_p99_s"), worst("tpot_p99_s")
    if judged is None:
        fresh = {key: _fresh(windows, key) for key in ("ttft", "tpot")}
        if all(cs is not None for cs in fresh.values()):
            judged = {key: judge(cs, q=slo.quantile) if cs else None for key, cs in fresh.items()}
    if judged is not None and all(judged.get(k) is None for k in ("ttft", "tpot")):
        # only stale windows: no evidence either way
        ttft_v = tpot_v = Verdict.INSUFFICIENT
    elif judged is not None:
        ttft_j, tpot_j = judged.get("ttft"), judged.get("tpot")
        ttft_v = ttft_j.verdict if ttft_j is not None else Verdict.INSUFFICIENT
        tpot_v = tpot_j.verdict if tpot_j is not None else Verdict.INSUFFICIENT
    else:
        ttft_v = tpot_v = None
    if noise and judged is not None:
        # Windows that disagree beyond sampling error are not one sample: each window is
        # judged on its own requests, and the majority of windows decides each SLO.
        ttft_v = _majority(windows, "ttft", slo.quantile)
        tpot_v = _majority(windows, "tpot", slo.quantile)
    marginal = len(windows) == 1 and _marginal(
        {"ttft": (ttft_v, ttft_p99, slo.ttft_p99_s), "tpot": (tpot_v, tpot_p99, slo.tpot_p99_s)}
    )
    if marginal and judged is not None:
        held = {
            k: replace(j, verdict=Verdict.INSUFFICIENT) if j is not None else None
            for k, j in judged.items()
        }
        judged, ttft_v, tpot_v = held, Verdict.INSUFFICIENT, Verdict.INSUFFICIENT
    pooled = combine(ttft_v, tpot_v)
    # Goodput of the pooled windows: their SLO-meeting requests over their total time.
    spans = [a.get("window_s") for a in windows]
    if all(isinstance(w, (int, float)) and w > 0 for w in spans):
        goodput = sum(int(a.get("slo_met") or 0) for a in windows) / sum(spans)  # type: ignore[arg-type]
    else:
        goodput = sum(values) / len(values)

    def ok(key: str, v: Verdict | None) -> bool:
        if pooled is not None:
            return v is Verdict.MET
        return all(a.get(f"{key}_verdict") == Verdict.MET.value for a in windows)

    return PointSummary(
        knobs=knobs,
        measurements=len(windows),
        goodput_rps=goodput,
        feasible=pooled is Verdict.MET if pooled is not None else 2 * met > len(windows),
        met_windows=met,
        throughput_rps=_mean(a.get("throughput_rps") for a in windows),
        ttft_p99_s=ttft_p99,
        tpot_p99_s=tpot_p99,
        ttft_ok=ok("ttft", ttft_v),
        tpot_ok=ok("tpot", tpot_v),
        first_trial=min(numbers),
        last_trial=max(numbers),
        pooled=pooled,
        ttft=None if judged is None else judged.get("ttft"),
        tpot=None if judged is None else judged.get("tpot"),
        noise=noise,
        marginal=marginal,
    )


def _marginal(slos: Mapping[str, tuple[Verdict | None, float, float]]) -> bool:
    """Whether one window's verdict could flip with a :data:`NOISE_BAND` slowdown: MET
    with some SLO's p99 within the band under its threshold, or VIOLATED with every
    violated SLO's p99 within the band over it. ``slos``: (verdict, p99, threshold)."""
    verdicts = [v for v, _, _ in slos.values()]
    near = {
        k: math.isfinite(p99) and abs(p99 / thr - 1) <= NOISE_BAND
        for k, (_, p99, thr) in slos.items()
    }
    if all(v is Verdict.MET for v in verdicts):
        return any(near.values())
    violated = [k for k, (v, _, _) in slos.items() if v is Verdict.VIOLATED]
    return bool(violated) and all(near[k] for k in violated)
