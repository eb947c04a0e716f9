"""vLLM's prefix caching on Kimi-K2's latent cache (--prefix-caching): NxDI's block KV layout, vllm-neuron's slot
mappings and block tables, and the prefill attention over cached blocks.

vLLM's scheduler hashes full blocks of a request's tokens and gives a new request the blocks an earlier one already
filled (its num_computed_tokens); vllm-neuron sends the whole prompt, the slot of each position from there, and the
block table. NxDI's prefix-caching context encoding (contract.prefix_caching_kwargs: a graph per prefill bucket and
prefix bucket) cuts the prompt where its bucket starts, reads the blocks before that through the block table
(BlockKVCacheManager.get_cache: a row's blocks in table order, position p at index p) and writes the call's entries at
their slots (NXDI_CONTRACT.md: prefix-buckets, block-kv-manager). The decoder layer's prefill attention here lays
those cached positions and the call's own entries out by position and attends them in fixed key tiles
(MLAttention.attend_positions), the same computation for a prefill with nothing cached: a turn that reuses a prefix
computes each new token as the same prompt cold does. Decode reads the blocks through NxDI's get_cache into the
decode branch the contiguous cache uses (its mask: the positions before the token).

Pure helpers: torch and the core; the cache manager itself is latent_cache.py's.
"""

from __future__ import annotations

import torch

from kimi_k2_neuron.model.mla import BLOCK_KEY_TILE, positional_keys
from kimi_k2_neuron.runtime.block_cache import key_width


def key_tile(neuron_config) -> int:
    """The model's key tile: BLOCK_KEY_TILE, or a context bucket below it (tiny models)."""
    return min(BLOCK_KEY_TILE, neuron_config.max_context_length)


def prefill_attention(attn, q_nope, q_pe, entries, prefix, positions, tile: int) -> torch.Tensor:
    """One context-encoding call's attention: prefix [B, P, latent] (the prefix bucket's positions read through the
    block table; None with nothing cached), entries [B, S, latent] of positions[:, 0] on (NxDI pads the call after its
    real tokens). Every key at a position up to the query's is visible: the prefix holds positions before the call's
    first, which NxDI's prefix mask shows exactly (its attention mask: the cached length)."""
    cached = 0 if prefix is None else prefix.shape[1]
    keys = positional_keys(entries[:, :0] if prefix is None else prefix, entries, positions[:, :1],
                           key_width(cached + entries.shape[1], tile))
    return attn.attend_positions(q_nope, q_pe, keys, positions, tile)
