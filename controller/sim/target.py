"""The simulator as a tuning target: the roofline's step time handed to serving/sim/simulator.py.

serving/ must not import search/, so the glue lives here. A :class:`Scenario`
names a model, a device (catalogue name or a ``slotune calibrate`` JSON), a
tensor-parallel degree, an SLO and a saturating load. The simulator's *true*
step time is the peak roofline of the planned step slowed the way real
hardware is (:class:`Efficiency`): a batch-dependent fraction of peak
(docs/controller.md gives the measured range), a fixed
per-step overhead and prefill interference. The tuner is seeded with the
*peak* roofline, so the seed is wrong by a realistic margin (the step time at
the seed's batch is 1.5-3x the prediction in the built-in scenarios).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np

from controller.sim.decode_run import DecodeRunStepTime
from controller.sim.scenarios import (
    SCENARIO_HARDWARE,
    Scenario,
    local_cpu_hardware,
)
from metrics.observation import Observation, Slo
from metrics.sequential import first_decision
from search.evidence import STOP_MARGIN
from search.roofline.curve import Roofline
from search.roofline.hardware import HardwareSpec, resolve_hardware
from search.roofline.models import resolve_model
from search.roofline.operating_point import analyze
from search.space import Knobs, SearchSpace
from serving.scheduler.plan import StepPlan
from serving.sim.observation import observation_from_timings
from serving.sim.result import SimConfig, SimResult
from serving.sim.simulator import simulate
from serving.sim.workload import mean_tokens

logger = logging.getLogger(__name__)


class SimTarget:
    """Measure knobs on the simulated fleet of a :class:`Scenario`."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        seed: int = 0,
        sequential: bool = True,
        budget_requests: int = 1000,
    ) -> None:
        """``sequential``: a window stops as soon as its verdict is decided
        (:func:`metrics.sequential.first_decision`), as the live canary's does; False: it
        always runs its whole length (the ablation). ``budget_requests``: a window lasts
        at least long enough for that many requests at the scenario's rate (its budget
        follows the request rate: a 1 req/s deployment gets longer windows)."""
        if not (isinstance(budget_requests, int) and budget_requests >= 1):
            raise ValueError(f"budget_requests={budget_requests!r}: must be an integer >= 1")
        self.sequential = sequential
        self.budget_requests = budget_requests
        self.scenario = sc = scenario
        if isinstance(sc.hardware, HardwareSpec):
            self.hardware = sc.hardware
            self.hardware_source = sc.hardware.source or sc.hardware.name
        elif sc.hardware == "local-cpu":
            self.hardware, self.hardware_source = local_cpu_hardware()
        elif sc.hardware in SCENARIO_HARDWARE:
            self.hardware = SCENARIO_HARDWARE[sc.hardware]
            self.hardware_source = self.hardware.source
        else:
            self.hardware = resolve_hardware(sc.hardware)
            self.hardware_source = self.hardware.source or sc.hardware
        model = resolve_model(sc.model)
        # Capacity: slots of max_len tokens. Prediction: at the mean decode context.
        self._memory_roofline = Roofline(
            model=model, hardware=self.hardware, tp=sc.tp, dtype=sc.dtype, context=sc.max_len
        )
        self.max_batch_memory = self._memory_roofline.max_batch_memory
        ctx = round(mean_tokens(sc.workload.prompt) + mean_tokens(sc.workload.output) / 2)
        self.context = max(1, ctx)
        self.roofline = Roofline(
            model=model, hardware=self.hardware, tp=sc.tp, dtype=sc.dtype, context=self.context
        )
        self.efficiency = (
            sc.calibrated_efficiency
            if self.hardware.calibrated and sc.calibrated_efficiency is not None
            else sc.efficiency
        )
        single = self.roofline.step_time_s(1)
        tpot_slo = max(sc.slo.tpot_p99_s, round(sc.min_tpot_slo_x_single * single, 3))
        self.slo = replace(sc.slo, tpot_p99_s=tpot_slo)
        self.analysis = analyze(
            self.roofline, slo_tpot_s=self.slo.tpot_p99_s, max_batch=max(1, self.max_batch_memory)
        )
        op = self.analysis.operating_point
        self.seed_batch = op.batch if op is not None else 1
        # The peak roofline at the shortest prompt is a lower bound on any real TPOT.
        lo_ctx = sc.workload.prompt.lo
        self.space = SearchSpace.bounded(
            step_time_s=lambda b: self.roofline.step_time_s(b, context=lo_ctx),
            max_batch_memory=self.max_batch_memory,
            slo=self.slo,
            headroom_max=sc.headroom_max,
        )
        out_mean = mean_tokens(sc.workload.output)
        predicted_rps = self.seed_batch / (self.model_tpot_s(self.seed_batch) * out_mean)
        if sc.workload.closed is None:
            self.rate_rps = sc.load_factor * predicted_rps
            self.workload = replace(sc.workload, rate_rps=self.rate_rps)
        else:  # a closed loop's rate is what its clients get (no rate is set)
            self.rate_rps = math.nan
            self.workload = sc.workload
        self.sim_config = SimConfig(
            max_slots=max(1, self.max_batch_memory),
            max_len=sc.max_len,
            prefill_chunk=sc.prefill_chunk,
            warmup_s=sc.warmup_s,
            window_s=(
                sc.calibrated_window_s
                if self.hardware.calibrated and sc.calibrated_window_s is not None
                else sc.window_s
            ),
            step_noise_cv=sc.step_noise_cv,
            window_noise_cv=sc.window_noise_cv,
        )
        self._seed = seed
        self._count = 0
        # step_time plus its vectorised decode_run (the simulator's fast path, same bits).
        self._runs = DecodeRunStepTime(self)

    @property
    def seed(self) -> int:
        """The simulator's seed: windows are drawn from it in sequence."""
        return self._seed

    # -- the two step times ------------------------------------------------------------

    def model_tpot_s(self, batch: int) -> float:
        """What the tuner is told: the peak roofline's decode step at the mean context."""
        return self.roofline.step_time_s(batch)

    def step_time(self, plan: StepPlan) -> float:
        """What the simulated hardware takes (see :class:`Efficiency`)."""
        eff = self.efficiency
        b = plan.decode_batch
        roof = self.roofline.step_time_detailed_s(
            decode_batch=b,
            kv_tokens=plan.kv_tokens,
            prefill_tokens=round(plan.prefill_tokens * eff.prefill_interference),
            prefill_sequences=len(plan.prefill) or None,
        )
        return eff.overhead_s + roof / eff.factor(max(1, b))

    # -- measuring ---------------------------------------------------------------------

    def seed_knobs(self) -> list[Knobs]:
        """The roofline's operating point, then a bracket below and above it."""
        b = self.seed_batch
        out = [Knobs(max_batch_size=b, max_concurrency=b)]
        for f in (0.5, 1.5):
            bb = max(1, round(b * f))
            out.append(Knobs(max_batch_size=bb, max_concurrency=bb))
        return [self.space.clip(k) for k in out]

    def run(
        self,
        knobs: Knobs,
        *,
        seed: int,
        denoised: bool = False,
        window_scale: float = 1.0,
        whole: bool = False,
    ) -> SimResult:
        """One window on ``knobs``; ``whole``: never stopped early (a truth run)."""
        cfg = self.sim_config.denoised() if denoised else self.sim_config
        cfg = replace(
            cfg,
            window_s=(self.sim_config.window_s if whole else self.window_s(knobs)) * window_scale,
            warmup_s=self.warmup_s(knobs),
        )
        result = simulate(
            max_batch_size=min(knobs.max_batch_size, cfg.max_slots),
            max_concurrency=max(knobs.max_concurrency, min(knobs.max_batch_size, cfg.max_slots)),
            workload=self.workload,
            step_time=self._runs,
            config=cfg,
            slo=self.slo,
            seed=seed,
        )
        if whole or not self.sequential:
            return result
        return stopped_early(
            result,
            self.slo,
            cfg.confidence,
            nominal_s=self.sim_config.window_s * window_scale,
            budget=self.budget_requests,
        )

    def _rate(self, knobs: Knobs) -> float:
        """Completions per second at ``knobs`` at the simulated decode step (prefill
        aside): what the live canary sees as requests finish, for sizing its windows."""
        b = max(1, min(knobs.max_batch_size, self.sim_config.max_slots))
        eff = self.efficiency
        step = eff.overhead_s + self.roofline.step_time_s(b) / eff.factor(b)
        return b / (step * mean_tokens(self.scenario.workload.output))

    def warmup_s(self, knobs: Knobs) -> float:
        """The scenario's warm-up, or long enough for ``WARMUP_TURNOVERS`` times the
        admission limit's requests to finish, whichever is longer: the burst that fills
        an empty engine at a knob change queues its requests, and the first requests a
        window sees would carry that queue, not the knob's steady state."""
        c = max(1, knobs.max_concurrency)
        return max(self.sim_config.warmup_s, WARMUP_TURNOVERS * c / self._rate(knobs))

    def window_s(self, knobs: Knobs) -> float:
        """How long a window on ``knobs`` may last: a whole window (``sequential`` off) the
        scenario's window; a sequential one until ``budget_requests`` have finished (1.25x
        slack on the rate, then cut at the budget) but at most :data:`MAX_WINDOW_S` (the
        live canary's ``--max-window``), or the scenario's window if longer."""
        if not self.sequential:
            return self.sim_config.window_s
        budgeted = min(1.25 * self.budget_requests / self._rate(knobs), MAX_WINDOW_S)
        return max(self.sim_config.window_s, budgeted)

    def measure(self, knobs: Knobs) -> Observation:
        """One noisy window (a fresh seed each call, deterministic in sequence)."""
        self._count += 1
        return self.run(knobs, seed=self._seed * 1_000_003 + self._count).observation

    def describe(self) -> dict[str, object]:
        sc = self.scenario
        return {
            "scenario": sc.name,
            "description": sc.description,
            "model": sc.model,
            "hardware": self.hardware.name,
            "hardware_source": self.hardware_source,
            "tp": sc.tp,
            "slo_ttft_p99_s": self.slo.ttft_p99_s,
            "slo_tpot_p99_s": self.slo.tpot_p99_s,
            # an open load's arrival rate; None: a closed loop (its clients send as they finish)
            "rate_rps": round(self.rate_rps, 3) if math.isfinite(self.rate_rps) else None,
            "kv_capacity": self.max_batch_memory,
            "search_batch_max": self.space.batch_max,
            "seed_batch": self.seed_batch,
            "context": self.context,
        }


