"""NxD's FP8 expert layout: [in, out] e4m3 codes within +-240 and a float32 scale grid, written from one expert
projection of any source (the converter) and read back (dequantize_nxd: the CPU runner's view of a converted
checkpoint, and the tests).

Every stored value lies within +-240, Neuron's e4m3 maximum: the compiler reinterprets OCP e4m3fn bytes with
exponent 15 as inf/NaN, and NxD maps float8_e4m3fn to +-240.

Three ways in:
- `fp8_to_blockwise`: source FP8 codes are kept. A block holding a code beyond +-240 gets all its codes halved and
  its scale doubled. Halving an e4m3 code only lowers its exponent, so it is exact except where the result falls
  into the subnormal range with an odd mantissa (round-to-nearest-even there); those are counted as `inexact`.
- `int4_to_blockwise`: INT4 codes -8..7 are exact e4m3 values and the group scale becomes the block scale: lossless.
- `quantize`: anything else (per-channel targets, BF16 sources) is dequantized exactly to float32 and re-rounded
  with scale = amax / 240; a block or channel whose rounded codes still exceed 240 gets its scale doubled.

All byte tricks rely on e4m3fn's layout: sign bit 7, exponent bits 3-6, mantissa bits 0-2, so for a magnitude
byte m = b & 0x7F, |value| <= 240 <=> m <= 0x77 and m == 0x7F is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..errors import KimiInputError
from . import check_finite
from .fp8 import check_fp8_weight, check_scales, fp8_values, scale_grid_shape
from .int4 import check_group_scale, unpack_int4

FP8 = torch.float8_e4m3fn
FP8_MAX = 240.0  # Neuron e4m3
FP8_MAX_BYTE = 0x77  # |code| <= 240 <=> (byte & 0x7F) <= 0x77 for e4m3fn (0x7F is NaN)
# Source bytes per rescale step: few enough torch calls per MB, and small enough that the step's passes (reductions,
# the halving, sparse fixes) run in L2 (1 MB per core here).
_CHUNK = 1 << 20


@dataclass
class Stats:
    """What happened to the FP8 values of some tensors; merged over experts, layers and the whole run."""

    blocks: int = 0  # scale entries written
    rescaled: int = 0  # of them, raised to keep codes within +-240
    inexact: int = 0  # FP8 codes whose value changed in a halving (subnormal tail)
    sq_err: float = 0.0  # sum of squared dequantization error against the source, for re-rounded tensors
    sq_ref: float = 0.0
    max_err: float = 0.0
    max_ref: float = 0.0

    def merge(self, o: "Stats") -> "Stats":
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(o, f.name)
            setattr(self, f.name, max(a, b) if f.name.startswith("max") else a + b)
        return self

    def to_json(self) -> dict:
        # Floats rounded so the record does not depend on reduction order across thread counts.
        return {f.name: (float(f"{getattr(self, f.name):.6g}") if isinstance(getattr(self, f.name), float)
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> "Stats":
        return cls(**{f.name: d.get(f.name, f.default) for f in fields(cls)})


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:, :] = src.T. Into a contiguous dst torch copies a transposed matrix in cache-sized tiles (its fastest
    byte transpose here: ~1.4 GB/s per core); a column slice of a wider dst goes through a contiguous temporary."""
    if dst.is_contiguous():
        dst.copy_(src.t())
    else:
        dst.copy_(src.t().contiguous())


def _i64(pattern: str) -> int:
    """A byte repeated over an int64 lane, as the signed value torch needs."""
    x = int(pattern * 8, 16)
    return x - (1 << 64) if x >= 1 << 63 else x


_L01, _L08, _H80 = (_i64(b) for b in ("01", "08", "80"))


