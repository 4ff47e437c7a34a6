"""Local checkpoints in the Hugging Face Llama layout: config.json + *.safetensors.

Only local directories: nothing is ever fetched. Tensor names are the Hugging
Face ones (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``...),
which serving/model/transformer.py's ``state_dict`` speaks (its fused q/k/v and gate/up
weights are split on save and stacked on load by state-dict hooks), so loading
is a checked ``load_state_dict``. Hugging Face stores q/k projections already permuted for
the ``rotate_half`` rotary convention the model uses. Sharded checkpoints
(several ``*.safetensors``) load as one state dict. ``rope_scaling`` (Llama
3.1's long-context frequency rescaling) is not implemented and is refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from serving.model.config import ModelConfig
from serving.model.transformer import Transformer, torch_dtype

logger = logging.getLogger(__name__)

_HF_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "torch_dtype": cfg.dtype,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def config_from_hf(
    hf: dict[str, Any], *, name: str = "checkpoint", dtype: str | None = None
) -> ModelConfig:
    """A ModelConfig from a Hugging Face Llama config.json dict."""
    arch = hf.get("model_type")
    if arch not in (None, "llama"):
        raise ValueError(f"model_type={arch!r}: only Llama-style ('llama') checkpoints load")
    if hf.get("rope_scaling"):
        raise ValueError(
            f"rope_scaling={hf['rope_scaling']!r}: not supported; use a checkpoint without it"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}={hf[key]!r}: biases are not supported")
    try:
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        if dtype is None:
            dtype = _HF_DTYPES.get(str(hf.get("torch_dtype", "bfloat16")), "bfloat16")
        return ModelConfig(
            name=name,
            vocab_size=hf["vocab_size"],
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or d // heads,
            intermediate_size=hf["intermediate_size"],
            max_position=hf.get("max_position_embeddings", 2048),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            dtype=dtype,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None


def save_checkpoint(model: Transformer, directory: str | Path) -> Path:
    """Write config.json + model.safetensors (Hugging Face Llama layout)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    tensors = {  # cloned: the fused linears' Hugging Face parts are views of one tensor
        k: v.detach().to("cpu").clone()
        for k, v in model.state_dict().items()
        if not (model.config.tie_embeddings and k == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_checkpoint(
    directory: str | Path, *, dtype: str | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a local Hugging Face Llama directory into :class:`Transformer`.

    ``dtype`` overrides config.json's ``torch_dtype``. Missing or unexpected
    tensors raise ValueError naming them.
    """
    src = Path(directory)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"checkpoint {str(src)!r}: no config.json (need a local HF Llama dir)")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {str(src)!r}: no *.safetensors files")
    cfg = config_from_hf(json.loads(cfg_path.read_text()), name=src.name, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    model = Transformer(cfg)
    target = dict(model.state_dict())
    if cfg.tie_embeddings:
        target.pop("lm_head.weight", None)
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(src)!r} does not match a Llama model of its config.json: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(
                f"checkpoint tensor {k!r} has shape {tuple(v.shape)}, "
                f"config.json implies {tuple(target[k].shape)}"
            )
    dt = torch_dtype(cfg.dtype)
    model.load_state_dict({k: v.to(dt) for k, v in state.items()}, strict=not cfg.tie_embeddings)
    logger.info("loaded %s: %d tensors from %d file(s)", src, len(state), len(files))
    return model.prepare(device)
