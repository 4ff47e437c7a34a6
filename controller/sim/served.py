"""The ``local`` scenario: this deployment as ``slotune tune`` runs it by default, simulated.

slotune's own ``small`` model on this machine's peak roofline (the calibration's bandwidth
and matmul peak at the replica's thread count), the canary's default workload (16 prompt,
8 output tokens) and SLO, and the served calibration (search/calibrate/served.py) folded
into the simulator's :class:`~controller.sim.scenarios.Efficiency`, step noise and load.

What the simulator departed on, measured (2026-12-04, AMD EPYC, 1 thread):

- A served TPOT is not a decode step: between a request's first and last token the engine
  also prefills the requests that replace finished ones, and the simulator adds those
  prefills itself. Fitting the decode step alone to the served p50 counted them twice: the
  simulated p50 came out 1.4-1.6x the measured one at B = 4-16 (p99 158 ms at B=14 where
  the replica measured 113).
- The device calibration's decode profile (the calibrated roofline) is slower than the
  served path at small B on a quiet machine (9.7 ms at B=1, 25 ms at B=4, where the whole
  served token took 7.8 and 14.7 ms): no efficiency <= 1 fitted it. The peak roofline is a
  lower bound, as :class:`Efficiency` wants.
- Live, the engine runs part empty: the serving path (Serve's proxy and router, the HTTP
  stream, the load generator, on the engine's cores) hands a freed slot its next request
  late, and the served request rate levels off as B grows (10.6, 18.6, 22.8, 23.8 req/s at
  B = 1, 4, 10, 16) where a simulated engine with every slot refilled at once went on
  to ~38 req/s. The decode batch that runs is the served tokens/s times the TPOT: 0.7, 2.2,
  4.6 and 6.6 sequences at B = 1, 4, 10, 16 (2026-12-05), and 16 at B=29 with p50 TPOT
  76 ms; so TPOT grows with the batch that runs, ~4.8 ms a sequence, and the knob's other
  clients are on the serving path. An open load in front of the engine (the first fit)
  kept the running batch level as the knob grew, so its p50 stayed flat past B=16 where
  the live one doubled, and its p99 grew from bursts alone.

So the fit goes through the simulator (:func:`fit_to_served`) with the canary's own load:
a closed loop of one client per admission slot (:class:`~serving.sim.workload.ClosedLoop`),
each client's next request reaching the front door a fixed gap after its last one
finished, then the engine after a serving path that works on one request at a time
(exponential times; the clients beyond what the engine runs queue there, inside the TTFT's
clock, as live). The
calibration's windows are simulated at its batches, and the decode step (at the batch that
ran), the step noise, the gap and the path's time per request are adjusted until the
simulated p50 TPOT, p99 spread and request rates meet the measured ones; the p99 TTFT
is not fitted, and the fit reports how close it came.
:class:`~controller.sim.target.SimTarget` itself is unchanged; the tuner is told the
served model (``slotune simulate -s local``), as ``slotune tune`` is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from controller.sim.scenarios import Efficiency, Scenario
from metrics.observation import DEFAULT_SLO, Slo
from search.calibrate.served import ServedModel, ServedPoint
from search.roofline.curve import Roofline
from search.roofline.hardware import HardwareSpec
from serving.sim.workload import ClosedLoop, LengthDist, Workload

log = logging.getLogger(__name__)

LOCAL = "local"
P99_Z = 2.326  # standard normal quantile of 0.99
OVERHEAD_GRID = 24  # overheads tried between 0 and the fastest measured step
FIT_ROUNDS = 20  # simulate, correct, refit: at most this many times
FIT_STEP = 0.5  # each correction goes this share of the way (in log) ...
# ... of a miss taken as at most this factor either way: where the engine and the serving
# path serve about as many requests a second, a slightly slower step moves the clients
# from the path into the engine and the p50 leaps (x0.36 <-> x3.7 in turn, unbounded)
FIT_MAX_RATIO = 1.3
FIT_TOLERANCE = 0.03  # stop once every p50, the mean p99/p50 and the rates are within 3%
FIT_SEED = 1  # the fit's windows are the same numbers every time
FIT_WINDOW_S = 60.0  # simulated seconds a fit window lasts (p99 of ~500-1500 requests)
CV_RANGE = (0.02, 0.9)
# A served step up to this factor faster than the peak roofline is taken for the peak (the
# machine's bandwidth was measured on a busier day); beyond it, the fit is refused.
MAX_BELOW_PEAK = 1.25


@dataclass(frozen=True, kw_only=True)
class LocalDeployment:
    """What the ``local`` scenario is built from: the served model, the device calibration
    JSON it sits beside, and the canary's defaults (controller/cli/tune.py)."""

    served: ServedModel
    hardware_path: Path
    slo: Slo = DEFAULT_SLO
    max_batch: int = 128  # the built-in small app's KV slots (tune_plan.DEFAULT_MAX_SLOTS)
    max_len: int = 512
    window_s: float = 30.0  # tune's --max-window (its windows aim at 300 requests)
    warmup_s: float = 2.0  # tune's --warmup
    headroom_max: float = 2.0  # tune_plan.HEADROOM_MAX

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch, int) and self.max_batch >= 1):
            raise ValueError(f"max_batch={self.max_batch!r}: must be an integer >= 1")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s={self.window_s!r}: must be > 0 seconds")


