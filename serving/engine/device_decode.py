"""Decode steps of fixed shapes on the device, captured as CUDA graphs on a GPU.

An eager decode step of a small model on a GPU is launch-bound: ~17 kernels a layer,
each launched by Python, each far shorter than its launch (for the built-in model on an
H200 the bandwidth bound is ~0.04 ms a step). This path makes a step a replay of one
captured graph, and keeps the host from waiting on the GPU more than once a step.

- **Shapes.** A step runs slots ``0..B-1`` (``Transformer.decode_window``): the scheduler
  hands out the lowest free slot first, so the running requests sit near the bottom, and
  B is the smallest bucket (1, 2, 4, ..., ``max_slots``) covering the highest running
  slot. Slots without a request among them are dummy rows whose logits are dropped.
- **Attention.** On CUDA, FlexAttention (:class:`FlexAttend`, compiled) over whole cache
  rows with a block mask of each row's own length: a row reads ``ceil((position + 1) /
  128)`` key blocks of its slot and no more, whatever the other rows' lengths. Elsewhere
  (and when asked: ``attention="sdpa"``) SDPA over the first ``W`` positions of each
  row as a view (no gather) with a per-row mask: ``W`` is the smallest window bucket (64
  x 2^k and 1.5x between, up to ``max_len``) covering the longest request in the step,
  so every row reads up to 1.5x the longest request's keys.
- **Graphs.** On CUDA each (B, W) pair is captured once into one shared memory pool;
  with FlexAttention W is always ``max_len``, and every batch bucket is captured when the
  engine starts (:meth:`DeviceDecode.warm_up`), so no request waits for a compile. Inputs
  (tokens, positions) are static device buffers filled from pinned host buffers without
  a sync. The capture's warm-up runs write the same K/V the step writes, so capturing on
  a live step changes nothing. On the CPU the same function runs directly (CUDA graphs
  need a GPU; the C kernels stay the CPU's decode path, and this one is used there only
  when asked: tests/serving/test_device_decode.py, which also runs FlexAttention compiled
  on the CPU).
- **One sync a step.** Every list the step sends (tokens, positions, temperatures, the
  prefill rows) goes through pinned buffers with asynchronous copies (:class:`Staging`);
  sampling runs on the device, and prefill logits join the decode logits for one
  sampling call. The host then waits for nothing but the step's tokens (an event), and
  with the engine's overlap (serving/engine/engine.py ``Engine.step``) it waits for step
  N-1's only after launching step N, whose inputs from step N-1 it takes from that
  step's draws on the device: the host schedules and prepares step N+1 while the GPU
  runs step N.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry

logger = logging.getLogger(__name__)

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
    """Lists to the device without a sync: on CUDA each goes through a pinned host tensor
    and an asynchronous copy (a copy from pageable memory waits for the GPU to drain). The
    pinned tensor is taken from torch's caching host allocator, which records the copy
    and gives its block out again only once the copy has run, however far ahead of the
    GPU the host gets (steps that sample nothing are never waited for). On the CPU a list
    simply becomes a tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"

    def put(
        self, values: Sequence[int | float], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``values`` as a 1-D tensor on the device (copied into ``out`` if given)."""
        src = torch.tensor(values, dtype=dtype, pin_memory=self.pinned)
        if not self.pinned:
            return src if out is None else out.copy_(src)
        dst = out if out is not None else torch.empty(len(values), dtype=dtype, device=self.device)
        return dst.copy_(src, non_blocking=True)


class Drawn:
    """The tokens one step drew: on the device (``drawn``, [R]) and on their way to the
    host (a pinned copy and an event on CUDA). :meth:`wait` is the step's one wait for
    the device, for this step only: work launched after it keeps the GPU busy."""

    def __init__(self, rows: list[str], drawn: torch.Tensor) -> None:
        self.rows, self.drawn = rows, drawn
        self.host = drawn
        self.event: torch.cuda.Event | None = None
        self._row_of: dict[str, int] | None = None

    @classmethod
    def start(cls, rows: list[str], drawn: torch.Tensor) -> Drawn:
        d = cls(rows, drawn)
        if drawn.device.type == "cuda":
            d.host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True)
            d.host.copy_(drawn, non_blocking=True)
            d.event = torch.cuda.Event()
            d.event.record(torch.cuda.current_stream(drawn.device))
        return d

    def row_of(self) -> dict[str, int]:
        if self._row_of is None:
            self._row_of = {r: i for i, r in enumerate(self.rows)}
        return self._row_of

    def wait(self) -> dict[str, int]:
        """request id -> token, once this step's draws reached the host."""
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.rows, self.host.tolist(), strict=True))


KV_BLOCK = 128  # FlexAttention's key block: rows read whole blocks of it
ATTENTIONS = ("flex", "sdpa")


def _flex_call(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: BlockMask, scale: float
) -> torch.Tensor:
    return flex_attention(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)


_flex_compiled: dict[tuple[str, int], Callable[..., torch.Tensor]] = {}


