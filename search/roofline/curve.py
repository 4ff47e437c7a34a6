"""The decode roofline: step time, the throughput-latency curve, its knee, the operating point.

One decode step reads every weight once and each sequence's KV cache, and does
2 FLOPs per matmul weight per token plus attention (per device, under tensor
parallelism over ``tp`` devices)::

    bytes(B)  = W / tp + B * ctx * kv_per_token_per_device
    flops(B)  = B * (2 * P_matmul + attn_flops(ctx)) / tp
    step(B)   = max(bytes(B) / BW, flops(B) / FLOPS) + all_reduce(B)
    all_reduce(B) = 2 * layers * (latency + 2 (tp-1)/tp * B * hidden * bytes / link_bw)

TPOT ~ step(B); tokens/s = B / step(B). On a device calibrated by
``slotune calibrate`` the two ideal bounds are replaced by what the device was
measured to achieve at the same shapes (weight bytes / rate(B) + KV bytes /
rate(B) + per-op overhead), so the prediction can be held against a measured
step; the ``bound`` column still names the ideal bound that dominates.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from search.roofline.hardware import BYTES_PER_ELEM, HardwareSpec
from search.roofline.models import ModelSpec

logger = logging.getLogger(__name__)

MAX_DEFAULT_BATCH = 1024


class DoesNotFit(ValueError):
    """The model's weights (or one sequence's KV cache) exceed the device memory."""


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    batch: int
    tpot_s: float
    tokens_per_s: float
    bound: str  # "memory" | "compute": the ideal bound that dominates
    fits: bool = True  # the KV cache of `batch` sequences at the context fits in memory

    def to_dict(self) -> dict[str, object]:
        return {
            "batch": self.batch,
            "tpot_ms": self.tpot_s * 1e3,
            "tokens_per_s": self.tokens_per_s,
            "bound": self.bound,
            "fits": self.fits,
        }


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """Decode step time of ``model`` on ``tp`` x ``hardware`` in ``dtype`` at ``context``."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    dtype: str = "bf16"
    context: int = 4096
    kv_dtype: str | None = None  # KV cache dtype; defaults to dtype
    mem_utilization: float = 0.9  # share of device memory for weights + KV (vLLM's default)

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r}: must be a positive integer")
        if self.model.heads % self.tp:
            ok = [n for n in range(1, self.model.heads + 1) if self.model.heads % n == 0]
            raise ValueError(
                f"tp={self.tp}: must divide {self.model.name}'s {self.model.heads} attention "
                f"heads; allowed: {', '.join(map(str, ok))}"
            )
        if self.tp > 1 and self.hardware.interconnect_bandwidth <= 0:
            raise ValueError(
                f"tp={self.tp}: {self.hardware.name} has no interconnect bandwidth; allowed: tp=1"
            )
        self.hardware.flops(self.dtype)  # raises naming the dtypes the device has
        kv = self.kv_dtype or self.dtype
        if kv not in BYTES_PER_ELEM:
            raise ValueError(f"kv_dtype={kv!r}: allowed: {', '.join(BYTES_PER_ELEM)}")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"context={self.context!r}: must be a positive number of tokens")
        if not 0 < self.mem_utilization <= 1:
            raise ValueError(f"mem_utilization={self.mem_utilization!r}: must be in (0, 1]")

    # ---- per-device constants ----------------------------------------------------

    @property
    def bytes_per_elem(self) -> int:
        return BYTES_PER_ELEM[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token adds, whole model (all devices)."""
        return self.model.kv_bytes_per_token(BYTES_PER_ELEM[self.kv_dtype or self.dtype])

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        """KV heads split over TP; when tp > kv_heads each device keeps a replica of one."""
        m = self.model
        kv_heads_here = math.ceil(m.kv_heads / self.tp)
        return self.kv_bytes_per_token * kv_heads_here / m.kv_heads

    @property
    def weight_bytes_per_device(self) -> float:
        """Weights resident on one device (all parameters, sharded over TP)."""
        return self.model.weight_bytes(self.bytes_per_elem) / self.tp

    @property
    def weight_bytes_read_per_device(self) -> float:
        """Weight bytes one step streams on one device."""
        return self.model.weight_bytes_read_per_step(self.bytes_per_elem) / self.tp

    @property
    def peak_flops(self) -> float:
        return self.hardware.flops(self.dtype)

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.hardware.ridge_flops_per_byte(self.dtype)

    @property
    def usable_memory_per_device(self) -> float:
        return self.hardware.mem_capacity * self.mem_utilization

    @property
    def max_batch_memory(self) -> int:
        """Sequences of ``context`` tokens whose KV cache fits next to the weights (0: none)."""
        free = self.usable_memory_per_device - self.weight_bytes_per_device
        if free <= 0:
            return 0
        return int(free // (self.kv_bytes_per_token_per_device * self.context))

    @property
    def calibrated(self) -> bool:
        return self.dtype in self.hardware.decode

    # ---- the knee -----------------------------------------------------------------

    def _per_seq_costs(self, context: int) -> tuple[float, float, float]:
        """(weight read s, KV read s per sequence, compute s per sequence) on one device."""
        bw = self.hardware.mem_bandwidth
        w_s = self.weight_bytes_read_per_device / bw
        kv_s = context * self.kv_bytes_per_token_per_device / bw
        flops = (
            2 * self.model.matmul_params + self.model.attention_flops_per_token(context)
        ) / self.tp
        return w_s, kv_s, flops / self.peak_flops

    @property
    def compute_crossover_batch(self) -> int | None:
        """Smallest B at which the compute bound overtakes the memory bound (KV bytes
        included); None when KV reads grow faster than compute and it never does."""
        w_s, kv_s, c_s = self._per_seq_costs(self.context)
        if c_s <= kv_s:
            return None
        return max(1, math.ceil(w_s / (c_s - kv_s)))

    @property
    def kv_crossover_batch(self) -> int:
        """Smallest B at which the KV cache read per step outweighs the weights read."""
        w_s, kv_s, _ = self._per_seq_costs(self.context)
        return max(1, math.ceil(w_s / kv_s))

    @property
    def knee_batch(self) -> int:
        """Where the curve bends: the compute crossover, or earlier the batch at which KV
        reads match the weight reads (beyond it tokens/s approaches BW / KV-per-sequence)."""
        c = self.compute_crossover_batch
        k = self.kv_crossover_batch
        return k if c is None else min(c, k)

    @property
    def knee_bound(self) -> str:
        c = self.compute_crossover_batch
        return "compute" if c is not None and c <= self.kv_crossover_batch else "kv"

    # ---- step time ----------------------------------------------------------------

    def all_reduce_s(self, rows: int) -> float:
        """Two all-reduces per layer of ``rows`` x hidden activations (ring algorithm)."""
        if self.tp == 1 or rows <= 0:
            return 0.0
        hw = self.hardware
        msg = rows * self.model.hidden * self.bytes_per_elem
        one = (
            hw.interconnect_latency_s
            + 2 * (self.tp - 1) / self.tp * msg / hw.interconnect_bandwidth
        )
        return 2 * self.model.layers * one

    def _shape(
        self,
        decode_batch: int,
        kv_tokens: int,
        prefill_tokens: int,
        prefill_sequences: int | None,
        prefill_attention_pairs: int | None,
    ) -> tuple[int, int, int]:
        """(rows through the layers' linears, rows through the lm_head, attention pairs)."""
        for name, v in (
            ("decode_batch", decode_batch),
            ("kv_tokens", kv_tokens),
            ("prefill_tokens", prefill_tokens),
        ):
            if v < 0:
                raise ValueError(f"{name}={v}: must be >= 0")
        seqs = (1 if prefill_tokens else 0) if prefill_sequences is None else prefill_sequences
        # Causal attention inside the prefill chunk(s): as one prompt unless told.
        pairs = (
            prefill_tokens * (prefill_tokens + 1) // 2
            if prefill_attention_pairs is None
            else prefill_attention_pairs
        )
        # Logits are taken at each sequence's last position only.
        return decode_batch + prefill_tokens, decode_batch + seqs, kv_tokens + pairs

    def bounds_s(
        self,
        *,
        decode_batch: int,
        kv_tokens: int,
        prefill_tokens: int = 0,
        prefill_sequences: int | None = None,
        prefill_attention_pairs: int | None = None,
    ) -> tuple[float, float]:
        """(memory-bound time, compute-bound time) of one step on one device, ideal."""
        m = self.model
        rows, head_rows, pairs = self._shape(
            decode_batch, kv_tokens, prefill_tokens, prefill_sequences, prefill_attention_pairs
        )
        if rows <= 0:
            return 0.0, 0.0
        kv_moved = (kv_tokens + prefill_tokens) * self.kv_bytes_per_token_per_device
        mem_bytes = self.weight_bytes_read_per_device + kv_moved
        head = m.embedding_params
        matmul_flops = 2 * ((m.matmul_params - head) * rows + head * head_rows)
        flops = (matmul_flops + 4 * m.layers * m.heads * m.head_dim * pairs) / self.tp
        return mem_bytes / self.hardware.mem_bandwidth, flops / self.peak_flops

    def step_time_detailed_s(
        self,
        *,
        decode_batch: int,
        kv_tokens: int,
        prefill_tokens: int = 0,
        prefill_sequences: int | None = None,
        prefill_attention_pairs: int | None = None,
    ) -> float:
        """One engine step: ``decode_batch`` sequences reading ``kv_tokens`` cached tokens in
        total (the sum of the context lengths each one attends to), plus ``prefill_tokens``
        prompt tokens of ``prefill_sequences`` prompts (default 1) in the same forward pass;
        ``prefill_attention_pairs``: their causal query-key pairs (default: one prompt)."""
        rows, head_rows, pairs = self._shape(
            decode_batch, kv_tokens, prefill_tokens, prefill_sequences, prefill_attention_pairs
        )
        if rows == 0:
            return 0.0
        comm = self.all_reduce_s(rows)
        if not self.calibrated:
            mem_s, comp_s = self.bounds_s(
                decode_batch=decode_batch,
                kv_tokens=kv_tokens,
                prefill_tokens=prefill_tokens,
                prefill_sequences=prefill_sequences,
                prefill_attention_pairs=prefill_attention_pairs,
            )
            return max(mem_s, comp_s) + comm
        m = self.model
        prof = self.hardware.decode[self.dtype]
        bpe = self.bytes_per_elem
        head_bytes = m.embedding_params * bpe / self.tp
        layer_bytes = self.weight_bytes_read_per_device - head_bytes
        linear_s = layer_bytes / prof.weight_rate_at(rows)
        if head_rows:
            linear_s += head_bytes / prof.weight_rate_at(head_rows)
        attn_s = 0.0
        if decode_batch > 0 and kv_tokens > 0:
            kv_bytes = kv_tokens * self.kv_bytes_per_token_per_device
            attn_s += kv_bytes / prof.kv_rate_at(decode_batch)
        prefill_pairs = pairs - kv_tokens
        if prefill_pairs > 0:
            flops = 4 * m.layers * m.heads * m.head_dim * prefill_pairs / self.tp
            attn_s += flops / self.peak_flops
        b = max(decode_batch, 1)
        overhead_s = prof.layer_overhead_at(b) * m.layers + prof.step_overhead_at(b)
        return linear_s + attn_s + overhead_s + comm

    def step_time_s(self, batch: int, *, context: int | None = None) -> float:
        """One decode step of ``batch`` sequences, each at ``context`` cached tokens."""
        ctx = self.context if context is None else context
        return self.step_time_detailed_s(decode_batch=batch, kv_tokens=batch * ctx)

    def bound_at(self, batch: int, *, context: int | None = None) -> str:
        ctx = self.context if context is None else context
        mem_s, comp_s = self.bounds_s(decode_batch=batch, kv_tokens=batch * ctx)
        return "compute" if comp_s > mem_s else "memory"

    def point(self, batch: int) -> CurvePoint:
        if batch < 1:
            raise ValueError(f"batch={batch}: must be >= 1")
        t = self.step_time_s(batch)
        return CurvePoint(
            batch=batch,
            tpot_s=t,
            tokens_per_s=batch / t,
            bound=self.bound_at(batch),
            fits=batch <= self.max_batch_memory,
        )

    def curve(self, max_batch: int) -> list[CurvePoint]:
        """Every batch size 1..max_batch at ``context``."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r}: must be a positive integer")
        return [self.point(b) for b in range(1, max_batch + 1)]

    def check_fits(self) -> None:
        """Raise :class:`DoesNotFit` naming the sizes and what would fit."""
        hw, m = self.hardware, self.model
        usable = self.usable_memory_per_device
        need = self.weight_bytes_per_device
        gb = 1e9
        if need >= usable:
            min_tp = next(
                (
                    n
                    for n in range(self.tp + 1, m.heads + 1)
                    if m.heads % n == 0 and m.weight_bytes(self.bytes_per_elem) / n < usable
                ),
                None,
            )
            hint = f"use --tp {min_tp} or more" if min_tp else "use a larger device"
            raise DoesNotFit(
                f"{m.name} needs {need / gb:.1f} GB of {self.dtype} weights per device at "
                f"tp={self.tp}, {hw.name} offers {usable / gb:.1f} GB "
                f"({self.mem_utilization:.0%} of {hw.mem_capacity / gb:.0f} GB); {hint}"
            )
        if self.max_batch_memory < 1:
            one = self.kv_bytes_per_token_per_device * self.context
            most = int((usable - need) // self.kv_bytes_per_token_per_device)
            raise DoesNotFit(
                f"context={self.context}: one sequence's KV cache needs {one / gb:.2f} GB per "
                f"device, {(usable - need) / gb:.2f} GB is left after the weights; "
                f"allowed: --context <= {most} or a larger --tp"
            )
