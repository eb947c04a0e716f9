"""Next-token choice: greedy, or temperature with optional top-k and top-p (nucleus) filtering."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import KimiInputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter

    def __post_init__(self):
        # NaN passes every comparison, so the checks are written as what must hold.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise KimiInputError(f"temperature {self.temperature}: expected a finite number >= 0")
        if not self.top_k >= 0:
            raise KimiInputError(f"top_k {self.top_k}: expected an integer >= 0")
        if not 0 < self.top_p <= 1:
            raise KimiInputError(f"top_p {self.top_p}: expected a number > 0 and <= 1")


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] float -> token ids [B]."""
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    # Scaled as logits less their maximum, in float64: any positive temperature (1e-300 too) leaves the top token at 0
    # and the rest finite or -inf, never the inf (and the NaN softmax) that logits / 1e-300 in float32 gives.
    logits = logits.double()
    logits = ((logits - logits.max(dim=-1, keepdim=True).values) / p.temperature).float()
    if p.top_k:
        kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p; the top token always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]
