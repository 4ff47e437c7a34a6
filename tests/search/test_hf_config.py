"""A Hugging Face config.json read as roofline shapes: published configs give the published
parameter counts and KV bytes; missing, invalid and refused fields are one-line errors
naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.roofline.models import CATALOG, ModelSpec

# meta-llama/Llama-3.1-8B config.json (the fields as published; rope details elided)
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# meta-llama/Llama-3.2-1B: tied embeddings, head_dim 64; 1,235,814,400 parameters.
LLAMA_32_1B = LLAMA_31_8B | {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "tie_word_embeddings": True,
}

# Qwen/Qwen2.5-7B: q/k/v carry a bias (always, in Qwen2Attention); 7,615,616,512 parameters.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# google/gemma-7b: head_dim 256 (not 3072 / 16), no tie_word_embeddings field (the class
# default, True, was dropped on save); 8,537,680,896 parameters.
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"],
    "attention_bias": False,
    "head_dim": 256,
    "hidden_act": "gelu",
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "model_type": "gemma",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 16,
    "torch_dtype": "bfloat16",
    "vocab_size": 256000,
}

# mistralai/Mixtral-8x7B-v0.1 (a mixture of experts)
MIXTRAL = LLAMA_31_8B | {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def test_llama_31_8b_gives_the_design_numbers() -> None:
    m = ModelSpec.from_hf_config(LLAMA_31_8B, name="llama-3.1-8b")
    assert m.kv_bytes_per_token() == 131_072  # 2 * 32 layers * 8 kv heads * 128 * 2 B
    assert m.params == 8_030_261_248 and m.params == pytest.approx(8.0e9, rel=0.01)
    assert m == CATALOG["llama-3.1-8b"]  # the catalogue's shapes, from the config


@pytest.mark.parametrize(
    ("cfg", "params", "tied", "bias"),
    [
        (LLAMA_32_1B, 1_235_814_400, True, False),
        (QWEN25_7B, 7_615_616_512, False, True),
        (GEMMA_7B, 8_537_680_896, True, False),
    ],
)
def test_published_parameter_counts(cfg: dict, params: int, tied: bool, bias: bool) -> None:
    m = ModelSpec.from_hf_config(cfg)
    assert (m.params, m.tied_embeddings, m.qkv_bias) == (params, tied, bias)


def test_gemma_head_dim_is_read_not_derived() -> None:
    m = ModelSpec.from_hf_config(GEMMA_7B)
    assert m.head_dim == 256 and m.kv_bytes_per_token() == 2 * 28 * 16 * 256 * 2


def test_missing_kv_heads_and_head_dim_default_as_transformers_does() -> None:
    cfg = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    m = ModelSpec.from_hf_config(cfg | {"head_dim": None})
    assert m.kv_heads == 32 and m.head_dim == 128  # multi-head; hidden / heads


def test_from_a_file_or_its_directory_named_for_the_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "Llama-3.1-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert ModelSpec.from_hf_config(d / "config.json").name == "Llama-3.1-8B"
    assert ModelSpec.from_hf_config(str(d)).params == 8_030_261_248
    snap = tmp_path / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "0e9e39f"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert ModelSpec.from_hf_config(snap).name == "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
        ({"hidden_size": 0}, r"field 'hidden_size'=0: must be a positive integer"),
        ({"vocab_size": "128256"}, "field 'vocab_size'='128256'"),
        ({"num_key_value_heads": 5}, "not a multiple of 'num_key_value_heads'=5"),
        ({"tie_word_embeddings": "no"}, "field 'tie_word_embeddings'='no': must be true or"),
        ({"torch_dtype": "int8"}, "field 'torch_dtype'='int8': allowed: bfloat16"),
        ({"model_type": "gpt2"}, "model_type='gpt2' is not a Llama-style decoder"),
        ({"model_type": None}, "field 'model_type' is missing"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
        ({"hidden_size": 4100, "head_dim": None}, "hidden_size=4100 is not a multiple"),
    ],
)
def test_bad_fields_are_one_line_errors_naming_file_and_field(
    tmp_path: Path, change: dict, match: str
) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({k: v for k, v in (LLAMA_31_8B | change).items() if v is not None}))
    with pytest.raises(ValueError, match=match) as e:
        ModelSpec.from_hf_config(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_a_mixture_of_experts_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="mixture-of-experts.*num_local_experts=8.*unseeded"):
        ModelSpec.from_hf_config(MIXTRAL)
    with pytest.raises(ValueError, match="num_experts=60"):  # a MoE field under another type
        ModelSpec.from_hf_config(QWEN25_7B | {"num_experts": 60})


def test_gemma_without_head_dim_is_refused() -> None:
    cfg = {k: v for k, v in GEMMA_7B.items() if k != "head_dim"}
    with pytest.raises(ValueError, match="field 'head_dim' is missing; a gemma config states"):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize(
    ("text", "match"),
    [("{not json", "not JSON"), ("[1, 2]", "must hold a JSON object")],
)
def test_unreadable_files(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(p)
    with pytest.raises(ValueError, match="cannot read"):
        ModelSpec.from_hf_config(tmp_path / "absent.json")
