"""modeling.py's pieces that answer NxD/NxDI's contracts, one at a time: the router NxD's MoE calls, and the masks of
a decode step (the whole model: test_to_cpu.py, test_logits.py)."""

import pytest
import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron.modeling import NxDRouter, decode_masks
from kimi_k2_neuron.testing.tiny_checkpoint import tiny_config_dict


def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


# -- the router in NxD's contract -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_affinities_at_the_chosen_experts_equal_the_core_router(n_group, topk_group, dtype):
    cfg = tiny_cfg(n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group)
    g = torch.Generator().manual_seed(0)
    router = NxDRouter(cfg)
    router.weight.data.copy_(torch.randn(32, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5)
    router.e_score_correction_bias.data.copy_(0.3 * torch.randn(32, generator=g))
    x = torch.randn(2, 5, cfg.hidden_size, generator=g).to(dtype)  # [B, S, H] as MoE passes it
    logits, aff, ids = router(x)
    core_w, core_ids = super(NxDRouter, router).forward(x.reshape(-1, cfg.hidden_size))
    assert torch.equal(ids, core_ids) and aff.shape == (10, 32) and aff.dtype == dtype
    torch.testing.assert_close(aff.gather(1, ids), core_w.to(dtype))
    off = torch.ones_like(aff, dtype=torch.bool).scatter(1, ids, False)
    assert (aff[off] == 0).all()
    torch.testing.assert_close(logits, x.reshape(-1, cfg.hidden_size).float() @ router.weight.T)
    # ExpertMLPsV2 masks to the chosen experts and, with normalize_top_k_affinities False, changes nothing
    # (expert_mlps_v2.py:283-319): rows still sum to routed_scaling_factor.
    mask = torch.zeros_like(aff, dtype=torch.float64).scatter(1, ids, 1.0)
    torch.testing.assert_close(aff.masked_fill(mask == 0, 0), aff)
    torch.testing.assert_close(aff.float().sum(1), torch.full((10,), cfg.routed_scaling_factor),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)


# -- decode masks and NxDI's prefill/decode flow ----------------------------------------------------------------

def prior_mask_for_positions(positions: torch.Tensor, cache_len: int) -> torch.Tensor:
    """The mask NxDI builds for rows decoding at `positions` [B]: [B, 1, 1, cache_len], True on [0, pos) (what
    hf_adapter's attention mask becomes in _create_simple_attn_mask)."""
    return (torch.arange(cache_len)[None, :] < positions[:, None])[:, None, None, :]


def test_decode_masks_are_the_cached_prefix_plus_the_current_token():
    prior_mask = prior_mask_for_positions(torch.tensor([2, 5]), 6)
    prior, active = decode_masks(prior_mask, 1)
    assert prior.tolist() == [[[[1, 1, 0, 0, 0, 0]]], [[[1, 1, 1, 1, 1, 0]]]] and active.tolist() == [[[[1]]]] * 2
    # the same as the core's rule for a token at position p: it sees cache slots 0..p (mla.py forward)
    for b, p in enumerate([2, 5]):
        core_visible = torch.arange(6) <= p
        core_visible[p] = False  # slot p is not written yet on Neuron: the token itself is the active segment
        assert torch.equal(prior[b, 0, 0], core_visible)
