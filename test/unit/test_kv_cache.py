"""runtime/kv_cache.py: the latent cache's slots and which positions each rank of a KV group holds (NxDI's
flash-decoding layout: position p on the rank at index p % G of its group, slot p // G)."""

import pytest
import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.kv_cache import LatentCache
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict

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


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_the_position_map_is_one_map(group):
    """parallel.py's owner/slot of a position, the position a rank's slot holds and the entries a rank keeps of a
    stripe-aligned run agree: every position is held once, by its owner, at its slot."""
    from kimi_k2_neuron.parallel import owner_of, slot_of, slot_positions, stripe
    from kimi_k2_neuron.placement import slots_for

    positions = torch.arange(40)
    owners, slots = owner_of(positions, group), slot_of(positions, group)
    held = {r: slot_positions(slots_for(40, group), group, r) for r in range(group)}
    for p, r, s in zip(positions.tolist(), owners.tolist(), slots.tolist()):
        assert held[r][s] == p
    for r in range(group):  # a run of 16 new positions from 24: rank r keeps those it owns, in order
        assert torch.equal(positions[24:40][stripe(16, group, r)], positions[24:40][owners[24:40] == r])
