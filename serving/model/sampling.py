"""Choosing each request's next token from the logits (serving/engine/executor.py)."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,  # [B, V] fp32
    temperature: torch.Tensor,  # [B]; 0 means greedy
    generator: torch.Generator | None = None,
    *,
    any_hot: bool | None = None,
) -> torch.Tensor:
    """Greedy where temperature is 0, softmax sampling elsewhere. Returns [B]
    int64. ``any_hot``: whether any temperature is > 0, if the caller knows (saves a
    device sync)."""
    greedy = logits.argmax(dim=-1)  # [B]
    hot = temperature > 0
    if not (bool(hot.any()) if any_hot is None else any_hot):
        return greedy
    t = torch.where(hot, temperature, torch.ones_like(temperature))  # [B]
    probs = torch.softmax(logits / t[:, None], dim=-1)  # [B, V]
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
    return torch.where(hot, drawn, greedy)
