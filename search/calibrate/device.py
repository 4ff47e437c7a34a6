"""Calibrate the local device: what it really does at the shapes decode runs.

Measures, with torch on the CPU (or the first CUDA device):

- sustained memory bandwidth: a reduction over a tensor far larger than the
  caches, filled first (untouched pages read as one shared zero page and lie);
- dense matmul peak FLOP/s per dtype (square GEMMs);
- at decode shapes, per dtype, on the serving model itself built at the reference
  model's shapes (:func:`search.calibrate.step.timing_model`: real-size random
  weights, prepacked as the engine prepacks them, drawn once): the rate at which
  its linears consume weight bytes at batch 1..256 (every linear in turn, so the
  working set is the model's and nothing stays cached between passes), the rate
  at which decode attention reads the KV cache (:func:`measure_kv_rate`), the time
  a layer spends in everything else (norms, rotary, cache writes: timed hot, and
  the model's own layers timed whole against their linears and attention
  (:mod:`search.calibrate.layer`): the larger of the two), and the time a step spends
  outside its layers beyond the lm_head's weight bytes (the executor's host work,
  embedding, step context, final norm, fp32 logits, sampling: timed hot, and the
  engine's own code timed on cold caches (:mod:`search.calibrate.step`): the larger).

The result is a :class:`~search.roofline.hardware.HardwareSpec` whose ``decode``
profiles let :class:`~search.roofline.curve.Roofline` predict a real decode step on
this device. Writing it to disk is the caller's job (the CLI).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from search.calibrate.layer import measure_layer_in_stream
from search.calibrate.plan import PLANS, CalibrationPlan
from search.calibrate.profile import assemble_profile
from search.calibrate.shapes import (
    TORCH_DTYPES,
    best_time,
    measure_kv_rate,
    measure_layer_overhead,
    measure_step_overhead,
)
from search.calibrate.step import (
    measure_step_in_stream,
    measure_weight_rate_on,
    measure_whole_step,
    timing_model,
)
from search.roofline.hardware import BYTES_PER_ELEM, HardwareSpec
from search.roofline.models import ModelSpec
from search.roofline.profile import DecodeProfile
from serving.kernels import hugepages
from serving.model.linear import widens_bf16

logger = logging.getLogger(__name__)

# A cache written by another way of measuring is not reused (bump on any change to what
# the figures mean). 2: the engine's own layers and step, each batch's best pass.
# 3: the engine's C kernels (decode attention, GEMV at batch 1-2, RMSNorm) on CPU bf16.
# 4: without bf16 matmul hardware, GEMMs in fp32 (the AVX2 small GEMM, widened weights).
CALIBRATION_VERSION = 4


@dataclass(frozen=True, kw_only=True)
class Calibration:
    spec: HardwareSpec
    measured: dict[str, Any] = field(default_factory=dict)  # human-readable detail
    elapsed_s: float = 0.0


def pick_device(device: str | None = None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device={device!r}: allowed: cpu, cuda, cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch sees no CUDA device; allowed: cpu")
    return torch.device(device)


def cpu_model_name() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), e.g. ``AMD EPYC``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_label(dev: torch.device) -> str:
    """A short name for the device, e.g. ``cpu-amd-epyc`` or ``cuda-nvidia-h100-80gb-hbm3``."""
    raw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model_name()
    slug = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    return f"{dev.type}-{slug}"[:60]


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/slotune`` (``~/.cache/slotune``): where slotune keeps what it
    measured or decided on this machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotune"


def default_cache_path(dev: torch.device, *, threads: int | None = None) -> Path:
    """``$XDG_CACHE_HOME/slotune/hardware-<host>-<device>[-<threads>t].json``.

    ``threads``: the torch thread count the calibration measured with (a CPU's
    decode speed depends on it); None gives the name without it (older caches)."""
    if threads is not None:
        _check_threads(threads)
    base = cache_root()
    host = re.sub(r"[^A-Za-z0-9_.-]+", "-", platform.node() or "host")
    suffix = f"-{threads}t" if threads is not None else ""
    return base / f"hardware-{host}-{device_label(dev)}{suffix}.json"


def _check_threads(threads: object) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: must be a positive integer (torch threads)")


def measure_bandwidth(dev: torch.device, nbytes: int, reps: int, budget_s: float = 0.0) -> float:
    """Bytes/s of a full read (sum) of a filled fp32 tensor of ``nbytes``."""
    # On huge pages where it can be, as the engine's packed weights and KV cache are.
    x = hugepages.empty(nbytes // 4, torch.float32, dev)  # [N]
    x.fill_(1.0)  # touch every page: zero pages would read from one cached page
    t = best_time(lambda: x.sum(), dev, reps, budget_s)
    return x.numel() * 4 / t


def measure_matmul_peak(
    dev: torch.device, dtype: str, n: int, reps: int, budget_s: float = 0.0
) -> float:
    """Dense FLOP/s of an n x n @ n x n matmul, as the engine multiplies in ``dtype``: bf16 on
    a CPU without bf16 matmul hardware in fp32 on widened operands (serving/model/linear.py
    ``widens_bf16``; torch's own bf16 GEMM there is a slow fallback, not the device)."""
    dt = TORCH_DTYPES[dtype]
    a = torch.randn(n, n, device=dev).to(dt)  # [n, n]
    b = torch.randn(n, n, device=dev).to(dt)  # [n, n]
    if widens_bf16(a):
        a, b = a.float(), b.float()  # exact: what a widened linear multiplies
    t = best_time(lambda: a @ b, dev, reps, budget_s)
    return 2.0 * n**3 / t


def _keep(best: dict[int, float], new: dict[int, float], pick: Callable) -> None:
    for k, v in new.items():
        best[k] = pick(best[k], v) if k in best else v


def calibrate(
    *,
    device: str | None = None,
    plan: CalibrationPlan | None = None,
    model: ModelSpec | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    name: str | None = None,
    threads: int | None = None,
    after_pass: Callable[[str, int], None] | None = None,
) -> Calibration:
    """Measure the device; the decode shapes are ``model``'s (default ``slotune-small``).

    ``after_pass(dtype, i)``: called after each pass over the decode-shape points (of
    ``dtype``; ``i`` from 0), in the calibration's threads: work to interleave with the
    passes, so both see the same spells of a machine whose speed drifts (bench/engine.py
    times its steps there, to judge the prediction, not the drift).

    ``threads``: torch intra-op threads to measure with (set for the duration,
    then restored); None measures with the process's current setting. Calibrate
    at the thread count of the process that will serve: a Ray replica runs 1.
    """
    if threads is not None:
        _check_threads(threads)
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        return _calibrate(
            plan=plan, device=device, model=model, dtypes=dtypes, name=name, after_pass=after_pass
        )
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _calibrate(
    *,
    device: str | None,
    plan: CalibrationPlan | None,
    model: ModelSpec | None,
    dtypes: Sequence[str],
    name: str | None,
    after_pass: Callable[[str, int], None] | None = None,
) -> Calibration:
    plan = plan or PLANS["full"]
    model = model or ModelSpec.from_name("slotune-small")
    for d in dtypes:
        if d not in TORCH_DTYPES:
            raise ValueError(f"dtype={d!r}: allowed: {', '.join(TORCH_DTYPES)}")
    dev = pick_device(device)
    t0 = time.perf_counter()
    outside = 0.0  # seconds spent in after_pass: not the calibration's
    with torch.inference_mode():
        spread = plan.budget_s * plan.passes  # as long as a decode point gets in all
        bw = measure_bandwidth(dev, plan.bandwidth_bytes, plan.reps, spread)
        logger.info("memory bandwidth: %.1f GB/s", bw / 1e9)
        peaks: dict[str, float] = {}
        decode: dict[str, DecodeProfile] = {}
        raw: dict[str, dict[str, dict[int, float]]] = {}
        for d in dtypes:
            # A GPU needs a far larger matmul than a CPU to reach its peak.
            n = max(plan.matmul_n, 8192) if dev.type == "cuda" else plan.matmul_n
            peaks[d] = measure_matmul_peak(dev, d, n, plan.reps, spread)
            logger.info("%s matmul peak: %.1f GFLOP/s", d, peaks[d] / 1e9)
            # Several passes over all the points, each point's best kept: a burst of
            # other work then spoils one pass of a point, not the point.
            wr: dict[int, float] = {}
            kr: dict[int, float] = {}
            ov: dict[int, float] = {}
            so: dict[int, float] = {}
            stream: dict[str, dict[int, float]] = {"full": {}, "linears": {}, "attention": {}}
            step_stream: dict[int, float] = {}
            whole: dict[int, float] = {}  # whole steps, where the timing model is the model
            # The serving model itself at the reference model's shapes (built once per
            # dtype): its own layers and its own step outside them are timed in stream.
            timing = timing_model(dev, d, model, plan.context)
            for i in range(plan.passes):
                mine = time.perf_counter() - t0 - outside  # the calibration's own time
                if i and mine > plan.max_s * (dtypes.index(d) + 1) / len(dtypes):
                    logger.warning("calibration past its time: %d pass(es) of %s", i, d)
                    break
                args = (plan.reps, plan.budget_s)
                _keep(wr, measure_weight_rate_on(timing, model, d, plan.weight_batches, *args), max)
                _keep(kr, measure_kv_rate(dev, d, model, plan.kv_batches, plan.context, *args), max)
                _keep(
                    ov,
                    measure_layer_overhead(dev, d, model, plan.kv_batches, plan.context, *args),
                    min,
                )
                _keep(
                    so,
                    measure_step_overhead(dev, d, model, plan.kv_batches, *args, plan.context),
                    min,
                )
                parts = measure_layer_in_stream(
                    dev, d, model, plan.kv_batches, plan.context, *args, timing=timing
                )
                for j, key in enumerate(("full", "linears", "attention")):
                    _keep(stream[key], {b: t[j] for b, t in parts.items()}, min)
                _keep(
                    step_stream,
                    measure_step_in_stream(
                        dev, d, model, plan.kv_batches, plan.context, *args, timing=timing
                    ),
                    min,
                )
                _keep(
                    whole,
                    measure_whole_step(
                        dev, d, model, plan.kv_batches, plan.context, *args, timing=timing
                    ),
                    min,
                )
                if after_pass is not None:
                    t_out = time.perf_counter()
                    after_pass(d, i)
                    outside += time.perf_counter() - t_out
            del timing
            decode[d], raw[d] = assemble_profile(
                model, d, plan.context, wr, kr, ov, so, stream["full"], step_stream, whole
            )
    elapsed = time.perf_counter() - t0 - outside
    if dev.type == "cuda":
        capacity = float(torch.cuda.get_device_properties(dev).total_memory)
    else:
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    label = device_label(dev)
    threads = torch.get_num_threads()
    spec = HardwareSpec(
        name=name or f"{label}-{platform.node() or 'host'}",
        peak_flops=peaks,
        mem_bandwidth=bw,
        mem_capacity=capacity,
        decode=decode,
        source=(
            f"slotune calibrate ({plan.name}) {time.strftime('%Y-%m-%d %H:%M:%S')} on {label}, "
            f"torch {torch.__version__}, {threads} threads, decode shapes of {model.name}"
        ),
    )
    measured = {
        "version": CALIBRATION_VERSION,
        "device": label,
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "plan": plan.name,
        "model": model.name,
        "context": plan.context,
        "mem_bandwidth_gb_s": bw / 1e9,
        "matmul_gflop_s": {d: peaks[d] / 1e9 for d in dtypes},
        "decode_linear_gb_s": {
            d: {b: r / 1e9 for b, r in decode[d].weight_rate.items()} for d in dtypes
        },
        "decode_linear_gflop_s": {
            d: {b: 2 * b * r / BYTES_PER_ELEM[d] / 1e9 for b, r in decode[d].weight_rate.items()}
            for d in dtypes
        },
        "decode_layer_overhead_us": {
            d: {b: t * 1e6 for b, t in decode[d].layer_overhead_s.items()} for d in dtypes
        },
        "decode_step_overhead_us": {
            d: {b: t * 1e6 for b, t in decode[d].step_overhead_s.items()} for d in dtypes
        },
        "decode_attention_kv_gb_s": {
            d: {b: r / 1e9 for b, r in decode[d].kv_rate.items()} for d in dtypes
        },
        "raw": raw,
        "elapsed_s": elapsed,
    }
    return Calibration(spec=spec, measured=measured, elapsed_s=elapsed)