def decode_step_s(eff: Efficiency, roofline: Roofline, batch: int) -> float:
    """The simulator's decode-only step of ``batch`` sequences under ``eff``."""
    return eff.overhead_s + roofline.step_time_s(batch) / eff.factor(max(1, batch))


def fit_efficiency(want: Mapping[int, float], roofline: Roofline) -> Efficiency:
    """The :class:`Efficiency` whose decode step comes closest (largest relative miss) to
    ``want`` (seconds by batch): for each overhead tried and each wanted batch above the
    smallest as the reference batch, ``f`` pinned to ``want`` at the smallest batch and at
    the reference (log-linear between, held beyond). A step up to :data:`MAX_BELOW_PEAK`
    faster than the peak roofline runs at the peak; ValueError when faster still."""
    lo = min(want)
    roof = {b: roofline.step_time_s(b) for b in want}
    refs = [b for b in sorted(want) if b > lo] or [lo]
    best: tuple[float, Efficiency] | None = None
    for i in range(OVERHEAD_GRID):
        ov = min(want.values()) * i / OVERHEAD_GRID
        f1 = roof[lo] / (want[lo] - ov)
        for ref in refs:
            fr = roof[ref] / (want[ref] - ov)
            if max(f1, fr) > MAX_BELOW_PEAK:
                continue
            eff = _pinned(f1=min(1.0, f1), fr=min(1.0, fr), lo=lo, ref=ref, overhead_s=ov)
            miss = max(abs(decode_step_s(eff, roofline, b) / w - 1) for b, w in want.items())
            if best is None or miss < best[0]:
                best = (miss, eff)
    if best is None:
        raise ValueError(
            f"the served p50 TPOT ({want[lo] * 1e3:.1f} ms at B={lo}) is far below the peak "
            f"roofline's step ({roof[lo] * 1e3:.1f} ms): no efficiency <= 1 fits"
        )
    return best[1]


def _pinned(*, f1: float, fr: float, lo: int, ref: int, overhead_s: float) -> Efficiency:
    """The Efficiency with factor ``f1`` at batch ``lo`` and ``fr`` at ``ref`` (log-linear
    in log batch between, extended down to batch 1 and at most 1 there)."""
    if lo <= 1 or ref <= lo:
        at1 = f1
    else:
        slope = (math.log(fr) - math.log(f1)) / (math.log(ref) - math.log(lo))
        at1 = min(1.0, math.exp(math.log(f1) - slope * math.log(lo)))
    return Efficiency(at_batch_1=at1, at_ref_batch=fr, ref_batch=max(2, ref), overhead_s=overhead_s)


