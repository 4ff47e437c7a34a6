"""Decode steps of fixed shapes on the device, captured as CUDA graphs on a GPU.

An eager decode step of a small model on a GPU is launch-bound: ~17 kernels a layer,
each launched by Python, each far shorter than its launch (for the built-in model on an
H200 the bandwidth bound is ~0.04 ms a step). This path makes a step a replay of one
captured graph, and keeps the host from waiting on the GPU more than once a step.

- **Shapes.** A step runs slots ``0..B-1`` (``Transformer.decode_window``): the scheduler
  hands out the lowest free slot first, so the running requests sit near the bottom, and
  B is the smallest bucket (1, 2, 4, ..., ``max_slots``) covering the highest running
  slot. Slots without a request among them are dummy rows whose logits are dropped.
- **Attention** reads the first ``W`` positions of each slot's cache row as a view (no
  gather), with SDPA and a per-row mask of the row's own length: ``W`` is the smallest
  window bucket (64 x 2^k and 1.5x between, up to ``max_len``) covering the longest
  request in the step, so a step reads at most 1.5x the keys of its longest request per
  row, instead of whole ``max_len`` rows. Rows shorter than the longest read their
  window's masked tail: a paged layout would skip it.
- **Graphs.** On CUDA each (B, W) pair is captured once, on first use, into one shared
  memory pool; its inputs (tokens, positions) are static device buffers filled from pinned
  host buffers without a sync. The capture's warm-up runs write the same K/V the step
  writes, so capturing on a live step changes nothing. On the CPU the same function runs
  directly (CUDA graphs need a GPU; the C kernels stay the CPU's decode path, and this
  one is used there only when asked: tests/serving/test_device_decode.py).
- **One sync a step.** Every list the step sends (tokens, positions, temperatures, the
  prefill rows) goes through pinned buffers with asynchronous copies (:class:`Staging`);
  sampling runs on the device, and the step's one wait for the GPU is reading the sampled
  tokens back (``tolist``, serving/engine/executor.py ``draw``). Prefill logits join the
  decode logits for that one sampling call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry

if TYPE_CHECKING:
    from serving.engine.executor import Drawn

MIN_WINDOW = 64


def batch_buckets(max_slots: int) -> list[int]:
    """1, 2, 4, ... below ``max_slots``, then ``max_slots``."""
    out = [1 << k for k in range(max_slots.bit_length()) if 1 << k < max_slots]
    return [*out, max_slots]


def window_buckets(max_len: int) -> list[int]:
    """64 x 2^k and 1.5x between, below ``max_len``, then ``max_len``."""
    out: list[int] = []
    w = MIN_WINDOW
    while w < max_len:
        out += [w, w * 3 // 2] if w * 3 // 2 < max_len else [w]
        w *= 2
    return [*out, max_len]


def _first_at_least(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class Staging:
    """Lists to the device without a sync: on CUDA each goes through a pinned host buffer
    and an asynchronous copy (a copy from pageable memory waits for the GPU to drain).

    Two sets of buffers, one per step in turn: :meth:`reset` at the start of a step turns
    to the set the step before last used. The engine has waited for that step's tokens
    before it launches the next one (with overlap it waits for step N-1 after launching
    step N), so its copies are done. On the CPU a list simply becomes a tensor."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._sets: list[dict[torch.dtype, torch.Tensor]] = [{}, {}]
        self._turn = 0
        self._used: dict[torch.dtype, int] = {}
        self._retired: list[list[torch.Tensor]] = [[], []]  # outgrown: kept until reuse
        self._capacity = capacity

    def reset(self) -> None:
        self._turn ^= 1
        self._used.clear()
        self._retired[self._turn].clear()

    def put(
        self, values: Sequence[int | float], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``values`` as a 1-D tensor on the device (copied into ``out`` if given)."""
        src = torch.tensor(values, dtype=dtype)
        if not self.pinned:
            return src if out is None else out.copy_(src)
        bufs = self._sets[self._turn]
        n, at = len(values), self._used.get(dtype, 0)
        buf = bufs.get(dtype)
        if buf is None or at + n > buf.numel():
            if buf is not None:
                self._retired[self._turn].append(buf)  # its copies may still be in flight
            size = max(self._capacity, 2 * (at + n))
            buf = bufs[dtype] = torch.empty(size, dtype=dtype, pin_memory=True)
            at = 0
        host = buf[at : at + n]
        host.copy_(src)
        self._used[dtype] = at + n
        dst = out if out is not None else torch.empty(n, dtype=dtype, device=self.device)
        return dst.copy_(host, non_blocking=True)


class DeviceDecode:
    def __init__(
        self,
        model: Transformer,
        *,
        max_slots: int,
        max_len: int,
        generator: torch.Generator,
        staging: Staging,
        cuda_graphs: bool | None = None,
    ) -> None:
        dev = model.lm_head.weight.device
        self.model, self.device, self.max_len, self.gen = model, dev, max_len, generator
        self.staging = staging
        self.cuda_graphs = dev.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and dev.type != "cuda":
            raise ValueError(f"cuda_graphs=True: the model is on {dev}, not a CUDA device")
        self.batches = batch_buckets(max_slots)
        self.windows = window_buckets(max_len)
        # Static inputs: a captured graph reads them at fixed addresses.
        self.tokens = torch.zeros(max_slots, dtype=torch.int64, device=dev)
        self.positions = torch.full((max_slots,), max_len - 1, dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    def shape_for(self, entries: Sequence[DecodeEntry]) -> tuple[int, int]:
        """(B, W) of a step of ``entries``."""
        top = max(e.slot for e in entries)
        longest = max(e.position for e in entries) + 1
        return _first_at_least(self.batches, top + 1), _first_at_least(self.windows, longest)

    def logits(
        self, entries: Sequence[DecodeEntry], pending: Drawn | None = None
    ) -> tuple[list[str | None], torch.Tensor]:
        """One decode step of ``entries``: the request of each row (None: a dummy row) and
        the logits [B, V] (fp32; a graph's output, valid until the next step). An entry
        whose token the host does not have yet (None: sampled by the step still in
        flight) takes it from ``pending``'s draws on the device."""
        b, w = self.shape_for(entries)
        tok = [0] * b
        pos = [self.max_len - 1] * b  # dummy rows: a position no request reads
        rows: list[str | None] = [None] * b
        later: list[tuple[int, int]] = []  # (slot, row of pending's draws)
        at = pending.row_of() if pending is not None else {}
        for e in entries:
            pos[e.slot], rows[e.slot] = e.position, e.request_id
            if e.token is not None:
                tok[e.slot] = int(e.token)
            else:
                later.append((e.slot, at[e.request_id]))
        self.staging.put(tok, torch.int64, out=self.tokens[:b])
        self.staging.put(pos, torch.int64, out=self.positions[:b])
        if later:
            assert pending is not None
            put = self.staging.put
            slots = put([s for s, _ in later], torch.int64)
            self.tokens.index_copy_(
                0, slots, pending.drawn.index_select(0, put([r for _, r in later], torch.int64))
            )
        if not self.cuda_graphs:
            return rows, self.model.decode_window(self.tokens[:b], self.positions[:b], w)
        hit = self._graphs.get((b, w))
        if hit is None:
            hit = self._capture(b, w)
        graph, out = hit
        graph.replay()
        return rows, out

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.tokens[:b], self.positions[:b], w)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, autotuning)
            for _ in range(2):
                self.model.decode_window(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model.decode_window(*args)
        self._graphs[(b, w)] = (graph, out)
        return graph, out

    @property
    def graphs_captured(self) -> int:
        return len(self._graphs)
