# SPDX-License-Identifier: Apache-2.0
"""A checkpoint in Kimi-K2's storage formats, converted once to the recommended layout, is exactly what the Neuron
model loads: every tensor it declares and no other, and routed experts that NxD dequantizes back to the source's
values (INT4: exactly; FP8: all but the subnormal tail the converter counts when it halves a block's codes to fit
Neuron's +-240 e4m3)."""

import types

import pytest
import torch

from kimi_k2_neuron.checkpoint.source import WeightSource
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.quant.nxd_fp8 import dequantize_nxd
from kimi_k2_neuron.neuron.fit import plan
from kimi_k2_neuron.neuron.plan_report import format_plan


def _state(shell, dst, tp=2):
    """The Neuron model's state dict from a converted checkpoint, as its checkpoint_loader_fn builds it."""
    nc = types.SimpleNamespace(**ConversionRecord.read(dst).nxd, tp_degree=tp)  # what MoENeuronConfig takes of it
    return shell.loader.to_neuron_state_dict(shell.loader.mmap_checkpoint(dst), KimiK2Config.from_file(dst), nc)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_the_converted_checkpoint_is_what_the_neuron_model_loads(converted, shell, quant):
    _, dst, _ = converted[quant]
    state = _state(shell, dst)  # strict: raises on a missing or unexpected tensor, shape or dtype
    cfg = KimiK2Config.from_file(dst)
    assert set(state) == shell.loader.expected_keys(cfg, ConversionRecord.of(cfg).scheme) | {"rank_util.rank"}


def _nxd_experts(state, layer, e, i):
    """Expert e of `layer` as NxD dequantizes the fused tensors: HF-shaped (gate, up, down) [out, in] weights."""
    m = f"layers.{layer}.mlp.expert_mlps.mlp_op."
    gate_up = dequantize_nxd(state[m + "gate_up_proj.weight"][e], state[m + "gate_up_proj.scale"][e])
    down = dequantize_nxd(state[m + "down_proj.weight"][e], state[m + "down_proj.scale"][e])
    return gate_up[:, :i].T, gate_up[:, i:].T, down.T


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_nxd_dequantizes_the_source_experts(converted, shell, quant):
    raw, dst, result = converted[quant]
    cfg, source, state = KimiK2Config.from_file(raw), WeightSource(raw), _state(shell, dst)
    changed = 0
    for layer in filter(cfg.is_moe_layer, range(cfg.num_hidden_layers)):
        for e in range(cfg.n_routed_experts):
            got = _nxd_experts(state, layer, e, cfg.moe_intermediate_size)
            for proj, value in zip(("gate_proj", "up_proj", "down_proj"), got):
                want = source.get(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", torch.float32)
                changed += int((value != want).sum())
    assert changed <= result.stats.inexact and (quant == "fp8" or changed == 0)


def test_the_usage_steps_before_compiling(converted, shell):
    """The README's Usage up to compile_model, which needs the Neuron SDK: convert (the fixture), plan, options."""
    _, dst, _ = converted["fp8"]
    cfg = KimiK2Config.from_file(dst)
    scheme = ConversionRecord.of(cfg).scheme
    # torch: the tiny model's hidden size is below NxD's prefill kernels'
    spec = shell.spec.RunSpec(tp=2, seq_len=128, batch=2, checkpoint=str(dst), scheme=scheme, moe_prefill="torch")
    p = plan(cfg, spec)
    assert p.fits and "fits: yes" in format_plan(p)
    assert shell.contract.neuron_config_kwargs(cfg, spec)["quantization_block_size"] == [32, 32]


def test_the_entry_module_exports_the_model_or_names_the_missing_sdk(shell):
    missing = shell.sdk.missing_neuron_packages()
    if not missing:
        import modeling_kimi_k2

        assert modeling_kimi_k2.NeuronKimiK2ForCausalLM.__module__ == "kimi_k2_neuron.neuron.modeling"
        return
    with pytest.raises(ImportError, match="needs the AWS Neuron SDK") as e:
        import modeling_kimi_k2  # noqa: F401
    assert all(name in str(e.value) for name in missing)
