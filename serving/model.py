"""A Llama-style decoder in plain torch, with a KV cache allocated once.

RMSNorm, rotary embeddings (the Hugging Face ``rotate_half`` convention),
grouped-query attention, SwiGLU. Module names follow the Hugging Face Llama
layout (``model.layers.0.self_attn.q_proj.weight`` ...), so a local
safetensors checkpoint loads with ``load_state_dict`` (serving/checkpoint.py).

The KV cache is one pair of buffers per layer, ``[max_slots, n_kv_heads, max_len,
head_dim]``, allocated once by :meth:`Transformer.allocate_cache` and updated
in place with ``index_put_`` on the whole buffer (FIELD-NOTES: writing into
slices of one big cache tensor makes inductor copy the cache per layer; a
per-layer buffer with ``index_put_`` does not). Each running request owns one
slot (a row of every buffer).

One ``forward`` serves both phases: a decode step (``T == 1``, ``B`` requests
at their own positions) and a prefill chunk (``B == 1``, ``T`` prompt tokens
from ``positions[0, 0]`` on). Keys are read from the cache: a view when the
slots are one ascending run (no copy), an ``index_select`` gather otherwise;
a boolean mask hides positions beyond each query's own. Whole ``max_len``
rows are read (see ``_StepContext.read``), so size ``max_len`` to the
contexts served.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from serving.config import ModelConfig

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype={name!r}: must be one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) that can use a oneDNN-prepacked copy of its weight on CPU.

    ``F.linear`` in bf16 streams a skinny decode GEMM at a fraction of the
    memory bandwidth here (measured 3-6 GB/s at batch 1 against ~20 GB/s for the
    prepacked weight: the blocked layout inductor's freezing pass uses). Results
    are bit-identical. The packed copy is a plain attribute: ``state_dict`` and
    checkpoints keep the ordinary weight.
    """

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


ROPE_TABLE_DEFAULT = 4096  # positions tabulated before a cache asks for more


