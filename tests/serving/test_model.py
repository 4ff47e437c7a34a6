"""The decode model: presets, an independent reference forward, the KV cache, sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.model.config import ModelConfig
from serving.model.linear import Linear
from serving.model.sampling import sample
from serving.model.transformer import Transformer


@pytest.fixture(scope="module")
def tiny32() -> Transformer:
    torch.set_num_threads(1)
    return Transformer.random(ModelConfig.from_name("tiny", dtype="float32"), seed=0)


def test_presets_sizes() -> None:
    small = ModelConfig.from_name("small")
    assert (small.d_model, small.n_layers, small.n_heads, small.n_kv_heads) == (768, 12, 12, 4)
    assert (small.head_dim, small.vocab_size, small.intermediate_size) == (64, 32000, 2048)
    assert 120e6 < small.n_params < 130e6  # untied embedding + head
    assert 95e6 < small.decode_params < 105e6  # what one decode step reads
    assert small.decode_params * 2 > 64 * 2**20 * 2  # bf16 weights far exceed the fast cache
    assert small.kv_bytes_per_token == 2 * 12 * 4 * 64 * 2
    tiny = ModelConfig.from_name("tiny")
    assert 1e6 < tiny.n_params < 10e6
    model = Transformer(tiny)
    assert sum(p.numel() for p in model.parameters()) == tiny.n_params


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"n_kv_heads": 3}, "n_heads=8 must be a multiple of n_kv_heads=3"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"d_model": 0}, "d_model=0"),
        ({"head_dim": 33}, "head_dim=33"),
    ],
)
def test_config_validation(kw, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_name("tiny", **kw)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="'huge'.*tiny, small"):
        ModelConfig.from_name("huge")


def test_seed_fixes_weights() -> None:
    cfg = ModelConfig.from_name("tiny")
    a, b, c = (Transformer.random(cfg, seed=s) for s in (1, 1, 2))
    wa, wb, wc = (m.state_dict()["model.layers.0.mlp.up_proj.weight"] for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert wa.dtype == torch.bfloat16


def reference_forward(m: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """An independent Llama forward: repeat_kv + SDPA, RoPE computed from scratch, from the
    Hugging Face-named weights of ``state_dict`` (the fused linears split back)."""
    cfg = m.config
    sd = m.state_dict()
    t = tokens.shape[0]
    x = sd["model.embed_tokens.weight"][tokens]  # [T, d]
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    ang = torch.arange(t).float()[:, None] * inv[None]  # [T, D/2]
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)  # [T, D]

    def rms(v, w):
        return w * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

    def rope(v):  # [H, T, D]
        half = cfg.head_dim // 2
        rot = torch.cat([-v[..., half:], v[..., :half]], -1)
        return v * cos + rot * sin

    for i in range(cfg.n_layers):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in sd.items()}
        h = rms(x, w["input_layernorm.weight"])
        q = (h @ w["self_attn.q_proj.weight"].T).view(t, cfg.n_heads, cfg.head_dim).transpose(0, 1)
        k = (h @ w["self_attn.k_proj.weight"].T).view(t, cfg.n_kv_heads, -1).transpose(0, 1)
        v = (h @ w["self_attn.v_proj.weight"].T).view(t, cfg.n_kv_heads, -1).transpose(0, 1)
        rep = cfg.n_heads // cfg.n_kv_heads
        k = rope(k).repeat_interleave(rep, 0)
        v = v.repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(rope(q), k, v, is_causal=True)  # [H, T, D]
        x = x + o.transpose(0, 1).reshape(t, -1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T  # [T, V]


@torch.inference_mode()
def test_matches_independent_reference(tiny32: Transformer) -> None:
    tokens = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(3))
    ours = tiny32(tokens[None], torch.arange(11)[None], last_only=False)[0]
    ref = reference_forward(tiny32, tokens)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("contiguous", [True, False])
def test_cache_prefill_chunks_and_decode_match_full_forward(
    tiny32: Transformer, contiguous: bool
) -> None:
    tiny32.allocate_cache(4, 32)
    for c in tiny32.caches():
        c.normal_()  # stale garbage must be masked, not read
    tokens = torch.randint(0, 512, (14,), generator=torch.Generator().manual_seed(4))
    full = tiny32(tokens[None], torch.arange(14)[None], last_only=False)[0]  # [T, V]
    slot = torch.tensor([2])
    start = 2 if contiguous else None
    a = tiny32(tokens[None, :5], torch.arange(5)[None], slot, slot_start=start, last_only=False)
    b = tiny32(tokens[None, 5:9], torch.arange(5, 9)[None], slot, slot_start=start)
    torch.testing.assert_close(a[0], full[:5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b[0], full[8], atol=1e-4, rtol=1e-4)
    for p in range(9, 14):
        out = tiny32(tokens[None, p : p + 1], torch.tensor([[p]]), slot, slot_start=start)
        torch.testing.assert_close(out[0], full[p], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_batched_decode_rows_are_independent(tiny32: Transformer) -> None:
    tiny32.allocate_cache(3, 16)
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 6)]
    # prefill all but the last token of each into slots 0 and 2
    for slot, s in zip((0, 2), seqs, strict=True):
        n = len(s) - 1
        tiny32(s[None, :n], torch.arange(n)[None], torch.tensor([slot]), slot_start=slot)
    toks = torch.tensor([[seqs[0][-1]], [seqs[1][-1]]])
    pos = torch.tensor([[2], [5]])
    out = tiny32(toks, pos, torch.tensor([0, 2]))  # gathered, different positions
    for row, s in enumerate(seqs):
        ref = tiny32(s[None], torch.arange(len(s))[None])[0]
        torch.testing.assert_close(out[row], ref, atol=1e-4, rtol=1e-4)


def test_cache_longer_than_max_position_rejected() -> None:
    m = Transformer(ModelConfig.from_name("tiny", max_position=64))
    with pytest.raises(ValueError, match="max_len=65"):
        m.allocate_cache(1, 65)


def test_cache_shape_is_per_layer_and_allocated_once(tiny32: Transformer) -> None:
    tiny32.allocate_cache(5, 24)
    caches = tiny32.caches()
    assert len(caches) == tiny32.config.n_layers  # K and V of a layer in one buffer
    assert all(c.shape == (2, 5, 4, 24, 32) for c in caches)
    ptrs = [c.data_ptr() for c in caches]
    with torch.inference_mode():
        tiny32(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.tensor([1]), slot_start=1)
    assert [c.data_ptr() for c in tiny32.caches()] == ptrs  # updated in place
    assert caches[0][:, 1, :, :3].abs().amin() > 0  # K and V of every head at 0..2
    assert caches[0][:, 1, :, 3:].abs().sum() == 0 and caches[0][:, [0, 2, 3, 4]].abs().sum() == 0


def test_sample_greedy_and_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    greedy = sample(logits, torch.zeros(4))
    assert torch.equal(greedy, logits.argmax(-1))
    t = torch.tensor([0.0, 1.0, 0.0, 5.0])
    draws = [sample(logits, t, torch.Generator().manual_seed(9)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])  # seeded
    assert draws[0][0] == greedy[0] and draws[0][2] == greedy[2]
    many = {int(sample(logits[3:4], torch.tensor([5.0]), g)) for _ in range(50)}
    assert len(many) > 5  # a hot temperature really samples


@torch.inference_mode()
def test_prepacked_linears_are_bit_identical() -> None:
    m = Transformer.random(ModelConfig.from_name("tiny"), seed=2)  # bf16
    m.allocate_cache(2, 16)
    toks, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    plain = m(toks, pos, last_only=False)
    if not m.prepack():
        pytest.skip("no oneDNN bf16 on this CPU")
    assert m.lm_head.packed is not None
    assert torch.equal(m(toks, pos, last_only=False), plain)
    assert "lm_head.weight" in m.state_dict()  # checkpoints keep the plain weight
    assert m.prepack(False) is False and m.lm_head.packed is None


@torch.inference_mode()
def test_without_bf16_hardware_linears_and_attention_multiply_in_fp32(monkeypatch) -> None:
    """Where the CPU has no bf16 matmul hardware (torch's bf16 GEMMs are a slow fallback),
    prepack gives each linear an fp32 copy and the GEMMs run in fp32, rounded to bf16."""
    import serving.model.layers as sl
    import serving.model.linear as fl

    for mod in (fl, sl):
        monkeypatch.setattr(mod, "bf16_matmul_native", lambda: False)
    m = Transformer.random(ModelConfig.from_name("tiny"), seed=2)  # bf16
    m.allocate_cache(2, 16)
    toks, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    plain = m(toks, pos, last_only=False)  # the widened attention, bf16 linears
    assert m.prepack() is False  # no oneDNN packing ...
    assert all(lin.w32 is not None and lin.w32.dtype == torch.float32 for lin in _linears(m))
    assert torch.equal(m.lm_head.w32, m.lm_head.weight.float())  # ... an exact fp32 copy
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda x, w, b=None: calls.append(w.dtype) or real(x, w, b)
    )
    wide = m(toks, pos, last_only=False)
    assert calls and set(calls) == {torch.float32}
    assert wide.dtype == plain.dtype
    torch.testing.assert_close(wide, plain, atol=0.05, rtol=0.05)  # bf16 sums, other order
    m.prepack(False)
    assert all(lin.w32 is None for lin in _linears(m))
    m.prepack()  # a moved model drops its copies: they describe the old dtype
    m.float()
    assert all(lin.w32 is None for lin in _linears(m))
    assert m(toks, pos, last_only=False).dtype == torch.float32


def _linears(m: Transformer) -> list[Linear]:
    return [lin for lin in m.modules() if isinstance(lin, Linear)]


def test_calibration_times_the_linears_the_model_runs() -> None:
    # search/calibrate/shapes.py times the model's linears by their shapes (and
    # search/calibrate/step.py the model itself): the same (out, in) shapes in the same
    # order, the fused ones included.
    from search.calibrate.shapes import _linear_shapes
    from search.roofline.models import ModelSpec

    m = Transformer(ModelConfig.from_name("small"))
    ours = [tuple(lin.weight.shape) for lin in m.modules() if isinstance(lin, Linear)]
    assert _linear_shapes(ModelSpec.from_name("slotune-small")) == ours
