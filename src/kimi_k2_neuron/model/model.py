"""KimiK2ForCausalLM: embeddings, decoder layers, final norm and lm_head.

Parameter names equal the checkpoint's tensor names (`model.layers.3.self_attn.q_a_proj.weight`, ...), so loading
needs no rename table, only dequantization (see kimi_k2_neuron.weights).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import KimiK2Config
from ..errors import KimiInputError
from ..parallel import SINGLE, ParallelContext
from ..quant import all_finite
from .decoder import DecoderLayer
from .norm import RMSNorm
from .rope import RotaryTable


class KimiK2Model(nn.Module):
    def __init__(self, cfg: KimiK2Config, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        self.embed_tokens = ctx.embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, ctx) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class KimiK2ForCausalLM(nn.Module):
    def __init__(self, cfg: KimiK2Config, dtype: torch.dtype = torch.float32, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.cfg, self.dtype, self.ctx = cfg, dtype, ctx
        self.model = KimiK2Model(cfg, dtype, ctx)
        self.lm_head = ctx.lm_head(cfg.hidden_size, cfg.vocab_size, dtype)
        self.rotary = RotaryTable(cfg)

    @torch.no_grad()
    def forward(self, input_ids, positions, latent_cache, absorbed=None, layer_hook=None):
        """input_ids/positions [B, S]; latent_cache: one [B, T_max, latent] tensor per layer (written in place).
        Returns float32 logits [B, S, vocab]. `layer_hook(idx)` is a context manager entered around each layer
        (the layer-streamed mode loads and frees the layer's weights there)."""
        rope = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            if layer_hook is None:
                x = layer(x, positions, rope, latent_cache[i], absorbed)
            else:
                with layer_hook(i):
                    x = layer(x, positions, rope, latent_cache[i], absorbed)
            _check_finite(x, f"model.layers.{i}")
        logits = self.lm_head(self.model.norm(x)).float()
        _check_finite(logits, "lm_head")
        return logits


def _check_finite(x: torch.Tensor, where: str) -> None:
    """Stop at the first module whose output is NaN or inf instead of carrying it to the logits: the weights were
    checked finite at load, so finite values overflowed the dtype's range there. One sum of the hidden state."""
    if not all_finite(x):
        raise KimiInputError(f"{where}: output went non-finite (NaN or inf) in the forward pass although every "
                             f"weight is finite; expected activations within the {x.dtype} range (try --dtype "
                             f"float32, or check the checkpoint's weight magnitudes)")