def _flex(device_type: str, batch: int) -> Callable[..., torch.Tensor]:
    """FlexAttention compiled (uncompiled it is a reference implementation that
    materializes every score) for one batch bucket, with static shapes: inductor picks its
    decoding kernel (keys split across blocks) only for a static batch, and on the CPU its
    C++ code for a dynamic batch did not compile (torch 2.13: an undeclared
    ``cur_qSplitSize8``). torch.compile keeps a function's compiled versions on its code
    object, at most 8; each bucket gets a copy of the code object of its own."""
    key = (device_type, batch)
    fn = _flex_compiled.get(key)
    if fn is None:
        code = _flex_call.__code__.replace(co_name=f"flex_attention_b{batch}")
        fresh = types.FunctionType(code, _flex_call.__globals__, code.co_name)
        fn = _flex_compiled[key] = torch.compile(fresh, dynamic=False)
    return fn


class FlexAttend:
    """Attention of a decode step of slots 0..B-1 that reads, per row, only the key blocks
    its own length covers (``ceil((position + 1) / KV_BLOCK)`` blocks of its cache row),
    with FlexAttention and a block mask whose tensors are fixed buffers: ``begin`` refills
    the per-row block counts from the step's positions on the device, so a captured graph
    replays it. The mask inside the last block hides positions past the row's own."""

    def __init__(self, positions: torch.Tensor, max_len: int) -> None:
        b, dev = positions.shape[0], positions.device
        self.max_len = max_len
        blocks = -(-max_len // KV_BLOCK)
        self.kv_num = torch.ones(b, 1, 1, dtype=torch.int32, device=dev)
        order = torch.arange(blocks, dtype=torch.int32, device=dev)
        kv_idx = order.view(1, 1, 1, blocks).expand(b, 1, 1, blocks).contiguous()
        pos = positions  # a fixed view: the mask reads each step's positions from it

        def own_length(b_idx, h_idx, q_idx, kv_pos):
            return kv_pos <= pos[b_idx]

        self.block_mask = BlockMask.from_kv_blocks(
            self.kv_num, kv_idx, BLOCK_SIZE=KV_BLOCK, mask_mod=own_length,
            seq_lengths=(1, max_len),
        )  # fmt: skip

    def begin(self, positions: torch.Tensor) -> None:
        blocks = (positions + KV_BLOCK) // KV_BLOCK
        dummy = positions == self.max_len - 1  # a hole: its output is dropped, read 1 block
        self.kv_num.copy_(torch.where(dummy, 1, blocks).view(-1, 1, 1))

    def __call__(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return _flex(q.device.type, q.shape[0])(q, keys, values, self.block_mask, scale)


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
        attention: str | None = None,
    ) -> None:
        dev = model.lm_head.weight.device
        self.model, self.device, self.max_len, self.gen = model, dev, max_len, generator
        self.staging = staging
        self.attention = attention or ("flex" if dev.type == "cuda" else "sdpa")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: must be one of {', '.join(ATTENTIONS)}")
        self._attend: dict[int, FlexAttend] = {}
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
        if self.attention == "flex":  # whole rows, each read as far as its own length
            return _first_at_least(self.batches, top + 1), self.max_len
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
            return rows, self.model.decode_window(*self._args(b, w))
        hit = self._graphs.get((b, w))
        if hit is None:
            hit = self._capture(b, w)
        graph, out = hit
        graph.replay()
        return rows, out

    def _args(self, b: int, w: int) -> tuple:
        """decode_window's arguments for a (B, W) step: fixed views of the static inputs."""
        attend = None
        if self.attention == "flex":
            attend = self._attend.get(b)
            if attend is None:
                attend = self._attend[b] = FlexAttend(self.positions[:b], self.max_len)
        return self.tokens[:b], self.positions[:b], w, attend

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = self._args(b, w)
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

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Capture every batch bucket's graph now, before serving (with FlexAttention a
        step's window is always ``max_len``: one graph a bucket), so no request waits for a
        first compile and capture mid-stream. The captures' dummy rows write K/V only at
        position ``max_len - 1``, which no request reads. Returns the graphs captured."""
        if not (self.cuda_graphs and self.attention == "flex"):
            return 0
        try:
            with torch.cuda.device(self.device):
                self._capture_all()
        except Exception:
            # A replica that cannot compile or capture still serves, on the device path
            # without graphs and with SDPA over a window, and says so.
            logger.exception(
                "capturing decode graphs with FlexAttention failed: serving without CUDA "
                "graphs, with SDPA attention"
            )
            self._graphs.clear()
            self._attend.clear()
            self.cuda_graphs, self.attention = False, "sdpa"
            return 0
        return len(self._graphs)

    def _capture_all(self) -> None:
        for b in self.batches:
            if (b, self.max_len) not in self._graphs:
                self.tokens[:b].zero_()
                self.positions[:b].fill_(self.max_len - 1)
                self._capture(b, self.max_len)

    @property
    def graphs_captured(self) -> int:
        return len(self._graphs)
