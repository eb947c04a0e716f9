"""Multi-head Latent Attention (MLA) with a latent KV cache.

Per token the cache holds one entry of width kv_lora_rank + qk_rope_head_dim (576 for Kimi-K2):
[c_kv (after kv_a_layernorm) | k_pe (after RoPE)], shared by all heads, with no per-head K or V.

Two ways to attend over it, giving the same result:
- naive: expand every cached c_kv through kv_b_proj into per-head K_nope and V, then ordinary attention.
  Used for prefill: there the cost is dominated by the S x T score matrix, and attending in the 128+64-wide
  per-head space is 3x cheaper than in the 512+64-wide latent space.
- absorbed: fold kv_b_proj's K half into the query (q_nope @ W_UK -> a 512-wide latent query), score it against
  the latent cache directly, and fold the V half into the output (latent context @ W_UV) before o_proj. Used for
  decode: nothing per-head is ever materialized for the T cached tokens, which is what makes long-context
  decode cheap (see scripts/bench_mla_decode.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import KimiK2Config
from ..parallel import ParallelContext
from .norm import RMSNorm
from .rope import apply_interleaved_rope, softmax_scale

# Kimi's modeling_deepseek.py builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps, so they
# use DeepseekV3RMSNorm's default; transformers' DeepseekV3 does the same. Matching it matters for configs whose
# rms_norm_eps is not 1e-6 (Kimi-K2-Thinking and K2.5 use 1e-5).
LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: KimiK2Config, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError("q_lora_rank is null: MLA without a query LoRA is not implemented (Kimi-K2 has one)")
        h, d = cfg.hidden_size, cfg.qk_head_dim
        self.n_heads = ctx.local(cfg.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = softmax_scale(cfg)
        heads = cfg.num_attention_heads
        # q_a_proj and kv_a_proj_with_mqa, or one layer computing both (the Neuron shell's fused, gathered pair),
        # registered where the checkpoint has them (formats.layout's order is the parameters')
        attention_a = ctx.attention_a(h, cfg.q_lora_rank, cfg.latent_dim, dtype)
        self._attention_a_names = tuple(attention_a)
        self.q_lora_rank, self.latent_dim = cfg.q_lora_rank, cfg.latent_dim
        self.add_module(self._attention_a_names[0], attention_a[self._attention_a_names[0]])
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype)
        self.q_b_proj = ctx.column(cfg.q_lora_rank, heads * d, dtype)
        for name in self._attention_a_names[1:]:
            self.add_module(name, attention_a[name])
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = ctx.column(cfg.kv_lora_rank, heads * (self.nope + self.v_dim), dtype)
        self.o_proj = ctx.row(heads * self.v_dim, h, dtype)

    def forward(self, x, positions, rope, latent_cache, absorbed: bool | None = None):
        """x [B, S, hidden]; positions [B, S] (rows may differ); rope = (cos, sin) for those positions;
        latent_cache [B, T_max, latent] for these rows, written in place at `positions`.
        Each query attends to cache slots 0..its own position. absorbed=None picks absorbed for S == 1."""
        q_nope, q_pe, entries = self.project(x, rope)
        _write_cache(latent_cache, positions, entries)
        t = int(positions.max()) + 1
        mask = torch.arange(t)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, T]
        return self.attend(q_nope, q_pe, latent_cache[:, :t], mask, absorbed)

    def project(self, x, rope):
        """The per-token half: queries (nope part, roped part) per local head and the new latent cache entries
        [B, S, kv_lora_rank + rope] = [normalized c_kv | roped k_pe]."""
        b, s, _ = x.shape
        cos, sin = rope
        q_a, kv_a = self._attention_a(x)
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(b, s, self.n_heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_interleaved_rope(q_pe, cos, sin)
        c_kv, k_pe = kv_a.split([self.rank, self.rope], dim=-1)
        k_pe = apply_interleaved_rope(k_pe[:, None], cos, sin)[:, 0]
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def _attention_a(self, x):
        """(q_a_proj(x) [.., q_lora_rank], kv_a_proj_with_mqa(x) [.., latent]), from the two layers or the fused one."""
        outs = [getattr(self, name)(x) for name in self._attention_a_names]
        return outs[0].split([self.q_lora_rank, self.latent_dim], dim=-1) if len(outs) == 1 else outs

    def attend(self, q_nope, q_pe, cache, mask, absorbed: bool | None = None):
        """Attention of the queries over latent entries cache [B, T, latent] under mask [B, 1, S, T] (True =
        visible), then o_proj. absorbed=None picks absorbed for a single query token (decode)."""
        b, _, s, _ = q_nope.shape
        if absorbed is None:
            absorbed = s == 1
        attend = self._attend_absorbed if absorbed else self._attend_naive
        out = attend(q_nope, q_pe, cache, mask)  # [B, heads, S, v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend_split(self, q_nope, q_pe, prior, prior_mask, active, active_mask):
        """Absorbed attention over two latent segments under one softmax, without concatenating them: the cached
        prior [B, T, latent] (mask [B, 1, S, T]) and this step's active entries [B, S, latent] (mask [B, 1, S, S]),
        then o_proj. The same as attend(absorbed=True) over their concatenation; decode on Neuron reads a
        T-long cache in place instead of copying it every layer and step."""
        b, _, s, _ = q_nope.shape
        out = self._absorbed(q_nope, q_pe, [prior, active], [prior_mask, active_mask])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _kv_b_halves(self):
        """kv_b_proj as per-head W_UK [heads, nope, rank] and W_UV [heads, v_dim, rank]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _attend_naive(self, q_nope, q_pe, cache, mask):
        c_kv, k_pe = cache.split([self.rank, self.rope], dim=-1)
        b, t, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe[:, None].transpose(-1, -2)
        return _softmax(scores * self.scale, mask) @ v

    def _attend_absorbed(self, q_nope, q_pe, cache, mask):
        return self._absorbed(q_nope, q_pe, [cache], [mask])

    def _absorbed(self, q_nope, q_pe, segments, masks):
        """Absorbed attention over latent segments [B, T_i, latent] (masks [B, 1, S, T_i]) under one softmax
        -> [B, heads, S, v_dim]."""
        w_uk, w_uv = self._kv_b_halves()
        q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)  # query in the latent space
        parts = [seg.split([self.rank, self.rope], dim=-1) for seg in segments]
        scores = _cat([_shared_kv_matmul(q_lat, c_kv.transpose(-1, -2))
                       + _shared_kv_matmul(q_pe, k_pe.transpose(-1, -2)) for c_kv, k_pe in parts])
        probs = _softmax(scores * self.scale, _cat(masks))
        ctx_lat = None  # [B, heads, S, rank]
        for p, (c_kv, _) in zip(probs.split([c.shape[1] for c, _ in parts], dim=-1), parts):
            ctx = _shared_kv_matmul(p, c_kv)
            ctx_lat = ctx if ctx_lat is None else ctx_lat + ctx
        return torch.einsum("bhsr,hvr->bhsv", ctx_lat, w_uv)


def _shared_kv_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, heads, S, K] @ b [B, K, N] (one matrix shared by all heads) -> [B, heads, S, N].
    Folding the heads into the rows makes one GEMM that streams the latent cache once; broadcasting b over heads
    instead reads the whole cache once per head (30x slower at 32K context on CPU)."""
    bsz, heads, s, k = a.shape
    return (a.reshape(bsz, heads * s, k) @ b).view(bsz, heads, s, b.shape[-1])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Along the key axis; a single part as is (torch.cat would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Softmax in float32 as modeling_deepseek.py does (it upcasts attention weights), then back to the compute dtype.
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return probs.to(scores.dtype)


def _write_cache(cache: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor) -> None:
    """cache [B, T_max, D]; positions [B, S]; entries [B, S, D] -> cache[b, positions[b, s]] = entries[b, s]."""
    if int(positions.max()) >= cache.shape[1]:
        raise ValueError(f"position {int(positions.max())} is beyond the KV cache length {cache.shape[1]}")
    rows = torch.arange(cache.shape[0])[:, None].expand_as(positions)
    cache[rows, positions] = entries.to(cache.dtype)
