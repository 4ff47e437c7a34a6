"""The whole decode step in one C call (serving/kernels/cpu_step.py) against the same kernels
called layer by layer: the very same bits, and the layer-by-layer path wherever the
whole-step kernel does not apply."""

from __future__ import annotations

import pytest
import torch

import serving.kernels.cpu_kernels as ck
from serving.model.config import ModelConfig
from serving.model.transformer import Transformer

KERNELS = ck.load()
pytestmark = pytest.mark.skipif(
    KERNELS is None or KERNELS.step_fn is None, reason="the whole-step kernel needs the GEMV"
)


def model_of(head_dim: int = 64, n_layers: int = 3) -> Transformer:
    cfg = ModelConfig.from_name("tiny").replace(
        name="k-step", n_layers=n_layers, n_heads=12, n_kv_heads=4, head_dim=head_dim
    )
    m = Transformer.random(cfg, seed=11)
    assert m.use_cpu_kernels()
    with torch.no_grad():  # a hidden state with large entries: silu's tails, both signs
        m.model.embed_tokens.weight.mul_(8.0)
    return m


class Counter:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def run_both(m: Transformer, rows: int, monkeypatch, positions=(63, 0, 17), slots=(4, 1, 2)):
    """(logits, caches) of one decode step with the whole-step kernel allowed, then with it
    off, from the same caches; and how many times the whole-step kernel ran."""
    gen = torch.Generator().manual_seed(rows)
    m.allocate_cache(6, 64)
    for c in m.caches():
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
    start = [c.clone() for c in m.caches()]
    tokens = torch.randint(0, m.config.vocab_size, (rows, 1), generator=gen)
    pos = torch.tensor(positions[:rows])[:, None]
    sl = torch.tensor(slots[:rows])
    counter = Counter(m.kernels.step_fn)  # the model's (an earlier test may reload them)
    out = []
    for fn in (counter, None):
        monkeypatch.setattr(m.kernels, "step_fn", fn)
        for c, s in zip(m.caches(), start, strict=True):
            c.copy_(s)
        with torch.inference_mode():
            out.append((m(tokens, pos, sl), [c.clone() for c in m.caches()]))
    monkeypatch.setattr(m.kernels, "step_fn", counter.fn)
    return out, counter.calls


@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_whole_step_gives_the_bits_of_the_layers_called_one_by_one(
    head_dim: int, rows: int, monkeypatch
) -> None:
    m = model_of(head_dim)
    for _ in range(2):  # the second time on new caches (allocate_cache) and new GEMV copies
        ((lw, cw), (ll, cl)), calls = run_both(m, rows, monkeypatch)
        assert calls == (1 if rows <= m.kernels.gemv_rows else 0)
        assert lw.dtype == torch.float32 and lw.shape == (rows, m.config.vocab_size)
        assert torch.equal(lw, ll)
        assert all(torch.equal(a, b) for a, b in zip(cw, cl, strict=True))
        assert m.use_cpu_kernels()


def test_a_step_the_kernel_cannot_run_goes_layer_by_layer(monkeypatch) -> None:
    m = model_of()
    # A layer without its GEMV copies (dropped after the fact) and a layer norm with
    # another epsilon each send the step back to the layer-by-layer path.
    m.model.layers[1].mlp.down_proj.rows8 = None
    _, calls = run_both(m, 1, monkeypatch)
    assert calls == 0
    m = model_of()
    m.model.layers[2].post_attention_layernorm.eps = 1e-3
    ((lw, _), (ll, _)), calls = run_both(m, 1, monkeypatch)
    assert calls == 0 and torch.equal(lw, ll)


def test_a_position_out_of_range_raises_and_writes_nothing(monkeypatch) -> None:
    m = model_of()
    m.allocate_cache(4, 32)
    before = [c.clone() for c in m.caches()]
    counter = Counter(m.kernels.step_fn)
    monkeypatch.setattr(m.kernels, "step_fn", counter)
    # 40 is past the 32-token cache (the rotary table is longer, so only the kernel's
    # own check stops it).
    with pytest.raises(IndexError, match="position outside"), torch.inference_mode():
        m(torch.tensor([[3]]), torch.tensor([[40]]), torch.tensor([1]))
    assert counter.calls == 1
    assert all(torch.equal(a, b) for a, b in zip(m.caches(), before, strict=True))
