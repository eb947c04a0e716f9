"""vLLM's prefix caching on Kimi-K2's latent cache (--prefix-caching): NxDI's block KV layout, vllm-neuron's slot
mappings and block tables, and the prefill attention over cached blocks.

vLLM's scheduler hashes full blocks of a request's tokens and gives a new request the blocks an earlier one already
filled (its num_computed_tokens); vllm-neuron sends the whole prompt, the slot of each position from there, and the
block table. NxDI's prefix-caching context encoding (contract.derived_fields: a graph per prefill bucket and
prefix bucket) cuts the prompt where its bucket starts, reads the blocks before that through the block table
(BlockKVCacheManager.get_cache: a row's blocks in table order, position p at index p) and writes the call's entries at
their slots (NXDI_CONTRACT.md: prefix-buckets, block-kv-manager). The decoder layer's prefill attention here lays
those cached positions and the call's own entries out by position and attends them in fixed key tiles
(MLAttention.attend_positions), the same computation for a prefill with nothing cached: a turn that reuses a prefix
computes each new token as the same prompt cold does. Decode reads the blocks through NxDI's get_cache into the
decode branch the contiguous cache uses (its mask: the positions before the token).

With --prefill-chunk N the largest prefill bucket is N, and a prompt with more than N uncached tokens is prefilled N
at a time, each call a prefill over the blocks the calls before it wrote: the graphs stay the size of N, and a long
cold prompt costs chunks as a long warm one does (the driver below, in front of NxDI's own dispatch).

Torch and the core; the cache manager is latent_cache.py's, the driver calls NxDI's methods it is handed. Last, the
parts the model and the application are built with (PrefixCachingModel, PrefixCaching), which modeling.py composes.
"""

from __future__ import annotations

import torch

from kimi_k2_neuron.model.mla import positional_keys
from kimi_k2_neuron.runtime.block_cache import key_tile_for, key_width

from .contract import run_spec

# The decoder layer's attention in a prefix-caching context-encoding submodel (base.KimiK2DecoderLayer)
BLOCK_PREFILL = "block-prefill"


def prefill_attention(attn, q_nope, q_pe, entries, past, positions) -> torch.Tensor:
    """One context-encoding call's attention: past, NxDI's (K, V) of the prefix bucket's positions read through the
    block table (None with nothing cached), K [B, 1, P, latent]; entries [B, S, latent] of positions[:, 0] on (NxDI
    pads the call after its real tokens). Every key at a position up to the query's is visible: the prefix holds
    positions before the call's first, which NxDI's prefix mask shows exactly (its attention mask: the cached length).
    The key tile is the model's (key_tile_for: from its seq_len), the same for every bucket."""
    prefix = None if past is None else past[0][:, 0]
    tile = key_tile_for(attn.ctx.config.neuron_config.seq_len)
    cached = 0 if prefix is None else prefix.shape[1]
    keys = positional_keys(entries[:, :0] if prefix is None else prefix, entries, positions[:, :1],
                           key_width(cached + entries.shape[1], tile))
    return attn.attend_positions(q_nope, q_pe, keys, positions, tile)


# -- the chunk driver (--prefill-chunk with --prefix-caching) -----------------------------------------------------

def takes(app, input_ids, position_ids, block_args) -> bool:
    """A prefill with more uncached tokens than the chunk; block_args: (slot_mapping, block_table, full_context_lens,
    computed_context_lens) as vllm-neuron passes them."""
    spec = run_spec(app.config)
    chunk = spec.layout.prefill_chunk
    if not (chunk and spec.prefix_caching and input_ids.shape[-1] > 1 and app._is_prefill(position_ids)):
        return False
    _, _, full, computed = block_args
    return bool(((full - computed) > chunk).any())


def prefill(app, base, inputs, rest, block_args):
    """Row by row, N tokens a call from each row's first uncached position: NxDI's prefix-caching dispatch (`base`,
    its _get_model_outputs) on the prompt up to the chunk's end, told the positions before it are computed, with the
    chunk's slots; in CPU mode the cache shared after every call, as NxDI does after one. inputs: (input_ids,
    attention_mask, position_ids, seq_ids, sampling_params); rest: NxDI's (prev_hidden, adapter_ids, medusa_args,
    llava_args). -> (each row's last output, then the cache on CPU; is_run_on_neuron)."""
    input_ids, attention_mask, position_ids, seq_ids, sampling_params = inputs
    chunk = run_spec(app.config).layout.prefill_chunk
    slot_mapping, block_table, full, computed = block_args
    nc = app.neuron_config
    # the sampled tokens, then the logits with output_logits under on-device sampling; in CPU mode the cache follows
    front = 2 if nc.on_device_sampling_config is not None and nc.output_logits else 1
    results, out, on_neuron = [], None, False
    for b in range(input_ids.shape[0]):
        row, first, length = slice(b, b + 1), int(computed[b]), int(full[b])
        for start in range(first, length, chunk):
            end = min(start + chunk, length)
            slots = slot_mapping[row, start - first:end - first]
            out, on_neuron = base(input_ids[row, :end], attention_mask[row, :end], position_ids[row, :end],
                                  seq_ids[row], sampling_params[row], *rest, slots, block_table[row],
                                  torch.tensor([[end]]), torch.tensor([[start]]))
            if not on_neuron:
                app._copy_past_key_values(out)
        results.append([out] if torch.is_tensor(out) else list(out[:front]))
    heads = [torch.cat(parts, dim=0) for parts in zip(*results)]
    if on_neuron:
        return (heads[0] if front == 1 else heads), True
    return [*heads, *out[front:]], False


# -- the parts of the model and the application (modeling.py composes them) ----------------------------------------

class PrefixCachingModel:
    """The model's part, with --prefix-caching: the latent cache in NxDI's block layout, and the context-encoding
    submodel's decoder layers attending over cached blocks (BLOCK_PREFILL). Decode reads the blocks through NxDI's
    get_cache into the contiguous cache's decode path."""

    def attention_kind(self, config) -> str:
        nc = config.neuron_config
        return BLOCK_PREFILL if nc.is_prefix_caching and nc.is_prefill_stage else super().attention_kind(config)

    def cache_manager(self, config):
        if not config.neuron_config.is_block_kv_layout:
            return super().cache_manager(config)
        from .latent_cache import LatentBlockKVCacheManager

        return LatentBlockKVCacheManager(config, num_kv_head=self.num_key_value_heads)


class PrefixCaching:
    """The application's part, with --prefix-caching and --prefill-chunk: a prefill with more uncached tokens than
    the chunk sent to the chunk driver above, each chunk through NxDI's own prefix-caching dispatch."""

    def _get_model_outputs(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args, **kwargs):
        """NXDI_CONTRACT.md: private-members, prefix-buckets."""
        if takes(self, input_ids, position_ids, args[4:8]):
            return prefill(self, super()._get_model_outputs, (input_ids, attention_mask, position_ids, seq_ids,
                                                              sampling_params), args[:4], args[4:8])
        return super()._get_model_outputs(input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args,
                                          **kwargs)
