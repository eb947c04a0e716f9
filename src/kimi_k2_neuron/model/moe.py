"""SwiGLU MLPs and the routed + shared expert block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import KimiK2Config
from ..parallel import ParallelContext
from .router import NoAuxTcRouter


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); intermediate columns split across ranks, one all-reduce in down_proj."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        self.gate_proj = ctx.column(hidden, intermediate, dtype)
        self.up_proj = ctx.column(hidden, intermediate, dtype)
        self.down_proj = ctx.row(intermediate, hidden, dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts (top-k of n_routed_experts, weights from the router) plus the always-on shared expert."""

    def __init__(self, cfg: KimiK2Config, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = NoAuxTcRouter(cfg, ctx)
        self.experts = nn.ModuleList(MLP(h, i, dtype, ctx) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(h, i * cfg.n_shared_experts, dtype, ctx) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        out = torch.zeros_like(flat)
        # Dropless: every token reaches all of its top-k experts (no capacity factor).
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[token]) * weights[token, slot, None].to(flat.dtype)
            out.index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
