"""A Llama-style decoder in plain torch, with a KV cache allocated once.

RMSNorm, rotary embeddings (the Hugging Face ``rotate_half`` convention, with Llama 3's
frequency rescaling; both in serving/model/layers.py), grouped-query attention, SwiGLU,
optional q/k/v biases (Qwen2). Sampling: serving/model/sampling.py.

Fused linears: q/k/v are one ``qkv_proj`` and gate/up one ``gate_up_proj`` (weights
stacked by rows): 4 linears a layer, not 7, since fewer, bigger GEMVs stream closer to
the memory bandwidth. ``state_dict`` still speaks the Hugging Face Llama layout:
state-dict hooks split the fused weights on save and stack the Hugging Face ones on
load, and ``linear.hf_tensors`` maps each Hugging Face name to its rows, which a local
safetensors checkpoint is copied into tensor by tensor (serving/model/checkpoint.py).

The KV cache is one buffer per layer, ``[2, max_slots, n_kv_heads, max_len,
head_dim]`` (K at index 0, V at 1), allocated once by
:meth:`Transformer.allocate_cache` and written in place with a single
``index_put_`` per layer (K and V together, rows computed once per step); a buffer per
layer, not slices of one buffer, which a compiler may copy per layer. Each running
request owns one slot (a row of every buffer).

One ``forward`` serves both phases: a decode step (``T == 1``, ``B`` requests
at their own positions) and a prefill chunk (``B == 1``, ``T`` prompt tokens
from ``positions[0, 0]`` on). Keys are read from the cache: a view when the
slots are one ascending run (no copy), one ``index_select`` gather (K and V
together) otherwise; an additive mask, built once per step, hides positions
beyond each query's own. Whole ``max_len`` rows are read (see
``StepContext.read``), so size ``max_len`` to the contexts served. On CPU bf16 the C
kernels run decode steps (serving/kernels/cpu_kernels.py; a whole step in one call
where they can: serving/kernels/cpu_step.py; docs/serving.md "CPU kernels").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from serving.kernels import cpu_kernels, cpu_step, hugepages
from serving.model.config import ModelConfig
from serving.model.layers import (
    ROPE_TABLE_DEFAULT,
    RMSNorm,
    apply_rope_,
    grouped_attention,
    rope_tables,
)
from serving.model.linear import (
    FusedHF,
    Linear,
    can_prepack,
    widens_bf16,
)
from serving.model.step_context import StepContext, cache_rows

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype={name!r}: must be one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


class Attention(FusedHF):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_dim, self.kv_dim = cfg.q_dim, cfg.kv_dim
        self.qkv_proj = Linear(
            cfg.d_model,
            cfg.q_dim + 2 * cfg.kv_dim,
            parts=(("q_proj", cfg.q_dim), ("k_proj", cfg.kv_dim), ("v_proj", cfg.kv_dim)),
            bias=cfg.qkv_bias,
        )
        self.o_proj = Linear(cfg.q_dim, cfg.d_model)
        self.register_buffer("kv_cache", torch.empty(0), persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, d_model]
        ctx: StepContext,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, d = self.n_heads, self.n_kv, self.hd
        g = h // hkv
        # Views by view/narrow/unbind, not Python indexing (``t[..., a:b]`` costs
        # several us of CPU a call; a step makes hundreds of them).
        if ctx.kernels is not None:  # a decode step on CPU bf16: one C call
            qkv = self.qkv_proj.forward(x).view(b, h + 2 * hkv, d)  # [B, H+2Hkv, D]
            out = ctx.kernels.decode_attention(
                qkv,
                self.kv_cache,
                ctx.cos_table,
                ctx.sin_table,
                ctx.positions,
                ctx.slots,
                h,
                d**-0.5,
            )  # [B, H*D]
            return out.view(b, 1, h * d)
        qkv = self.qkv_proj.forward(x).view(b, t, h + 2 * hkv, d)  # [B, T, H+2Hkv, D]
        apply_rope_(qkv.narrow(2, 0, h + hkv), ctx.cos, ctx.sin)  # q and k, in place
        q = qkv.narrow(2, 0, h)  # [B, T, H, D]
        kv = qkv.narrow(2, h, 2 * hkv)  # [B, T, 2*Hkv, D]: K heads, then V heads
        if ctx.slots is None:  # full recomputation, no cache
            keys, values = kv.transpose(1, 2).reshape(b, 2, hkv, t, d).unbind(1)
            keys = keys.reshape(b * hkv, t, d)  # [B*Hkv, T, D]
            values = values.reshape(b * hkv, t, d)  # [B*Hkv, T, D]
        else:
            ctx.write(self.kv_cache, kv)  # cache [2, S, Hkv, L, D]
            keys, values = ctx.read(self.kv_cache).unbind(0)  # [B, Hkv, L, D] each
            # Contiguous [B*Hkv, L, D] views: a batch stride other than L*D (K and V
            # interleaved per head) makes CPU bmm copy the whole cache (measured).
            keys = keys.reshape(b * hkv, -1, d)  # [B*Hkv, L, D] (a view)
            values = values.reshape(b * hkv, -1, d)  # [B*Hkv, L, D] (a view)
        # Grouped-query attention as two batched GEMMs: query head h uses KV head
        # h // g (Hugging Face repeat_kv order), so the g heads of a group and the
        # T positions stack into one [g*T, D] matrix per KV head. Plain bmm beats
        # CPU SDPA here for single-token queries (measured, torch 2.13).
        qg = q.transpose(1, 2).reshape(b * hkv, g * t, d)  # [B*Hkv, g*T, D]
        out = grouped_attention(qg, keys, values, ctx.mask, d**-0.5)  # [B*Hkv, g*T, D]
        out = out.view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)  # [B, T, H*D]
        return out

    def window_forward(
        self,
        x: torch.Tensor,  # [B, 1, d_model]: rows of slots 0..B-1
        cos: torch.Tensor,  # [B, 1, 1, D]
        sin_signed: torch.Tensor,  # [B, 1, 1, D]
        rows: torch.Tensor,  # [B, 1, 2*Hkv]: cache_rows of the step
        visible: torch.Tensor,  # [B, 1, 1, W] bool: key positions each row attends to
        attend: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """A decode step of slots 0..B-1 reading the first W positions of their cache rows
        (a view: no gather) with SDPA, or, given ``attend(q [B, H, 1, D], keys, values
        [B, Hkv, L, D], scale)``, with it over whole rows; see
        :meth:`Transformer.decode_window`."""
        b = x.shape[0]
        h, hkv, d = self.n_heads, self.n_kv, self.hd
        w = visible.shape[-1]
        qkv = self.qkv_proj.forward(x).view(b, 1, h + 2 * hkv, d)
        apply_rope_(qkv.narrow(2, 0, h + hkv), cos, sin_signed)
        self.kv_cache.view(-1, d).index_put_((rows,), qkv.narrow(2, h, 2 * hkv))
        if attend is not None:  # it reads only the blocks each row's length covers
            keys, values = self.kv_cache.narrow(1, 0, b).unbind(0)  # [B, Hkv, L, D]
            q = qkv.narrow(2, 0, h).transpose(1, 2)  # [B, H, 1, D]
            return attend(q, keys, values, d**-0.5).transpose(1, 2).reshape(b, 1, h * d)
        keys, values = self.kv_cache.narrow(1, 0, b).narrow(3, 0, w).unbind(0)  # [B,Hkv,W,D]
        # The g query heads of a KV head as g query rows of it (Hugging Face repeat_kv
        # order): no K/V expansion, and a kernel that takes a mask reads each key once.
        q = qkv.narrow(2, 0, h).view(b, hkv, h // hkv, d)  # [B, Hkv, g, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=d**-0.5)
        return out.reshape(b, 1, h * d)  # [B, Hkv, g, D] -> [B, 1, H*D]


class MLP(FusedHF):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.d_model, 2 * i, parts=(("gate_proj", i), ("up_proj", i)))
        self.down_proj = Linear(i, cfg.d_model)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``: the add fused into the down projection."""
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)  # [B, T, I] each
        return self.down_proj.add_forward(F.silu(gate) * up, residual)


