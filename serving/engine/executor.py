"""The torch executor: runs the decode model for one :class:`StepPlan`.

- Decode: one forward for the whole batch. Entries are sorted by slot; when the
  slots span a range at most ``DENSE_SPAN`` times the batch, the executor feeds
  the whole slot range and reads the cache as a view (no gather); holes get a
  dummy row that writes at position ``max_len - 1``, a position no request
  ever reads (the last token a request may feed is at ``max_len - 2``).
  Otherwise it gathers the slots with ``index_select``.
  On a GPU (or when asked) decode steps take the device path instead
  (serving/engine/device_decode.py): fixed shapes, CUDA graphs, one sync a step.
- Prefill: one forward per chunk (batch 1) on the CPU; on the device path the chunks of a
  step in one forward, one row each, left-padded to the longest (the pads sit at
  position ``max_len - 1``, written and never read, like the dummy rows above, so each
  row's last position is its chunk's last token).
- Linears: on CPU in bf16 the engine prepacks the weights for oneDNN
  (``Transformer.prepack``): bit-identical results, several times the bandwidth
  of ``F.linear`` for skinny decode GEMMs.
- Sampling: greedy at temperature 0, softmax sampling otherwise, from one
  seeded generator. The ``[B, V]`` fp32 logits are 33 MB at B=256 with a 32k
  vocabulary: they are copied (gathered, concatenated) only when rows must go.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from serving.engine.device_decode import DeviceDecode, Drawn, Staging
from serving.model.sampling import sample
from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry, PrefillChunk, StepPlan

logger = logging.getLogger(__name__)

DENSE_SPAN = 1.5  # read a slot range as a view if it is at most this many times the batch


class TorchExecutor:
    def __init__(
        self,
        *,
        model: Transformer,
        device: torch.device,
        max_len: int,
        seed: int = 0,
        device_decode: bool | None = None,
        cuda_graphs: bool | None = None,
        attention: str | None = None,
    ) -> None:
        """``device_decode``: decode steps by :class:`DeviceDecode` (None: on CUDA);
        ``cuda_graphs``: whether it captures them (None: on CUDA); ``attention``: its
        kernel, "flex" or "sdpa" (None: flex on CUDA)."""
        self.model, self.device, self.max_len = model, device, max_len
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self.staging = Staging(device)
        use = device.type == "cuda" if device_decode is None else device_decode
        self.device_decode = (
            DeviceDecode(
                model,
                max_slots=model.max_slots,
                max_len=max_len,
                generator=self._gen,
                cuda_graphs=cuda_graphs,
                staging=self.staging,
                attention=attention,
            )
            if use
            else None
        )

    def execute(
        self,
        plan: StepPlan,
        temps: dict[str, float],
        bans: dict[str, tuple[int, ...]] | None = None,
    ) -> dict[str, int]:
        """Run the model for one plan; returns the token each sampling request drew
        (never one of its ``bans``)."""
        drawn = self.launch(plan, temps, bans)
        return drawn.wait() if drawn is not None else {}

    @torch.inference_mode()
    def launch(
        self,
        plan: StepPlan,
        temps: dict[str, float],
        bans: dict[str, tuple[int, ...]] | None = None,
        pending: Drawn | None = None,
    ) -> Drawn | None:
        """Start one plan on the device and return its draws, still on their way to the
        host (None: no request samples). ``pending``: the step launched before, not waited
        for yet: the decode entries whose token is None take it from its draws on the
        device (the device path only)."""
        if self.device.type == "cuda":  # streams, events and graphs of this GPU
            with torch.cuda.device(self.device):
                return self._launch(plan, temps, bans, pending)
        return self._launch(plan, temps, bans, pending)

    def _launch(
        self,
        plan: StepPlan,
        temps: dict[str, float],
        bans: dict[str, tuple[int, ...]] | None,
        pending: Drawn | None,
    ) -> Drawn | None:
        rows: list[str | None] = []
        logits: list[torch.Tensor] = []
        if plan.decode:
            rows_d, logits_d = self._decode(plan, pending)
            rows += rows_d
            logits.append(logits_d)
        # Prefill chunks in one forward on the device path (a GPU has compute to spare
        # and pays per launch); one at a time on the CPU, where prefill is compute-bound
        # and left-padding the shorter chunks would add work.
        on_device = self.device_decode is not None and plan.prefill
        batches = [plan.prefill] if on_device else [[c] for c in plan.prefill]
        for chunks in batches:
            rows_p, logits_p = self._prefill(chunks)
            rows += rows_p
            logits.append(logits_p)
        if not any(r is not None for r in rows):
            return None
        all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)  # [R, V]
        kept, drawn = sample_rows(rows, all_logits, temps, self._gen, bans, staging=self.staging)
        return Drawn.start(kept, drawn)

    def _prefill(self, chunks: Sequence[PrefillChunk]) -> tuple[list[str | None], torch.Tensor]:
        """One forward for every chunk of the step: [N, T] left-padded rows."""
        t = max(c.length for c in chunks)
        tok: list[int] = []
        pos: list[int] = []
        for c in chunks:
            assert c.token_ids is not None, "the engine always passes prompt ids"
            pad = t - c.length
            tok += [0] * pad + list(c.token_ids)
            pos += [self.max_len - 1] * pad + list(range(c.start, c.start + c.length))
        slots = [c.slot for c in chunks]
        put = self.staging.put
        toks = put(tok, torch.int64).view(len(chunks), t)  # [N, T]
        poss = put(pos, torch.int64).view(len(chunks), t)  # [N, T]
        run = all(b == a + 1 for a, b in zip(slots, slots[1:], strict=False))
        out = self.model(toks, poss, put(slots, torch.int64), slot_start=slots[0] if run else None)
        return [c.request_id if c.last else None for c in chunks], out  # [N, V]

    def _decode(
        self, plan: StepPlan, pending: Drawn | None
    ) -> tuple[list[str | None], torch.Tensor]:
        entries = sorted(plan.decode, key=lambda e: e.slot)
        if self.device_decode is not None:
            return self.device_decode.logits(entries, pending)
        tokens, positions, slots, start, keep = decode_inputs(entries, self.max_len, self.device)
        logits = self.model(tokens, positions, slots, slot_start=start)  # [span or B, V]
        if keep is not None:  # drop the dummy rows (a copy of [B, V] fp32 logits)
            logits = logits.index_select(0, keep)  # [B, V]
        return [e.request_id for e in entries], logits


def decode_inputs(
    entries: Sequence[DecodeEntry], max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None, torch.Tensor | None]:
    """The host work before a decode forward: (tokens [R, 1], positions [R, 1], slots [R],
    slot_start or None, rows to keep or None) for ``entries`` sorted by slot.

    A public function so the calibration (search/calibrate/step.py) times the engine's
    own per-step host work, not a copy of it."""
    lo, hi = entries[0].slot, entries[-1].slot
    span = hi - lo + 1
    dev = device
    if span <= DENSE_SPAN * len(entries):
        tok = [0] * span
        pos = [max_len - 1] * span  # dummy rows: a position nobody reads
        for e in entries:
            tok[e.slot - lo] = int(e.token)
            pos[e.slot - lo] = e.position
        keep = None
        if span > len(entries):
            keep = torch.tensor([e.slot - lo for e in entries], device=dev)  # [B]
        return (
            torch.tensor(tok, device=dev)[:, None],  # [span, 1]
            torch.tensor(pos, device=dev)[:, None],  # [span, 1]
            torch.arange(lo, hi + 1, device=dev),  # [span]
            lo,
            keep,
        )
    return (
        torch.tensor([[int(e.token)] for e in entries], device=dev),  # [B, 1]
        torch.tensor([[e.position] for e in entries], device=dev),  # [B, 1]
        torch.tensor([e.slot for e in entries], device=dev),  # [B]
        None,
        None,
    )


def sample_rows(
    rows: Sequence[str | None],
    logits: torch.Tensor,
    temps: dict[str, float],
    gen: torch.Generator,
    bans: dict[str, tuple[int, ...]] | None = None,
    *,
    staging: Staging | None = None,
) -> tuple[list[str], torch.Tensor]:
    """Sample one token per row of ``logits`` [R, V] (fp32) at each request's
    temperature, on the logits' device: (the requests, their tokens [R']). Rows named None
    are dropped first (dummy rows, prefill chunks that do not end a prompt), so a request
    draws as it would alone. ``bans``: ids a request may not sample (its logits become
    -inf in place: ``min_tokens``). ``staging``: how lists reach the device
    (serving/engine/device_decode.py ``Staging``; None: a plain copy)."""
    put = staging.put if staging is not None else _plain_put(logits.device)
    kept = [r for r in rows if r is not None]
    if len(kept) < len(rows):
        keep = [i for i, r in enumerate(rows) if r is not None]
        logits = logits.index_select(0, put(keep, torch.int64))  # [R', V]
    if bans:
        r_idx = [i for i, r in enumerate(kept) for _ in bans.get(r, ())]
        v_idx = [t for r in kept for t in bans.get(r, ())]
        if r_idx:  # [R', V] at the banned (row, id) pairs
            logits[put(r_idx, torch.int64), put(v_idx, torch.int64)] = -math.inf
    tl = [temps.get(r, 0.0) for r in kept]
    return kept, sample(logits, put(tl, torch.float32), gen, any_hot=any(x > 0 for x in tl))


def draw(
    rows: Sequence[str | None],
    logits: torch.Tensor,
    temps: dict[str, float],
    gen: torch.Generator,
    bans: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, int]:
    """The host work after a forward: :func:`sample_rows`, and the tokens back to Python
    (a wait for the device)."""
    kept, drawn = sample_rows(rows, logits, temps, gen, bans)
    return dict(zip(kept, drawn.tolist(), strict=True))


def _plain_put(device: torch.device):
    def put(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return put
