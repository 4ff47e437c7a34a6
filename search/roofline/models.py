"""Decoder-only transformer specs: what the roofline needs to know about a model.

The catalog holds the shapes published in each model's ``config.json`` on the
Hugging Face Hub (Llama-style: RMSNorm, rotary, grouped-query attention,
SwiGLU MLP), and slotune's own built-in models (their shapes must equal the
presets in ``serving/model/config.py``; a test holds the two together, since
``search/`` may not import ``serving/``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a Llama-style decoder (per model, not per device)."""

    name: str
    params: int  # total parameter count, embeddings included (as published)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # SwiGLU hidden size (gate/up/down)
    tied_embeddings: bool = False  # lm_head shares the input embedding
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r}: must be a non-empty string")
        for f in ("params", "layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.name}: {f}={v!r}: must be a positive integer")
        if isinstance(self.intermediate, bool) or not isinstance(self.intermediate, int):
            raise ValueError(f"{self.name}: intermediate={self.intermediate!r}: must be an integer")
        if self.intermediate < 1:
            raise ValueError(f"{self.name}: intermediate={self.intermediate!r}: must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}"
            )

    # ---- sizes -------------------------------------------------------------------

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V for one token over all layers: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_elem

    def weight_bytes(self, bytes_per_elem: int = 2) -> int:
        """All parameters at ``bytes_per_elem`` (what must fit in memory)."""
        return self.params * bytes_per_elem

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer, from the shapes."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden
        return q + kv + o + bias + mlp + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def architecture_params(self) -> int:
        """Parameter count computed from the shapes (checks the published ``params``)."""
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + lm_head + self.hidden

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul for every token: layers' linears + lm_head.

        The input embedding is a row lookup (no FLOPs, B rows read) unless it is
        tied to the lm_head, which reads it whole anyway.
        """
        lm_head = self.embedding_params
        linear = self.layers * (self.layer_params - 2 * self.hidden)
        return linear + lm_head

    def weight_bytes_read_per_step(self, bytes_per_elem: int = 2) -> int:
        """Weight bytes one decode step streams: all matmul weights (norms are noise)."""
        return self.matmul_params * bytes_per_elem

    def attention_flops_per_token(self, context: int) -> int:
        """QK^T and PV for one query token attending to ``context`` keys, all layers."""
        return 4 * self.layers * self.heads * self.head_dim * context

    # ---- constructors and persistence -------------------------------------------

    @classmethod
    def from_name(cls, name: str) -> ModelSpec:
        try:
            return CATALOG[name]
        except KeyError:
            raise ValueError(
                f"model {name!r} is not in the catalog; allowed: {', '.join(MODEL_NAMES)} "
                "(or a JSON file path)"
            ) from None

    @classmethod
    def from_hf_config(
        cls, source: str | Path | Mapping[str, Any], *, name: str | None = None
    ) -> ModelSpec:
        """A Llama-style decoder from a Hugging Face ``config.json`` (a path, a directory
        holding one, or its parsed dict); the parameter count follows from the shapes.
        ``name`` defaults to the checkpoint's directory. What is read, what is assumed and
        what is refused (mixture of experts, quantized): :mod:`search.roofline.hf_config`."""
        from search.roofline.hf_config import hf_shapes, read_hf_config

        data, where, default_name = read_hf_config(source)
        shapes = hf_shapes(data, where=where)
        try:
            return cls.from_dict({"name": name or default_name, **shapes})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"unknown model field(s) {extra}; allowed: {sorted(known)}")
        kw = dict(d)
        if "params" not in kw:
            # Compute it from the shapes when the file does not say.
            probe = cls(**{**kw, "params": 1})
            kw["params"] = probe.architecture_params
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelSpec:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ValueError(f"model file {str(p)!r}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(
                f"model file {str(p)!r}: not JSON ({e.msg}, line {e.lineno})"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"model file {str(p)!r}: must hold a JSON object")
        try:
            return cls.from_dict(data)
        except TypeError as e:
            raise ValueError(f"model file {str(p)!r}: malformed ({e})") from None

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _m(name: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, **kw)


def _builtin(name: str, **shapes: Any) -> ModelSpec:
    """A built-in model: its parameter count follows from its shapes."""
    return ModelSpec.from_dict({"name": name, **shapes})


CATALOG: Mapping[str, ModelSpec] = MappingProxyType(
    {
        # meta-llama/Llama-3.1-8B config.json; 8,030,261,248 parameters.
        "llama-3.1-8b": _m(
            "llama-3.1-8b",
            params=8_030_261_248,
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=128_256,
            intermediate=14_336,
        ),
        # meta-llama/Llama-3.1-70B config.json; 70,553,706,496 parameters.
        "llama-3.1-70b": _m(
            "llama-3.1-70b",
            params=70_553_706_496,
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            vocab=128_256,
            intermediate=28_672,
        ),
        # meta-llama/Llama-3.1-405B config.json; 405,853,388,800 parameters.
        "llama-3.1-405b": _m(
            "llama-3.1-405b",
            params=405_853_388_800,
            layers=126,
            hidden=16_384,
            heads=128,
            kv_heads=8,
            head_dim=128,
            vocab=128_256,
            intermediate=53_248,
        ),
        # mistralai/Mistral-7B-v0.1 config.json; 7,241,732,096 parameters. (Its 4,096-token
        # sliding window is ignored: KV is counted for the whole context, an upper bound.)
        "mistral-7b": _m(
            "mistral-7b",
            params=7_241_732_096,
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=32_000,
            intermediate=14_336,
        ),
        # Qwen/Qwen2.5-72B config.json (q/k/v carry a bias); 72,706,203,648 parameters.
        "qwen2.5-72b": _m(
            "qwen2.5-72b",
            params=72_706_203_648,
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            vocab=152_064,
            intermediate=29_568,
            qkv_bias=True,
        ),
        # slotune's built-in models: must equal serving/model/config.py's presets
        # (tests/search/test_catalog.py holds them together).
        "slotune-tiny": _builtin(
            "slotune-tiny",
            layers=4,
            hidden=256,
            heads=8,
            kv_heads=4,
            head_dim=32,
            vocab=512,
            intermediate=768,
        ),
        "slotune-small": _builtin(
            "slotune-small",
            layers=12,
            hidden=768,
            heads=12,
            kv_heads=4,
            head_dim=64,
            vocab=32_000,
            intermediate=2048,
        ),
    }
)

MODEL_NAMES: tuple[str, ...] = tuple(CATALOG)


def resolve_model(name_or_path: str) -> ModelSpec:
    """A catalog name, or a path to a model JSON file."""
    if name_or_path in CATALOG:
        return CATALOG[name_or_path]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return ModelSpec.from_json(p)
    return ModelSpec.from_name(name_or_path)
