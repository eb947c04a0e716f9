"""Strict single-pass loading (kimi_k2_neuron.weights): every tensor has a parameter and every parameter a tensor, of
the shape config.json says, in memory and layer-streamed alike; broken copies of the tiny checkpoints, loaded as a user
does, each refused in one line."""

from __future__ import annotations

import pytest
import torch
from checkpoint_edits import (BIAS1, EXPERT, O_PROJ, SHARD1, SHARD3, add_tensor, edit_config, edit_index, edit_tensor,
                              load, set_field, shard_of)

from kimi_k2_neuron.runtime.runner import CpuRunner


# -- config.json against the tensors -----------------------------------------------------------------------------------

def test_config_hidden_size_disagrees_with_tensors(ckpt, one_line_error):
    d = ckpt("bf16")
    edit_config(d, set_field("hidden_size", 256))
    msg = one_line_error(lambda: CpuRunner(d), "has shape", "256]", "expected", "from config.json")
    assert "model-0000" in msg and ".weight" in msg  # names the shard and the tensor


@pytest.mark.parametrize("field, value, tensor", [
    ("hidden_size", 10**12, "model.embed_tokens.weight has shape [512, 192], expected [512, 1000000000000]"),
    ("moe_intermediate_size", 10**9, "experts.0.gate_proj.weight_shape says shape [64, 192], expected [1000000000, ")])
@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "layer-streamed"])
def test_a_config_beyond_the_checkpoint_is_refused_before_the_model_is_allocated(ckpt, field, value, tensor,
                                                                                  streamed, monkeypatch,
                                                                                  one_line_error):
    """hidden_size 10^12: the shape check names a tensor before the 2 PB model config.json describes is built
    (before: torch's allocator failed, a traceback)."""
    from kimi_k2_neuron.runtime import runner

    def never(*args, **kwargs):
        raise AssertionError("the model was built before its shapes were checked")

    d = ckpt("int4" if "experts" in tensor else "fp8")
    edit_config(d, set_field(field, value))
    monkeypatch.setattr(runner, "KimiK2ForCausalLM", never)
    one_line_error(lambda: CpuRunner(d, layer_streamed=streamed), tensor, "from config.json")


def test_config_more_layers_than_checkpoint(ckpt, one_line_error):
    d = ckpt("fp8")
    edit_config(d, set_field("num_hidden_layers", 4))
    one_line_error(lambda: CpuRunner(d), "missing from the checkpoint", "model.layers.3.")


def test_config_fewer_layers_than_checkpoint(ckpt, one_line_error):
    d = ckpt("fp8")
    edit_config(d, set_field("num_hidden_layers", 2))
    one_line_error(lambda: CpuRunner(d), "no place for", "model.layers.2.")


# -- shapes ------------------------------------------------------------------------------------------------------------

def _fp8_o_proj_transposed(d):
    edit_tensor(d, O_PROJ + ".weight", lambda t: t.t())
    edit_tensor(d, O_PROJ + ".weight_scale_inv", lambda t: t.t())


def _bf16_o_proj_transposed(d):
    edit_tensor(d, O_PROJ + ".weight", lambda t: t.t())


@pytest.mark.parametrize("quant, corrupt", [("fp8", _fp8_o_proj_transposed), ("bf16", _bf16_o_proj_transposed)])
@pytest.mark.parametrize("streamed", [False, True])
def test_transposed_weight(ckpt, quant, corrupt, streamed, one_line_error):
    d = ckpt(quant)
    corrupt(d)
    one_line_error(lambda: load(d, streamed), SHARD1, O_PROJ + ".weight", "has shape [128, 192]",
                   "expected [192, 128] from config.json")


def test_int4_weight_shape_disagrees_with_config(ckpt, one_line_error):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_shape", lambda t: torch.tensor([64, 192 + 32], dtype=torch.int32))
    one_line_error(lambda: CpuRunner(d), shard_of(d, EXPERT + ".weight_shape"), EXPERT + ".weight_shape",
                   "says shape [64, 224]", "expected [64, 192] from config.json")


@pytest.mark.parametrize("shape, needles", [
    ([[64, 192]], ["has shape [1, 2]", "expected a 1-D [out, in]"]),  # used to leak a TypeError from int(list)
    ([64], ["says shape [64]", "expected [64, 192]"]),
    ([], ["says shape []", "expected [64, 192]"]),
], ids=["2-D", "one dim", "empty"])
def test_int4_weight_shape_malformed(ckpt, shape, needles, one_line_error):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_shape", lambda t: torch.tensor(shape, dtype=torch.int32))
    one_line_error(lambda: CpuRunner(d), EXPERT + ".weight_shape", *needles)


@pytest.mark.parametrize("streamed", [False, True])
def test_streamed_layer_tensor_wrong_shape(ckpt, streamed, one_line_error):
    d = ckpt("int4")
    name = "model.layers.2.post_attention_layernorm.weight"
    edit_tensor(d, name, lambda t: t[:100])
    one_line_error(lambda: load(d, streamed), shard_of(d, name), name, "has shape [100]", "expected [192]")


# -- a tensor for every parameter, a parameter for every tensor --------------------------------------------------------

@pytest.mark.parametrize("streamed", [False, True])
def test_missing_required_tensor(ckpt, streamed, one_line_error):
    d = ckpt("fp8")
    edit_tensor(d, BIAS1, lambda t: None)
    one_line_error(lambda: load(d, streamed), "1 tensor(s) missing from the checkpoint", BIAS1)


def test_tensor_in_shard_but_not_in_index_is_missing(ckpt, one_line_error):
    d = ckpt("int4")
    edit_index(d, lambda ix: ix["weight_map"].pop(BIAS1))
    one_line_error(lambda: CpuRunner(d), "missing from the checkpoint", BIAS1)


@pytest.mark.parametrize("streamed", [False, True])
def test_unexpected_layer_tensor(ckpt, streamed, one_line_error):
    d = ckpt("fp8")
    bogus = "model.layers.0.self_attn.bogus.weight"
    add_tensor(d, bogus, torch.zeros(4, 4, dtype=torch.bfloat16))
    one_line_error(lambda: load(d, streamed), "no place for", bogus)


@pytest.mark.parametrize("bogus", ["model.bogus.weight", "model.layers.3.input_layernorm.weight"])
@pytest.mark.parametrize("streamed", [False, True])
def test_unexpected_tensor_outside_layers(ckpt, bogus, streamed, one_line_error):
    d = ckpt("int4")
    add_tensor(d, bogus, torch.ones(192, dtype=torch.bfloat16), shard=SHARD3)
    one_line_error(lambda: load(d, streamed), "no place for", bogus)
