"""noaux_tc routing vs transformers' DeepseekV3TopkRouter."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.model.router import NoAuxTcRouter


def make_pair(n_experts, top_k, n_group, topk_group, norm, seed=0, bias_scale=0.5):
    raw = {**tiny_config_dict("bf16"), "n_routed_experts": n_experts, "num_experts_per_tok": top_k,
           "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": norm}
    ours = NoAuxTcRouter(KimiK2Config.from_dict(raw))
    hf = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=raw["hidden_size"], n_routed_experts=n_experts, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=raw["routed_scaling_factor"]))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_experts, raw["hidden_size"], generator=g) / raw["hidden_size"] ** 0.5
    bias = bias_scale * torch.randn(n_experts, generator=g)
    ours.weight.data.copy_(w)
    ours.e_score_correction_bias.data.copy_(bias)
    hf.weight.data.copy_(w)
    hf.e_score_correction_bias.copy_(bias)
    x = torch.randn(64, raw["hidden_size"], generator=g)
    return ours, hf, x


def sorted_by_expert(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order), ids.gather(-1, order)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers(n_group, topk_group, norm):
    ours, hf, x = make_pair(32, 6, n_group, topk_group, norm)
    w, ids = sorted_by_expert(*ours(x))
    _, hf_w, hf_ids = hf(x)
    hf_w, hf_ids = sorted_by_expert(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)


def test_bias_changes_selection_but_not_weights():
    ours, _, x = make_pair(32, 6, 1, 1, True, bias_scale=0.5)
    w, ids = ours(x)
    scores = torch.sigmoid(x @ ours.weight.T)
    unbiased_ids = scores.topk(6, dim=-1).indices
    # The bias matters: for some tokens the biased choice differs from the plain top-k of the scores...
    differs = [set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, unbiased_ids)]
    assert any(differs)
    # ...but the weights are the unbiased sigmoid scores of the chosen experts, normalized, times the scale.
    picked = scores.gather(-1, ids)
    torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True) * 2.827)
