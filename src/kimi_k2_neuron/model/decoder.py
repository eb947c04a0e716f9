"""One Kimi-K2 decoder layer: pre-norm MLA attention, then a pre-norm dense MLP or MoE block.

The Neuron shell builds this same layer (its MoE block is NxD's, from NxDParallelContext.moe) and only answers
NxDI's forward contract in a subclass.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import KimiK2Config
from ..parallel import ParallelContext
from .mla import MLAttention
from .moe import MLP, MoE
from .norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiK2Config, layer_idx: int, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, dtype, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            backend_moe = ctx.moe(cfg, dtype)
            self.mlp = MoE(cfg, dtype, ctx) if backend_moe is None else backend_moe
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, ctx)

    def attention_input(self, x):
        """-> (the attention's input, the residual); an EAGLE3 draft's layer reads two (model/eagle3.py)."""
        return self.input_layernorm(x), x

    def forward(self, x, positions, rope, latent_cache, absorbed=None):
        attn_in, x = self.attention_input(x)
        x = x + self.self_attn(attn_in, positions, rope, latent_cache, absorbed)
        return x + self.mlp(self.post_attention_layernorm(x))
