"""WeightSource: a checkpoint's raw tensors grouped into logical weights and dequantized on demand, and every way a
tensor can be stored wrong refused in one line naming the tensor (broken copies of the tiny checkpoints, loaded as a
user does: through the CPU runner)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_edits import (BIAS1, EMBED, EXPERT, NORM, O_PROJ, SHARD1, del_field, edit_config, edit_tensor, load,
                              scramble_data, set_code, set_element, set_field, shard_of)

from kimi_k2_neuron.checkpoint.source import WeightSource
from kimi_k2_neuron.runtime.runner import CpuRunner


def test_pristine_copies_load(ckpt):
    # Sanity: the helpers themselves do not break a checkpoint (a no-op rewrite still loads in both modes).
    for quant in ("fp8", "int4", "bf16"):
        d = ckpt(quant)
        edit_tensor(d, NORM, lambda t: t)
        for streamed in (False, True):
            assert load(d, streamed).shape == (1, 3, 512)


# -- tensors stored wrong ----------------------------------------------------------------------------------------------

# A tensor stored with the wrong dtype or shape: (format, tensor, edit, words the one-line error must hold).
WRONG_STORAGE = {
    "fp8 scale grid shape": ("fp8", O_PROJ + ".weight_scale_inv", lambda t: torch.ones(3, 1),
                             ["expected shape [2, 1]", "got [3, 1]"]),
    "fp8 scale as bf16": ("fp8", O_PROJ + ".weight_scale_inv", lambda t: t.to(torch.bfloat16),
                          ["expected float32", "bfloat16"]),
    "fp8 weight as int8": ("fp8", O_PROJ + ".weight", lambda t: t.view(torch.int8),
                           ["expected a 2-D float8_e4m3fn tensor", "int8"]),
    "plain weight as int": ("fp8", NORM, lambda t: t.to(torch.int32),
                            [SHARD1, "torch.int32", "expected bf16/fp16/fp32"]),
    "int4 scale as int": ("int4", EXPERT + ".weight_scale", lambda t: t.to(torch.int32),
                          ["expected floating [64, 6]", "int32"]),
    "int4 packed as int64": ("int4", EXPERT + ".weight_packed", lambda t: t.to(torch.int64),
                             ["expected int32 [64, 24]", "int64"]),
}


@pytest.mark.parametrize("case", WRONG_STORAGE)
def test_tensor_stored_wrong(ckpt, case, one_line_error):
    fmt, name, edit, words = WRONG_STORAGE[case]
    d = ckpt(fmt)
    edit_tensor(d, name, edit)
    one_line_error(lambda: CpuRunner(d), name, *words)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_fp8_bad_scale_value(ckpt, bad, one_line_error):
    d = ckpt("fp8")
    edit_tensor(d, O_PROJ + ".weight_scale_inv", set_element((1, 0), bad))
    want = "expected finite positive scales" if bad != bad or bad == float("inf") else "expected positive scales"
    one_line_error(lambda: CpuRunner(d), O_PROJ + ".weight_scale_inv", want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("streamed", [False, True])
def test_int4_bad_scale_value(ckpt, bad, streamed, one_line_error):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_scale", set_element((5, 2), bad))
    one_line_error(lambda: load(d, streamed), EXPERT + ".weight_scale", "NaN or inf", "expected finite scales")


def test_int4_packed_disagrees_with_weight_shape(ckpt, one_line_error):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_packed", lambda t: t[:, :20])
    one_line_error(lambda: CpuRunner(d), EXPERT + ".weight_packed", "expected int32 [64, 24]", "[64, 20]")


# -- grouping raw tensors into logical weights -------------------------------------------------------------------------

@pytest.mark.parametrize("part", ["weight_packed", "weight_scale", "weight_shape"])
def test_int4_weight_missing_part(ckpt, part, one_line_error):
    d = ckpt("int4")
    edit_tensor(d, f"{EXPERT}.{part}", lambda t: None)
    one_line_error(lambda: CpuRunner(d), f"INT4 weight {EXPERT} lacks {EXPERT}.{part}")


def test_fp8_weight_without_scale(ckpt, one_line_error):
    d = ckpt("fp8")
    edit_tensor(d, O_PROJ + ".weight_scale_inv", lambda t: None)
    one_line_error(lambda: CpuRunner(d), SHARD1, f"FP8 tensor {O_PROJ}.weight has no {O_PROJ}.weight_scale_inv")


def test_fp8_scale_without_weight(ckpt, one_line_error):
    d = ckpt("fp8")
    edit_tensor(d, O_PROJ + ".weight", lambda t: None)
    one_line_error(lambda: CpuRunner(d), SHARD1, f"{O_PROJ}.weight_scale_inv has no {O_PROJ}.weight")


def test_fp8_tensors_without_quantization_config(ckpt, one_line_error):
    d = ckpt("fp8")
    edit_config(d, del_field("quantization_config"))
    one_line_error(lambda: CpuRunner(d), "config.json", "no quantization_config", "is FP8-quantized")


def test_int4_tensors_with_fp8_quantization_config(ckpt, one_line_error):
    d = ckpt("int4")
    edit_config(d, set_field("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}))
    one_line_error(lambda: CpuRunner(d), "config.json", "quant_method 'fp8'", "weight_packed is INT4-quantized")


def test_fp8_tensors_with_int4_quantization_config(ckpt, one_line_error):
    # A config that says INT4 over FP8 tensors: the FP8 tensors are the unexpected ones.
    d = ckpt("fp8")
    int4_cfg = json.loads((ckpt("int4") / "config.json").read_text())["quantization_config"]
    edit_config(d, set_field("quantization_config", int4_cfg))
    one_line_error(lambda: CpuRunner(d), "config.json", "quant_method 'compressed-tensors'", "is FP8-quantized")


def test_weight_source_is_the_natural_layer_for_grouping_errors(ckpt, one_line_error):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_scale", lambda t: None)
    one_line_error(lambda: WeightSource(d), EXPERT + ".weight_scale")
    d2 = ckpt("fp8")
    edit_config(d2, del_field("quantization_config"))
    one_line_error(lambda: WeightSource(d2), "no quantization_config")


# -- non-finite weights ------------------------------------------------------------------------------------------------

FP8_EXPERT = "model.layers.1.mlp.experts.0.up_proj.weight"  # FP8 codes [64, 192] in the fp8 checkpoint
# (format, tensor, edit, words the one-line error must hold besides the tensor and its file)
NON_FINITE = {
    "NaN in a bf16 norm weight": ("fp8", NORM, set_element(5, float("nan")), ["NaN or inf"]),
    "inf in an embedding row": ("bf16", EMBED, set_element((7,), float("inf")), ["NaN or inf"]),
    "NaN in the router bias": ("int4", BIAS1, set_element(3, float("nan")), ["NaN or inf"]),
    "FP8 NaN code 0x7f in an expert": ("fp8", FP8_EXPERT, set_code((3, 9), 0x7F), ["NaN FP8 codes"]),
    "FP8 NaN code 0xff in an expert": ("fp8", FP8_EXPERT, set_code((60, 0), 0xFF), ["NaN FP8 codes"]),
    "FP8 NaN code in attention": ("fp8", O_PROJ + ".weight", set_code((0, 0), 0xFF), ["NaN FP8 codes"]),
    # finite codes times a finite scale can overflow float32: caught after dequantization
    "FP8 scale that overflows": ("fp8", O_PROJ + ".weight_scale_inv", set_element((0, 0), 3e38), ["NaN or inf"]),
}


@pytest.mark.parametrize("case", NON_FINITE)
@pytest.mark.parametrize("streamed", [False, True])
def test_non_finite_weight_is_refused_at_load(ckpt, case, streamed, one_line_error):
    fmt, name, edit, words = NON_FINITE[case]
    d = ckpt(fmt)
    edit_tensor(d, name, edit)
    tensor = name.removesuffix("_scale_inv")  # an overflowing product is the weight's, named by its codes
    one_line_error(lambda: load(d, streamed), f"{shard_of(d, name)}: tensor {tensor}", *words)


@pytest.mark.parametrize("fmt", ["fp8", "int4", "bf16"])
def test_random_bytes_over_a_shard_are_refused_at_load(ckpt, fmt, one_line_error):
    # Random bytes hold NaN/inf bf16 and fp32 values and NaN FP8 codes (2 in 256 bytes): some tensor of the shard is
    # refused, by name, whichever comes first (INT4's weight_shape tensors, read by the shape check before the
    # model is built, then say a shape no config describes).
    d = ckpt(fmt)
    scramble_data(d, SHARD1)
    msg = one_line_error(lambda: load(d), SHARD1 + ": tensor ")
    assert "NaN" in msg or "positive scales" in msg or (fmt == "int4" and "weight_shape says shape" in msg), msg
