"""The context one decode or prefill forward shares across its layers.

Built once per step by ``Transformer.prologue`` (serving/model/transformer.py): the rotary
factors of each row's positions, the cache rows the step writes (K and V of
every KV head in one ``index_put_``), and the additive attention mask; for a
decode step run by the C kernel (serving/kernels/cpu_kernels.py) only the positions,
slots and rotary tables it reads.
"""

from __future__ import annotations

import torch

from serving.kernels.cpu_kernels import Kernels


def cache_rows(
    slots: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, T]
    max_slots: int,
    n_kv_heads: int,
    max_len: int,
) -> torch.Tensor:
    """The rows a step writes in a layer's cache viewed as [2*S*Hkv*L, D]: row of (K|V j,
    slot, kv head h, position p) = ((j*S + slot)*Hkv + h)*L + p, ordered [B, T, 2*Hkv] like
    the k|v half of the qkv output, so one ``index_put_`` writes both."""
    dev = positions.device
    j = torch.arange(2, device=dev)[:, None]  # [2, 1]
    hh = torch.arange(n_kv_heads, device=dev)[None, :]  # [1, Hkv]
    within = (j * max_slots * n_kv_heads + hh) * max_len  # [2, Hkv]
    base = slots * (n_kv_heads * max_len)  # [B]
    rows = base[:, None, None, None] + within + positions[:, :, None, None]  # [B, T, 2, Hkv]
    return rows.flatten(2)  # [B, T, 2*Hkv]


class StepContext:
    """Where one forward writes and reads the cache, its rotary factors and its mask;
    built once per step, shared by every layer."""

    def __init__(
        self,
        positions: torch.Tensor,  # [B, T]
        slots: torch.Tensor | None,  # [B]
        slot_start: int | None,
        *,
        max_slots: int,
        kv_len: int,
        n_kv_heads: int,
        n_heads: int,
        cos: torch.Tensor,  # [P, D] in the model dtype
        sin_signed: torch.Tensor,  # [P, D]
        kernels: Kernels | None = None,
    ) -> None:
        b, t = positions.shape
        dev = positions.device
        self.slots, self.slot_start, self.b = slots, slot_start, b
        # A decode step with the C kernel (serving/kernels/cpu_kernels.py): it takes the rotary
        # tables, positions and slots as they are and needs no mask or cache rows.
        self.kernels = kernels if (kernels is not None and slots is not None and t == 1) else None
        if self.kernels is not None:
            self.cos_table, self.sin_table = cos, sin_signed  # [P, D] each
            self.positions = positions.reshape(b).to(torch.int64).contiguous()  # [B]
            self.slots = slots.to(torch.int64).contiguous()  # [B]
            return
        self.cos = cos[positions].unsqueeze(2)  # [B, T, 1, D]
        self.sin = sin_signed[positions].unsqueeze(2)  # [B, T, 1, D]
        if slots is not None:
            self.rows = cache_rows(slots, positions, max_slots, n_kv_heads, kv_len)
        key_pos = torch.arange(kv_len, device=dev)  # [Lk]
        hidden = key_pos > positions[:, None, None, :, None]  # [B, 1, 1, T, Lk]
        g = n_heads // n_kv_heads
        # The scores GEMM's addend (0 / -inf, in the model dtype), one row per query
        # row of the grouped GEMM: [B*Hkv, g*T, Lk], materialized once per step.
        mask = torch.zeros(hidden.shape, dtype=cos.dtype, device=dev).masked_fill_(
            hidden, float("-inf")
        )  # [B, 1, 1, T, Lk]
        self.mask = mask.expand(b, n_kv_heads, g, t, kv_len).reshape(b * n_kv_heads, g * t, kv_len)

    def write(self, cache: torch.Tensor, kv: torch.Tensor) -> None:
        # cache: [2, S, Hkv, L, D]; kv: [B, T, 2*Hkv, D] (a strided view of qkv)
        cache.view(-1, cache.shape[-1]).index_put_((self.rows,), kv)

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        # cache: [2, S, Hkv, L, D] -> [2, B, Hkv, L, D]. Whole slots are read: a
        # narrowed length makes the batch non-contiguous and CPU bmm then copies
        # it, 5-8x slower than reading all max_len positions (measured).
        if self.slot_start is not None:
            return cache.narrow(1, self.slot_start, self.b)  # a view: no copy
        return cache.index_select(1, self.slots)
