"""A Hugging Face ``config.json`` read as the shapes the roofline needs.

Field meanings follow transformers' configuration classes (huggingface/transformers,
``src/transformers/models/{llama,mistral,qwen2,qwen3,gemma,gemma2}/configuration_*.py``):

- ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``
  (the gated MLP's gate/up width) and ``vocab_size`` are required: they are not fields of
  the base ``PreTrainedConfig``, so ``save_pretrained`` always writes them.
- ``num_key_value_heads`` missing or null means multi-head attention (= heads), as the
  configs' ``__post_init__`` set it; ``head_dim`` missing or null means
  ``hidden_size // num_attention_heads`` (LlamaConfig, MistralConfig; Qwen2Attention
  falls back the same way). Gemma's head dim is not derived from the hidden size
  (gemma-7b: 3072 / 16 heads, head_dim 256), so a Gemma config must state it.
- ``tie_word_embeddings`` missing means the model class's default: True for Gemma, False
  for the others. ``PreTrainedConfig.to_diff_dict`` drops a field equal to both the base
  default (True) and the class default, so a saved Gemma config often omits it.
- Qwen2's q/k/v projections always carry a bias (``Qwen2Attention``: ``bias=True``);
  elsewhere ``attention_bias`` turns it on (it also adds an o_proj bias, ``hidden`` numbers
  per layer, as ``mlp_bias`` adds a few: both are left out of the count, < 0.01%).
- ``torch_dtype`` (``dtype`` since transformers 4.56) is checked to be a float dtype. The
  roofline predicts 16-bit weights for bfloat16, float16 and float32 checkpoints alike: both
  16-bit types are 2 bytes with the same peak on every catalogued device, and serving
  engines run fp32 checkpoints in 16 bits (vLLM's ``--dtype auto``).

Refused, with a one-line reason: mixture-of-experts configs (the weight bytes a decode
step reads depend on how many experts the batch routes to, which a dense ``ModelSpec``
cannot say), quantized checkpoints (``quantization_config``: weights are not 2 bytes), and
other architectures (non-gated MLPs, fused or multimodal configs). Sliding-window attention
(Mistral, Gemma 2) is ignored: the KV cache is counted over the whole context, an upper
bound. For anything refused, a ModelSpec JSON file states the shapes by hand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# model_type -> what differs from Llama: (q/k/v bias always on, head_dim must be stated,
# tie_word_embeddings default)
_FAMILIES: Mapping[str, tuple[bool, bool, bool]] = {
    "llama": (False, False, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (False, False, False),
    "gemma": (False, True, True),
    "gemma2": (False, True, True),
}
HF_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)

# Fields that make a config a mixture of experts (Mixtral: num_local_experts; Qwen2-MoE,
# Qwen3-MoE: num_experts, moe_intermediate_size; DeepSeek: n_routed_experts).
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def read_hf_config(source: str | Path | Mapping[str, Any]) -> tuple[Mapping[str, Any], str, str]:
    """(the config's fields, where they came from for messages, a default model name).

    ``source``: a ``config.json`` path, a directory holding one, or the parsed dict."""
    if isinstance(source, Mapping):
        return source, "model config", str(source.get("model_type") or "hf-model")
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    where = f"model config {str(p)!r}"
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"{where}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must hold a JSON object (a Hugging Face config.json)")
    return data, where, _name_from_path(p)


def _name_from_path(p: Path) -> str:
    """``.../Llama-3.1-8B/config.json`` -> ``Llama-3.1-8B``; a Hub cache snapshot
    (``models--org--name/snapshots/<rev>/config.json``) -> ``org/name``."""
    parent = p.resolve().parent
    if parent.parent.name == "snapshots" and parent.parent.parent.name.startswith("models--"):
        return parent.parent.parent.name.removeprefix("models--").replace("--", "/")
    if p.name == "config.json" and parent.name:
        return parent.name
    return p.stem


def _int(data: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = data.get(key)
    if v is None:
        if default is None:
            raise ValueError(
                f"{where}: field {key!r} is missing; a decoder's config.json states it"
            )
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where}: field {key!r}={v!r}: must be a positive integer")
    return v


def _bool(data: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    v = data.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: field {key!r}={v!r}: must be true or false")
    return v


def hf_shapes(data: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The ``ModelSpec`` shape fields (no name, no params) of a config's fields; a
    ValueError naming ``where`` and the field for anything missing, invalid or refused."""
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(
            f"{where}: field 'model_type' is missing; a Hugging Face config.json names its "
            f"architecture (allowed: {', '.join(HF_MODEL_TYPES)})"
        )
    moe = {k: data[k] for k in _MOE_FIELDS if isinstance(data.get(k), int) and data[k] > 1}
    if model_type in _MOE_TYPES or moe:
        what = ", ".join(f"{k}={v}" for k, v in moe.items()) or f"model_type={model_type!r}"
        raise ValueError(
            f"{where}: a mixture-of-experts model ({what}); the roofline models dense decoders "
            "only (the weights a decode step reads depend on how many experts the batch "
            "routes to): tune it unseeded"
        )
    if model_type not in _FAMILIES:
        raise ValueError(
            f"{where}: model_type={model_type!r} is not a Llama-style decoder slotune reads; "
            f"allowed: {', '.join(HF_MODEL_TYPES)} (or give a ModelSpec JSON file)"
        )
    quant = data.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        raise ValueError(
            f"{where}: field 'quantization_config' (quant_method={method!r}): a quantized "
            "checkpoint; the roofline assumes 16-bit weights: tune it unseeded"
        )
    dtype_key = "torch_dtype" if "torch_dtype" in data else "dtype"
    dtype = data.get(dtype_key)
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{where}: field {dtype_key!r}={dtype!r}: allowed: {', '.join(_FLOAT_DTYPES)}"
        )
    qkv_bias, states_head_dim, tie_default = _FAMILIES[model_type]
    hidden = _int(data, "hidden_size", where)
    heads = _int(data, "num_attention_heads", where)
    if states_head_dim and data.get("head_dim") is None:
        raise ValueError(
            f"{where}: field 'head_dim' is missing; a {model_type} config states it (it is not "
            "hidden_size / num_attention_heads)"
        )
    if not states_head_dim and data.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"{where}: field 'head_dim' is missing and hidden_size={hidden} is not a multiple "
            f"of num_attention_heads={heads}"
        )
    kv_heads = _int(data, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: field 'num_attention_heads'={heads} is not a multiple of "
            f"'num_key_value_heads'={kv_heads}"
        )
    if data.get("sliding_window"):
        logger.info(
            "%s: sliding_window=%s ignored: the KV cache is counted over the whole context",
            where,
            data["sliding_window"],
        )
    return {
        "layers": _int(data, "num_hidden_layers", where),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": _int(data, "head_dim", where, default=hidden // heads),
        "vocab": _int(data, "vocab_size", where),
        "intermediate": _int(data, "intermediate_size", where),
        "tied_embeddings": _bool(data, "tie_word_embeddings", where, tie_default),
        "qkv_bias": qkv_bias or _bool(data, "attention_bias", where, False),
    }
