# SPDX-License-Identifier: Apache-2.0
"""The MoE router the Neuron model gives NxD (NxDRouter) against transformers' DeepseekV3TopkRouter, the noaux_tc
gate as transformers writes it (an implementation independent of this port): the correction bias ranks the experts
and nothing else. NxDRouter lives in the Neuron model's module, so these tests need NxD and NxDI importable, and
with them transformers (skipped, with the missing packages named, elsewhere)."""

import pytest
import torch

from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict
from kimi_k2_neuron.config import KimiK2Config

EXPERTS, TOP_K, TOKENS = 16, 4, 24


def transformers_gate(x, weight, bias, cfg):
    """(expert ids [T, k], combine weights [T, k]) of transformers' DeepseekV3TopkRouter with these weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gate = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=cfg.hidden_size, n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor))
    with torch.no_grad():
        gate.weight.copy_(weight)
        gate.e_score_correction_bias.copy_(bias)
        return gate(x)[-2:]  # (indices, weights); transformers 5 puts the router logits first


@pytest.fixture(scope="module")
def nxd_router(shell):
    """modeling.NxDRouter, or a skip naming the missing Neuron packages."""
    try:
        from kimi_k2_neuron.neuron.modeling import NxDRouter
    except ImportError as e:
        pytest.skip(str(e).split(";")[0] + ": " + ", ".join(shell.sdk.missing_neuron_packages()))
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
    want_ids, want_weights = transformers_gate(x, router.weight, router.e_score_correction_bias, cfg)
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
