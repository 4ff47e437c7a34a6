"""slotune's decoder against transformers' own forward pass, on small random checkpoints.

Each architecture slotune loads (Llama with Llama 3's rope scaling, Mistral, Qwen2 with its
q/k/v biases) is built with random weights by ``transformers`` (a test-only dependency),
saved by ``save_pretrained`` as a sharded safetensors checkpoint, and loaded by
serving/model/checkpoint.py. In float32 on the CPU the logits must match transformers' at
prefill, across decode steps through the KV cache, and for requests of mixed lengths
decoded in one batch.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from serving.model.checkpoint import load_checkpoint
from serving.model.transformer import Transformer

VOCAB = 384
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,  # GQA: 4 query heads a KV head
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # short, so the rescaled band covers several of head_dim 8's four frequencies
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
ARCHS = {
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **COMMON,
        max_position_embeddings=256,
        rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "llama-linear-rope": lambda: transformers.LlamaConfig(
        **COMMON,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "mistral": lambda: transformers.MistralConfig(
        **COMMON, max_position_embeddings=512, sliding_window=256, head_dim=16
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, max_position_embeddings=256),
}


def _hf_model(name: str) -> torch.nn.Module:
    torch.manual_seed(sorted(ARCHS).index(name))  # a fixed seed per architecture
    cfg = ARCHS[name]()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):  # transformers starts biases at zero: make them count
                p.normal_(0.0, 0.5)
            elif "norm" in pname:  # and norm weights at one
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Transformer]:
    hf = _hf_model(request.param)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d, max_shard_size="100KB")  # sharded: several files and an index
    assert len(list(d.glob("*.safetensors"))) > 1
    ours = load_checkpoint(d, dtype="float32")
    return request.param, hf, ours


@torch.no_grad()
def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_read_as_stated(pair) -> None:
    name, hf, ours = pair
    cfg = ours.config
    assert cfg.architecture == hf.config.model_type
    head_dim = getattr(hf.config, "head_dim", None) or 64 // 8
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (8, 2, head_dim)
    assert cfg.qkv_bias == (name == "qwen2")
    assert cfg.tie_embeddings == (name == "llama3-rope-tied")
    assert (cfg.rope_scaling is None) == (name in ("mistral", "qwen2"))
    if name == "mistral":  # the window is not implemented: contexts stop at it
        assert cfg.max_position == 256


@torch.no_grad()
def test_prefill_and_decode_match(pair) -> None:
    name, hf, ours = pair
    ours.allocate_cache(max_slots=4, max_len=128)
    ids = _prompt(1, 40)  # past original_max_position_embeddings: the rescaled band is used
    slot = torch.tensor([2])
    got = ours(torch.tensor([ids]), torch.arange(40)[None], slot, last_only=False)[0]
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=2e-4, rtol=2e-4)
    for step in range(6):  # decode through the cache, one token at a time
        nxt = int(got[-1].argmax()) if step == 0 else int(got.argmax())
        ids.append(nxt)
        pos = torch.tensor([[len(ids) - 1]])
        got = ours(torch.tensor([[nxt]]), pos, slot)[0]
        torch.testing.assert_close(got, _hf_logits(hf, ids)[-1], atol=2e-4, rtol=2e-4)


@torch.no_grad()
def test_mixed_lengths_in_one_batch(pair) -> None:
    name, hf, ours = pair
    ours.allocate_cache(max_slots=4, max_len=128)
    prompts = [_prompt(10 + i, n) for i, n in enumerate((5, 33, 17))]
    slots = [3, 0, 1]  # not one ascending run: the cache is gathered
    for p, s in zip(prompts, slots, strict=True):
        # prefill in two chunks, as the scheduler's chunk budget may split a prompt
        cut = len(p) // 2
        for lo, hi in ((0, cut), (cut, len(p))):
            ours(torch.tensor([p[lo:hi]]), torch.arange(lo, hi)[None], torch.tensor([s]))
    nxt = [int(_hf_logits(hf, p)[-1].argmax()) for p in prompts]
    for _ in range(3):  # decode steps of the three together, each at its own position
        for p, t in zip(prompts, nxt, strict=True):
            p.append(t)
        got = ours(
            torch.tensor([[t] for t in nxt]),
            torch.tensor([[len(p) - 1] for p in prompts]),
            torch.tensor(slots),
        )  # [3, V]
        want = torch.stack([_hf_logits(hf, p)[-1] for p in prompts])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        nxt = [int(r.argmax()) for r in got]


@torch.no_grad()
def test_bf16_serving_path_agrees(pair, tmp_path) -> None:
    """The serving dtype with the CPU fast paths (C kernels, prepacked linears) on, the
    biased q/k/v included: close to float32, as bf16 rounding allows."""
    name, hf, _ = pair
    hf.save_pretrained(tmp_path)
    m = load_checkpoint(tmp_path, dtype="bfloat16")
    m.prepack()
    m.use_cpu_kernels()
    m.allocate_cache(max_slots=2, max_len=64)
    ids = _prompt(5, 20)
    m(torch.tensor([ids[:-1]]), torch.arange(19)[None], torch.tensor([1]))
    got = m(torch.tensor([ids[-1:]]), torch.tensor([[19]]), torch.tensor([1]))[0]
    want = _hf_logits(hf, ids)[-1]
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99
