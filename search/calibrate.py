"""Calibrate the local device: what it really does at the shapes decode runs.

Measures, with torch on the CPU (or the first CUDA device):

- sustained memory bandwidth: a reduction over a tensor far larger than the
  caches, filled first (untouched pages read as one shared zero page and lie);
- dense matmul peak FLOP/s per dtype (square GEMMs);
- at decode shapes, per dtype: the rate at which a model's linear layers consume
  weight bytes at batch 1..256 (every linear of the reference model in turn, so
  the working set is the model's and nothing stays cached between passes), the
  rate at which decode attention reads the KV cache (done the way the serving
  model does it: see :func:`measure_kv_rate`), and the time a layer spends in
  everything else (norms, rotary, cache writes: :func:`measure_layer_overhead`).

The result is a :class:`~search.hardware.HardwareSpec` whose ``decode``
profiles let :class:`~search.roofline.Roofline` predict a real decode step on
this device. Writing it to disk is the caller's job (the CLI).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from search.hardware import BYTES_PER_ELEM, DecodeProfile, HardwareSpec
from search.models import ModelSpec

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class CalibrationPlan:
    """How much to measure. Presets: ``full`` (~20-30 s on 2 busy CPU cores), ``quick`` (tests).

    On a CPU shared with other work, run with ``OMP_WAIT_POLICY=PASSIVE`` (the CLI
    sets it): spinning OpenMP threads made skinny GEMMs 10-100x slower here.
    """

    name: str = "full"
    bandwidth_bytes: int = 1 << 30
    matmul_n: int = 2048
    weight_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # KV read rates barely move with batch once the cache is far past the caches;
    # beyond the largest batch the rate is held flat.
    kv_batches: tuple[int, ...] = (1, 8, 64)
    context: int = 256
    reps: int = 2
    budget_s: float = 0.2  # per measured point: keep trying for a quiet moment this long

    def __post_init__(self) -> None:
        if self.bandwidth_bytes < 1 << 20:
            raise ValueError(f"bandwidth_bytes={self.bandwidth_bytes}: must be >= 1 MiB")
        for name in ("matmul_n", "context", "reps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        for name in ("weight_batches", "kv_batches"):
            v = getattr(self, name)
            if not v or any(b < 1 for b in v) or list(v) != sorted(set(v)):
                raise ValueError(f"{name}={v!r}: must be ascending distinct batches >= 1")

    @classmethod
    def from_name(cls, name: str) -> CalibrationPlan:
        if name not in PLANS:
            raise ValueError(f"calibration plan {name!r}: allowed: {', '.join(PLANS)}")
        return PLANS[name]


PLANS = {
    "full": CalibrationPlan(),
    "quick": CalibrationPlan(
        name="quick",
        bandwidth_bytes=256 << 20,
        matmul_n=1024,
        weight_batches=(1, 8, 64),
        kv_batches=(1, 8),
        context=64,
        reps=2,
        budget_s=0.0,
    ),
}


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


def device_label(dev: torch.device) -> str:
    """A short name for the device, e.g. ``cpu-amd-epyc`` or ``cuda-nvidia-h100-80gb-hbm3``."""
    if dev.type == "cuda":
        raw = torch.cuda.get_device_name(dev)
    else:
        raw = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    raw = line.split(":", 1)[1]
                    break
        except OSError:
            pass
    slug = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    return f"{dev.type}-{slug}"[:60]


def default_cache_path(dev: torch.device) -> Path:
    """``$XDG_CACHE_HOME/slotune/hardware-<host>-<device>.json``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotune"
    host = re.sub(r"[^A-Za-z0-9_.-]+", "-", platform.node() or "host")
    return base / f"hardware-{host}-{device_label(dev)}.json"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], object], dev: torch.device, reps: int, budget_s: float = 0.0) -> float:
    """Fastest timed call of ``fn`` after one warm-up call: at least ``reps`` calls, and
    more (up to 50) while the calls so far took less than ``budget_s``.

    The minimum, not the median: other work on a shared machine only ever adds
    time, so the fastest run is the device's own figure, and more tries within a
    time budget give a quiet moment more chances (compare it with the fastest
    measured step, too).
    """
    fn()
    _sync(dev)
    best, spent, n = math.inf, 0.0, 0
    while n < reps or (spent < budget_s and n < 50):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def measure_bandwidth(dev: torch.device, nbytes: int, reps: int, budget_s: float = 0.0) -> float:
    """Bytes/s of a full read (sum) of a filled fp32 tensor of ``nbytes``."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)  # [N]
    x.fill_(1.0)  # touch every page: zero pages would read from one cached page
    t = _time(lambda: x.sum(), dev, reps, budget_s)
    return x.numel() * 4 / t


def measure_matmul_peak(
    dev: torch.device, dtype: str, n: int, reps: int, budget_s: float = 0.0
) -> float:
    """Dense FLOP/s of an n x n @ n x n matmul."""
    dt = TORCH_DTYPES[dtype]
    a = torch.randn(n, n, device=dev).to(dt)  # [n, n]
    b = torch.randn(n, n, device=dev).to(dt)  # [n, n]
    t = _time(lambda: a @ b, dev, reps, budget_s)
    return 2.0 * n**3 / t


def _linear_shapes(model: ModelSpec) -> list[tuple[int, int]]:
    """(out, in) of every linear one decode step runs, in order, lm_head last."""
    m = model
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    layer = [
        (q, m.hidden),
        (kv, m.hidden),
        (kv, m.hidden),
        (m.hidden, q),
        (m.intermediate, m.hidden),
        (m.intermediate, m.hidden),
        (m.hidden, m.intermediate),
    ]
    return layer * m.layers + [(m.vocab, m.hidden)]


def measure_weight_rate(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> weight bytes/s that the model's linears consume at that batch."""
    dt = TORCH_DTYPES[dtype]
    shapes = _linear_shapes(model)
    weights = [torch.empty(o, i, device=dev, dtype=dt).normal_(0, 0.02) for o, i in shapes]
    total = sum(w.numel() for w in weights) * BYTES_PER_ELEM[dtype]
    out: dict[int, float] = {}
    for b in batches:
        xs = {i: torch.randn(b, i, device=dev).to(dt) for i in {i for _, i in shapes}}  # [B, in]

        def run(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)  # [B, out]

        out[b] = total / _time(run, dev, reps, budget_s)
        logger.info("%s weight rate at B=%d: %.2f GB/s", dtype, b, out[b] / 1e9)
    return out


