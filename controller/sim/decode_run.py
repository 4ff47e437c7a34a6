"""A SimTarget's step time, fast: a scalar mirror per step and runs of decode-only steps.

The simulator calls the step-time function once per planned step and, when it also
offers ``decode_run(batch, kv_tokens[m]) -> seconds[m]``, times a run of decode-only
steps (nothing admitted, prefilled or finished in between) in one call
(serving/sim/simulator.py). :class:`DecodeRunStepTime` wraps :meth:`SimTarget.step_time` with
both, computed from constants of the scenario taken once:

- ``__call__``: the same arithmetic as ``SimTarget.step_time`` (the peak roofline's
  ``step_time_detailed_s`` of the plan's totals, then the scenario's
  :class:`Efficiency`), operation for operation and in the same order, so every float
  is the same bits, at a fraction of the cost (no property chains, the efficiency
  factor cached per batch). It reads ``plan.totals()``, so the plan's entries are
  never built. Calibrated devices (decode tables) take ``SimTarget.step_time`` itself.
- ``step_totals()``: for the simulator, once per window, the mirror as a function of a
  plan's totals, so that a step needs no plan object and is one call (checked every
  512th call too, by the same closure).
- ``decode_run``: its numpy form for decode-only plans; each run is checked at its
  first and last step against the scalar function.

The mirror is checked against ``SimTarget.step_time`` when built (a grid of plan
shapes: decode batches, KV tokens, prefill tokens and chunks) and on every 512th call
after; on any difference it is switched off (the run is timed step by step) and a
warning is logged once: a change in the roofline's arithmetic costs speed here, and
the checks are there so that it does not cost exactness.

Use: ``simulate(..., step_time=DecodeRunStepTime(target))``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from serving.scheduler.plan import PrefillChunk, StepPlan

if TYPE_CHECKING:
    from controller.sim.scenarios import Efficiency
    from search.roofline.curve import Roofline
    from serving.sim.result import SimConfig

logger = logging.getLogger(__name__)

_CHECK_EVERY = 512  # calls between two checks of the scalar mirror (a power of two)


def _entries(lean: tuple, prefill: bool) -> tuple:
    return lean[-1] if prefill else ()


def plan_of(batch: int, kv_tokens: int, chunk_lengths: tuple[int, ...] = ()) -> StepPlan:
    """A plan of ``batch`` decoding sequences reading ``kv_tokens`` cached tokens and a
    first prefill chunk of each given length (its decode entries are not known: for
    step-time functions that read only the totals and the chunks)."""
    chunks = tuple(
        PrefillChunk(request_id=f"c{j}", slot=j, start=0, length=n, last=True, token_ids=None)
        for j, n in enumerate(chunk_lengths)
    )
    return StepPlan.lean((batch, kv_tokens, sum(chunk_lengths), len(chunks), -1, _entries, chunks))


def plan_of_totals(batch: int, kv_tokens: int, prefill_tokens: int, chunks: int) -> StepPlan:
    """A plan of these totals: ``chunks`` prefill chunks of ``prefill_tokens`` in all (one
    of the rest, the others of one token each)."""
    if not chunks:
        return plan_of(batch, kv_tokens)
    return plan_of(batch, kv_tokens, (prefill_tokens - chunks + 1,) + (1,) * (chunks - 1))


def decode_only_plan(batch: int, kv_tokens: int) -> StepPlan:
    """A decode-only plan of ``batch`` sequences reading ``kv_tokens`` cached tokens."""
    return plan_of(batch, kv_tokens)


def _no_mirror(b: int, kv: int, ptok: int, nchunks: int) -> float:
    raise AssertionError("the scalar mirror is off")


def _check_grid(capacity: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Plan shapes the mirror is checked on: (batch, kv tokens, chunk lengths)."""
    out: list[tuple[int, int, tuple[int, ...]]] = []
    for b in sorted({0, 1, 3, 64, max(1, capacity)}):
        for chunks in ((), (17,), (5, 200, 51)):
            if b or chunks:
                out.append((b, b * 37 + (b // 2), chunks))
    return out


class SteppedTarget(Protocol):
    """What the mirror reads of a simulated target (``controller.sim.target.SimTarget``):
    its step-time function and what that function computes from."""

    roofline: Roofline  # the peak roofline, at the scenario's mean context
    efficiency: Efficiency  # how far below the peak the simulated hardware runs
    sim_config: SimConfig  # its max_slots bound the plans the mirror is checked on

    def step_time(self, plan: StepPlan) -> float: ...


class DecodeRunStepTime:
    """``target.step_time`` made fast, plus ``decode_run`` (see module doc)."""

    def __init__(self, target: SteppedTarget) -> None:
        self.target = target
        self._per_batch: dict[int, tuple[float, ...]] = {}
        self._factor: dict[int, float] = {}  # the efficiency's factor per decode batch
        self.runs = 0  # decode_run calls
        self.fallbacks = 0  # ... timed step by step instead
        self._calls = 0
        self._scalar: tuple | None = None
        self._fast: Callable[[int, int, int, int], float] = _no_mirror  # of the totals
        self._for: tuple[object, object] | None = None  # (roofline, efficiency) it mirrors
        self._mirrored()

    # ---- one step --------------------------------------------------------------------

    def __call__(self, plan: StepPlan) -> float:
        t = self.target
        c = self._scalar
        f = self._for
        if c is None or f is None or t.roofline is not f[0] or t.efficiency is not f[1]:
            c = self._mirrored()
            if c is None:
                return t.step_time(plan)
        self._calls += 1
        if not self._calls & (_CHECK_EVERY - 1):
            return self._checked(plan)
        return self._fast(*plan.totals())

    def step_totals(self) -> Callable[[int, int, int, int], float] | None:
        """For the simulator, once per window: ``f(decode_batch, kv_tokens, prefill_tokens,
        prefill_count) -> seconds``, what calling this on a plan of those totals returns
        (the mirror, checked every 512th call as ``__call__`` checks it, and timing every
        call with ``step_time`` once a check failed), without a plan; None while the
        mirror is off (time the plans instead). One closure: a step is one call."""
        c = self._mirrored()
        if c is None:
            return None

        def check(b: int, kv: int, ptok: int, nchunks: int) -> float:
            plan = plan_of_totals(b, kv, ptok, nchunks)
            if self._scalar is None:
                return self.target.step_time(plan)
            want = self._checked(plan)
            if not self.mirroring:  # (a property: a compiled build keeps no narrowed read)
                stop_mirroring()  # from now on every call is timed by step_time
            return want

        fn, stop_mirroring = self._mirror_of(c, check)
        return fn

    @property
    def mirroring(self) -> bool:
        """Whether the scalar mirror is on (off: every step is timed by ``step_time``)."""
        return self._scalar is not None

    def _checked(self, plan: StepPlan) -> float:
        want = self.target.step_time(plan)
        got = self._fast(*plan.totals())
        if got != want:
            self._disable(f"plan totals {plan.totals()}: {got!r} != {want!r}")
        return want

    def _mirrored(self) -> tuple | None:
        """The mirror's constants for the target's roofline and efficiency as they are now
        (built and checked again when either was replaced); None: step_time itself."""
        t = self.target
        now = (t.roofline, t.efficiency)
        if self._for is not None and now[0] is self._for[0] and now[1] is self._for[1]:
            return self._scalar
        self._for = now
        self._factor = {}
        self._scalar = self._scalar_constants()
        if self._scalar is not None:
            self._fast = self._mirror_of(self._scalar)[0]
            self._check_mirror()
        return self._scalar

    def _mirror_of(
        self, c: tuple, check: Callable[[int, int, int, int], float] | None = None
    ) -> tuple[Callable[[int, int, int, int], float], Callable[[], None]]:
        """SimTarget.step_time, uncalibrated roofline, for a plan of the totals
        ``(decode_batch, kv_tokens, prefill_tokens, prefill_count)``: the constants ``c``
        bound once, the efficiency's factor cached per decode batch. With ``check``, every
        512th call returns ``check(...)`` instead, and every call once the second function
        returned (``stop``) was called. Returns (the mirror, stop)."""
        (interf, overhead, tp, wb, kvb, mm_rest, head, attn4, bw, peak, hb, lat, c_ar, ar_l) = c
        bw_mem, bw_link = bw
        factors = self._factor
        factor = self.target.efficiency.factor
        calls = 0
        # Calls between two checks, less one (0: check every call; -1: never).
        mask = -1 if check is None else _CHECK_EVERY - 1

        # The prefill's share of a step, per (prefill tokens, chunks): Roofline._shape's
        # prefill rows p and the integer FLOPs that vary with neither b nor kv. The mirror's
        # FLOPs are integers (see _scalar_constants), so regrouping them is exact:
        # 2 (mm_rest rows + head head_rows) + attn4 pairs
        #   = per_b b + attn4 kv + 2 mm_rest p + 2 head seqs + attn4 p (p + 1) // 2.
        per_b = 2 * (mm_rest + head)
        prefill: dict[int, tuple[int, int]] = {}

        def prefill_part(ptok: int, nchunks: int) -> tuple[int, int]:
            p = round(ptok * interf)
            # Roofline._shape: prefill_sequences = nchunks or None.
            seqs = nchunks if nchunks else (1 if p else 0)
            return p, 2 * mm_rest * p + 2 * head * seqs + attn4 * (p * (p + 1) // 2)

        def mirror(b: int, kv: int, ptok: int, nchunks: int) -> float:
            nonlocal calls
            if mask >= 0:
                calls += 1
                if not calls & mask:
                    return check(b, kv, ptok, nchunks)  # type: ignore[misc]
            key = ptok << 32 | nchunks  # a step has far fewer than 2**32 chunks
            pp = prefill.get(key)
            if pp is None:
                pp = prefill[key] = prefill_part(ptok, nchunks)
            p, flops_p = pp
            rows = b + p
            if rows == 0:
                roof = 0.0
            else:
                mem_s = (wb + (kv + p) * kvb) / bw_mem
                flops = per_b * b + attn4 * kv + flops_p  # the integer, regrouped (above)
                if tp == 1:  # no all-reduce; an integer over 1 is that integer as a float
                    comp_s = flops / peak
                    roof = comp_s if comp_s > mem_s else mem_s  # max(mem_s, comp_s) + 0.0
                else:
                    comm = ar_l * (lat + c_ar * (rows * hb) / bw_link)  # rows > 0 here
                    comp_s = flops / tp / peak
                    roof = (comp_s if comp_s > mem_s else mem_s) + comm
            f = factors.get(b)
            if f is None:
                f = factors[b] = factor(max(1, b))
            return overhead + roof / f

        def stop() -> None:
            nonlocal mask
            mask = 0

        return mirror, stop

    def _disable(self, why: str) -> None:
        logger.warning(
            "the scalar step time differs from %s.step_time (%s): timing each step with it"
            " (the roofline's arithmetic changed; update controller/sim/decode_run.py)",
            type(self.target).__name__,
            why,
        )
        self._scalar = None

    def _scalar_constants(self) -> tuple | None:
        """What SimTarget.step_time computes that no plan changes (None: no mirror)."""
        r = self.target.roofline
        if r.calibrated:
            return None
        m = r.model
        eff = self.target.efficiency
        hw = r.hardware
        ints = (m.matmul_params, m.embedding_params, m.layers, m.heads, m.head_dim, m.hidden)
        if not all(type(v) is int for v in (*ints, r.bytes_per_elem, r.tp)):
            return None  # the mirror regroups integer products only
        head = m.embedding_params
        return (
            eff.prefill_interference,
            eff.overhead_s,
            r.tp,
            r.weight_bytes_read_per_device,
            r.kv_bytes_per_token_per_device,
            m.matmul_params - head,
            head,
            4 * m.layers * m.heads * m.head_dim,
            (hw.mem_bandwidth, hw.interconnect_bandwidth),
            r.peak_flops,
            m.hidden * r.bytes_per_elem,
            hw.interconnect_latency_s,
            2 * (r.tp - 1) / r.tp,
            2 * m.layers,
        )

    def _check_mirror(self) -> None:
        scalar = self.target.step_time
        for b, kv, chunks in _check_grid(self.target.sim_config.max_slots):
            plan = plan_of(b, kv, chunks)
            got, want = self._fast(*plan.totals()), scalar(plan)
            if got != want:
                self._disable(f"batch {b}, kv {kv}, chunks {chunks}: {got!r} != {want!r}")
                return

    # ---- a run of decode-only steps -----------------------------------------------------

    def decode_run(self, batch: int, kv_tokens: np.ndarray) -> np.ndarray:
        """Step times of decode-only plans of ``batch`` sequences reading ``kv_tokens`` [m]."""
        self.runs += 1
        out = self._vector(batch, kv_tokens)  # [m]
        ends = (0, len(kv_tokens) - 1)
        if all(out[j] == self._decode_step(batch, int(kv_tokens[j])) for j in ends):
            return out
        if not self.fallbacks:
            logger.warning(
                "decode_run differs from %s.step_time at batch %d: timing runs step by step"
                " (the roofline's arithmetic changed; update controller/sim/decode_run.py)",
                type(self.target).__name__,
                batch,
            )
        self.fallbacks += 1
        scalar = self.target.step_time
        return np.array([scalar(decode_only_plan(batch, int(x))) for x in kv_tokens])

    def _decode_step(self, batch: int, kv_tokens: int) -> float:
        """The scalar step time of one decode-only plan: the mirror while it is on (checked
        against step_time as ``__call__`` checks it), else step_time itself."""
        c = self._scalar
        f = self._for
        t = self.target
        if c is None or f is None or t.roofline is not f[0] or t.efficiency is not f[1]:
            return t.step_time(decode_only_plan(batch, kv_tokens))
        self._calls += 1
        if not self._calls & (_CHECK_EVERY - 1):
            return self._checked(decode_only_plan(batch, kv_tokens))
        return self._fast(batch, kv_tokens, 0, 0)

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
        """What search/roofline/curve.py's step_time_detailed_s computes that a decode-only step
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
