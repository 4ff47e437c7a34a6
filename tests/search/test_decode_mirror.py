"""The calibration's mirror of decode attention computes grouped-query attention.

search/calibrate/shapes.py times :func:`decode_attention` as the serving model's decode
attention; this checks it against an independent fp32 reference (repeat_kv + softmax)
on the serving cache layout ``[2, B, Hkv, L, D]``, with positions beyond each
query's own masked out.
"""

from __future__ import annotations

import math

import torch

from search.calibrate.shapes import decode_attention


def test_decode_attention_matches_a_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    b, hkv, g, length, d = 3, 2, 3, 16, 64
    cache = torch.randn(2, b, hkv, length, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(b, hkv * g, d, generator=gen).to(torch.bfloat16)  # [B, H, D]
    pos = torch.tensor([0, 7, 15])  # each row attends to keys 0..pos
    hidden = torch.arange(length)[None, :] > pos[:, None]  # [B, L]
    mask = torch.zeros(b, 1, 1, length).masked_fill_(hidden[:, None, None], -math.inf)
    mask = mask.expand(b, hkv, g, length).reshape(b * hkv, g, length).to(torch.bfloat16)

    got = decode_attention(q.view(b * hkv, g, d), cache, mask)  # [B*Hkv, g, D]

    k = cache[0].float().repeat_interleave(g, dim=1)  # [B, H, L, D]
    v = cache[1].float().repeat_interleave(g, dim=1)  # [B, H, L, D]
    s = torch.einsum("bhd,bhld->bhl", q.float(), k) / math.sqrt(d)  # [B, H, L]
    s = s.masked_fill(hidden[:, None, :], -math.inf)
    want = torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), v)  # [B, H, D]
    torch.testing.assert_close(got.view(b, hkv * g, d).float(), want, atol=2e-2, rtol=2e-2)
    # Row 0 sees only key 0: its output is V[0] exactly (to bf16 rounding).
    torch.testing.assert_close(got.view(b, hkv * g, d)[0].float(), v[0, :, 0], atol=1e-2, rtol=0)
