"""kimi_k2_neuron.formats, the one owner of the checkpoint formats: the logical weights are the core model's
parameters, the converted tensors are what the converter writes, the scheme round-trips through its NxD settings, and
the conversion record is read typed or refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats import SCHEMES, layout
from kimi_k2_neuron.formats.record import CONVERSION_KEY, LAYOUT_VERSION, ConversionRecord
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, ExpertScheme, scheme_for
from kimi_k2_neuron.model.model import KimiK2ForCausalLM
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict
from kimi_k2_neuron.weights import full_shape, owned_params


def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


@pytest.mark.parametrize("over", [{}, {"num_hidden_layers": 5, "first_k_dense_replace": 2, "n_shared_experts": 2},
                                  {"n_shared_experts": 0, "moe_layer_freq": 2}],
                         ids=["tiny", "2 dense, 2 shared", "no shared, every other layer"])
def test_logical_weights_are_the_core_models_parameters_in_checkpoint_order(over):
    cfg = tiny_cfg(**over)
    with torch.device("meta"):
        model = KimiK2ForCausalLM(cfg, torch.bfloat16)
    params = {name: full_shape(name, mod, p) for name, (mod, p) in owned_params(model).items()}
    assert list(layout.logical_shapes(cfg).items()) == list(params.items())


@pytest.mark.parametrize("source", ["fp8", "int4"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_converted_tensors_are_what_the_converter_writes(converted, source, scheme):
    dst = converted[(source, scheme)][0]
    record = ConversionRecord.read(dst)
    assert (record.experts, record.source_format) == (scheme, source)
    blockwise = (32, 1) if source == "int4" else (32, 32)  # one scale per INT4 group; 32x32 from FP8
    assert record.scheme.block == (blockwise if scheme == "fp8-blockwise" else None)
    with ShardedCheckpoint(dst) as ck:
        written = {k: (ck.info(k).dtype, ck.info(k).shape) for k in ck.keys()}
    assert written == layout.converted_tensors(KimiK2Config.from_file(dst), record.scheme)


@pytest.mark.parametrize("scheme", [scheme_for("fp8-per-channel", "fp8"), scheme_for("fp8-blockwise", "fp8"),
                                    scheme_for("fp8-blockwise", "int4", 32), ExpertScheme("fp8-blockwise", (128, 32))])
def test_a_scheme_is_what_its_nxd_settings_describe(scheme):
    assert ExpertScheme.from_nxd(scheme.nxd(2048)) == scheme
    assert ExpertScheme.from_nxd({"quantized": False}) == BF16_EXPERTS and not BF16_EXPERTS.quantized


@pytest.mark.parametrize("block", [[32, 0], [True, 32], [-32, 32], [32], "32x32", None])
def test_a_hand_made_block_size_is_refused_in_one_line(block, one_line_error):
    nxd = {**scheme_for("fp8-blockwise", "fp8").nxd(2048), "quantization_block_size": block}
    one_line_error(lambda: ExpertScheme.from_nxd(nxd), f"quantization_block_size {block!r}", "two integers >= 1")


def test_the_record_is_read_typed_or_refused_in_one_line(converted, tiny, tmp_path, one_line_error):
    assert ConversionRecord.read(tiny["fp8"]) is None  # a raw checkpoint
    assert ConversionRecord.read(tmp_path) is None  # no config.json at all
    raw = json.loads((converted[("int4", "fp8-blockwise")][0] / "config.json").read_text())
    for bad in ({**raw[CONVERSION_KEY], "layout_version": LAYOUT_VERSION + 1},
                {**raw[CONVERSION_KEY], "experts": "fp8-per-channel"}):
        (tmp_path / "config.json").write_text(json.dumps({**raw, CONVERSION_KEY: bad}))
        one_line_error(lambda: ConversionRecord.read(tmp_path), str(tmp_path / "config.json"), CONVERSION_KEY)
