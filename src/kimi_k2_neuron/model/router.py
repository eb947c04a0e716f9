"""The noaux_tc router of DeepSeek-V3 / Kimi-K2.

e_score_correction_bias is added AFTER the sigmoid and only to choose experts; folding it into the linear layer (as
the community NxDI port does) changes the choice and the weights. Sharded, the float32 logits are all-gathered so
every rank picks the same experts (each holds a slice of every expert)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import KimiK2Config
from ..parallel import SINGLE, ParallelContext


class NoAuxTcRouter(nn.Module):
    def __init__(self, cfg: KimiK2Config, ctx: ParallelContext = SINGLE):
        super().__init__()
        e = cfg.n_routed_experts
        self._init_logits(cfg, ctx)
        # float32 whatever the model's compute dtype, as the weight: routing decisions are sensitive to rounding.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.normalize, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def _init_logits(self, cfg: KimiK2Config, ctx: ParallelContext) -> None:
        """float32 weight [E, hidden] (E / tp rows with shard_router); ctx, shard_dim, full_shape for the loader."""
        self.ctx, self.shard_dim = ctx, 0 if ctx.layout.shard_router else None
        self.full_shape = (cfg.n_routed_experts, cfg.hidden_size)
        rows = ctx.local(cfg.n_routed_experts, "n_routed_experts") if ctx.layout.shard_router else cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(rows, cfg.hidden_size, dtype=torch.float32), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> float32 router logits [N, E], the same on every rank."""
        out = x.float() @ self.weight.T
        return out if self.shard_dim is None else self.ctx.all_gather_last(out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(self.logits(x))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits [N, E] -> (weights [N, top_k] float32, expert ids [N, top_k])."""
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        choice = self._mask_to_top_groups(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _mask_to_top_groups(self, choice: torch.Tensor) -> torch.Tensor:
        if self.n_group == 1:
            return choice
        n = choice.shape[0]
        grouped = choice.view(n, self.n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
        # -inf, not modeling_deepseek.py's 0.0: a masked expert stays unchosen even if every kept biased score is < 0
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)
