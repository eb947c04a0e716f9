"""NxD's FP8 expert layout (quant/nxd_fp8.py): halving e4m3 codes byte-exactly, source FP8 blocks rescaled to +-240
and transposed, against float references and by hand; a NaN code refused in one line. The rescale-and-transpose
tests run each implementation: the C kernel (_fp8_bytes.c) with its AVX2 tiles and with its SSE2 ones, and the
torch fallback used where the kernel is not built."""

import pytest
import torch

from kimi_k2_neuron.quant import nxd_fp8
from kimi_k2_neuron.quant.fp8 import dequantize_blockwise, quantize_blockwise
from kimi_k2_neuron.quant.nxd_fp8 import block_flags, fp8_to_blockwise, halve_codes, inexact_halves

IMPLS = ["avx2", "sse2", "torch"]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Which implementation nxd_fp8 runs (AVX2 where this CPU has it; the test is skipped where it does not)."""
    kernel = nxd_fp8._kernel
    if request.param == "torch":
        monkeypatch.setattr(nxd_fp8, "_kernel", None)
    elif kernel is None:
        pytest.skip("quant/_fp8_bytes.c is not built (test_the_c_kernel_is_built says so)")
    elif kernel.use_avx2(request.param == "avx2") != (request.param == "avx2"):
        pytest.skip("this CPU has no AVX2")
    yield request.param
    if kernel is not None:
        kernel.use_avx2(True)


def test_the_c_kernel_is_built():
    """setup.py builds it (an optional extension: without a C compiler the install goes on, and the converter runs
    the torch fallback at about twice the CPU time); CI and every machine with gcc must have it."""
    assert nxd_fp8._kernel is not None, ("quant/_fp8_bytes.c was not built: pip install -e . with a C compiler (in a "
                                         "worktree on PYTHONPATH: python setup.py build_ext --inplace)")


def test_halve_codes_exact_rne_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # all but NaN
    want = (codes.view(torch.float8_e4m3fn).float() * 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    got = halve_codes(codes)
    assert torch.equal(got, want)
    exact = codes.view(torch.float8_e4m3fn).float() * 0.5 == got.view(torch.float8_e4m3fn).float()
    assert inexact_halves(codes) == int((~exact).sum()) == 16  # the odd magnitudes 1..15 of either sign


@pytest.mark.parametrize("src_max", [448.0, 250.0])  # nearly every block vs a few blocks beyond 240
def test_fp8_to_blockwise_exact_up_to_counted_codes(src_max, impl):
    g = torch.Generator().manual_seed(0)
    w, s = quantize_blockwise(torch.randn(192, 320, generator=g), (128, 128), fp8_max=src_max)
    dst = torch.empty(320, 192, dtype=torch.uint8)
    scale, st = fp8_to_blockwise(w, s, (128, 128), (32, 32), dst, "w")
    got = (dst.view(torch.float8_e4m3fn).float().view(10, 32, 6, 32) * scale[:, None, :, None]).view(320, 192)
    want = dequantize_blockwise(w, s, (128, 128)).t()
    assert 0 < st.rescaled <= st.blocks == 60 and int((got != want).sum()) == st.inexact
    assert int((dst & 0x7F).max()) <= 0x77


@pytest.mark.parametrize("code,half", [(0x00, 0x00), (0x01, 0x00), (0x02, 0x01), (0x03, 0x02), (0x05, 0x02),
                                       (0x07, 0x04), (0x08, 0x04), (0x09, 0x04), (0x0B, 0x06), (0x0F, 0x08),
                                       (0x10, 0x08), (0x77, 0x6F), (0x78, 0x70), (0x7E, 0x76), (0x81, 0x80),
                                       (0x83, 0x82), (0x8F, 0x88), (0xF8, 0xF0), (0xFE, 0xF6)])
def test_halve_codes_bit_patterns(code, half):
    """By hand: subnormals (m * 2^-9) halve to m/2 rounded to even, exponent-1 codes land in the subnormals,
    larger codes lose one exponent step (0x78 = 256 -> 0x70 = 128, 0x7E = 448 -> 0x76 = 224); the sign stays."""
    got = halve_codes(torch.full((16,), code, dtype=torch.uint8))
    assert got.tolist() == [half] * 16


def _reference_blockwise(w: torch.Tensor, s: torch.Tensor, src_block, block):
    """fp8_to_blockwise by plain float ops: a block with a code beyond +-240 gets every code halved by float
    rounding (round to nearest even) and its scale doubled; returns (dst codes, scale, rescaled, inexact)."""
    bi, bo = block
    out_f, in_f = w.shape
    flag = w.float().abs().view(out_f // bo, bo, in_f // bi, bi).amax(dim=(1, 3)) > 240
    halved = (w.float() * 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    per_code = flag.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    codes = torch.where(per_code, halved, w.view(torch.uint8))
    inexact = int((per_code & (halved.view(torch.float8_e4m3fn).float() * 2 != w.float())).sum())
    grid = s.repeat_interleave(src_block[0], 0).repeat_interleave(src_block[1], 1)[:out_f:bo, :in_f:bi]
    scale = grid * torch.where(flag, 2.0, 1.0)
    return codes.t().contiguous(), scale.t().contiguous(), int(flag.sum()), inexact


@pytest.mark.parametrize("over", [0.0, 0.02, 0.5, 0.97, 1.0])  # share of blocks holding a code beyond +-240
@pytest.mark.parametrize("chunk", [None, 1])  # whole matrix in one step, or one block row per step
@pytest.mark.parametrize("in_f", [384, 416])  # 8-code lanes, or byte by byte (416 = 13 blocks of 32)
def test_fp8_to_blockwise_matches_float_reference(over, chunk, in_f, monkeypatch, impl):
    """The vectorized rescale against _reference_blockwise on codes that cover every non-NaN byte, subnormals
    included (positive ones below 0x08 borrow from their lane's next byte when 8 is subtracted lane-wide), the
    +-240 edge (0x77/0xF7 stay, 0x78/0xF8 trigger a halving), and chunk boundaries."""
    if chunk is not None:
        monkeypatch.setattr(nxd_fp8, "_CHUNK", chunk)
    if in_f % 8:
        monkeypatch.setattr(nxd_fp8, "_L08", None)  # the lane path would fail on it
    g = torch.Generator().manual_seed(int(over * 100))
    out_f = 256
    codes = torch.randint(0, 0x78, (out_f, in_f), generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7  # signs
    codes[:16, :16] = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte ...
    codes[:16, :16][(codes[:16, :16] & 0x7F) == 0x7F] = 0x77  # ... but NaN
    codes[16:48, :8] = torch.arange(16, dtype=torch.uint8).repeat(32, 1)[:, ::2] | 0x80  # negative small codes
    codes[48, 40], codes[49, 41] = 0x77, 0xF7  # +-240 alone does not make a block halve
    blocks = torch.zeros(out_f // 32 * in_f // 32, dtype=torch.bool)
    blocks[torch.randperm(blocks.numel(), generator=g)[:round(over * blocks.numel())]] = True
    blocks = blocks.view(out_f // 32, in_f // 32)
    for r, c in blocks.nonzero().tolist():
        codes[r * 32 + 5, c * 32 + 3] = 0xF8 if (r + c) % 2 else 0x78
    w = codes.view(torch.float8_e4m3fn)
    s = torch.rand(2, (in_f + 127) // 128, generator=g) + 0.5
    dst = torch.empty(in_f, out_f, dtype=torch.uint8)
    scale, st = fp8_to_blockwise(w, s, (128, 128), (32, 32), dst, "w")
    want, want_scale, rescaled, inexact = _reference_blockwise(w, s, (128, 128), (32, 32))
    assert torch.equal(dst, want) and torch.equal(scale, want_scale)
    assert (st.rescaled, st.inexact, st.blocks) == (rescaled, inexact, 8 * in_f // 32)
    blocks[0, 0] = True  # it holds every byte, 0x78-0x7E and 0xF8-0xFE included
    assert rescaled == int(blocks.sum()) and inexact > 0  # that block's odd small codes round


def test_fp8_to_blockwise_leaves_its_source_alone_unless_inplace(impl):
    """A destination the kernel does not take (here a transposed view) sends the work to the torch fallback, which
    halves in place: on a copy, unless inplace."""
    g = torch.Generator().manual_seed(2)
    w, s = quantize_blockwise(torch.randn(192, 320, generator=g), (128, 128))
    before = w.view(torch.uint8).clone()
    for dst in (torch.empty(320, 192, dtype=torch.uint8), torch.empty(192, 320, dtype=torch.uint8).t()):
        fp8_to_blockwise(w, s, (128, 128), (32, 32), dst, "w")
        assert torch.equal(w.view(torch.uint8), before)
        assert torch.equal(dst, _reference_blockwise(w, s, (128, 128), (32, 32))[0])


@pytest.mark.parametrize("nan", [0x7F, 0xFF])
def test_fp8_to_blockwise_refuses_nan(nan, one_line_error, impl):
    w = torch.full((64, 64), 0x30, dtype=torch.uint8)
    w[40, 7] = nan
    name = "model.layers.1.mlp.experts.0.up_proj"
    one_line_error(lambda: fp8_to_blockwise(w.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128), (32, 32),
                                            torch.empty(64, 64, dtype=torch.uint8), name), name + ".weight", "NaN")


def test_block_flags():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 0x78, (64, 96), generator=g, dtype=torch.uint8)
    x |= torch.randint(0, 2, x.shape, generator=g, dtype=torch.uint8) << 7
    x[3, 5], x[40, 70] = 0xF9, 0x78
    flags, nan = block_flags(x, (32, 32))
    assert flags.tolist() == [[True, False, False], [False, False, True]] and not nan
    x[1, 1] = 0x7F
    assert block_flags(x, (32, 32))[1]


def test_block_flags_of_a_block_too_large_for_carry_free_lane_counts():
    # 256 codes beyond +-240, all in byte 7 of their 8-byte lanes, in one 64 x 64 block: summed per lane they would
    # carry out of the int64 and read as none. Such blocks take the byte path.
    x = torch.zeros(64, 64, dtype=torch.uint8)
    x[:32, 7::8] = 0x78
    flags, nan = block_flags(x, (64, 64))
    assert flags.tolist() == [[True]] and not nan


def _simple_flags(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """The check block_flags makes, by comparisons: a block holds |code| beyond +-240; any code is NaN."""
    (rows, cols), (br, bc) = x.shape, block
    m = x & 0x7F
    return (m > 0x77).view(rows // br, br, cols // bc, bc).any(3).any(1), bool((m == 0x7F).any())


@pytest.mark.parametrize("shape, block", [((32, 32), (32, 32)), ((64, 96), (32, 32)), ((96, 40), (32, 8)),
                                          ((40, 416), (8, 32)), ((24, 36), (8, 12))],
                         ids=["one block", "lanes", "narrow blocks", "416 wide", "no lanes"])
def test_block_flags_flag_exactly_what_comparisons_flag_for_every_code(shape, block):
    """All 256 codes, one at a time, at the corners of blocks, at the first and last byte of an 8-byte lane and
    at the matrix's edges, over a background of both signs just inside +-240: the lane arithmetic flags exactly
    the blocks, and finds exactly the NaNs, that byte comparisons do."""
    (rows, cols), (br, bc) = shape, block
    g = torch.Generator().manual_seed(rows * cols)
    background = torch.randint(0, 0x78, shape, generator=g, dtype=torch.uint8)
    background |= torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
    places = {(0, 0), (0, cols - 1), (rows - 1, 0), (rows - 1, cols - 1), (br - 1, bc - 1), (br % rows, bc % cols),
              (rows // 2, 7), (rows // 2, 8), (1, cols - 8)}
    for code in range(256):
        for r, c in places:
            x = background.clone()
            x[r, c] = code
            flags, nan = block_flags(x, block)
            want_flags, want_nan = _simple_flags(x, block)
            assert torch.equal(flags, want_flags) and nan == want_nan, (code, r, c)
    assert not block_flags(background, block)[0].any()


@pytest.mark.parametrize("offset", [0, 3, 4])  # lanes, bytes (not 8-aligned), int32 but not int64 aligned
def test_rescale_blocks_at_any_alignment_equals_the_float_reference(offset, impl):
    g = torch.Generator().manual_seed(offset)
    w, s = quantize_blockwise(torch.randn(128, 256, generator=g), (128, 128))
    buf = torch.empty(w.numel() + offset, dtype=torch.uint8)
    codes = buf[offset:].view(128, 256)
    codes.copy_(w.view(torch.uint8))
    codes[5, 9] = 0x01  # a subnormal in a halved block
    dst = torch.empty(256, 128, dtype=torch.uint8)
    scale, st = fp8_to_blockwise(codes.view(torch.float8_e4m3fn), s, (128, 128), (32, 32), dst, "w", inplace=True)
    want, want_scale, rescaled, inexact = _reference_blockwise(w.view(torch.uint8).clone().index_put_(
        (torch.tensor([5]), torch.tensor([9])), torch.tensor([1], dtype=torch.uint8)).view(torch.float8_e4m3fn),
        s, (128, 128), (32, 32))
    assert torch.equal(dst, want) and torch.equal(scale, want_scale) and (st.rescaled, st.inexact) == (rescaled,
                                                                                                       inexact)


@pytest.mark.parametrize("rows, cols, offset", [(300, 256, 0), (257, 260, 0), (256, 258, 0), (300, 256, 1),
                                                (300, 256, 4), (16, 16, 0), (4096, 7168, 0), (7168, 2048, 3)])
def test_transpose_into_is_the_transpose(rows, cols, offset, impl):
    """Every path gives src.T: the kernel's 16-row strips and its scalar rest (rows or columns not multiples of 16),
    unaligned source and destination (no non-temporal stores then), Kimi-K2's gate_up and down shapes; the torch
    two-step transpose (int32 lanes, then 4-byte groups) and its fallbacks (columns not a multiple of 4, an
    unaligned start, a small matrix)."""
    g = torch.Generator().manual_seed(rows + cols + offset)
    buf = torch.randint(0, 256, (rows * cols + offset,), generator=g, dtype=torch.uint8)
    src = buf[offset:].view(rows, cols)
    out = torch.empty(rows * cols + offset, dtype=torch.uint8)
    dst = out[offset:].view(cols, rows)
    nxd_fp8.transpose_into(dst, src)
    assert torch.equal(dst, src.t())


@pytest.mark.parametrize("rows, cols, block, offset", [
    (2 * 2048, 7168, (32, 32), 0), (7168, 2048, (32, 32), 0), (4096, 7168, (128, 128), 3),
    (512, 64, (256, 32), 0), (1024, 64, (512, 32), 0), (64, 96, (16, 48), 0), (96, 64, (32, 32), 0),
    (96, 80, (24, 40), 0), (48, 40, (8, 8), 5)],
    ids=["gate_up", "down", "128 blocks, dst unaligned", "strips of 256 rows", "512-row blocks",
         "16x48 blocks", "rows not of 64", "blocks not of 16", "small, dst unaligned"])
def test_rescale_transposed_at_kimi_shapes_equals_the_float_reference(rows, cols, block, offset, impl):
    """Kimi-K2's per-expert [out, in] gate_up and down codes quantized like its checkpoint (amax -> 448 per 128 x 128
    block, so nearly every 32 x 32 block holds a code beyond +-240), a quarter of the blocks kept within +-240, into
    the scheme's 32 x 32 blocks; and the kernel's scalar path (blocks not multiples of 16): dst, flags and the count
    of rounded codes equal the float reference's."""
    g = torch.Generator().manual_seed(rows)
    w, _ = quantize_blockwise(torch.randn(rows, cols, generator=g), (128, 128))
    codes = w.view(torch.uint8).clone()
    br, bc = block
    keep = torch.rand(rows // br, cols // bc, generator=g) < 0.25
    within = codes.view(rows // br, br, cols // bc, bc).permute(0, 2, 1, 3)
    within[keep.nonzero(as_tuple=True)] &= 0xF7  # magnitudes 0x78.. lose bit 3: all <= 0x77
    codes[0, 0], codes[1, 1] = 0x01, 0x83  # subnormals (0x01 rounds) in a block that halves
    codes[0, 2] = 0x78
    dst = torch.empty(rows * cols + offset, dtype=torch.uint8)[offset:].view(cols, rows)
    flags, inexact = nxd_fp8.rescale_transposed(dst, codes.clone(), (br, bc), "w")
    w = codes.view(torch.float8_e4m3fn)
    want, _, rescaled, want_inexact = _reference_blockwise(w, torch.ones(1, 1), (rows, cols), (bc, br))
    assert torch.equal(dst, want)
    assert int(flags.sum()) == rescaled and inexact == want_inexact > 0
    assert torch.equal(flags, w.float().abs().view(rows // br, br, cols // bc, bc).amax(dim=(1, 3)) > 240)


@pytest.mark.parametrize("shape", [(0, 64), (64, 0)])
def test_rescale_transposed_of_an_empty_matrix(shape, impl):
    codes = torch.zeros(shape, dtype=torch.uint8)
    dst = torch.empty(shape[::-1], dtype=torch.uint8)
    flags, inexact = nxd_fp8.rescale_transposed(dst, codes, (32, 32), "w")
    assert flags.shape == (shape[0] // 32, shape[1] // 32) and inexact == 0


@pytest.mark.parametrize("row", [0, 200, 255])  # the first strip, a later one, the last row
def test_rescale_transposed_refuses_a_nan_in_any_strip(row, one_line_error, impl):
    codes = torch.full((256, 64), 0x30, dtype=torch.uint8)
    codes[row, 40] = 0xFF
    one_line_error(lambda: nxd_fp8.rescale_transposed(torch.empty(64, 256, dtype=torch.uint8), codes, (32, 32),
                                                      "model.layers.3.mlp.experts.7.up_proj"),
                   "model.layers.3.mlp.experts.7.up_proj.weight", "NaN")
