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
from .fp8 import check_fp8_weight, check_scales, scale_grid_shape
from .int4 import check_group_scale, unpack_int4

FP8 = torch.float8_e4m3fn
FP8_MAX = 240.0  # Neuron e4m3
FP8_MAX_BYTE = 0x77  # |code| <= 240 <=> (byte & 0x7F) <= 0x77 for e4m3fn (0x7F is NaN)
# Source rows per transposed copy: 64-row copies of a Kimi expert ran fastest here (torch 2.13, one thread:
# 1.7 GB/s against 0.9-1.2 for 32, 128 or 256 rows and for one whole-matrix copy).
_TILE = 64
# Source bytes per rescale step: few enough torch calls per MB, and small enough that the step's several passes
# and its transposed copy run in L2 (2 MB per core here).
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
    """dst[:, :] = src.T for a (possibly row-strided) dst view; tiled because torch's plain transposed copy of a
    byte matrix runs at a fraction of memory speed."""
    for r in range(0, src.shape[0], _TILE):
        dst[:, r: r + _TILE].copy_(src[r: r + _TILE].t())


def _i64(pattern: str) -> int:
    """A byte repeated over an int64 lane, as the signed value torch needs."""
    x = int(pattern * 8, 16)
    return x - (1 << 64) if x >= 1 << 63 else x


_L08, _L70, _L7F, _H80 = (_i64(b) for b in ("08", "70", "7f", "80"))


def _lanes(b: torch.Tensor) -> torch.Tensor:
    """8 codes per int64 lane (padded with 0x10, a code that halves exactly and is in range)."""
    flat = b.reshape(-1)
    if flat.numel() % 8:
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8), value=0x10)
    return flat.view(torch.int64)


