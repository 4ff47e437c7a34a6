"""The decoder's small parts: RMSNorm, rotary embeddings (the Hugging Face
``rotate_half`` convention) and the torch attention core, used by serving/model/transformer.py."""

from __future__ import annotations

import math

import torch
from torch import nn

from serving.kernels import cpu_kernels
from serving.model.config import ModelConfig
from serving.model.linear import bf16_matmul_native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels: cpu_kernels.Kernels | None = None  # set by Transformer.use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.kernels is not None
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.is_contiguous()
        ):  # CPU bf16: the same bits
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # torch's fused kernel: normalizes in fp32, one op instead of seven.
        return torch.rms_norm(x, self.shape, self.weight, self.eps)


ROPE_TABLE_DEFAULT = 4096  # positions tabulated before a cache asks for more


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2] in fp32, rescaled as ``cfg.rope_scaling``
    says (the formulas of Llama 3.1's and of position-interpolation's papers, as the
    ``llama3`` and ``linear`` rope types of transformers' modeling_rope_utils.py state them)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.kind == "linear":
        return inv_freq / rs.factor
    # llama3: a wavelength (positions per turn) past original / low_freq_factor is
    # stretched by factor, one under original / high_freq_factor is kept, and one between
    # is blended, linearly in original / wavelength from low_freq_factor to high_freq_factor.
    wavelength = 2 * math.pi / inv_freq
    ratio = rs.original_max_position / wavelength  # turns within the pretraining length
    blend = ((ratio - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)).clamp(0, 1)
    return (1 - blend) * inv_freq / rs.factor + blend * inv_freq


def rope_tables(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [length, head_dim] in fp32."""
    inv_freq = inverse_frequencies(cfg)
    t = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """Rotate ``x`` in place: ``x * cos + rotate_half(x) * sin``.

    x: [B, T, H, D] (may be a strided view); cos, sin_signed: [B, T, 1, D].
    ``rotate_half(x) * sin == [x2, x1] * sin_signed`` with the first half of
    ``sin_signed`` negated, so the rotation is a swap, a mul and one addcmul
    (``torch.roll`` for the swap was 1.4x slower at B=256, measured).
    """
    x1, x2 = x.chunk(2, dim=-1)
    swapped = torch.cat((x2, x1), dim=-1)  # [B, T, H, D]
    torch.addcmul(x * cos, swapped, sin_signed, out=x)


def grouped_attention(
    qg: torch.Tensor,  # [B*Hkv, g*T, D]: each KV head's g query heads and T positions
    keys: torch.Tensor,  # [B*Hkv, Lk, D]
    values: torch.Tensor,  # [B*Hkv, Lk, D]
    mask: torch.Tensor,  # 0 / -inf, broadcast to [B*Hkv, g*T, Lk], in the model dtype
    scale: float,
) -> torch.Tensor:
    """softmax(qg keys^T * scale + mask) values: grouped-query attention as two batched
    GEMMs (plain bmm beats CPU SDPA for single-token queries, measured with torch 2.13).
    The mask is the first GEMM's addend and the scale its alpha (a power of two for D=64:
    the same bits as scaling after it); softmax of a bf16 input computes in fp32 and
    rounds once. Without bf16 matmul hardware (see ``Linear.w32``) both GEMMs run in fp32
    on widened inputs, each result rounded to bf16 as a bf16 GEMM rounds it.
    Returns [B*Hkv, g*T, D]."""
    dt = qg.dtype
    wide = dt == torch.bfloat16 and qg.device.type == "cpu" and not bf16_matmul_native()

    def up(x: torch.Tensor) -> torch.Tensor:
        return x.float() if wide else x

    scores = torch.baddbmm(up(mask), up(qg), up(keys.transpose(1, 2)), alpha=scale).to(dt)
    probs = torch.softmax(scores, dim=-1)  # [B*Hkv, g*T, Lk]
    return torch.bmm(up(probs), up(values)).to(dt)
