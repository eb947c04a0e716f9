"""NeuronKimiK2ForCausalLM.to_cpu builds each submodel as the device path builds it, and loads it strictly."""

import pytest
import torch
from neuronx_distributed.quantization.quantization_layers import (QuantizedExpertFusedColumnParallel,
                                                                  QuantizedExpertFusedRowParallel)

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron import cpu, modeling
from kimi_k2_neuron.neuron.loader import unloaded_parameters


@pytest.fixture(scope="module")
def bf16_app(converted):
    """bfloat16 at TP=1, the device dtype: NxDI's own to_cpu would cast the float32 router to bf16 here."""
    return cpu.build(cpu.CpuOptions(model=str(converted[("fp8", "fp8-blockwise")]), dtype="bfloat16"), 16, 2)


def _moe_layer(model):
    return next(layer.mlp for layer in model.layers if layer.is_moe)


def test_parameters_keep_their_declared_dtypes(bf16_app):
    for wrapper in bf16_app.models:
        model = wrapper.model
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        router = {n: d for n, d in dtypes.items() if ".mlp.router." in n}
        assert router and set(router.values()) == {torch.float32}, router
        assert dtypes["layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
        assert dtypes["embed_tokens.weight"] == torch.bfloat16


def test_fp8_experts_are_nxd_quantized_layers_with_their_scales(bf16_app):
    """NxDI's to_cpu skips quantize.convert, so FP8 codes would load into plain bf16 expert layers and the scales be
    dropped; built as on device they are NxD's quantized expert layers holding float8 codes and float32 scales."""
    op = _moe_layer(bf16_app.context_encoding_model.model).expert_mlps.mlp_op
    assert isinstance(op.gate_up_proj, QuantizedExpertFusedColumnParallel)
    assert isinstance(op.down_proj, QuantizedExpertFusedRowParallel)
    for proj in (op.gate_up_proj, op.down_proj):
        assert proj.weight.dtype == torch.float8_e4m3fn and proj.scale.dtype == torch.float32
        assert proj.scale.abs().sum() > 0  # loaded, not left at its allocation


def test_each_submodel_is_built_with_its_own_config(bf16_app):
    """As enable_context_encoding / enable_token_generation configure them (model_base.py:3107-3141)."""
    cte, tkg = bf16_app.context_encoding_model.model, bf16_app.token_generation_model.model
    assert cte is not tkg
    assert _moe_layer(cte).expert_mlps.is_prefill is True
    assert _moe_layer(tkg).expert_mlps.is_prefill is False


def test_loading_is_strict_both_ways(bf16_app):
    model = bf16_app.token_generation_model.model
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("kv_mgr.past_key_values.")}
    assert unloaded_parameters(model, [], state) == []
    # kv_mgr.global_rank.rank is a second name of rank_util.rank: loaded with it, not missing
    assert unloaded_parameters(model, ["kv_mgr.global_rank.rank"], state) == []
    gone = "layers.1.mlp.router.e_score_correction_bias"
    without = {k: v for k, v in state.items() if k != gone}
    assert unloaded_parameters(model, [gone], without) == [gone]
    with pytest.raises(KimiInputError, match="1 tensor\\(s\\) the model has no place for: layers.1.mlp.stray"):
        modeling._check_no_unexpected(model, {**state, "layers.1.mlp.stray": torch.zeros(1)}, "ckpt")


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_our_reading_of_the_converted_experts_is_nxds(converted, scheme):
    """quant.nxd_fp8.dequantize_nxd (the core runner's reading of a converted checkpoint) against NxD's quantized
    expert layers themselves: an identity input through the loaded layer gives its dequantized weight [E, in, out]."""
    from kimi_k2_neuron.quant.nxd_fp8 import dequantize_nxd

    app = cpu.build(cpu.CpuOptions(model=str(converted[("fp8", scheme)])), 8, 1)
    op = _moe_layer(app.token_generation_model.model).expert_mlps.mlp_op
    for proj in (op.gate_up_proj, op.down_proj):
        e, n_in = proj.weight.shape[0], proj.weight.shape[1]
        with torch.no_grad():
            nxd = proj(torch.eye(n_in).expand(e, 1, n_in, n_in).contiguous())[:, 0]
        ours = torch.stack([dequantize_nxd(proj.weight[i], proj.scale[i]) for i in range(e)])
        torch.testing.assert_close(ours, nxd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_the_loader_delivers_exactly_the_models_tensors(converted, scheme):
    """checkpoint_loader_fn on a real KimiK2InferenceConfig at TP=2: every key the model's state dict has for weights,
    the float32 router as the core reads it."""
    from kimi_k2_neuron.neuron import contract
    from kimi_k2_neuron.runtime.runner import CpuRunner

    app = cpu.application(cpu.CpuOptions(model=str(converted[("fp8", scheme)]), tp=2), 8, 1)
    state = app.checkpoint_loader_fn()
    cfg = app.config.core_config()
    assert set(state) == contract.expected_keys(cfg, scheme) | {"rank_util.rank"}
    core = CpuRunner(converted[("fp8", scheme)]).model
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert state[f"layers.{layer}.mlp.router.weight"].dtype == torch.float32
    torch.testing.assert_close(state[f"layers.{layer}.mlp.router.weight"], core.model.layers[layer].mlp.gate.weight)


def test_the_loader_refuses_a_checkpoint_converted_for_another_scheme(converted):
    app = cpu.application(cpu.CpuOptions(model=str(converted[("fp8", "fp8-per-channel")])), 8, 1)
    app.neuron_config.quantized_checkpoints_path = str(converted[("fp8", "fp8-blockwise")])
    with pytest.raises(KimiInputError, match="converted with experts=fp8-blockwise"):
        app.checkpoint_loader_fn()


def test_nxd_converts_exactly_the_routed_experts(bf16_app):
    """NxD's quantize.convert with contract.modules_to_not_convert: quantized layers are the routed experts only."""
    from neuronx_distributed.quantization.quantization_layers import BaseQuantizeParallelLinear

    for wrapper in bf16_app.models:
        quantized = {n for n, m in wrapper.model.named_modules() if isinstance(m, BaseQuantizeParallelLinear)}
        moe = [i for i, layer in enumerate(wrapper.model.layers) if layer.is_moe]
        projections = ("gate_up_proj", "down_proj")
        assert quantized == {f"layers.{i}.mlp.expert_mlps.mlp_op.{p}" for i in moe for p in projections}
