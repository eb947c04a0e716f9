"""The EAGLE3 MLA draft's math (TorchSpec's Eagle3DeepseekV2ForCausalLM, vLLM's deepseek_eagle3.py, SGLang's
kimi_k25_eagle3.py; docs/speculative.md): the core's decoder layer with its MLA attention reading [input_layernorm(
embedding) | hidden_norm(hidden)] (2H), the residual the un-normed hidden; the target's three captured hidden states
fused by fc, each first RMS-normed under EAGLE3.1's fc_norm; the hidden state the next draft step reads is the final
norm's input (EAGLE3) or its output (EAGLE3.1's norm_output). The Neuron shell's draft class
(neuron/eagle3_mla.py) builds these same modules."""

from __future__ import annotations

import torch
from torch import nn

from ..config import KimiK2Config
from ..parallel import ParallelContext
from .decoder import DecoderLayer
from .norm import RMSNorm

AUX_INPUTS = 3  # the captured hidden states fc fuses


class Eagle3Layer(DecoderLayer):
    """One dense decoder layer (cfg: the draft's, checkpoint/draft.py core_config) whose attention's a-projections
    take the 2H input."""

    def __init__(self, cfg: KimiK2Config, dtype: torch.dtype, ctx: ParallelContext, **kwargs):
        super().__init__(cfg, 0, dtype, ctx, **kwargs)
        self.hidden_size = h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        attn = self.self_attn
        for name, module in ctx.attention_a(2 * h, cfg.q_lora_rank, cfg.latent_dim, dtype).items():
            setattr(attn, name, module)

    def attention_input(self, x):
        """x [B, S, 2H] = [embedding | hidden] -> (the attention's input, the residual)."""
        embeds, hidden = x[..., :self.hidden_size], x[..., self.hidden_size:]
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1), hidden


def fc_norms(hidden: int, eps: float, dtype: torch.dtype) -> nn.ModuleList:
    """EAGLE3.1's fc_norm: an RMSNorm of its own per captured hidden state."""
    return nn.ModuleList(RMSNorm(hidden, eps, dtype) for _ in range(AUX_INPUTS))


def fuse_aux(aux: torch.Tensor, fc: nn.Module, fc_norm: nn.ModuleList | None) -> torch.Tensor:
    """The three captured hidden states [B, S, 3H] -> fc's [B, S, H]; under fc_norm each H-wide chunk normed first."""
    if fc_norm is not None:
        chunks = aux.chunk(AUX_INPUTS, dim=-1)
        aux = torch.cat([norm(c) for norm, c in zip(fc_norm, chunks)], dim=-1)
    return fc(aux)


def draft_outputs(norm: nn.Module, hidden: torch.Tensor, norm_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output -> (lm_head's input, the hidden state the next draft step reads)."""
    normed = norm(hidden)
    return normed, normed if norm_output else hidden
