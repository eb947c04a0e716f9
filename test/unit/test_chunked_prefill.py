"""kimi_k2_neuron.neuron.chunked_prefill's pure helpers, without NxD/NxDI: the plan of a prefill in chunks, the chunk's
inputs and masks against the one-shot causal mask, the row write against an element-by-element one, and the order in
which the driver's calls are put back into rows. The submodel itself runs through the real NxDI in
test/nxdi_cpu/test_chunk_submodel.py."""

from __future__ import annotations

import pytest
import torch

from kimi_k2_neuron.neuron import chunked_prefill as cp
from kimi_k2_neuron.parallel import stripe


@pytest.mark.parametrize("length,chunk,starts", [(28, 8, [0, 8, 16, 24]), (8, 8, [0]), (9, 8, [0, 8]), (1, 8, [0])])
def test_chunk_starts(length, chunk, starts):
    assert cp.chunk_starts(length, chunk) == starts


def test_chunk_inputs_pad_the_last_chunk_with_the_next_positions():
    ids = torch.arange(100, 128)
    got_ids, pos, mask = cp.chunk_inputs(ids, 24, 28, 8, pad_id=0)
    assert got_ids.tolist() == [[124, 125, 126, 127, 0, 0, 0, 0]]
    assert pos.tolist() == [list(range(24, 32))]
    assert mask.shape == (1, 28) and bool(mask.all())


@pytest.mark.parametrize("start,n,cache", [(0, 4, 16), (8, 4, 16), (24, 8, 32)])
def test_prior_then_active_mask_is_the_one_shot_causal_mask(start, n, cache):
    """Over the cache before the chunk and the chunk itself, query p sees exactly the positions <= p."""
    positions = torch.arange(start, start + n)[None]
    prior, active = cp.chunk_masks(positions, cache)
    assert prior.shape == (1, 1, n, cache) and active.shape == (1, 1, n, n)
    assert not prior[..., start:].any()  # nothing at or after the chunk's first position comes from the cache
    keys = torch.arange(start + n)
    want = keys[None, :] <= positions[0, :, None]
    assert torch.equal(torch.cat([prior[0, 0, :, :start], active[0, 0]], dim=-1), want)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("start,n", [(0, 8), (8, 8), (16, 4), (24, 8)])
def test_sharded_chunk_masks_element_by_element(group, start, n):
    """Rank r of a KV group of G: slot s holds position s*G + r; of the chunk it keeps entries r, r + G, ... Every
    (query, key) pair is checked against positions: the prior mask shows the slots whose position precedes the
    chunk, the active one the owned entries at or before the query. At G = 1 they are the replicated masks."""
    cache = 32 // group + 3  # a few reserve slots past the row
    positions = torch.arange(start, start + n)[None]
    for r in range(group):
        prior, active = cp.chunk_masks(positions, cache, group, torch.tensor([r]))
        assert prior.shape == (1, 1, n, cache) and active.shape == (1, 1, n, n // group)
        owned = cp.owned_positions(positions, group, torch.tensor([r]))
        assert owned.tolist() == [[p for p in range(start, start + n) if p % group == r]]
        for i in range(n):
            q = start + i
            for s in range(cache):
                assert bool(prior[0, 0, i, s]) == (s * group + r < start), (r, i, s)
            for j, k in enumerate(owned[0].tolist()):
                assert bool(active[0, 0, i, j]) == (k <= q), (r, i, j)
        if group == 1:
            want_prior, want_active = cp.chunk_masks(positions, cache)
            assert torch.equal(prior, want_prior) and torch.equal(active, want_active)
            assert torch.equal(active[0, 0], torch.ones(n, n, dtype=torch.bool).tril())


@pytest.mark.parametrize("group", [1, 2, 4])
def test_every_key_is_visible_on_exactly_one_rank(group):
    """attend_sharded's contract: over the group's ranks, each query sees each earlier-or-equal position once, as
    the one-shot causal mask does."""
    start, n, cache = 16, 8, 32 // group + 2
    positions = torch.arange(start, start + n)[None]
    seen = torch.zeros(n, start + n, dtype=torch.int64)
    for r in range(group):
        prior, active = cp.chunk_masks(positions, cache, group, r)
        held = torch.arange(cache) * group + r
        for s in range(cache):
            if held[s] < start + n:
                seen[:, held[s]] += prior[0, 0, :, s].long()
        for j, k in enumerate(cp.owned_positions(positions, group, r)[0].tolist()):
            seen[:, k] += active[0, 0, :, j].long()
    want = (torch.arange(start + n)[None, :] <= positions[0, :, None]).long()
    assert torch.equal(seen, want)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_owned_slots_are_the_owned_positions_over_the_group(group):
    """Every rank writes its j-th owned entry (position start + r + G*j) at slot position // G."""
    positions = torch.arange(24, 32)[None]
    slots = cp.owned_slots(positions, group)
    for r in range(group):
        owned = cp.owned_positions(positions, group, r)
        assert torch.equal(slots, owned // group)
        assert stripe(8, group, r).tolist() == list(range(r, 8, group))


def test_last_real_index():
    pos = torch.tensor([[16, 17, 18, 19, 20, 21, 22, 23]])
    assert cp.last_real_index(torch.ones(1, 21), pos).tolist() == [[4]]  # position 20 is slot 4
    assert cp.last_real_index(torch.ones(1, 24), pos).tolist() == [[7]]
    # the wrapper pads the mask with zeros to the bucket
    padded = torch.cat([torch.ones(1, 21), torch.zeros(1, 11)], dim=-1)
    assert cp.last_real_index(padded, pos).tolist() == [[4]]


def test_hidden_rows_puts_the_drivers_calls_back_into_rows():
    h = 3
    one_call = torch.randn(2, 6, h)
    assert [r.shape[0] for r in cp.hidden_rows([one_call], [6, 4], None)] == [6, 4]
    # row 0: 10 tokens = CTE + 2 chunks of 4; row 1: 3 tokens = its CTE call only
    calls = [torch.full((1, 4, h), float(i)) for i in range(4)]
    rows = cp.hidden_rows(calls, [10, 3], 4)
    assert rows[0][:, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 2
    assert rows[1][:, 0].tolist() == [3.0] * 3
    with pytest.raises(RuntimeError, match="prefill calls"):
        cp.hidden_rows(calls[:3], [10, 3], 4)
