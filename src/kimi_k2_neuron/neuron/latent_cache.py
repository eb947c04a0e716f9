"""The latent KV cache in NxDI's cache managers: the [c_kv | k_pe] entry in the K slot, V 1 wide; the flash-decoding
decode write that holds it (NXDI_CONTRACT.md: latent-kv-head, latent-v-slot, fd-write); and NxDI's block layout for
vLLM's prefix caching (NXDI_CONTRACT.md: block-kv-manager)."""

from __future__ import annotations


from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed_inference.modules.kvcache.block_kv_cache_manager import BlockKVCacheManager  # noqa: E402
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager  # noqa: E402

from kimi_k2_neuron.errors import env_int  # noqa: E402
from kimi_k2_neuron.parallel import slot_of  # noqa: E402


class LatentKVCacheManager(KVCacheManager):
    """A 1-wide V, not a copy of K that doubles the cache (NXDI_CONTRACT.md: latent-v-slot, private-members)."""

    def _init_kv_shape(self, config, layer_to_cache_size_mapping=None):
        super()._init_kv_shape(config, layer_to_cache_size_mapping)
        if layer_to_cache_size_mapping:
            raise ValueError("Kimi-K2 has one cache length for every layer (no layer_to_cache_size_mapping)")
        if self.is_kv_cache_tiled or self.k_cache_transposed:
            raise ValueError("the latent cache supports neither kv_cache_tiling nor k_cache_transposed")
        self.v_shape = (*self.v_shape[:-1], 1)
        _check_separate_kv()

    def update_kv_by_layer_id(self, idx, is_for_context_encoding, seq_ids, position_ids, kv_per_layer, seq_len,
                              **kwargs):
        """The flash-decoding decode write scatters V with K's index, which the 1-wide V slot cannot take: here each
        with its own index at NxDI's slot, V's zeros too, so that neither output is its input unchanged (an aliased
        buffer no CPU trace exercises) (NXDI_CONTRACT.md: fd-write); the rest is NxDI's (which passes every argument
        by keyword, kv_active_mask and kvcache_buffer among kwargs)."""
        if is_for_context_encoding or not self.flash_decoding_enabled:
            return super().update_kv_by_layer_id(idx, is_for_context_encoding, seq_ids, position_ids, kv_per_layer,
                                                 seq_len, **kwargs)
        kv_active_mask = kwargs.get("kv_active_mask")
        k_cache, v_cache = self._fetch_cache(idx, kwargs.get("kvcache_buffer"))
        # the owner writes position p at slot p // G; the others into the last slot, which no mask exposes
        slot = torch.where(kv_active_mask == 1, slot_of(position_ids, self.num_cores_per_group), seq_len - 1)
        slot = slot.view(-1, 1, slot.shape[-1], 1).to(torch.int64)
        return tuple(torch.scatter(cache, 2, slot.expand_as(latest), latest.to(cache.dtype))
                     for cache, latest in zip((k_cache, v_cache), kv_per_layer))


class LatentBlockKVCacheManager(BlockKVCacheManager):
    """NxDI's prefix-caching block layout with the latent in K and a 1-wide V: per layer [pa_num_blocks + 1,
    pa_block_size, 1, latent], the last block taking padded writes. Untiled: NxDI tiles a short table's blocks to
    spare its attention kernels a V transpose, and they do not compute MLA (NXDI_CONTRACT.md: block-kv-manager).
    NxDI's reads (get_cache: a row's blocks in table order) and writes (update_cache: at the slot mapping) serve it
    as they are."""

    def _init_kv_shape(self, config, layer_to_cache_size_mapping=None):
        nc = config.neuron_config
        if layer_to_cache_size_mapping or not nc.is_prefix_caching:
            raise ValueError("the latent cache has the block layout for prefix caching only, one length for every "
                             "layer")
        _check_separate_kv()
        shape = (nc.pa_num_blocks + self._NUM_EXTRA_RESERVED_BLOCK, nc.pa_block_size,
                 self._get_num_kv_heads_per_rank(config))
        self.k_shape, self.v_shape = (*shape, self._get_hidden_dim_per_head(config)), (*shape, 1)


def _check_separate_kv() -> None:
    """A combined K+V buffer needs K and V of one numel (NXDI_CONTRACT.md: combined-kv-allocation)."""
    if env_int("NEURON_COMBINE_KV_ALLOCATIONS", 0):
        raise ValueError("NEURON_COMBINE_KV_ALLOCATIONS=1 needs K and V of one shape; the latent cache's V slot is 1 "
                         "wide. Unset it.")
