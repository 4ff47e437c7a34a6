"""A whole decode step in one C call, where every layer would run the whole-layer kernel.

At the GEMV's batch sizes (``Kernels.gemv_rows`` rows) a decode step on CPU bf16 runs
each decoder layer in one C call (``Kernels.decode_layer``), then the final norm and
the lm_head GEMV. Between those 14 calls Python builds each call's ~26 arguments and a
new thread team starts, with the Python interpreter's own data cold after each layer
streamed its weights (docs/serving.md "CPU kernels" has the cost). Here the same
kernels run in one call and one thread team (``slotune_decode_step_bf16`` in
serving/kernels/cpu_kernels.c): the same steps, roundings and results, bit for bit
(tests/serving/test_cpu_step.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# x_in, logits, layers, n_layers, norm_f, head, V, eps, cos, sin, positions, slots;
# M, d, I, H, Hkv, D, S, L, P; scale, threads
ARGTYPES = [_P, _P, _P, _I, _P, _P, _I, _F, _P, _P, _P, _P] + [_I] * 9 + [_F, _C]


def bind(lib: ctypes.CDLL) -> Any:
    """The library's whole-step function with its argument types."""
    fn = lib.slotune_decode_step_bf16
    fn.argtypes = ARGTYPES
    fn.restype = ctypes.c_int
    return fn


def call_tail(x: torch.Tensor, layer: Any, ctx: Any) -> tuple:
    """The arguments the whole-layer and whole-step calls end with: the rotary tables,
    positions and slots of the step; M, d, I, H, Hkv, D, S, L, P; scale, threads
    (``layer``: any of the model's decoder layers, ``x`` [M, 1, d])."""
    cache, cos = layer.self_attn.kv_cache, ctx.cos_table
    _, s, hkv, length, hd = cache.shape
    return (
        cos.data_ptr(),
        ctx.sin_table.data_ptr(),
        ctx.positions.data_ptr(),
        ctx.slots.data_ptr(),
        x.shape[0],
        x.shape[-1],
        layer.mlp.down_proj.in_features,
        layer.self_attn.n_heads,
        hkv,
        hd,
        s,
        length,
        cos.shape[0],
        hd**-0.5,
        torch.get_num_threads(),
    )


def check_call(kernels: Any, rc: int, tail: tuple, ctx: Any) -> None:
    """``Kernels._check`` of a call that ended with ``tail`` (:func:`call_tail`)."""
    s, length, table = tail[10:13]
    kernels._check(rc, length, table, s, ctx.positions, ctx.slots)


def _layer_modules(model: Any) -> list[tuple[Any, Any, Any, tuple[Any, ...], Any]]:
    """Per layer (the block, its two norms, its four linears, its attention), kept on
    the model for later steps while its layer list is the same."""
    layers = model.model.layers
    key = tuple(map(id, layers))
    cached = model.__dict__.get("_cpu_step_modules")
    if cached is None or cached[0] != key:
        mods = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            mods.append((layer, layer.input_layernorm, layer.post_attention_layernorm, lins, a))
        cached = (key, mods)
        model.__dict__["_cpu_step_modules"] = cached
    return cached[1]


def decode_step(model: Any, x: torch.Tensor, ctx: Any) -> torch.Tensor | None:
    """fp32 logits [B, V] of a decode step of ``model`` (serving.model.transformer.Transformer) from
    its embedded rows ``x`` [B, 1, d] and step context ``ctx`` (both from
    ``Transformer.prologue``), the way its forward computes them; None where the step
    is not one the whole-step kernel runs (then the forward runs layer by layer)."""
    k = ctx.kernels
    if (
        k is None
        or k.step_fn is None
        or x.shape[0] > k.gemv_rows
        or x.dtype != torch.bfloat16
        or not x.is_contiguous()
    ):
        return None
    head = model.lm_head.rows8
    norm_f = model.model.norm
    if head is None:
        return None
    eps = norm_f.eps
    ptrs: list[int] = []
    for layer, n1, n2, lins, attn in _layer_modules(model):
        # Tensors read past nn.Module.__getattr__ (~0.4 us a lookup, 150 a step).
        copies = [lin.__dict__.get("rows8") for lin in lins]
        if not layer.fused or n1.eps != eps or n2.eps != eps or any(c is None for c in copies):
            return None
        ptrs += (n1._parameters["weight"].data_ptr(), n2._parameters["weight"].data_ptr())
        ptrs += (c.data_ptr() for c in copies)
        ptrs.append(attn._buffers["kv_cache"].data_ptr())
    vocab = model.lm_head.out_features
    logits = torch.empty(x.shape[0], vocab, dtype=x.dtype)
    table = (ctypes.c_int64 * len(ptrs))(*ptrs)
    tail = call_tail(x, model.model.layers[0], ctx)
    rc = k.step_fn(
        x.data_ptr(),
        logits.data_ptr(),
        table,
        len(ptrs) // 7,
        norm_f.weight.data_ptr(),
        head.data_ptr(),
        vocab,
        eps,
        *tail,
    )
    check_call(k, rc, tail, ctx)
    return logits.float()
