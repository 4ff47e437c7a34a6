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
from dataclasses import replace

from controller.sim.decode_run import DecodeRunStepTime
from controller.sim.scenarios import (
    SCENARIO_HARDWARE,
    Scenario,
    local_cpu_hardware,
)
from metrics.observation import Observation
from search.roofline.curve import Roofline
from search.roofline.hardware import resolve_hardware
from search.roofline.models import resolve_model
from search.roofline.operating_point import analyze
from search.space import Knobs, SearchSpace
from serving.scheduler.plan import StepPlan
from serving.sim.result import SimConfig, SimResult
from serving.sim.simulator import simulate
from serving.sim.workload import mean_tokens

logger = logging.getLogger(__name__)


class SimTarget:
    """Measure knobs on the simulated fleet of a :class:`Scenario`."""

    def __init__(self, scenario: Scenario, *, seed: int = 0) -> None:
        self.scenario = sc = scenario
        if sc.hardware == "local-cpu":
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
        self.rate_rps = sc.load_factor * predicted_rps
        self.workload = replace(sc.workload, rate_rps=self.rate_rps)
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
        self, knobs: Knobs, *, seed: int, denoised: bool = False, window_scale: float = 1.0
    ) -> SimResult:
        cfg = self.sim_config.denoised() if denoised else self.sim_config
        if window_scale != 1.0:
            cfg = replace(cfg, window_s=cfg.window_s * window_scale)
        return simulate(
            max_batch_size=min(knobs.max_batch_size, cfg.max_slots),
            max_concurrency=max(knobs.max_concurrency, min(knobs.max_batch_size, cfg.max_slots)),
            workload=self.workload,
            step_time=self._runs,
            config=cfg,
            slo=self.slo,
            seed=seed,
        )

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
            "rate_rps": round(self.rate_rps, 3),
            "kv_capacity": self.max_batch_memory,
            "search_batch_max": self.space.batch_max,
            "seed_batch": self.seed_batch,
            "context": self.context,
        }