def halve_codes(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8, no NaN) -> bytes of half the value, byte by byte. A magnitude m >= 0x10 only loses one
    exponent step (m - 8, exact); below it the value is m * 2^-9 (subnormals and exponent 1 alike), so the half is
    m / 2 rounded to nearest even, stored as that integer."""
    m = b & 0x7F
    return torch.where(m < 0x10, (b & 0x80) | ((m >> 1) + (m & (m >> 1) & 1)), b - 8)


def inexact_halves(b: torch.Tensor) -> int:
    """How many of these codes halve_codes rounds: the odd magnitudes below 0x10."""
    m = b & 0x7F
    return int(((m < 0x10) & (m & 1).bool()).sum())


def block_flags(b: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """[rows/br, cols/bc] bool: the block holds a code beyond +-240; and whether any code is NaN."""
    umax, imax = _column_extremes(b, block[0], False)[:2]
    return _over_240(umax, imax, block[1]), _has_nan(umax, imax)


def _column_extremes(b: torch.Tensor, br: int, minima: bool) -> tuple[torch.Tensor, ...]:
    """Per column and per br rows, the max of the bytes read as uint8 and as int8; and (minima) per column and per
    8 rows, a byte whose high nibble is zero exactly when those rows hold a magnitude below 0x10 there: uint8 min &
    0xF0 for positive codes, (int8 min ^ 0x80) & 0xF0 for negative ones, the smaller of the two. Reductions over an
    outer dimension, which torch vectorizes along the contiguous rows (an inner reduction over a block's 32 bytes
    runs ~30x slower), a row chunk of whole blocks (~1 MB) at a time so that its passes stay in L2."""
    rows, cols = b.shape
    umax, imax = torch.empty(rows // br, cols, dtype=torch.uint8), torch.empty(rows // br, cols, dtype=torch.int8)
    small = torch.empty(rows // 8, cols, dtype=torch.uint8) if minima else None
    step = br * max(1, _CHUNK // (br * cols))
    for r in range(0, rows, step):
        c = b[r: r + step]
        n = c.shape[0]
        i = c.view(torch.int8)
        torch.amax(c.view(n // br, br, cols), 1, out=umax[r // br: (r + n) // br])
        torch.amax(i.view(n // br, br, cols), 1, out=imax[r // br: (r + n) // br])
        if minima:
            neg = i.view(n // 8, 8, cols).amin(1).view(torch.uint8).bitwise_xor_(0x80)
            torch.minimum(c.view(n // 8, 8, cols).amin(1), neg, out=small[r // 8: (r + n) // 8])
    return (umax, imax) if small is None else (umax, imax, small.bitwise_and_(0xF0))


def _has_nan(umax: torch.Tensor, imax: torch.Tensor) -> bool:
    """NaN is 0x7F (the largest int8) or 0xFF (the largest uint8). Whole-tensor reductions: torch's comparisons
    of byte tensors run ~1 ns an element here, its reductions ~20x faster."""
    return umax.numel() > 0 and (int(imax.max()) == 0x7F or int(umax.max()) == 0xFF)


def _over_240(umax: torch.Tensor, imax: torch.Tensor, bc: int) -> torch.Tensor:
    """Blocks holding a code beyond +-240, from the column maxima: the largest positive magnitude is the int8 max,
    the largest negative one the uint8 max minus 0x80 (compared once per block, after reducing the block's
    columns)."""
    rows, cols = umax.shape
    bu, bi = (t.view(rows, cols // bc, bc).amax(-1) for t in (umax, imax))
    return (bi > FP8_MAX_BYTE) | (bu > 0x80 + FP8_MAX_BYTE)


def _grid(n: int, block: int, what: str) -> int:
    if n % block:
        raise KimiInputError(f"{what}: dimension {n} is not a multiple of the {block}-wide FP8 block")
    return n // block


def fp8_to_blockwise(w: torch.Tensor, s: torch.Tensor, src_block: tuple[int, int], block: tuple[int, int],
                     dst: torch.Tensor, name: str, inplace: bool = False) -> tuple[torch.Tensor, Stats]:
    """HF FP8 [out, in] codes + scale_inv grid -> dst[in, out] codes (written in place), scale [in/bi, out/bo].
    With inplace=True the codes of w are rescaled where they lie (the caller's own buffer), saving a copy."""
    check_fp8_weight(w, name)  # the rescale below works on the e4m3 bit pattern
    out_f, in_f = w.shape
    bi, bo = block
    _grid(out_f, bo, name), _grid(in_f, bi, name)
    u = w.view(torch.uint8) if inplace else w.view(torch.uint8).clone()
    flag, inexact = rescale_blocks(u, (bo, bi), name)
    scale = blockwise_scale(s, (out_f, in_f), src_block, block, flag, name)
    transpose_into(dst, u)
    return scale, Stats(blocks=flag.numel(), rescaled=int(flag.sum()), inexact=inexact)


def blockwise_scale(s: torch.Tensor, shape: tuple[int, int], src_block: tuple[int, int], block: tuple[int, int],
                    flag: torch.Tensor, name: str) -> torch.Tensor:
    """The NxD scale [in/bi, out/bo] of one [out, in] projection: its scale_inv grid repeated onto the finer block
    grid, doubled where rescale_blocks halved the codes (flag [out/bo, in/bi])."""
    grid = list(scale_grid_shape(shape, src_block))
    if list(s.shape) != grid or s.dtype != torch.float32:
        raise KimiInputError(f"{name}.weight_scale_inv: expected float32 {grid} for weight {list(shape)}, "
                             f"got {s.dtype} {list(s.shape)}")
    check_scales(s, f"{name}.weight_scale_inv")
    (go, gi), (bi, bo) = flag.shape, block
    # Each fine block lies inside one source block (src_block % block == 0 is checked when planning).
    rows, cols = torch.arange(go) * bo // src_block[0], torch.arange(gi) * bi // src_block[1]
    scale = s[rows][:, cols] * torch.where(flag, 2.0, 1.0)
    check_scales(scale, f"{name}.weight_scale_inv doubled")  # twice a huge finite scale is inf
    return scale.t().contiguous()


def rescale_blocks(u: torch.Tensor, block: tuple[int, int], name: str) -> tuple[torch.Tensor, int]:
    """Halve, in place, every [br, bc] block of u (uint8 e4m3fn codes [rows, cols]) that holds a code beyond +-240;
    returns the blocks' flags [rows/br, cols/bc] and how many codes the halving rounded (odd subnormal-tail codes
    of halved blocks). Rows of several projections may follow one another (gate then up) as long as no block
    straddles two.

    Halving subtracts 8 from every byte of an int64 lane of 8 codes: exact (and borrow-free) for magnitudes
    >= 0x10, one pass. Lanes holding a smaller code in a halved block are redone byte by byte from their original
    codes: candidates are the 8 x 8 tiles whose 8-row column minima show one (a positive code >= 0x10 has uint8
    min >= 0x10, a negative one int8 min >= -0x70); in the benchmark's DeepSeek-style FP8 about 1 tile in 70. Besides
    the reductions and that pass, everything works on per-block or per-tile tensors, once per matrix: torch's
    per-call cost (~10 us here) would dominate per chunk."""
    br, bc = block
    rows, cols = u.shape
    lanes_fit = cols % 8 == 0 and bc % 8 == 0 and br % 8 == 0  # else lanes or 8-row groups straddle blocks
    umax, imax, *small = _column_extremes(u, br, lanes_fit)
    if _has_nan(umax, imax):
        raise KimiInputError(f"{name}.weight: holds NaN FP8 codes (0x7f/0xff); expected finite weights")
    flag = _over_240(umax, imax, bc)
    n_flag = int(flag.sum())
    if not n_flag:
        return flag, 0
    if not lanes_fit:  # (tiny shapes) byte by byte
        per_code = flag.repeat_interleave(br, 0).repeat_interleave(bc, 1)
        inexact = inexact_halves(u[per_code])
        u.copy_(torch.where(per_code, halve_codes(u), u))
        return flag, inexact
    # A zero byte in an int64 lane of the 8-row column minima marks an 8 x 8 tile holding a magnitude below 0x10
    # ((v - 0x01..) & ~v & 0x80.. is nonzero exactly when v has a zero byte): byte arithmetic, no comparisons.
    m = small[0].view(torch.int64)  # [rows/8, cols/8]
    group, lane = ((m - _L01).bitwise_and_(~m).bitwise_and_(_H80) != 0).nonzero(as_tuple=True)
    keep = flag[group // (br // 8), lane // (bc // 8)]  # tiles of halved blocks only
    group, lane = group[keep], lane[keep]
    lanes = u.view(torch.int64).view(rows, cols // 8)
    r, c = (group[:, None] * 8 + torch.arange(8)).reshape(-1), lane.repeat_interleave(8)
    fixed = lanes[r, c].view(torch.uint8).view(-1, 8)  # original codes, before the subtraction below
    real = ((fixed & 0x7F) < 0x10).any(1)  # the candidate lanes that hold one themselves
    r, c, fixed = r[real], c[real], fixed[real]
    inexact = inexact_halves(fixed)
    fixed = halve_codes(fixed).view(torch.int64).view(-1)
    if n_flag == flag.numel():
        lanes.sub_(_L08)
    else:  # unflagged blocks subtract 0
        amount = flag.repeat_interleave(bc // 8, 1).to(torch.int64).mul_(_L08)  # [rows/br, cols/8]
        lanes.view(rows // br, br, cols // 8).sub_(amount[:, None, :])
    lanes[r, c] = fixed
    return flag, inexact


_INT4_TO_FP8 = torch.arange(-8, 8, dtype=torch.float32).to(FP8).view(torch.uint8)  # exact


def int4_to_blockwise(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], group: int,
                      dst: torch.Tensor, name: str) -> tuple[torch.Tensor, Stats]:
    """compressed-tensors INT4 [out, in] -> dst[in, out] FP8 codes equal to the INT4 codes, scale [in/group, out]."""
    out_f, in_f = shape
    check_group_scale(scale, out_f, _grid(in_f, group, name), group, name)
    s = scale.to(torch.float32)
    q = unpack_int4(packed, in_f, name=name)  # validates the packed shape
    transpose_into(dst, _INT4_TO_FP8[(q + 8).long()])
    return s.t().contiguous(), Stats(blocks=s.numel())


def quantize(ref: torch.Tensor, block: tuple[int, int] | None, dst: torch.Tensor,
             name: str) -> tuple[torch.Tensor, Stats]:
    """float32 [in, out] -> dst codes (in place) and scale ([in/bi, out/bo] blockwise, [1, out] per channel)."""
    if not torch.isfinite(ref).all():
        raise KimiInputError(f"{name}.weight: contains NaN or inf after dequantization; cannot quantize to FP8")
    a, b = ref.shape
    bi, bo = block if block is not None else (a, 1)
    shape4 = (_grid(a, bi, name), bi, _grid(b, bo, name), bo)
    x = ref.view(shape4)
    amax = x.abs().amax(dim=(1, 3))
    # An all-zero block gets scale 1 (any positive scale encodes zeros exactly).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    st = Stats(blocks=scale.numel())
    for _ in range(8):  # amax / 240 already fits unless the scale lost precision (denormal); then double it
        codes = (x / scale[:, None, :, None]).to(FP8)
        over = ((codes.view(torch.uint8) & 0x7F) > FP8_MAX_BYTE).any(dim=3).any(dim=1)
        if not over.any():
            break
        scale = torch.where(over, scale * 2, scale)
        st.rescaled += int(over.sum())
    else:
        raise KimiInputError(f"{name}.weight: cannot fit FP8 codes within +-{FP8_MAX:g}")
    deq = codes.to(torch.float32).mul_(scale[:, None, :, None])
    err = deq.sub_(x)
    st.sq_err = float(err.pow(2).sum(dtype=torch.float64))
    st.sq_ref = float(ref.pow(2).sum(dtype=torch.float64))
    st.max_err, st.max_ref = float(err.abs().max()), float(amax.max())
    dst.copy_(codes.view(a, b).view(torch.uint8))
    return scale, st


def dequantize_nxd(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's FP8 [in, out] codes and its scale ([in/b_in, out/b_out], or [1, out]) -> float32 [in, out].

    Blocks are inferred from the shapes, as NxD's blockwise dequantize does."""
    if not torch.isfinite(scale).all():
        raise KimiInputError("converted expert scale contains NaN or inf")
    check_finite(codes, "converted expert codes")
    x = fp8_values(codes)
    (a, b), (sa, sb) = x.shape, scale.shape
    if a % sa or b % sb:
        raise KimiInputError(f"converted expert scale {list(scale.shape)} does not tile weight {list(x.shape)}")
    return x.view(sa, a // sa, sb, b // sb).mul_(scale[:, None, :, None]).view(a, b)