def measure_kv_rate(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> KV-cache bytes/s decode attention reads (all layers, one query token each).

    Mirrors serving/model.py's decode attention (keep the two in step): a cache
    ``[slots, kv_heads, len, head_dim]`` per layer, grouped-query attention as two
    batched matmuls (the g query heads of a group stacked), fp32 scores, a mask,
    softmax. Only the shapes matter here: the values are random.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    g = m.heads // m.kv_heads
    out: dict[int, float] = {}
    for b in batches:
        caches = [
            (
                torch.empty(b, m.kv_heads, context, m.head_dim, device=dev, dtype=dt).normal_(),
                torch.empty(b, m.kv_heads, context, m.head_dim, device=dev, dtype=dt).normal_(),
            )
            for _ in range(m.layers)
        ]  # per layer: [B, Hkv, L, D] x 2, filled (untouched pages would read as zeros)
        q = torch.randn(b, m.kv_heads, g, m.head_dim, device=dev).to(dt)  # [B, Hkv, g, D]
        hidden = torch.zeros(b, 1, 1, context, dtype=torch.bool, device=dev)  # [B, 1, 1, L]

        def run(caches: list = caches, q: torch.Tensor = q, hidden: torch.Tensor = hidden) -> None:
            for k, v in caches:
                scores = (
                    torch.matmul(q, k.transpose(-1, -2)).float() * m.head_dim**-0.5
                )  # [B, Hkv, g, L]
                scores = scores.masked_fill(hidden, float("-inf"))
                probs = torch.softmax(scores, dim=-1).to(dt)  # [B, Hkv, g, L]
                torch.matmul(probs, v)  # [B, Hkv, g, D]

        nbytes = b * context * m.kv_bytes_per_token(BYTES_PER_ELEM[dtype])
        out[b] = nbytes / _time(run, dev, reps, budget_s)
        logger.info("%s KV rate at B=%d: %.2f GB/s", dtype, b, out[b] / 1e9)
        del caches
    return out


def measure_layer_overhead(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    context: int,
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> seconds per decoder layer outside its linears and attention core.

    Runs the rest of serving/model.py's decode block (keep the two in step) at
    the model's shapes: two RMSNorms in fp32, rotary on q and k, the two cache
    writes (``index_put_``), reshapes, SwiGLU's activation, residual adds. At
    these sizes it is dispatch and small-kernel time, the part the bytes miss.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out: dict[int, float] = {}
    layers = 8
    for b in batches:
        x = torch.randn(b, 1, m.hidden, device=dev).to(dt)  # [B, 1, d]
        w = torch.ones(m.hidden, device=dev, dtype=dt)  # [d]
        qf = torch.randn(b, 1, q_dim, device=dev).to(dt)  # [B, 1, H*D]
        kf = torch.randn(b, 1, kv_dim, device=dev).to(dt)  # [B, 1, Hkv*D]
        gate = torch.randn(b, 1, m.intermediate, device=dev).to(dt)  # [B, 1, I]
        cos = torch.randn(b, 1, 1, m.head_dim, device=dev).to(dt)  # [B, 1, 1, D]
        sin = torch.randn(b, 1, 1, m.head_dim, device=dev).to(dt)  # [B, 1, 1, D]
        caches = [
            torch.zeros(b, m.kv_heads, context, m.head_dim, device=dev, dtype=dt) for _ in range(2)
        ]  # [S, Hkv, L, D]
        heads = torch.arange(m.kv_heads, device=dev)
        pos = torch.full((b, 1), 7, device=dev, dtype=torch.long)  # [B, 1]
        index = (torch.arange(b, device=dev)[:, None, None], heads[None, None, :], pos[:, :, None])

        def norm(h: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            hf = h.float()
            hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
            return w * hf.to(h.dtype)

        def rope(t: torch.Tensor, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        def run(
            x: torch.Tensor = x,
            qf: torch.Tensor = qf,
            kf: torch.Tensor = kf,
            gate: torch.Tensor = gate,
            caches: list = caches,
            index: tuple = index,
            b: int = b,
        ) -> None:
            h = x
            for _ in range(layers):
                n = norm(h)
                q = rope(qf.view(b, 1, m.heads, m.head_dim))  # [B, 1, H, D]
                k = rope(kf.view(b, 1, m.kv_heads, m.head_dim))  # [B, 1, Hkv, D]
                caches[0].index_put_(index, k)
                caches[1].index_put_(index, kf.view(b, 1, m.kv_heads, m.head_dim))
                q.transpose(1, 2).reshape(b, m.kv_heads, -1, m.head_dim)
                h = h + n
                n = norm(h)
                h = h + (torch.nn.functional.silu(gate) * gate)[..., : m.hidden]

        out[b] = _time(run, dev, reps, budget_s) / layers
        logger.info("%s layer overhead at B=%d: %.1f us", dtype, b, out[b] * 1e6)
    return out


def measure_step_overhead(
    dev: torch.device,
    dtype: str,
    model: ModelSpec,
    batches: Sequence[int],
    reps: int,
    budget_s: float = 0.0,
) -> dict[int, float]:
    """batch -> seconds per step outside the layers and the lm_head matmul.

    serving/model.py's prologue and epilogue (keep in step): embedding lookup,
    rotary table lookups cast to the dtype, the position mask, the final RMSNorm,
    fp32 logits, and a greedy argmax.
    """
    dt = TORCH_DTYPES[dtype]
    m = model
    emb = torch.empty(m.vocab, m.hidden, device=dev, dtype=dt).normal_()  # [V, d]
    table = torch.randn(2048, m.head_dim, device=dev)  # [P, D] fp32
    w = torch.ones(m.hidden, device=dev, dtype=dt)  # [d]
    out: dict[int, float] = {}
    for b in batches:
        tokens = torch.randint(0, m.vocab, (b, 1), device=dev)  # [B, 1]
        pos = torch.full((b, 1), 100, device=dev, dtype=torch.long)  # [B, 1]
        logits = torch.randn(b, m.vocab, device=dev).to(dt)  # [B, V], as the lm_head gives

        def run(
            tokens: torch.Tensor = tokens, pos: torch.Tensor = pos, logits: torch.Tensor = logits
        ) -> None:
            x = F.embedding(tokens, emb)  # [B, 1, d]
            table[pos].to(dt)[:, :, None, :]  # cos [B, 1, 1, D]
            table[pos].to(dt)[:, :, None, :]  # sin
            key_pos = torch.arange(256, device=dev)
            torch.gt(key_pos, pos[:, None, None, :, None])  # [B, 1, 1, 1, L]
            xf = x[:, -1].float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
            w * xf.to(dt)
            logits.float().argmax(dim=-1)  # [B]

        out[b] = _time(run, dev, reps, budget_s)
        logger.info("%s step overhead at B=%d: %.1f us", dtype, b, out[b] * 1e6)
    return out


def monotone_rates(
    table: dict[int, float], work: Callable[[int], float] | None
) -> dict[int, float]:
    """Make the time of a point never fall as the batch grows (more work is never
    faster): a time above a later one was disturbed, so it takes the later one.

    ``table``: batch -> rate of ``work(batch)`` units per second, or (``work`` None)
    batch -> seconds.
    """
    keys = sorted(table)
    times = {b: (table[b] if work is None else work(b) / table[b]) for b in keys}
    for lo, hi in zip(reversed(keys[:-1]), reversed(keys[1:]), strict=True):
        times[lo] = min(times[lo], times[hi])
    return {b: (times[b] if work is None else work(b) / times[b]) for b in keys}


def calibrate(
    *,
    device: str | None = None,
    plan: CalibrationPlan | None = None,
    model: ModelSpec | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    name: str | None = None,
) -> Calibration:
    """Measure the device; the decode shapes are ``model``'s (default ``slotune-small``)."""
    plan = plan or PLANS["full"]
    model = model or ModelSpec.from_name("slotune-small")
    for d in dtypes:
        if d not in TORCH_DTYPES:
            raise ValueError(f"dtype={d!r}: allowed: {', '.join(TORCH_DTYPES)}")
    dev = pick_device(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        bw = measure_bandwidth(dev, plan.bandwidth_bytes, plan.reps, plan.budget_s)
        logger.info("memory bandwidth: %.1f GB/s", bw / 1e9)
        peaks: dict[str, float] = {}
        decode: dict[str, DecodeProfile] = {}
        raw: dict[str, dict[str, dict[int, float]]] = {}
        for d in dtypes:
            # A GPU needs a far larger matmul than a CPU to reach its peak.
            n = max(plan.matmul_n, 8192) if dev.type == "cuda" else plan.matmul_n
            peaks[d] = measure_matmul_peak(dev, d, n, plan.reps, plan.budget_s)
            logger.info("%s matmul peak: %.1f GFLOP/s", d, peaks[d] / 1e9)
            wr = measure_weight_rate(dev, d, model, plan.weight_batches, plan.reps, plan.budget_s)
            kr = measure_kv_rate(
                dev, d, model, plan.kv_batches, plan.context, plan.reps, plan.budget_s
            )
            ov = measure_layer_overhead(
                dev, d, model, plan.kv_batches, plan.context, plan.reps, plan.budget_s
            )
            so = measure_step_overhead(dev, d, model, plan.kv_batches, plan.reps, plan.budget_s)
            raw[d] = {"weight_rate": wr, "kv_rate": kr, "layer_s": ov, "step_s": so}
            decode[d] = DecodeProfile(
                weight_rate=monotone_rates(wr, lambda b: 1.0),
                kv_rate=monotone_rates(kr, float),
                layer_overhead_s=monotone_rates(ov, None),
                step_overhead_s=monotone_rates(so, None),
            )
    elapsed = time.perf_counter() - t0
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
        "device": label,
        "threads": threads,
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
