"""A SimTarget's step time with the simulator's fast path: runs of decode-only steps at once.

serving/sim.py times a run of decode-only steps (nothing admitted, prefilled or
finished in between) in one call when its step-time function also offers
``decode_run(batch, kv_tokens[m]) -> seconds[m]``. :class:`DecodeRunStepTime` wraps
:meth:`SimTarget.step_time` with a numpy form of the same arithmetic (the peak
roofline's ``step_time_detailed_s`` with no prefill, or its calibrated form, then
the scenario's :class:`Efficiency`), operation for operation and in the same order,
so every float is the same bits as the scalar call. Each run is also checked, at its
first and last step, against the scalar function; on any difference the whole run
is timed step by step and a warning is logged once: a change in the roofline's
arithmetic costs speed here, never exactness.

Use: ``simulate(..., step_time=DecodeRunStepTime(target))``.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from serving.scheduler import StepPlan

if TYPE_CHECKING:
    from controller.sim_target import SimTarget

logger = logging.getLogger(__name__)


def _no_entries() -> tuple:
    return ()


def decode_only_plan(batch: int, kv_tokens: int) -> StepPlan:
    """A decode-only plan of ``batch`` sequences reading ``kv_tokens`` cached tokens (its
    entries are not known: for step-time functions that read only the totals)."""
    return StepPlan.lean(
        decode_batch=batch,
        kv_tokens=kv_tokens,
        make_decode=partial(_no_entries),
        prefill=(),
        step=-1,
        seqs=(),
    )


class DecodeRunStepTime:
    """``target.step_time`` plus ``decode_run`` (see module doc)."""

    def __init__(self, target: SimTarget) -> None:
        self.target = target
        self._per_batch: dict[int, tuple[float, ...]] = {}
        self.runs = 0  # decode_run calls
        self.fallbacks = 0  # ... timed step by step instead

    def __call__(self, plan: StepPlan) -> float:
        return self.target.step_time(plan)

    def decode_run(self, batch: int, kv_tokens: np.ndarray) -> np.ndarray:
        """Step times of decode-only plans of ``batch`` sequences reading ``kv_tokens`` [m]."""
        self.runs += 1
        out = self._vector(batch, kv_tokens)  # [m]
        scalar = self.target.step_time
        ends = (0, len(kv_tokens) - 1)
        if all(out[j] == scalar(decode_only_plan(batch, int(kv_tokens[j]))) for j in ends):
            return out
        if not self.fallbacks:
            logger.warning(
                "decode_run differs from %s.step_time at batch %d: timing runs step by step"
                " (the roofline's arithmetic changed; update controller/sim_decode_run.py)",
                type(self.target).__name__,
                batch,
            )
        self.fallbacks += 1
        return np.array([scalar(decode_only_plan(batch, int(x))) for x in kv_tokens])

    def _vector(self, batch: int, kv: np.ndarray) -> np.ndarray:
        r = self.target.roofline
        eff = self.target.efficiency
        c = self._per_batch.get(batch)
        if c is None:
            c = self._per_batch[batch] = self._constants(batch)
        if r.calibrated:
            linear_s, kv_bytes, kv_rate, overhead_s, comm = c
            attn_s = kv * kv_bytes / kv_rate  # [m]
            roof = linear_s + attn_s + overhead_s + comm  # [m]
        else:
            weight_bytes, kv_bytes, matmul_flops, attn_flops, tp, bw, peak, comm = c
            mem_bytes = weight_bytes + kv * kv_bytes  # [m]
            flops = (matmul_flops + int(attn_flops) * kv) / int(tp)  # [m]
            roof = np.maximum(mem_bytes / bw, flops / peak) + comm  # [m]
        return eff.overhead_s + roof / eff.factor(max(1, batch))  # [m]

    def _constants(self, batch: int) -> tuple[float, ...]:
        """What search/roofline.py's step_time_detailed_s computes that a decode-only step
        of ``batch`` sequences does not vary with its KV tokens."""
        r = self.target.roofline
        m = r.model
        rows = head_rows = batch
        comm = r.all_reduce_s(rows)
        if r.calibrated:
            prof = r.hardware.decode[r.dtype]
            head_bytes = m.embedding_params * r.bytes_per_elem / r.tp
            layer_bytes = r.weight_bytes_read_per_device - head_bytes
            linear_s = layer_bytes / prof.weight_rate_at(rows)
            linear_s += head_bytes / prof.weight_rate_at(head_rows)
            overhead_s = prof.layer_overhead_at(batch) * m.layers + prof.step_overhead_at(batch)
            return (
                linear_s,
                r.kv_bytes_per_token_per_device,
                prof.kv_rate_at(batch),
                overhead_s,
                comm,
            )
        head = m.embedding_params
        matmul_flops = 2 * ((m.matmul_params - head) * rows + head * head_rows)
        return (
            r.weight_bytes_read_per_device,
            r.kv_bytes_per_token_per_device,
            matmul_flops,
            4 * m.layers * m.heads * m.head_dim,
            r.tp,
            r.hardware.mem_bandwidth,
            r.peak_flops,
            comm,
        )