class Block(nn.Module):
    # Set by Transformer.use_cpu_kernels: decode steps of up to kernels.gemv_rows rows run
    # the whole layer in one C call while all four linears have GEMV copies.
    fused: bool = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def _gemv_copies(self) -> bool:
        a, m = self.self_attn, self.mlp
        return all(x.rows8 is not None for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:  # x: [B, T, d]
        if (
            self.fused
            and ctx.kernels is not None
            and x.shape[0] <= ctx.kernels.gemv_rows
            and x.dtype == torch.bfloat16
            and x.is_contiguous()
            and self._gemv_copies()
        ):
            return ctx.kernels.decode_layer(x, self, ctx)
        # ``.forward`` called directly: ``nn.Module.__call__`` costs ~2 us of CPU and
        # a decode step makes ~100 of them (no module here has forward hooks).
        # Residual adds fused into o_proj and down_proj (one oneDNN op each).
        attn = self.self_attn.forward(self.input_layernorm.forward(x), ctx)  # [B, T, H*D]
        x = self.self_attn.o_proj.add_forward(attn, x)
        return self.mlp.forward(self.post_attention_layernorm.forward(x), x)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._set_rope(min(cfg.max_position, ROPE_TABLE_DEFAULT), torch.float32)
        self.max_slots = 0
        self.max_len = 0
        self.kernels: cpu_kernels.Kernels | None = None

    @classmethod
    def random(
        cls, cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Transformer:
        """Random weights from a fixed seed (N(0, 0.02), norms at 1), in cfg.dtype.

        Drawn per Hugging Face tensor in the Hugging Face order, so a fused weight
        holds what its parts would have held unfused."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                    continue
                owner = model.get_submodule(name.rsplit(".", 1)[0])
                rows = [n for _, n in owner.parts] if getattr(owner, "parts", ()) else [len(p)]
                for part in p.split(rows):
                    part.normal_(0.0, 0.02, generator=gen)
        return model.prepare(device)

    @classmethod
    def for_timing(cls, cfg: ModelConfig, *, device: str | torch.device = "cpu") -> Transformer:
        """Real-size weights drawn on the device in cfg.dtype, no seed: for timing only
        (the calibration, search/calibrate/step.py), quicker than :meth:`random`."""
        model = cls.empty(cfg, device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
        return model.prepare(device)

    @classmethod
    def empty(cls, cfg: ModelConfig, *, device: str | torch.device = "cpu") -> Transformer:
        """Uninitialized weights on ``device`` in cfg.dtype: built on the meta device (no
        memory, no initialisation) and given storage once, in the serving dtype (never a
        float32 copy first). The caller fills every parameter, then calls :meth:`prepare`."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to(dtype=torch_dtype(cfg.dtype))  # still meta: free
        model.to_empty(device=device)
        if cfg.tie_embeddings:  # to_empty gives each module its own storage: tie again
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def prepare(self, device: str | torch.device) -> Transformer:
        """Move to device in cfg.dtype for inference (no gradients)."""
        dt = torch_dtype(self.config.dtype)
        self.to(device=device, dtype=dt)
        self.requires_grad_(False)
        self._set_rope(self.rope_cos.shape[0], dt)
        return self.eval()

    def _set_rope(self, length: int, dtype: torch.dtype) -> None:
        """Rotary tables in the model dtype (rounded from fp32, as a cast per step would)."""
        cos, sin = rope_tables(self.config, length)  # [P, D] fp32
        half = self.config.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [P, D]
        dev = self.lm_head.weight.device
        self.register_buffer("rope_cos", cos.to(dev, dtype), persistent=False)  # [P, D]
        self.register_buffer("rope_sin", sin_signed.to(dev, dtype), persistent=False)  # [P, D]

    def prepack(self, enable: bool = True) -> bool:
        """Use oneDNN-prepacked weights for every linear (CPU bf16 only; see ``Linear``).
        On a CPU without native bf16 matmuls (``widens_bf16``) each linear the AVX2 small
        GEMM does not serve keeps an fp32 copy of its weight for its GEMMs instead.

        Returns whether oneDNN packing is on. Call after the model is on its device;
        ``prepack(False)`` drops the packed and fp32 copies.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        on = enable and can_prepack(self.lm_head.weight)
        widen = enable and widens_bf16(self.lm_head.weight)
        with torch.no_grad():
            for m in linears:
                m.packed = (
                    torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 1) if on else None
                )
                m.w32 = m.weight.detach().float() if widen and m.cols16 is None else None
        return on

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), .cuda(), ...
        # The kernels' weight copies and flags, and the prepacked and fp32 copies, describe
        # the old dtype and device: drop them (call prepack and use_cpu_kernels again after
        # moving the model).
        if getattr(self, "kernels", None) is not None:
            self.use_cpu_kernels(False)
        if any(
            m.packed is not None or m.w32 is not None
            for m in self.modules()
            if isinstance(m, Linear)
        ):
            self.prepack(False)
        return super()._apply(fn, *args, **kwargs)

    def use_cpu_kernels(self, enable: bool = True) -> bool:
        """Run decode-step attention, every RMSNorm and the linears of small batches
        with the C kernels (serving/kernels/cpu_kernels.py) where they apply: CPU, bf16, a head
        layout they support, and a compiler that built them. Returns whether they are
        on; ``use_cpu_kernels(False)`` goes back to torch ops (and drops the GEMV's
        weight copies). Call after loading weights: the GEMV packs its own copies. Where
        the AVX2 small GEMM is built it takes every batch past the GEMV's, so a linear's
        fp32 copy (``prepack`` on a CPU without bf16 matmul hardware) is dropped."""
        cfg = self.config
        w = self.lm_head.weight
        self.kernels = (
            cpu_kernels.for_model(w.device, w.dtype, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
            if enable
            else None
        )
        k = self.kernels
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.kernels = k
                elif isinstance(m, Linear):
                    plain = k is not None and m.bias is None  # the kernels add no bias
                    gemv = plain and k.supports_gemv(m.out_features, m.in_features)
                    gemm = plain and k.supports_gemm(m.out_features)
                    had_gemm = m.cols16 is not None
                    m.kernels = k if gemv or gemm else None
                    m.rows8 = k.pack_rows8(m.weight) if gemv else None
                    m.cols16 = k.pack_cols16(m.weight) if gemm else None
                    if gemm:  # it takes every batch the fp32 copy would have taken
                        m.w32 = None
                    elif had_gemm and widens_bf16(m.weight):  # back to the fp32 copy
                        m.w32 = m.weight.detach().float()
        for layer in self.model.layers:
            layer.fused = layer._gemv_copies()
        return k is not None

    def allocate_cache(self, max_slots: int, max_len: int) -> None:
        """Allocate the KV cache once: per layer [2, max_slots, n_kv_heads, max_len, head_dim]."""
        cfg = self.config
        if max_len > cfg.max_position:
            raise ValueError(
                f"max_len={max_len}: exceeds the model's max_position={cfg.max_position}"
            )
        if max_len > self.rope_cos.shape[0]:
            self._set_rope(max_len, self.rope_cos.dtype)
        dev, dt = self.lm_head.weight.device, self.lm_head.weight.dtype
        shape = (2, max_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
        for layer in self.model.layers:
            layer.self_attn.kv_cache = hugepages.empty(shape, dt, dev).zero_()  # read each step
        self.max_slots, self.max_len = max_slots, max_len
        logger.info(
            "KV cache: %d slots x %d tokens, %.1f MiB",
            max_slots,
            max_len,
            2 * cfg.n_layers * max_slots * max_len * cfg.kv_dim * dt.itemsize / 2**20,
        )

    def caches(self) -> list[torch.Tensor]:
        """The per-layer KV buffers, [2, max_slots, n_kv_heads, max_len, head_dim] each."""
        return [layer.self_attn.kv_cache for layer in self.model.layers]

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        slots: torch.Tensor | None = None,  # [B] int64; None: no cache (full recompute)
        *,
        slot_start: int | None = None,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Logits [B, V] in fp32 at each row's last position (or [B, T, V] if not
        last_only). fp32, not bf16: CPU argmax over bf16 was 4x slower than the
        conversion plus an fp32 argmax at B=256 (measured).

        With ``slots``: writes K/V at ``positions`` into those slots and attends
        to each slot's cache up to its own position (the whole ``max_len`` row
        is read, masked). ``slot_start`` promises ``slots == arange(slot_start, slot_start + B)``
        so the cache is read as a view. Without ``slots``: plain causal
        attention over ``tokens`` (positions must be 0..T-1), no cache.
        """
        x, ctx = self.prologue(tokens, positions, slots, slot_start=slot_start)
        if last_only and (logits := cpu_step.decode_step(self, x, ctx)) is not None:
            return logits  # the whole step in one C call, the same bits
        for layer in self.model.layers:
            x = layer.forward(x, ctx)
        return self.logits(x, last_only=last_only)

    def decode_window(
        self,
        tokens: torch.Tensor,  # [B] int64: the token of slot i in row i
        positions: torch.Tensor,  # [B] int64
        window: int,
        attend: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] (fp32) of a decode step of slots 0..B-1, each at its own position,
        attending to the first ``window`` positions of its cache row (at least its
        position + 1; the keys past a row's position are masked, not read twice).

        The device decode path (serving/engine/device_decode.py): fixed shapes for a
        (B, window) pair, no host sync, cache read as views, so a step can be captured as
        a CUDA graph. Rows without a request (holes among slots 0..B-1) take position
        ``max_len - 1``, which no request reads, and their logits are discarded.

        ``attend``: the attention of every layer instead of SDPA over the window (the
        device path's FlexAttention, which reads only the key blocks each row's own length
        covers: serving/engine/device_decode.py); its ``begin(positions)`` runs once first."""
        cfg = self.config
        b = tokens.shape[0]
        x = self.model.embed_tokens(tokens).unsqueeze(1)  # [B, 1, d_model]
        cos = self.rope_cos[positions][:, None, None, :]  # [B, 1, 1, D]
        sin = self.rope_sin[positions][:, None, None, :]  # [B, 1, 1, D]
        slots = torch.arange(b, device=tokens.device)  # [B]
        rows = cache_rows(slots, positions[:, None], self.max_slots, cfg.n_kv_heads, self.max_len)
        key_pos = torch.arange(window, device=tokens.device)  # [W]
        visible = (key_pos <= positions[:, None]).view(b, 1, 1, window)  # [B, 1, 1, W]
        if attend is not None:
            attend.begin(positions)  # type: ignore[attr-defined]
        for layer in self.model.layers:
            attn = layer.self_attn.window_forward(
                layer.input_layernorm.forward(x), cos, sin, rows, visible, attend
            )
            x = layer.self_attn.o_proj.add_forward(attn, x)
            x = layer.mlp.forward(layer.post_attention_layernorm.forward(x), x)
        return self.logits(x)  # [B, V]

    def prologue(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        slots: torch.Tensor | None = None,  # [B] int64
        *,
        slot_start: int | None = None,
    ) -> tuple[torch.Tensor, StepContext]:
        """What a forward does before the layers: the embedding [B, T, d_model] and the
        step's shared context (rotary factors, cache rows, mask). Public so the
        calibration (search/calibrate/step.py) times the engine's own code."""
        x = self.model.embed_tokens(tokens)  # [B, T, d_model]
        ctx = StepContext(
            positions,
            slots,
            slot_start,
            max_slots=self.max_slots,
            kv_len=self.max_len if slots is not None else tokens.shape[1],
            n_kv_heads=self.config.n_kv_heads,
            n_heads=self.config.n_heads,
            cos=self.rope_cos,
            sin_signed=self.rope_sin,
            kernels=self.kernels,
        )
        return x, ctx

    def logits(self, x: torch.Tensor, *, last_only: bool = True) -> torch.Tensor:
        """What a forward does after the layers: final norm, lm_head, fp32 logits
        [B, V] at each row's last position (or [B, T, V])."""
        if last_only:
            x = x[:, -1]  # [B, d_model]
        return self.lm_head.forward(self.model.norm.forward(x)).float()  # [B, V] or [B, T, V]
