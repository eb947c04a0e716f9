"""Blockwise FP8 (quant/fp8.py): dequantize and quantize, against transformers' dequantizer and by hand, and the
one-line refusals of bad codes, scales and grids."""

import pytest
import torch

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.quant import fp8

NAME = "model.layers.3.self_attn.q_a_proj"


def _rand_fp8(shape, gen):
    # Random finite codes spread over the e4m3fn range (never NaN, unlike random bytes).
    return (torch.randn(shape, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_scale_grid_shape():
    assert fp8.scale_grid_shape((576, 7168)) == (5, 56)
    assert fp8.scale_grid_shape((130, 129), (128, 128)) == (2, 2)
    assert fp8.scale_grid_shape((128, 256)) == (1, 2)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((64, 96), (32, 16)), ((128, 128), (128, 128))])
def test_dequant_matches_transformers(shape, block):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    q = _rand_fp8(shape, gen)
    s = torch.rand(fp8.scale_grid_shape(shape, block), generator=gen) * 0.01 + 1e-4
    ref = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    got = fp8.dequantize_blockwise(q, s, block)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    got_bf16 = fp8.dequantize_blockwise(q, s, block, out_dtype=torch.bfloat16)
    ref_bf16 = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16, ref_bf16, rtol=0, atol=0)


def test_dequant_partial_blocks_by_hand():
    gen = torch.Generator().manual_seed(1)
    q = _rand_fp8((130, 129), gen)
    s = torch.tensor([[0.5, 2.0], [0.25, 3.0]], dtype=torch.float32)
    got = fp8.dequantize_blockwise(q, s)
    assert got.shape == (130, 129)
    code = q.to(torch.float32)
    # (row, col) -> the scale that block owns, written out by hand.
    expected_scale = {
        (0, 0): 0.5, (127, 127): 0.5,  # full block
        (0, 128): 2.0, (127, 128): 2.0,  # partial column block (1 column wide)
        (128, 0): 0.25, (129, 127): 0.25,  # partial row block (2 rows tall)
        (128, 128): 3.0, (129, 128): 3.0,  # corner: partial in both
    }
    for (i, j), sc in expected_scale.items():
        assert got[i, j].item() == code[i, j].item() * sc, (i, j)
    # And the whole corner/edge tiles, not just sampled elements.
    assert torch.equal(got[128:, 128:], code[128:, 128:] * 3.0)
    assert torch.equal(got[:128, 128:], code[:128, 128:] * 2.0)
    assert torch.equal(got[128:, :128], code[128:, :128] * 0.25)


@pytest.mark.parametrize("shape", [(256, 256), (130, 129), (576, 200), (1, 1)])
def test_quantize_blockwise_round_trip(shape):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitude
    codes, s = fp8.quantize_blockwise(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_grid_shape(shape)
    assert codes.to(torch.float32).abs().max() <= 448.0
    back = fp8.dequantize_blockwise(codes, s)
    # e4m3 has 3 mantissa bits: half-ulp relative error 2^-4 at the top of a block's range, so the absolute error
    # is at most amax/16 (normals) and well under that in the subnormal range.
    n_o, n_i = s.shape
    for bi in range(n_o):
        for bj in range(n_i):
            sl = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            amax = w[sl].abs().max()
            assert (back[sl] - w[sl]).abs().max() <= amax / 16 + 1e-12
            torch.testing.assert_close(s[bi, bj], amax / 448.0)


def test_quantize_blockwise_zero_block_and_determinism():
    w = torch.zeros(200, 256)
    w[:128, 128:] = torch.randn(128, 128, generator=torch.Generator().manual_seed(3))
    codes, s = fp8.quantize_blockwise(w)
    assert s[0, 0] == 1.0 and s[1, 0] == 1.0 and s[1, 1] == 1.0
    assert torch.equal(fp8.dequantize_blockwise(codes, s)[:, :128], torch.zeros(200, 128))
    codes2, s2 = fp8.quantize_blockwise(w)
    assert torch.equal(codes.view(torch.uint8), codes2.view(torch.uint8)) and torch.equal(s, s2)


def test_fp8_validation_errors(one_line_error):
    q = torch.zeros(130, 129, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 2)
    dq = fp8.dequantize_blockwise
    one_line_error(lambda: dq(q.to(torch.bfloat16), s, name=NAME), NAME, "float8_e4m3fn")
    one_line_error(lambda: dq(q[0], s[0], name=NAME), NAME, "2-D")
    one_line_error(lambda: dq(q, s.double(), name=NAME), f"{NAME}.weight_scale_inv", "float32")
    one_line_error(lambda: dq(q, torch.ones(1, 2), name=NAME), f"{NAME}.weight_scale_inv", "[2, 2]")
    bad = s.clone()
    bad[1, 1] = float("nan")
    one_line_error(lambda: dq(q, bad, name=NAME), f"{NAME}.weight_scale_inv", "NaN")
    bad[1, 1] = float("inf")
    one_line_error(lambda: dq(q, bad, name=NAME), f"{NAME}.weight_scale_inv", "inf")
    bad[1, 1] = 0.0
    one_line_error(lambda: dq(q, bad, name=NAME), f"{NAME}.weight_scale_inv", "<= 0")
    bad[1, 1] = -1.0
    one_line_error(lambda: dq(q, bad, name=NAME), f"{NAME}.weight_scale_inv", "<= 0")
    assert issubclass(KimiInputError, ValueError)


def test_fp8_values_equal_torch_conversion_on_every_code():
    """The float16 route of fp8_values against torch's own float8 -> float32 conversion, every non-NaN byte."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    assert torch.equal(fp8.fp8_values(codes), codes.to(torch.float32))
    assert torch.equal(fp8.fp8_values(codes.view(2, -1)), codes.view(2, -1).to(torch.float32))  # any shape


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_dequantize_refuses_nan_codes(code, one_line_error):
    w = torch.full((4, 8), 0x38, dtype=torch.uint8)
    w[2, 3] = code
    one_line_error(lambda: fp8.dequantize_blockwise(w.view(torch.float8_e4m3fn), torch.ones(1, 1), name="x.q_proj"),
                   "x.q_proj.weight", "NaN FP8 codes")


@pytest.mark.parametrize("step", [1, 300, 1 << 18])  # one block row per step, a step inside a row, one step
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_in_steps_equals_one_pass(step, dtype, monkeypatch):
    """dequantize_blockwise works a few block rows at a time: every code (and partial edge blocks) gives the bits
    of torch's float8 conversion times its block's scale in float32, then cast, wherever the steps fall."""
    monkeypatch.setattr(fp8, "_DEQUANT_STEP", step)
    g = torch.Generator().manual_seed(step)
    codes = torch.randint(0, 256, (300, 200), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # no NaN
    codes[:2, :128] = torch.arange(256, dtype=torch.uint8).view(2, 128)
    codes[:2, :128][(codes[:2, :128] & 0x7F) == 0x7F] = 0
    w = codes.view(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) * 1e-2 + 1e-3
    want = w.float() * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    got = fp8.dequantize_blockwise(w, s, (128, 128), out_dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
