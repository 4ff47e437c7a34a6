"""Local checkpoints in the Hugging Face layout: config.json + *.safetensors.

Only local directories: nothing is ever fetched. Three architectures load, by their
config.json ``model_type``: ``llama`` (Llama 2 and 3.x, with Llama 3.1's ``rope_scaling``
type ``llama3``, or ``linear``), ``mistral`` and ``qwen2`` (q/k/v biases). They share
the tensor names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``...);
Hugging Face stores q/k projections already permuted for the ``rotate_half`` rotary
convention the model uses.

Loading builds the model on the meta device (no memory, no random initialisation), gives
it empty storage on the target device in the serving dtype, and copies the stored tensors
into it one at a time (``serving.model.linear.hf_tensors`` says where each goes: a fused
linear's part is a row range), so host memory holds the model's weights where they live
on the CPU and, beyond that, one shard's mapping at a time, never a whole state dict.

A sliding window (Mistral v0.1's ``sliding_window``, Qwen2's with ``use_sliding_window``)
is not implemented: the context is capped at the window instead, where full attention
and the window are the same computation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from serving.model.config import ARCHITECTURES, ModelConfig, RopeScaling
from serving.model.linear import hf_tensors
from serving.model.transformer import Transformer

logger = logging.getLogger(__name__)

_HF_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Tensors some checkpoints store that the model computes instead (old Llama exports).
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    hf: dict[str, Any] = {
        "architectures": [_HF_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
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
    }
    if cfg.architecture == "llama":
        hf |= {"attention_bias": False, "mlp_bias": False}
    rs = cfg.rope_scaling
    if rs is not None:
        hf["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor}
        if rs.kind == "llama3":
            hf["rope_scaling"] |= {
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position,
            }
    return hf


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling: transformers 4 writes ``rope_theta`` and ``rope_scaling``
    (``type`` in older files, ``rope_type`` in newer), transformers 5 one
    ``rope_parameters`` holding both."""
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"rope_scaling={scaling!r}: type {kind!r} is not supported; "
            "supported: 'linear', 'llama3', or none"
        )
    try:
        return theta, RopeScaling(
            kind=kind,
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    except KeyError:
        raise ValueError(f"rope_scaling={scaling!r}: needs a 'factor'") from None


def config_from_hf(
    hf: dict[str, Any], *, name: str = "checkpoint", dtype: str | None = None
) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict (Llama, Mistral or Qwen2)."""
    arch = hf.get("model_type", "llama")
    if arch not in ARCHITECTURES:
        raise ValueError(f"model_type={arch!r}: must be one of {', '.join(ARCHITECTURES)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}={hf[key]!r}: biases are not supported in {arch}")
    theta, scaling = _rope(hf)
    try:
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        if dtype is None:
            stated = hf.get("torch_dtype", hf.get("dtype")) or "bfloat16"
            dtype = _HF_DTYPES.get(str(stated), "bfloat16")
        max_position = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window")
        if arch == "qwen2" and not hf.get("use_sliding_window", False):
            window = None
        if window is not None and window < max_position:
            logger.info(
                "%s: sliding_window=%d is not implemented; contexts capped at it", name, window
            )
            max_position = window
        return ModelConfig(
            name=name,
            architecture=arch,
            vocab_size=hf["vocab_size"],
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or d // heads,
            intermediate_size=hf["intermediate_size"],
            max_position=max_position,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            dtype=dtype,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None


def read_config(directory: str | Path, *, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of a local checkpoint directory's config.json."""
    src = Path(directory)
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"checkpoint {str(src)!r}: no config.json (need a local HF model dir)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return config_from_hf(hf, name=src.name, dtype=dtype)


def save_checkpoint(
    model: Transformer, directory: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """Write config.json and the weights in the Hugging Face layout: one
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` (a tensor larger than
    that gets a shard of its own) with ``model.safetensors.index.json``, as
    ``save_pretrained`` writes them."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    tensors = {  # cloned: the fused linears' Hugging Face parts are views of one tensor
        k: v.detach().to("cpu").clone()
        for k, v in model.state_dict().items()
        if not (model.config.tie_embeddings and k == "lm_head.weight")
    }
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def load_checkpoint(
    directory: str | Path, *, dtype: str | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a local Hugging Face directory (Llama, Mistral, Qwen2) into :class:`Transformer`
    on ``device``, tensor by tensor (see the module docstring).

    ``dtype`` overrides config.json's. Missing, unexpected or misshapen tensors raise
    ValueError naming them.
    """
    src = Path(directory)
    files = sorted(src.glob("*.safetensors"))
    if not files and (src / "config.json").is_file():
        raise ValueError(f"checkpoint {str(src)!r}: no *.safetensors files")
    cfg = read_config(src, dtype=dtype)
    model = Transformer.empty(cfg, device=device)
    where = hf_tensors(model)
    if cfg.tie_embeddings:  # the head is the embedding; a stored copy is ignored, as HF does
        where.pop("lm_head.weight")
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for key in st.keys():
                    if key not in where:
                        derived = key.endswith(_DERIVED_SUFFIXES)
                        if not (derived or (cfg.tie_embeddings and key == "lm_head.weight")):
                            unexpected.append(key)
                        continue
                    param, row, rows = where[key]
                    shape = (rows, *param.shape[1:])
                    stored = st.get_slice(key).get_shape()
                    if tuple(stored) != shape:
                        raise ValueError(
                            f"checkpoint tensor {key!r} has shape {tuple(stored)}, "
                            f"config.json implies {shape}"
                        )
                    # one tensor on the host at a time; copy_ converts dtype and device
                    param.narrow(0, row, rows).copy_(st.get_tensor(key))
                    loaded.add(key)
    missing = sorted(set(where) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(src)!r} does not match a {cfg.architecture} model of its "
            f"config.json: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {sorted(unexpected)[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    logger.info("loaded %s: %d tensors from %d file(s)", src, len(loaded), len(files))
    return model.prepare(device)
