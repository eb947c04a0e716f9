"""runtime/kv_cache.py: the latent cache's slots and which positions each rank of a KV group holds (NxDI's
flash-decoding layout: position p on the rank at index p % G of its group, slot p // G)."""

import pytest
import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.kv_cache import LatentCache
from kimi_k2_neuron.testing.tiny_checkpoint import tiny_config_dict

CFG = KimiK2Config.from_dict(tiny_config_dict("bf16"))


def test_a_replicated_cache_holds_every_position():
    c = LatentCache(CFG, batch=2, max_len=10, dtype=torch.float32)
    assert c.slots == 10 and c.slot_positions().tolist() == list(range(10))
    assert [t.shape for t in c.layers] == [(2, 10, CFG.latent_dim)] * CFG.num_hidden_layers


def test_each_rank_of_a_group_holds_every_gth_position():
    held = [LatentCache(CFG, 1, 10, torch.float32, group=4, rank=r).slot_positions().tolist() for r in range(4)]
    assert held == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]  # 10 and 11 are past max_len: never written
    covered = sorted(p for positions in held for p in positions if p < 10)
    assert covered == list(range(10))  # every position on exactly one rank
    assert LatentCache(CFG, 1, 10, torch.float32, group=4, rank=0).layers[0].shape == (1, 3, CFG.latent_dim)


def test_a_rank_outside_its_group_is_refused():
    with pytest.raises(ValueError, match="rank 4 is not an index in a KV group of 4"):
        LatentCache(CFG, 1, 8, torch.float32, group=4, rank=4)
