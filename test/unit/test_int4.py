"""Pack-quantized INT4 (quant/int4.py): pack, unpack, dequantize and quantize against compressed-tensors and by
hand, and the one-line refusals of bad packed words, scales and shapes."""

import math

import pytest
import torch

from kimi_k2_neuron.quant import int4

EXPERT = "model.layers.5.mlp.experts.17.down_proj"


# Rounding costs half a step, except at +amax: amax / scale = 7.5 clamps to 7, and the bf16-rounded scale (relative
# error <= 2^-8) can push that to 7.5 * (1 + 2^-8) -> 0.529 steps.
MAX_STEP_ERR = 0.53


def _ct_helpers():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    return pack_to_int32, unpack_from_int32


def _ct_args(group_size=32):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


@pytest.mark.parametrize("shape", [(16, 64), (7, 40), (3, 13), (5, 8)])
def test_unpack_and_pack_match_compressed_tensors(shape):
    pack_to_int32, unpack_from_int32 = _ct_helpers()
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    ref_packed = pack_to_int32(q, 4)
    ours = int4.pack_int4(q)
    assert ours.dtype == torch.int32 and ours.shape == (shape[0], math.ceil(shape[1] / 8))
    assert torch.equal(ours, ref_packed)
    # Random words (every bit pattern, including the sign bit) unpack identically.
    words = torch.randint(-(2**31), 2**31, (shape[0], math.ceil(shape[1] / 8)), generator=gen, dtype=torch.int64)
    words = words.to(torch.int32)
    ref = unpack_from_int32(words, 4, torch.Size(shape))
    got = int4.unpack_int4(words, shape[1])
    assert got.dtype == torch.int8 and torch.equal(got, ref)
    assert torch.equal(int4.unpack_int4(ours, shape[1]), q)


def test_unpack_hand_made_word():
    # Nibbles 0..7 from the low end: 0x76543210 -> stored [0,1,...,7] -> q = stored - 8.
    # 0xFEDCBA98 sets bit 31 (negative int32): stored [8..15] -> q = [0..7].
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - 2**32]], dtype=torch.int32)
    got = int4.unpack_int4(words, 16)
    assert got.tolist() == [[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]]
    # Cropping keeps the low-order elements of the last word.
    assert int4.unpack_int4(words, 10).tolist() == [[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1]]
    # And back: q = 0 everywhere is stored as nibble 8 -> 0x88888888.
    assert int4.pack_int4(torch.zeros(1, 8, dtype=torch.int8)).item() == 0x88888888 - 2**32
    assert torch.equal(int4.pack_int4(got), words)