def block_flags(b: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """[rows/br, cols/bc] bool: the block holds a code beyond +-240; and whether any code is NaN."""
    rows, cols = b.shape
    br, bc = block
    if not _lanes_fit(b.shape, block):  # plain byte ops
        mag = (b & 0x7F).view(rows // br, br, cols // bc, bc).amax(dim=(1, 3))
        return mag > FP8_MAX_BYTE, bool((mag == 0x7F).any())
    return _lane_flags(_lanes(b) & _L7F, b.shape, block)


def _lanes_fit(shape: tuple[int, int], block: tuple[int, int]) -> bool:
    """Whether _lane_flags applies: rows and blocks hold whole 8-byte lanes (not so on tiny shapes), and a block's
    per-byte counts stay below 256 (fewer than 2048 codes a block: 32 x 32 has 1024), so they never carry."""
    return shape[1] % 8 == 0 and block[1] % 8 == 0 and block[0] * block[1] < 8 * 256


def _lane_flags(mag: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """block_flags from the magnitude lanes (b & 0x7F per byte) of a [rows, cols] byte matrix whose rows and blocks
    hold whole lanes.

    Per lane, (mag + 0x08) & 0x80 marks the bytes >= 0x78 with no carry between bytes; the marks, shifted down to
    0/1 per byte, are summed over each block. NaN (0x7F/0xFF) is the only magnitude 0x7F, so one byte max finds it."""
    rows, cols = shape
    br, bc = block
    nan = bool(mag.view(torch.uint8).max() == 0x7F)
    over = (mag + _L08).bitwise_and_(_H80).bitwise_right_shift_(7)  # 0/1 per byte
    # Each byte sum stays below 256 (a block has br*bc/8 lanes per byte position; _lanes_fit), so sums never carry.
    counts = over.view(rows, cols // bc, bc // 8).sum(-1).view(rows // br, br, cols // bc).sum(1)
    return counts != 0, nan


def halve_codes(b: torch.Tensor, mag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3fn bytes (uint8, no NaN) -> bytes of half the value; also the flat positions and odd-ness of the
    small-magnitude codes (the only ones that can round). `mag` may pass in _lanes(b) & 0x7F when it is at hand.

    Subtracting 8 from every byte of an int64 lane lowers each exponent by one, exact (and borrow-free) whenever
    the magnitude is >= 0x10 (exponent field >= 2). The rare lanes holding a smaller code are found with
    (mag + 0x70) & 0x80, which keeps bit 7 of a byte exactly when its magnitude is >= 0x10 (no carry between
    bytes), and redone one byte at a time."""
    n = b.numel()
    lanes = _lanes(b)
    if mag is None:
        mag = lanes & _L7F
    out = (lanes - _L08).view(torch.uint8)
    lane_idx = (mag + _L70).bitwise_and_(_H80).ne_(_H80).nonzero().squeeze(1)
    if not lane_idx.numel():
        return out[:n].view(b.shape), lane_idx, lane_idx.bool()
    idx = (lane_idx[:, None] * 8 + torch.arange(8)).reshape(-1)
    v = lanes.view(torch.uint8)[idx]
    m = v & 0x7F
    # For m < 0x10 the value is m * 2^-9 (subnormals and exponent 1 alike), and so are the codes below it, so
    # halving is m / 2 rounded to nearest even, stored as that integer.
    small = m < 0x10
    out[idx] = torch.where(small, (v & 0x80) | ((m >> 1) + (m & (m >> 1) & 1)), v - 8)
    keep = small & (idx < n)
    return out[:n].view(b.shape), idx[keep], (m[keep] & 1).bool()


def _grid(n: int, block: int, what: str) -> int:
    if n % block:
        raise KimiInputError(f"{what}: dimension {n} is not a multiple of the {block}-wide FP8 block")
    return n // block


def fp8_to_blockwise(w: torch.Tensor, s: torch.Tensor, src_block: tuple[int, int], block: tuple[int, int],
                     dst: torch.Tensor, name: str) -> tuple[torch.Tensor, Stats]:
    """HF FP8 [out, in] codes + scale_inv grid -> dst[in, out] codes (written in place), scale [in/bi, out/bo]."""
    check_fp8_weight(w, name)  # the rescale below works on the e4m3 bit pattern
    out_f, in_f = w.shape
    bi, bo = block
    go, gi = _grid(out_f, bo, name), _grid(in_f, bi, name)
    grid = list(scale_grid_shape(w.shape, src_block))
    if list(s.shape) != grid or s.dtype != torch.float32:
        raise KimiInputError(f"{name}.weight_scale_inv: expected float32 {grid} for weight {[out_f, in_f]}, "
                             f"got {s.dtype} {list(s.shape)}")
    check_scales(s, f"{name}.weight_scale_inv")
    u = w.view(torch.uint8)
    # One pass over the source in row chunks of whole blocks (~1 MB, within L2): each chunk is checked, halved
    # where needed and copied transposed while it is still in cache.
    step = bo * max(1, _CHUNK // (bo * in_f))
    flags, inexact = [], 0
    for r in range(0, out_f, step):
        f, n = _rescale_transpose(u[r: r + step], (bo, bi), dst[:, r: r + step], name)
        flags.append(f)
        inexact += n
    flag = torch.cat(flags)  # [out/bo, in/bi]
    # Each fine block lies inside one source block (src_block % block == 0 is checked when planning).
    rows, cols = torch.arange(go) * bo // src_block[0], torch.arange(gi) * bi // src_block[1]
    scale = s[rows][:, cols] * torch.where(flag, 2.0, 1.0)
    st = Stats(blocks=go * gi, rescaled=int(flag.sum()), inexact=inexact)
    return scale.t().contiguous(), st


def _rescale_transpose(u: torch.Tensor, block: tuple[int, int], dst: torch.Tensor,
                       name: str) -> tuple[torch.Tensor, int]:
    """dst = u.T with every block of u that holds a code beyond +-240 halved; returns the blocks' flags and how
    many codes the halving changed (odd subnormal-tail codes of halved blocks)."""
    lanes_fit = _lanes_fit(u.shape, block)
    mag = _lanes(u) & _L7F if lanes_fit else None
    flag, nan = _lane_flags(mag, u.shape, block) if lanes_fit else block_flags(u, block)
    if nan:
        raise KimiInputError(f"{name}.weight: holds NaN FP8 codes")
    inexact = 0
    if bool(flag.any()):
        halved, idx, odd = halve_codes(u, mag)
        if idx.numel():  # an odd small code rounds only if its block is one of those halved
            cols = u.shape[1]
            inexact = int((odd & flag[idx // cols // block[0], idx % cols // block[1]]).sum())
        keep = ~flag
        n_keep = int(keep.sum())
        if n_keep * 16 <= keep.numel():  # real DeepSeek-style data: nearly every block is halved
            _restore_blocks(halved, u, keep, block)
        else:
            shape4 = (flag.shape[0], block[0], flag.shape[1], block[1])
            halved = torch.where(flag[:, None, :, None], halved.view(shape4), u.view(shape4)).view(u.shape)
        u = halved
    transpose_into(dst, u)
    return flag, inexact


def _restore_blocks(dst: torch.Tensor, src: torch.Tensor, which: torch.Tensor, block: tuple[int, int]) -> None:
    """dst[block] = src[block] for the (few) blocks marked in `which`."""
    br, bc = block
    for r, c in which.nonzero().tolist():
        dst[r * br:(r + 1) * br, c * bc:(c + 1) * bc] = src[r * br:(r + 1) * br, c * bc:(c + 1) * bc]


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
    x = codes.to(torch.float32)
    (a, b), (sa, sb) = x.shape, scale.shape
    if a % sa or b % sb:
        raise KimiInputError(f"converted expert scale {list(scale.shape)} does not tile weight {list(x.shape)}")
    return x.view(sa, a // sa, sb, b // sb).mul_(scale[:, None, :, None]).view(a, b)
