# SPDX-License-Identifier: Apache-2.0
"""The MoE router the Neuron model gives NxD (NxDRouter) against DeepSeek-V3's noaux_tc gate as Kimi-K2's
modeling_deepseek.py computes it, written out here: the correction bias ranks the experts and nothing else.
NxDRouter lives in the Neuron model's module, so these tests need NxD and NxDI importable (skipped, with the
missing packages named, elsewhere)."""

import pytest
import torch

from kimi_k2_neuron.testing.tiny_checkpoint import tiny_config_dict
from kimi_k2_neuron.config import KimiK2Config

EXPERTS, TOP_K, TOKENS = 16, 4, 24


def reference_gate(x, weight, bias, cfg):
    """(expert ids [T, k], combine weights [T, k]): float32 sigmoid scores; biased scores pick topk_group groups (a
    group scores the sum of its two best) and then the experts; the weights are the chosen experts' unbiased scores,
    normalized when norm_topk_prob, times routed_scaling_factor."""
    scores = torch.sigmoid(x.float() @ weight.T)
    biased = scores + bias
    per_group = biased.view(len(x), cfg.n_group, -1)
    best = per_group.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
    keep = torch.zeros(len(x), cfg.n_group, dtype=torch.bool).scatter(1, best, True)
    ids = per_group.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1).topk(cfg.num_experts_per_tok).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


@pytest.fixture(scope="module")
def nxd_router(shell):
    """modeling.NxDRouter, or a skip naming the missing Neuron packages."""
    try:
        from kimi_k2_neuron.neuron.modeling import NxDRouter
    except ImportError as e:
        pytest.skip(str(e).split(";")[0] + ": " + ", ".join(shell.contract.missing_neuron_packages()))
    return NxDRouter


def _router(nxd_router, n_group=1, topk_group=1, norm=True, seed=0):
    cfg = KimiK2Config.from_dict({**tiny_config_dict("bf16"), "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                                  "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": norm})
    router = nxd_router(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.1)
        router.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=g) * 0.05)
    return cfg, router, torch.randn(TOKENS, cfg.hidden_size, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (1, 1, False)])
def test_nxd_router_is_the_noaux_tc_gate(nxd_router, n_group, topk_group, norm):
    cfg, router, x = _router(nxd_router, n_group, topk_group, norm)
    logits, affinities, ids = router(x[None])  # NxD's contract: hidden [B, S, H] -> three [T, ...] tensors
    want_ids, want_weights = reference_gate(x, router.weight, router.e_score_correction_bias, cfg)
    assert logits.shape == (TOKENS, EXPERTS) and affinities.dtype == x.dtype  # cast to the hidden dtype, as NxD's
    assert [set(r) for r in ids.tolist()] == [set(r) for r in want_ids.tolist()]
    chosen = torch.zeros(TOKENS, EXPERTS).scatter(1, want_ids, want_weights)
    torch.testing.assert_close(affinities.float(), chosen.to(torch.bfloat16).float())  # zero off the chosen experts


def test_the_correction_bias_chooses_but_does_not_weigh(nxd_router):
    """A large bias on expert 3 puts it in every token's choice, with the weight of its plain sigmoid score."""
    cfg, router, x = _router(nxd_router, norm=False)
    with torch.no_grad():
        router.e_score_correction_bias[3] = 10.0
    _, affinities, ids = router(x[None])
    assert (ids == 3).any(-1).all()
    unbiased = torch.sigmoid(x.float() @ router.weight.T)[:, 3] * cfg.routed_scaling_factor
    torch.testing.assert_close(affinities[:, 3].float(), unbiased.to(torch.bfloat16).float())
