"""The latent cache in blocks (runtime/block_cache.py) and attention through a block table (model/mla.py
attend_positions, positional_keys), against the contiguous latent cache the core runner is tested with.

- Slots, write and gather: entries written through a shuffled block table and gathered back are the contiguous
  cache's, exactly; padded slots land in the reserved block only.
- A prefill through blocks equals the contiguous model's logits (the core runner, tested against transformers), to
  float32 rounding: the block path's attention is tiled, the contiguous one is not.
- Warm == cold, exactly in float32: one attention layer prefilling a prompt whose first P positions sit in blocks
  another prompt's prefill wrote (P below, at and above a block boundary, from any offset) gives the cold prefill's
  output bit for bit; so do a prefill spread over several key tiles and one whose keys end in more tiles. Calls of
  12 or more query rows: MKL's float32 GEMM gives a row a result that depends on its neighbours below that (the
  Neuron graphs' prefill buckets are larger).
"""

import pytest
import torch

from kimi_k2_neuron.model.mla import positional_keys
from kimi_k2_neuron.runtime import block_cache
from kimi_k2_neuron.runtime.block_cache import PAD_SLOT, BlockLatentCache, BlockView
from kimi_k2_neuron.runtime.runner import CpuRunner

BS = 8


def test_written_through_a_shuffled_table_and_gathered_back_is_the_contiguous_cache():
    g = torch.Generator().manual_seed(0)
    pool = torch.zeros(13, BS, 5)
    table = torch.tensor([[7, 2, 11, 0], [3, 9, 1, 5]])
    entries = torch.randn(2, 4 * BS, 5, generator=g)
    positions = torch.arange(4 * BS).expand(2, -1)
    slots = block_cache.slots_of(table, positions, BS)
    block_cache.write(pool, slots, entries)
    torch.testing.assert_close(block_cache.gather(pool, table), entries, rtol=0, atol=0)
    assert pool[12].abs().sum() == 0  # the reserve took nothing
    padded = torch.tensor([[PAD_SLOT, 3 * BS + 1]])
    block_cache.write(pool, padded, torch.ones(1, 2, 5))
    assert pool[12, 0].eq(1).all() and pool[3, 1].eq(1).all()


def test_a_table_naming_a_block_outside_the_pool_is_refused(tiny):
    cfg = CpuRunner(tiny["bf16"]).cfg
    cache = BlockLatentCache(cfg, blocks=4, block_size=BS, dtype=torch.float32)
    with pytest.raises(ValueError, match="the pool has 0..3"):
        cache.layers(torch.tensor([[0, 4]]))


def test_positional_keys_place_the_cached_prefix_then_the_calls_entries():
    prefix = torch.arange(6.0).view(1, 6, 1).expand(1, 6, 2)
    entries = 100 + torch.arange(3.0).view(1, 3, 1).expand(1, 3, 2)
    keys = positional_keys(prefix, entries, torch.tensor([[4]]), 10)
    assert keys[0, :, 0].tolist() == [0, 1, 2, 3, 100, 101, 102, 0, 0, 0]
    cold = positional_keys(prefix[:, :0], entries, torch.tensor([[0]]), 4)
    assert cold[0, :, 0].tolist() == [100, 101, 102, 0]


def test_a_prefill_through_blocks_equals_the_contiguous_models_logits(tiny):
    runner = CpuRunner(tiny["fp8"])
    row = [(37 * i + 11) % 500 + 5 for i in range(30)]
    want = runner.logits([row])[0]
    cache = BlockLatentCache(runner.cfg, blocks=6, block_size=BS, dtype=torch.float32, key_tile=16)
    ids, pos = torch.tensor([row]), torch.arange(len(row))[None]
    got = runner.forward(ids, pos, cache.layers(torch.tensor([[4, 0, 5, 2]])))[0]
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def _layer_and_inputs(tiny, n: int):
    runner = CpuRunner(tiny["fp8"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, runner.cfg.hidden_size, generator=g)
    return runner, runner.model.model.layers[1].self_attn, x


def _attend(runner, attn, x, start, stop, view):
    pos = torch.arange(start, stop)[None]
    return attn(x[:, start:stop], pos, runner.model.rotary(pos), view)


@pytest.mark.parametrize("p", [BS * 2 - 1, BS * 2, BS * 2 + 1, 13])
@pytest.mark.parametrize("key_tile", [16, 64])
def test_a_prefill_after_cached_blocks_gives_the_cold_prefill_bit_for_bit(tiny, p, key_tile):
    """Another prompt sharing the first p positions prefilled them (its tail differs); this prompt reads the blocks
    holding them (the last one partly: its own positions written over the other's) and prefills from p."""
    n = 44
    runner, attn, x = _layer_and_inputs(tiny, n)
    cold = BlockLatentCache(runner.cfg, blocks=8, block_size=BS, dtype=torch.float32, key_tile=key_tile)
    want = _attend(runner, attn, x, 0, n, cold.layers(torch.tensor([[0, 1, 2, 3, 4, 5]]))[1])
    warm = BlockLatentCache(runner.cfg, blocks=12, block_size=BS, dtype=torch.float32, key_tile=key_tile)
    other = x.clone()
    other[:, p:] = torch.randn(1, n - p, x.shape[-1], generator=torch.Generator().manual_seed(2))
    table = torch.tensor([[9, 3, 7, 1, 10, 2]])
    _attend(runner, attn, other, 0, n, warm.layers(table)[1])
    got = _attend(runner, attn, x, p, n, warm.layers(table)[1])
    assert torch.equal(got, want[:, p:])


def test_keys_past_a_querys_position_change_nothing(tiny):
    """The same call over a table of 6 blocks and of 12 (three more key tiles, all after every query)."""
    n = 24
    runner, attn, x = _layer_and_inputs(tiny, n)
    outs = []
    for blocks in (6, 12):
        cache = BlockLatentCache(runner.cfg, blocks=12, block_size=BS, dtype=torch.float32, key_tile=16)
        outs.append(_attend(runner, attn, x, 0, n, cache.layers(torch.arange(blocks)[None])[1]))
    assert torch.equal(outs[0], outs[1])


def test_two_sequences_sharing_blocks_read_the_same_entries(tiny):
    runner, attn, x = _layer_and_inputs(tiny, 32)
    cache = BlockLatentCache(runner.cfg, blocks=8, block_size=BS, dtype=torch.float32, key_tile=16)
    _attend(runner, attn, x, 0, 32, cache.layers(torch.tensor([[0, 1, 2, 3]]))[1])
    views = BlockView(cache.pools[1], torch.tensor([[0, 1, 4, 5], [0, 1, 6, 7]]), 16).keys()
    assert torch.equal(views[0, :2 * BS], views[1, :2 * BS])
