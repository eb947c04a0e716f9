"""The core's MoE block (model/moe.py): dropless, each token through every one of its top-k experts, weighted by the
router, plus the always-on shared expert; written out token by token here."""

import torch
import torch.nn.functional as F

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.model.moe import MLP, MoE
from kimi_k2_neuron.parallel import SINGLE
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict


def _filled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return module


def test_mlp_is_down_of_silu_gate_times_up():
    mlp = _filled(MLP(16, 24, torch.float32, SINGLE), seed=0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    want = (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), want)


def test_every_token_reaches_each_of_its_top_k_experts_plus_the_shared_expert():
    cfg = KimiK2Config.from_dict(tiny_config_dict("bf16"))  # 8 experts, top-3, one shared expert
    moe = _filled(MoE(cfg, torch.float32, SINGLE), seed=2)
    x = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    flat = x.reshape(-1, cfg.hidden_size)
    weights, ids = moe.gate(flat)
    want = torch.stack([
        sum(weights[t, k] * moe.experts[int(ids[t, k])](flat[t]) for k in range(cfg.num_experts_per_tok))
        + moe.shared_experts(flat[t]) for t in range(flat.shape[0])])
    torch.testing.assert_close(moe(x), want.view_as(x), rtol=1e-5, atol=1e-5)
    assert len({int(i) for i in ids.flatten()}) > cfg.num_experts_per_tok  # the tokens do not all pick the same experts
