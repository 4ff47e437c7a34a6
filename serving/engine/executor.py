"""The torch executor: runs the decode model for one :class:`StepPlan`.

- Decode: one forward for the whole batch. Entries are sorted by slot; when the
  slots span a range at most ``DENSE_SPAN`` times the batch, the executor feeds
  the whole slot range and reads the cache as a view (no gather); holes get a
  dummy row that writes at position ``max_len - 1``, a position no request
  ever reads (the last token a request may feed is at ``max_len - 2``).
  Otherwise it gathers the slots with ``index_select``.
- Prefill: one forward per chunk (batch 1).
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

from serving.model.sampling import sample
from serving.model.transformer import Transformer
from serving.scheduler.plan import DecodeEntry, StepPlan

logger = logging.getLogger(__name__)

DENSE_SPAN = 1.5  # read a slot range as a view if it is at most this many times the batch


class TorchExecutor:
    def __init__(
        self, *, model: Transformer, device: torch.device, max_len: int, seed: int = 0
    ) -> None:
        self.model, self.device, self.max_len = model, device, max_len
        self._gen = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        temps: dict[str, float],
        bans: dict[str, tuple[int, ...]] | None = None,
    ) -> dict[str, int]:
        """Run the model for one plan; returns the token each sampling request drew
        (never one of its ``bans``)."""
        rows: list[str] = []
        logits: list[torch.Tensor] = []
        if plan.decode:
            rows_d, logits_d = self._decode(plan)
            rows += rows_d
            logits.append(logits_d)
        for c in plan.prefill:
            assert c.token_ids is not None, "the engine always passes prompt ids"
            toks = torch.tensor([c.token_ids], device=self.device)  # [1, L]
            pos = torch.arange(c.start, c.start + c.length, device=self.device)[None]  # [1, L]
            slot = torch.tensor([c.slot], device=self.device)  # [1]
            out = self.model(toks, pos, slot, slot_start=c.slot)  # [1, V]
            if c.last:
                rows.append(c.request_id)
                logits.append(out)
        if not rows:
            return {}
        all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)  # [R, V]
        return draw(rows, all_logits, temps, self._gen, bans)

    def _decode(self, plan: StepPlan) -> tuple[list[str], torch.Tensor]:
        entries = sorted(plan.decode, key=lambda e: e.slot)
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


def draw(
    rows: list[str],
    logits: torch.Tensor,
    temps: dict[str, float],
    gen: torch.Generator,
    bans: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, int]:
    """The host work after a forward: sample one token per row of ``logits`` [R, V]
    (fp32) at each request's temperature and hand them back to Python. ``bans``: ids a
    request may not sample (its logits become -inf in place: ``min_tokens``)."""
    if bans:
        r_idx = [i for i, r in enumerate(rows) for _ in bans.get(r, ())]
        v_idx = [t for r in rows for t in bans.get(r, ())]
        if r_idx:
            logits[r_idx, v_idx] = -math.inf  # [R, V] at the banned (row, id) pairs
    tl = [temps.get(r, 0.0) for r in rows]
    t = torch.tensor(tl, device=logits.device)  # [R]
    drawn = sample(logits, t, gen, any_hot=any(x > 0 for x in tl)).tolist()
    return dict(zip(rows, drawn, strict=True))
