"""The example's model: a tiny byte-level causal LM (a GRU) with fixed-seed random weights.

Tokens are bytes (0-255) plus an end-of-sequence id. A GRU carries its state in a hidden
tensor, so decoding needs no KV cache: one step is one GRU cell per layer over the batch.
A step reads every weight once whatever the batch (the fixed cost) and does a
[B, D] x [D, 3D] matmul per gate block (the cost that grows with B), which is what gives
the batch limit a throughput / latency trade-off worth tuning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deploy.examples.serve_batch.tokens import EOS_ID, VOCAB_SIZE


@dataclass(frozen=True, kw_only=True)
class LMConfig:
    """Size and seed of :class:`TinyLM` (the weights are a pure function of these)."""

    d_model: int = 768
    n_layers: int = 2
    seed: int = 0
    # Added to EOS's logit: random weights would otherwise end about one greedy step in
    # 257; this makes a natural stop rare (clients measuring TPOT send ignore_eos anyway).
    eos_bias: float = -4.0

    def __post_init__(self) -> None:
        if not (isinstance(self.d_model, int) and 8 <= self.d_model <= 8192):
            raise ValueError(f"d_model={self.d_model!r}: must be an integer in 8..8192")
        if not (isinstance(self.n_layers, int) and 1 <= self.n_layers <= 8):
            raise ValueError(f"n_layers={self.n_layers!r}: must be an integer in 1..8")
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"seed={self.seed!r}: must be an integer >= 0")


class TinyLM(nn.Module):
    """Embedding → multi-layer GRU → linear head; greedy decoding."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):  # fixed weights; the caller's RNG untouched
            torch.manual_seed(config.seed)
            self.embed = nn.Embedding(VOCAB_SIZE, config.d_model)
            self.gru = nn.GRU(config.d_model, config.d_model, num_layers=config.n_layers)
            self.head = nn.Linear(config.d_model, VOCAB_SIZE)
        with torch.no_grad():
            self.head.bias[EOS_ID] += config.eos_bias
        self.eval()
        self.requires_grad_(False)

    def _greedy(self, top: torch.Tensor) -> torch.Tensor:
        return self.head(top).argmax(dim=-1)  # [B, D] -> [B, V] -> [B]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run each prompt; return the hidden state [L, B, D] and the first new token [B]."""
        hs = []
        for ids in prompts:
            x = self.embed(torch.tensor(ids, dtype=torch.long))  # [T, D]
            _, h = self.gru(x[:, None, :])  # h: [L, 1, D]
            hs.append(h)
        h = torch.cat(hs, dim=1)  # [L, B, D]
        return h, self._greedy(h[-1])  # the top layer's last output is h[-1]

    @torch.inference_mode()
    def step(
        self, tokens: torch.Tensor, h: torch.Tensor, rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for the batch rows ``rows`` (all when None): feed ``tokens`` [B],
        return the next tokens [B'] and the new hidden state [L, B', D]."""
        if rows is not None and len(rows) != tokens.shape[0]:
            index = torch.tensor(rows, dtype=torch.long)
            tokens, h = tokens[index], h[:, index]  # [B'], [L, B', D]
        out, h = self.gru(self.embed(tokens)[None], h)  # out: [1, B', D]
        return self._greedy(out[0]), h