@pytest.mark.parametrize("shape,group", [((8, 128), 32), ((4, 96), 32), ((6, 80), 32), ((3, 64), 16)])
def test_dequantize_group_vs_independent(shape, group):
    _, unpack_from_int32 = _ct_helpers()
    gen = torch.Generator().manual_seed(5)
    out_f, in_f = shape
    n_groups = math.ceil(in_f / group)
    packed = torch.randint(-(2**31), 2**31, (out_f, math.ceil(in_f / 8)), generator=gen, dtype=torch.int64)
    packed = packed.to(torch.int32)
    scale = (torch.rand(out_f, n_groups, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    ref_q = unpack_from_int32(packed, 4, torch.Size(shape)).to(torch.float32)
    ref = ref_q * scale.to(torch.float32).repeat_interleave(group, dim=1)[:, :in_f]
    ws = torch.tensor(shape, dtype=torch.int32)
    got = int4.dequantize_group(packed, scale, ws, group_size=group)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    got_bf16 = int4.dequantize_group(packed, scale, list(shape), group_size=group, out_dtype=torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16 and torch.equal(got_bf16, ref.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_group_matches_compressed_tensors(dtype):
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    _, unpack_from_int32 = _ct_helpers()
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(16, 128, generator=gen) * 0.05).to(dtype)
    w[3, 32:64] = 0  # an all-zero group
    packed, scale, shape = int4.quantize_group(w)
    assert packed.dtype == torch.int32 and packed.shape == (16, 16)
    assert scale.dtype == torch.bfloat16 and scale.shape == (16, 4)
    assert shape.dtype == torch.int32 and shape.tolist() == [16, 128]
    assert scale[3, 1] > 0

    groups = w.view(16, 4, 32)
    ref_scale, ref_zp = calculate_qparams(groups.amin(-1), groups.amax(-1), _ct_args())
    assert torch.equal(ref_zp, torch.zeros_like(ref_zp))
    assert torch.equal(scale, ref_scale.to(torch.bfloat16))

    # Codes: compressed-tensors' own quantize() with the same stored scale.
    ref_q = quantize(w.float(), scale.float(), torch.zeros(16, 4, dtype=torch.int8), _ct_args(), dtype=torch.int8)
    q = unpack_from_int32(packed, 4, torch.Size([16, 128]))
    assert torch.equal(q, ref_q)
    assert q.min() >= -8 and q.max() <= 7

    # dequantize reproduces q * bf16 scale exactly, and the error is within about half a step per group.
    back = int4.dequantize_group(packed, scale, shape)
    assert torch.equal(back, q.float() * scale.float().repeat_interleave(32, dim=1))
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((back - w.float()).abs() <= step * MAX_STEP_ERR).all()


def test_quantize_group_partial_last_group():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(4, 40, generator=gen)
    packed, scale, shape = int4.quantize_group(w)
    assert packed.shape == (4, 5) and scale.shape == (4, 2) and shape.tolist() == [4, 40]
    # The 8-wide tail group is scaled by its own amax.
    torch.testing.assert_close(scale[:, 1].float(), (w[:, 32:].abs().amax(-1) / 7.5).to(torch.bfloat16).float())
    back = int4.dequantize_group(packed, scale, shape)
    assert ((back - w).abs() <= scale.float().repeat_interleave(32, dim=1)[:, :40] * MAX_STEP_ERR).all()


def test_int4_validation_errors(one_line_error):
    packed = torch.zeros(8, 8, dtype=torch.int32)  # [O=8, I=64]
    scale = torch.ones(8, 2, dtype=torch.bfloat16)
    ws = torch.tensor([8, 64], dtype=torch.int32)
    dq = int4.dequantize_group
    wide = packed.to(torch.int64)
    one_line_error(lambda: dq(wide, scale, ws, name=EXPERT), f"{EXPERT}.weight_packed", "int32")
    one_line_error(lambda: dq(packed[:, :7], scale, ws, name=EXPERT), f"{EXPERT}.weight_packed", "[8, 8]")
    one_line_error(lambda: dq(packed, scale[:, :1], ws, name=EXPERT), f"{EXPERT}.weight_scale", "[8, 2]")
    bad = scale.clone()
    bad[0, 0] = float("nan")
    one_line_error(lambda: dq(packed, bad, ws, name=EXPERT), f"{EXPERT}.weight_scale", "NaN")
    bad[0, 0] = float("inf")
    one_line_error(lambda: dq(packed, bad, ws, name=EXPERT), f"{EXPERT}.weight_scale", "inf")
    one_line_error(lambda: dq(packed, scale, torch.tensor([8, 64, 1]), name=EXPERT), f"{EXPERT}.weight_shape")
    one_line_error(lambda: dq(packed, scale, [64], name=EXPERT), f"{EXPERT}.weight_shape", "2")
    # weight_shape disagreeing with the packed tensor is reported against weight_packed.
    one_line_error(lambda: dq(packed, scale, [8, 128], name=EXPERT), f"{EXPERT}.weight_packed", "[8, 16]")
    one_line_error(lambda: int4.pack_int4(torch.full((2, 8), 8, dtype=torch.int8)), "[-8, 7]")
