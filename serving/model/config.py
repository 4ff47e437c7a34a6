"""Model configuration: a Llama-style decoder, with named presets.

Presets (parameter counts include the untied embedding and LM head):

- ``tiny``: d_model 256, 4 layers, 8 heads, 4 KV heads, head_dim 32, vocab
  512 (bytes + specials), SwiGLU intermediate 768: ~3.4M parameters, for tests.
- ``small``: d_model 768, 12 layers, 12 heads, 4 KV heads, head_dim 64, vocab
  32000, SwiGLU intermediate 2048: ~125M parameters, ~100M of which are read
  per decode step (layers + LM head; the embedding is a row lookup), 200 MB in
  bf16: far more than a CPU's fast cache, so decode is memory-bound. The
  same numbers are the roofline catalog's ``slotune-small`` (search/roofline/models.py).

dtype: the demo runs **bfloat16**, which halves the bytes decode reads against fp32
(docs/serving.md "Model dtype" says why not fp32, and how CPUs without bf16 matmul
hardware run it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DTYPES = ("bfloat16", "float32", "float16")
ARCHITECTURES = ("llama", "mistral", "qwen2")  # Hugging Face model_type values that load
ROPE_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Rotary frequency rescaling for contexts past the pretraining length, as a
    checkpoint's ``rope_scaling`` (or transformers 5's ``rope_parameters``) states it.

    - ``linear``: every position divided by ``factor`` (inverse frequencies / factor);
    - ``llama3`` (Llama 3.1-3.3): wavelengths longer than ``original_max_position /
      low_freq_factor`` are stretched by ``factor``, those shorter than ``original_max_position
      / high_freq_factor`` are kept, and those between are interpolated
      (serving/model/layers.py ``inverse_frequencies``).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(
                f"rope_scaling type {self.kind!r}: must be one of {', '.join(ROPE_SCALINGS)}"
            )
        if not self.factor >= 1:
            raise ValueError(f"rope_scaling factor={self.factor!r}: must be >= 1")
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position > 0
        ):
            raise ValueError(
                f"rope_scaling llama3 low_freq_factor={self.low_freq_factor!r}, "
                f"high_freq_factor={self.high_freq_factor!r}, "
                f"original_max_position_embeddings={self.original_max_position!r}: need "
                "0 < low < high and a positive original length"
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "custom"
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int = 2048  # longest context RoPE tables cover
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    tie_embeddings: bool = False
    architecture: str = "llama"  # the Hugging Face model_type a checkpoint states
    qkv_bias: bool = False  # biases on q/k/v (Qwen2)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}={v!r}: must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: must be even (rotary embeddings)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r}: must be one of {', '.join(ARCHITECTURES)}"
            )
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(
                f"rope_theta={self.rope_theta!r}, norm_eps={self.norm_eps!r}: must be positive"
            )

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"model preset {name!r}: must be one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- sizes the roofline and the tests use ----------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        d, i = self.d_model, self.intermediate_size
        attn = d * self.q_dim * 2 + d * self.kv_dim * 2
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return attn + bias + 3 * d * i + 2 * d  # + two RMSNorm weights

    @property
    def n_params(self) -> int:
        embed = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else embed
        return embed + head + self.n_layers * self.layer_params + self.d_model

    @property
    def decode_params(self) -> int:
        """Parameters read once per decode step: all but the embedding table."""
        return self.n_layers * self.layer_params + self.d_model + self.vocab_size * self.d_model

    @property
    def bytes_per_param(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_dim * self.bytes_per_param


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        intermediate_size=768,
        max_position=1024,
    ),
    "small": ModelConfig(
        name="small",
        vocab_size=32000,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        max_position=2048,
    ),
}