def served_noise_cv(served: ServedModel) -> float:
    """The first guess of the per-step noise: the one whose mean over a request's decode
    steps spreads p99/p50 as measured (the median ratio over the measured points), within
    :data:`CV_RANGE`; :func:`fit_to_served` corrects it through the simulator."""
    steps = max(1.0, served.output_tokens - 1)
    ratios = sorted(p.tpot_p99_s / p.tpot_p50_s for p in served.points)
    r = ratios[len(ratios) // 2]
    return _clip_cv(math.log(max(r, 1.0)) / P99_Z * math.sqrt(steps))


def _bounded(ratio: float) -> float:
    """A simulated / measured ratio, as a correction takes it (:data:`FIT_MAX_RATIO`)."""
    return min(FIT_MAX_RATIO, max(1 / FIT_MAX_RATIO, ratio))


def _clip_cv(cv: float) -> float:
    return min(CV_RANGE[1], max(CV_RANGE[0], cv))


@dataclass(frozen=True, kw_only=True)
class ServedFit:
    """What :func:`fit_to_served` settled on, and how close the simulator came."""

    efficiency: Efficiency
    step_noise_cv: float
    closed: ClosedLoop  # the canary's load, through the serving path fitted
    rounds: int
    # batch -> simulated / measured: p50 TPOT, p99 TPOT, requests per second, p99 TTFT
    ratios: Mapping[int, tuple[float, float, float, float]]

    def describe(self) -> str:
        c = self.closed
        return (
            f"serving path {c.gap_s * 1e3:.0f} ms outside the TTFT, then {c.path_s * 1e3:.1f} ms"
            " a request on average, one at a time; simulated at the measured batches: "
            + "; ".join(
                f"B={b}: p50 x{r50:.2f}, p99 x{r99:.2f}, req/s x{rr:.2f}, p99 TTFT x{rt:.2f}"
                for b, (r50, r99, rr, rt) in self.ratios.items()
            )
        )


def _running(p: ServedPoint) -> float:
    """The decode batch that ran in the point's window: tokens/s times the p50 TPOT (each
    running sequence yields a token a step), within [1, B]; B where no rate was recorded."""
    n = p.tokens_per_s * p.tpot_p50_s
    return min(float(p.batch), max(1.0, n)) if math.isfinite(n) else float(p.batch)


def fit_to_served(served: ServedModel, base: Scenario) -> ServedFit:
    """Fit the simulator to the served calibration, through the simulator: simulate ``base``
    (efficiency, noise and load replaced) at each measured batch under the canary's closed
    loop, then correct the decode step wanted at the batch that ran (:func:`_running`) by
    measured p50 / simulated p50 (and refit the efficiency to it), the step noise by the
    measured mean log(p99/p50) over the simulated one (the upper half of the measured
    batches: the SLO knee), the serving path's time per request by the request rate at
    the largest batch (where the path holds the rate back) and its fixed gap by the cycle
    of a client at the smallest; until all are within :data:`FIT_TOLERANCE`, at most
    :data:`FIT_ROUNDS` times (the best round is kept). Without recorded rates (an old
    calibration) there is no serving path (gap and path 0). ValueError when no efficiency
    <= 1 fits."""
    from controller.sim.target import SimTarget
    from search.space import Knobs

    pts = {p.batch: p for p in served.points}
    top = max(pts)
    out = served.output_tokens
    at = {b: max(1, round(_running(p))) for b, p in pts.items()}  # knob -> batch that ran
    want: dict[int, float] = {}
    for b in pts:  # the step at each batch that ran (the mean where two share one)
        same = [q.tpot_p50_s for c, q in pts.items() if at[c] == at[b]]
        want[at[b]] = sum(same) / len(same)
    upper = sorted(pts)[len(pts) // 2 :]  # where the SLO knee lies: the noise is fitted there
    spread = sum(math.log(pts[b].tpot_p99_s / pts[b].tpot_p50_s) for b in upper) / len(upper)
    cv = served_noise_cv(served)
    roof = SimTarget(base).roofline
    rates = {b: p.tokens_per_s / out for b, p in pts.items()}
    has_rate = all(math.isfinite(r) and r > 0 for r in rates.values())
    lo = min(pts)
    # First guesses: at the largest batch the path is the bottleneck (the served rate
    # levels off there), each request costing it 1 / req/s; at the smallest, a client's
    # cycle (1 / its req/s) less the request's decode and that path time is the gap.
    path_s = 1 / rates[top] if has_rate else 0.0
    gap = max(0.0, lo / rates[lo] - out * pts[lo].tpot_p50_s - path_s) if has_rate else 0.0
    best: tuple[float, ServedFit] | None = None
    for rnd in range(1, FIT_ROUNDS + 1):
        eff = fit_efficiency(want, roof)
        closed = ClosedLoop(gap_s=gap, path_s=path_s)
        sc = replace(
            base,
            efficiency=eff,
            calibrated_efficiency=eff,
            step_noise_cv=cv,
            workload=replace(base.workload, rate_rps=None, closed=closed),
            window_noise_cv=0.0,
            window_s=FIT_WINDOW_S,
            calibrated_window_s=FIT_WINDOW_S,
        )
        target = SimTarget(sc)
        ratios: dict[int, tuple[float, float, float, float]] = {}
        sim_spread = 0.0
        for b, p in pts.items():
            k = Knobs(max_batch_size=b, max_concurrency=b)
            o = target.run(k, seed=FIT_SEED, whole=True).observation
            s50, s99 = o.tpot.p50, o.tpot.p99
            rr = o.tokens_per_s / p.tokens_per_s  # NaN where the window has no rate
            rt = o.ttft.p99 / p.ttft_p99_s  # NaN where none was recorded
            ratios[b] = (s50 / p.tpot_p50_s, s99 / p.tpot_p99_s, rr, rt)
            if b in upper:
                sim_spread += math.log(s99 / s50) / len(upper)
        fit = ServedFit(efficiency=eff, step_noise_cv=cv, closed=closed, rounds=rnd, ratios=ratios)
        misses = [abs(r[0] - 1) for r in ratios.values()]
        misses.append(abs(math.exp(sim_spread - spread) - 1))
        if has_rate:
            misses += [abs(ratios[b][2] - 1) for b in (lo, top)]
        miss = max(misses)
        log.debug("served fit round %d: miss %.3f, cv %.3f, %s", rnd, miss, cv, fit.describe())
        if best is None or miss < best[0]:
            best = (miss, fit)
        if miss <= FIT_TOLERANCE:
            break
        # Half steps (in log for the step and the noise): each pulls on the others.
        for n in want:  # the knobs that ran this batch: their ratios' geometric mean
            logs = [math.log(_bounded(ratios[b][0])) for b in pts if at[b] == n]
            want[n] /= math.exp(FIT_STEP * sum(logs) / len(logs))
        if sim_spread > 0:
            cv = _clip_cv(cv * (spread / sim_spread) ** FIT_STEP)
        if has_rate:
            # the largest batch's rate is the path's (in log, half way); the smallest's
            # cycle, the simulated one less the measured one, is the gap's miss
            path_s *= _bounded(ratios[top][2]) ** FIT_STEP
            miss_s = 1 / rates[lo] - 1 / (ratios[lo][2] * rates[lo])
            gap = max(0.0, gap + FIT_STEP * lo * miss_s)
    assert best is not None
    return best[1]


def local_scenario(dep: LocalDeployment) -> Scenario:
    """The scenario of this deployment (see the module doc)."""
    s = dep.served
    prompt, output = round(s.prompt_tokens), round(s.output_tokens)
    base = Scenario(
        name=LOCAL,
        model=s.model,
        # this machine's peak roofline: the calibration's bandwidth and matmul peak, without
        # its measured decode profile (slower than the served path: see the module doc)
        hardware=HardwareSpec.from_json(dep.hardware_path).without_calibration(),
        slo=dep.slo,
        workload=Workload(
            rate_rps=1.0,
            prompt=LengthDist(kind="fixed", mean=prompt, lo=1, hi=prompt),
            output=LengthDist(kind="fixed", mean=output, lo=1, hi=output),
        ),
        load_factor=1.0,  # unused: the load is the fit's closed loop
        max_len=dep.max_len,
        warmup_s=dep.warmup_s,
        window_s=dep.window_s,
        window_noise_cv=0.03,
        headroom_max=dep.headroom_max,
    )
    fit = fit_to_served(s, base)
    return replace(
        base,
        efficiency=fit.efficiency,
        calibrated_efficiency=fit.efficiency,
        step_noise_cv=fit.step_noise_cv,
        workload=replace(base.workload, rate_rps=None, closed=fit.closed),
        description=f"this deployment: {s.model} served on {s.device} ({s.threads} thread(s)); "
        + s.describe()
        + "; the canary's closed loop, "
        + fit.describe(),
    )
