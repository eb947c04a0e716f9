# SPDX-License-Identifier: Apache-2.0
"""Kimi-K2's config.json files as the contrib reads them, and what the Neuron shell makes of the recommended
configuration: the NeuronConfig it compiles with, what it refuses, whether it fits."""

import math

import pytest

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats import DEFAULT_SCHEME
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, scheme_for
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.model.rope import softmax_scale
from kimi_k2_neuron.neuron.fit import plan
from kimi_k2_neuron.neuron.spec import RunSpec


@pytest.mark.parametrize("name,factor,context,eos,quant", [
    ("kimi-k2-instruct", 32.0, 131072, 163585, "fp8"),
    ("kimi-k2-instruct-0905", 64.0, 262144, 163585, "fp8"),
    ("kimi-k2-thinking", 64.0, 262144, 163586, "compressed-tensors"),
])
def test_each_checkpoint_is_read_from_its_config_json(configs, name, factor, context, eos, quant):
    cfg = KimiK2Config.from_file(configs / f"{name}.json")
    assert (cfg.rope_scaling.factor, cfg.max_position_embeddings, cfg.eos_token_ids) == (factor, context, (eos,))
    assert cfg.quant.method == quant
    # the architecture they share: 64 heads (not DeepSeek-V3's 128), 384 experts, a 576-wide latent cache entry
    assert (cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.latent_dim) == (64, 384, 8, 576)
    assert (cfg.first_k_dense_replace, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (1, 1, 1, 2.827)
    # YaRN's attention factor: qk_head_dim**-0.5 * (0.1 * ln(factor) + 1)**2 (DeepSeek-V3's yarn_get_mscale)
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(factor) + 1) ** 2, rel=1e-12)


def _recommended(shell, cfg, **over):
    """TP=64 at LNC=2, batch 1, seq_len 1024, fp8-blockwise experts, as converted from an FP8 checkpoint."""
    scheme = scheme_for(DEFAULT_SCHEME, "fp8")
    return shell.spec.RunSpec(**{"tp": 64, "checkpoint": "/converted", "scheme": scheme, **over})


def test_the_recommended_configuration_compiles_with_this_neuron_config(kimi, shell):
    kw = shell.contract.neuron_config_kwargs(kimi, _recommended(shell, kimi))
    assert (kw["tp_degree"], kw["logical_nc_config"], kw["seq_len"], kw["max_context_length"]) == (64, 2, 1024, 1024)
    assert [kw[k] for k in ("batch_size", "ctx_batch_size", "tkg_batch_size", "max_batch_size")] == [1, 1, 1, 1]
    # FP8 routed experts in 32x32 blocks, which shard for every TP dividing 64; everything else stays bf16
    assert (kw["quantization_type"], kw["quantization_dtype"], kw["quantization_scale_dtype"]) == \
        ("blockwise_symmetric", "f8e4m3", "f32")
    assert (kw["quantization_block_axis"], kw["quantization_block_size"]) == ([1, 2], [32, 32])
    assert {"self_attn", "shared_experts", "lm_head", "embed_tokens"} <= set(kw["modules_to_not_convert"])
    # the noaux_tc router in float32, dropless, weights normalized by the router itself (not again by NxD)
    assert kw["router_config"] == {"act_fn": "sigmoid", "dtype": "float32"} and kw["cast_type"] == "as-declared"
    assert kw["capacity_factor"] is None and kw["disable_normalize_top_k_affinities"] is True
    assert kw["save_sharded_checkpoint"] is True  # pre-sharded at compile time, so loading converts nothing


@pytest.mark.parametrize("over,needle", [
    ({"tp": 48}, "num_attention_heads=64 is not divisible by 48"),
    ({"ep": 4, "moe_decode": "selective"}, "NxD's selective loading has no expert-parallel variant"),
    ({"checkpoint": None}, "needs a converted checkpoint"),
    ({"seq_len": 1000}, "must be a multiple of 128"),  # the shard-on-block kernel's output tiles
])
def test_what_cannot_compile_is_refused_in_one_line(kimi, shell, over, needle):
    with pytest.raises(KimiInputError) as e:
        shell.rules.check(kimi, _recommended(shell, kimi, **over))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_recommended_configuration_fits_and_bf16_experts_do_not(kimi):
    """Per logical core of a trn2.48xlarge (24 GiB HBM), by the planner's estimate."""
    assert plan(kimi, RunSpec(tp=64, lnc=2, seq_len=1024, batch=1, scheme=scheme_for(DEFAULT_SCHEME, "fp8"))).fits
    assert not plan(kimi, RunSpec(tp=64, lnc=2, seq_len=1024, batch=1, scheme=BF16_EXPERTS)).fits