# A sequential window lasts at most this long (slotune tune's --max-window default).
MAX_WINDOW_S = 900.0

# A warm-up lasts at least until this many times the admission limit's requests finished.
WARMUP_TURNOVERS = 4

# A window never stops before this many requests: requests finishing together share the
# engine's state, and a verdict on the first handful would rest on one moment.
MIN_REQUESTS = 20


def stopped_early(
    result: SimResult,
    slo: Slo,
    confidence: float,
    *,
    nominal_s: float = 0.0,
    budget: int | None = None,
) -> SimResult:
    """``result`` cut where a reader of every finished request would have stopped it: the
    first request, from the :data:`MIN_REQUESTS`-th on, at which either SLO is clearly
    VIOLATED or, from ``nominal_s`` into the window on, either is VIOLATED or both are MET
    (:func:`metrics.sequential.first_decision` on the window's own requests). Rejections
    are prorated to the time kept; the step counts stay the whole run's. Undecided by
    ``budget`` requests, the window ends there."""
    timings = result.timings
    if budget is not None and budget < len(timings):
        timings = timings[:budget]  # undecided by then: the window ends at its budget
    if not timings:
        return result
    ttft = np.array([t.ttft_s for t in timings])  # [n]
    tpot = np.array([t.tpot_s if t.generated_tokens >= 2 else np.nan for t in timings])  # [n]
    with np.errstate(invalid="ignore"):
        over = [
            (ttft > slo.ttft_p99_s).astype(float),
            np.where(np.isnan(tpot), np.nan, (tpot > slo.tpot_p99_s).astype(float)),
        ]
    # only a clear violation stops the window before the scenario's nominal length
    nominal = int(
        np.searchsorted(
            [t.last_token_s for t in timings], result.observation.start_s + nominal_s, side="right"
        )
    )
    n, _ = first_decision(
        over,
        q=slo.quantile,
        confidence=confidence,
        start=MIN_REQUESTS,
        nominal=nominal,
        margin=STOP_MARGIN,
    )
    if n >= len(result.timings):
        return result
    obs = result.observation
    end = timings[n - 1].last_token_s
    kept = (end - obs.start_s) / obs.window_s if obs.window_s > 0 else 1.0
    cut = observation_from_timings(
        timings[:n],
        slo=slo,
        start_s=obs.start_s,
        end_s=end,
        rejected=round(obs.rejected * kept),
        confidence=confidence,
        source=obs.source,
    )
    return SimResult(
        observation=cut,
        timings=tuple(timings[:n]),
        steps=result.steps,
        busy_s=result.busy_s,
        sim_s=result.sim_s,
        slowdown=result.slowdown,
    )
