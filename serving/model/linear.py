"""Linears for the decode model: oneDNN-prepacked weights, fused Hugging Face parts.

:class:`Linear` can run on a oneDNN-prepacked copy of its weight (CPU bf16). A
fused linear stacks several Hugging Face weights by rows (``qkv_proj`` holds
``q_proj``, ``k_proj``, ``v_proj``); modules that hold fused linears derive from
:class:`FusedHF`, whose state-dict hooks split them on save and stack the Hugging
Face tensors on load, so ``state_dict`` and checkpoints keep the Hugging Face
layout.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` that can use a oneDNN-prepacked copy of its weight on CPU.

    ``F.linear`` in bf16 streams a skinny decode GEMM at a fraction of the
    memory bandwidth here (measured 17-23 GB/s at batch 1 against 35-49 GB/s for
    the prepacked weight: the blocked layout inductor's freezing pass uses).
    Results are bit-identical. The packed copy is a plain attribute:
    ``state_dict`` and checkpoints keep the ordinary weight.

    ``parts``: for a fused linear, the Hugging Face names and row counts of the
    weights stacked in it, in order (``(("q_proj", 768), ("k_proj", 256), ...)``).
    ``bias`` (Qwen2's q/k/v): the C kernels take no bias, so a linear with one never gets
    their copies (``Transformer.use_cpu_kernels``); its other paths add it in the GEMM.
    """

    packed: torch.Tensor | None = None
    # An fp32 copy of the weight where bf16 matmuls are not native here (widens_bf16): the
    # linear then multiplies in fp32 and rounds to bf16 once. Set by Transformer.prepack.
    w32: torch.Tensor | None = None
    # serving.kernels.cpu_kernels and its copies of the weight, set by Transformer.use_cpu_kernels:
    # the GEMV's (rows8), used for up to ``kernels.gemv_rows`` rows of input (decode at small
    # batch), and the AVX2 small GEMM's (cols16), used for more rows where it is built.
    kernels: Any = None
    rows8: torch.Tensor | None = None
    cols16: torch.Tensor | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        parts: tuple[tuple[str, int], ...] = (),
        bias: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if parts and sum(n for _, n in parts) != out_features:
            raise ValueError(f"parts={parts!r}: rows must sum to out_features={out_features}")
        self.parts = parts

    def _gemv_fits(self, x: torch.Tensor) -> bool:
        return (
            self.rows8 is not None
            and x.numel() <= self.kernels.gemv_rows * self.in_features
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.is_contiguous()
        )

    def _gemm_fits(self, x: torch.Tensor) -> bool:
        return self.cols16 is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv_fits(x):
            return self.kernels.gemv(x, self.rows8, self.out_features)
        if self._gemm_fits(x):
            return self.kernels.gemm(x, self.cols16, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.w32 is not None and x.dtype == torch.bfloat16:
            b32 = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.w32, b32).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` as one op, rounded once to the dtype: prepacked, the
        add is a oneDNN post-op; otherwise ``addmm`` (the same bits, measured)."""
        if self.bias is not None:  # no fused form carries a bias as well
            return residual + self.forward(x)
        if self._gemv_fits(x) and residual.is_contiguous():
            return self.kernels.gemv(x, self.rows8, self.out_features, residual)
        if self._gemm_fits(x) and residual.is_contiguous():
            return self.kernels.gemm(x, self.cols16, self.out_features, residual)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
        if self.w32 is not None and x.dtype == torch.bfloat16:
            out = torch.addmm(
                residual.reshape(-1, self.out_features).float(),
                x.reshape(-1, x.shape[-1]).float(),
                self.w32.t(),
            )
            return out.to(residual.dtype).view(residual.shape)
        out = torch.addmm(
            residual.reshape(-1, self.out_features), x.reshape(-1, x.shape[-1]), self.weight.t()
        )
        return out.view(residual.shape)


@lru_cache(maxsize=1)
def bf16_matmul_native() -> bool:
    """Whether this CPU multiplies bf16 matrices in bf16 hardware (oneDNN's kernels for
    avx512_bf16 or AMX). Where it does not, torch's CPU bf16 GEMMs are a slow fallback,
    several times slower than fp32 (docs/serving.md "CPU kernels")."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether the weight gets a oneDNN-prepacked copy (CPU bf16 on native bf16 hardware)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and bf16_matmul_native()


def widens_bf16(weight: torch.Tensor) -> bool:
    """Whether the weight gets an fp32 copy for its GEMMs instead (CPU bf16 without native
    bf16 matmuls): bf16 inputs widen exactly, the sums are fp32 as in a bf16 GEMM, and the
    result is rounded to bf16 once."""
    cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
    return cpu_bf16 and not bf16_matmul_native()


def _tensor_kinds(linear: Linear) -> tuple[str, ...]:
    return ("weight",) if linear.bias is None else ("weight", "bias")


def _split_fused(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    """state_dict post-hook: each fused ``<name>.weight`` (and ``.bias``) -> its Hugging
    Face parts (views)."""
    for child_name, child in module.named_children():
        if isinstance(child, Linear) and child.parts:
            rows = [n for _, n in child.parts]
            for kind in _tensor_kinds(child):
                key = f"{prefix}{child_name}.{kind}"
                keys = list(state)
                after = keys[keys.index(key) + 1 :]
                fused = state.pop(key)
                for (hf, _), w in zip(child.parts, fused.split(rows), strict=True):
                    state[f"{prefix}{hf}.{kind}"] = w
                if isinstance(state, OrderedDict):  # keep the Hugging Face order
                    for k in after:
                        state.move_to_end(k)


def _stack_hf(module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
    """load_state_dict pre-hook: Hugging Face ``q_proj/k_proj/v_proj`` -> fused ``qkv_proj``."""
    for child_name, child in module.named_children():
        if isinstance(child, Linear) and child.parts:
            for kind in _tensor_kinds(child):
                keys = [f"{prefix}{hf}.{kind}" for hf, _ in child.parts]
                if all(k in state for k in keys):
                    state[f"{prefix}{child_name}.{kind}"] = torch.cat([state.pop(k) for k in keys])


def hf_tensors(module: nn.Module, prefix: str = "") -> dict[str, tuple[torch.Tensor, int, int]]:
    """Every Hugging Face tensor name of ``module``'s parameters -> (the parameter, first
    row, rows): a fused linear's part is a row range of its weight (and bias). What a
    checkpoint loader copies each stored tensor into, one at a time
    (serving/model/checkpoint.py)."""
    out: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, sub in module.named_modules(prefix=prefix):
        for kind, p in sub.named_parameters(recurse=False):
            if isinstance(sub, Linear) and sub.parts:
                parent, _, _ = name.rpartition(".")  # q_proj sits beside qkv_proj
                row = 0
                for hf, n in sub.parts:
                    out[f"{parent}.{hf}.{kind}" if parent else f"{hf}.{kind}"] = (p, row, n)
                    row += n
            else:
                out[f"{name}.{kind}" if name else kind] = (p, 0, p.shape[0])
    return out


class FusedHF(nn.Module):
    """A module holding fused linears that reads and writes the Hugging Face names."""

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(_split_fused)
        self.register_load_state_dict_pre_hook(_stack_hf)