def rope_tables(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [length, head_dim] in fp32."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    t = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; cos, sin: [B, T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # [B, T, H, D]
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.d_model, cfg.q_dim, bias=False)
        self.k_proj = Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.v_proj = Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.o_proj = Linear(cfg.q_dim, cfg.d_model, bias=False)
        self.register_buffer("k_cache", torch.empty(0), persistent=False)
        self.register_buffer("v_cache", torch.empty(0), persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, d_model]
        cos: torch.Tensor,  # [B, T, 1, D]
        sin: torch.Tensor,  # [B, T, 1, D]
        ctx: _StepContext,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        g = self.n_heads // self.n_kv
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd)  # [B, T, H, D]
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd)  # [B, T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.slots is None:  # full recomputation, no cache
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
        else:
            self.k_cache.index_put_(ctx.write_index, k)  # cache [S, Hkv, L, D]
            self.v_cache.index_put_(ctx.write_index, v)
            keys, values = ctx.read(self.k_cache), ctx.read(self.v_cache)  # [B, Hkv, Lk, D]
        # Grouped-query attention as two batched GEMMs: query head h uses KV head
        # h // g (Hugging Face repeat_kv order), so the g heads of a group and the
        # T positions stack into one [g*T, D] matrix per KV head. Plain bmm beats
        # CPU SDPA here by 3-7x for single-token queries (measured, torch 2.13).
        qg = q.transpose(1, 2).reshape(b, self.n_kv, g * t, self.hd)  # [B, Hkv, g*T, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [B, Hkv, g*T, Lk]
        scores = scores.view(b, self.n_kv, g, t, -1) * self.hd**-0.5  # [B, Hkv, g, T, Lk]
        scores = scores.masked_fill(ctx.hidden, float("-inf"))  # hidden: [B, 1, 1, T, Lk]
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, self.n_kv, g * t, -1)
        out = torch.matmul(probs, values)  # [B, Hkv, g*T, D]
        out = out.view(b, self.n_heads, t, self.hd).transpose(1, 2)  # [B, T, H, D]
        return self.o_proj(out.reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.d_model, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx):  # x: [B, T, d_model]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class _StepContext:
    """Where one forward writes and reads the cache, and its mask; built once per step."""

    def __init__(
        self,
        positions: torch.Tensor,  # [B, T]
        slots: torch.Tensor | None,  # [B]
        kv_len: int,
        slot_start: int | None,
        n_kv_heads: int,
    ) -> None:
        b, t = positions.shape
        self.slots, self.slot_start, self.b = slots, slot_start, b
        if slots is not None:
            heads = torch.arange(n_kv_heads, device=positions.device)
            # index_put_ indices broadcasting to [B, T, Hkv]: (slot, head, position)
            self.write_index = (slots[:, None, None], heads[None, None, :], positions[:, :, None])
        key_pos = torch.arange(kv_len, device=positions.device)  # [Lk]
        self.hidden = key_pos > positions[:, None, None, :, None]  # [B, 1, 1, T, Lk]

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        # cache: [S, Hkv, L, D] -> [B, Hkv, L, D]. Whole slots are read: a
        # narrowed length makes the batch non-contiguous and CPU bmm then copies
        # it, 5-8x slower than reading all max_len positions (measured).
        if self.slot_start is not None:
            return cache.narrow(0, self.slot_start, self.b)  # a view: no copy
        return cache.index_select(0, self.slots)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg, min(cfg.max_position, ROPE_TABLE_DEFAULT))
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [P, D]
        self.max_slots = 0
        self.max_len = 0

    @classmethod
    def random(
        cls, cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Transformer:
        """Random weights from a fixed seed (N(0, 0.02), norms at 1), in cfg.dtype."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        return model.prepare(device)

    def prepare(self, device: str | torch.device) -> Transformer:
        """Move to device in cfg.dtype, keeping the RoPE tables in fp32."""
        self.to(device=device, dtype=torch_dtype(self.config.dtype))
        self._set_rope(self.rope_cos.shape[0])
        return self.eval()

    def _set_rope(self, length: int) -> None:
        cos, sin = rope_tables(self.config, length)
        dev = self.lm_head.weight.device
        self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)

    def prepack(self, enable: bool = True) -> bool:
        """Use oneDNN-prepacked weights for every linear (CPU bf16 only; see ``Linear``).

        Returns whether packing is on. Call after the model is on its device;
        ``prepack(False)`` drops the packed copies.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        on = enable and can_prepack(self.lm_head.weight)
        with torch.no_grad():
            for m in linears:
                m.packed = (
                    torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 1) if on else None
                )
        return on

    def allocate_cache(self, max_slots: int, max_len: int) -> None:
        """Allocate the KV cache once: per layer [max_slots, n_kv_heads, max_len, head_dim]."""
        cfg = self.config
        if max_len > cfg.max_position:
            raise ValueError(
                f"max_len={max_len}: exceeds the model's max_position={cfg.max_position}"
            )
        if max_len > self.rope_cos.shape[0]:
            self._set_rope(max_len)
        dev, dt = self.lm_head.weight.device, self.lm_head.weight.dtype
        shape = (max_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
        for layer in self.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, device=dev, dtype=dt)
            layer.self_attn.v_cache = torch.zeros(shape, device=dev, dtype=dt)
        self.max_slots, self.max_len = max_slots, max_len
        logger.info(
            "KV cache: %d slots x %d tokens, %.1f MiB",
            max_slots,
            max_len,
            2 * cfg.n_layers * max_slots * max_len * cfg.kv_dim * dt.itemsize / 2**20,
        )

    def caches(self) -> list[torch.Tensor]:
        return [
            t
            for layer in self.model.layers
            for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)
        ]

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        slots: torch.Tensor | None = None,  # [B] int64; None: no cache (full recompute)
        *,
        slot_start: int | None = None,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Logits [B, V] at each row's last position (or [B, T, V] if not last_only).

        With ``slots``: writes K/V at ``positions`` into those slots and attends
        to each slot's cache up to its own position (the whole ``max_len`` row
        is read, masked). ``slot_start`` promises ``slots == arange(slot_start, slot_start + B)``
        so the cache is read as a view. Without ``slots``: plain causal
        attention over ``tokens`` (positions must be 0..T-1), no cache.
        """
        kv_len = self.max_len if slots is not None else tokens.shape[1]
        ctx = _StepContext(positions, slots, kv_len, slot_start, self.config.n_kv_heads)
        x = self.model.embed_tokens(tokens)  # [B, T, d_model]
        cos = self.rope_cos[positions].to(x.dtype)[:, :, None, :]  # [B, T, 1, D]
        sin = self.rope_sin[positions].to(x.dtype)[:, :, None, :]  # [B, T, 1, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        if last_only:
            x = x[:, -1]  # [B, d_model]
        return self.lm_head(self.model.norm(x)).float()  # [B, V] or [B, T, V]


def sample(
    logits: torch.Tensor,  # [B, V] fp32
    temperature: torch.Tensor,  # [B]; 0 means greedy
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Greedy where temperature is 0, softmax sampling elsewhere. Returns [B] int64."""
    greedy = logits.argmax(dim=-1)  # [B]
    hot = temperature > 0
    if not bool(hot.any()):
        return greedy
    t = torch.where(hot, temperature, torch.ones_like(temperature))  # [B]
    probs = torch.softmax(logits / t[:, None], dim=-1)  # [B, V]
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
    return torch.where(hot, drawn, greedy)
