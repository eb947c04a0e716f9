"""NxD's FP8 expert layout: [in, out] e4m3 codes within +-240 (Neuron's compiler reads e4m3fn exponent 15 as
inf/NaN) and a float32 scale grid. fp8_to_blockwise halves a block's codes where one exceeds 240 (exact but for odd
subnormal-tail codes). Byte tricks: for m = b & 0x7F, |value| <= 240 <=> m <= 0x77, and 0x7F is NaN."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

import torch

from ..errors import KimiInputError
from . import check_finite
from .fp8 import check_fp8_weight, check_scales, fp8_values, scale_grid_shape
from .int4 import check_group_scale, unpack_int4

try:  # the C kernel (setup.py builds it at install); without it the torch steps below (the benchmark's conversion:
    from . import _fp8_bytes as _kernel  # 2.03 against 1.24 CPU-s/GB, docs/converter.md)
except ImportError:
    _kernel = None
KERNEL_BUILT = _kernel is not None
NO_KERNEL = ("FP8 expert codes go through the torch steps: the C kernel quant/_fp8_bytes.c is not built (about 1.6x "
             "the CPU time; reinstall the package where a C compiler is installed)")

FP8 = torch.float8_e4m3fn
FP8_MAX = 240.0
FP8_MAX_BYTE = 0x77
# Source bytes per rescale step: few torch calls per MB, and the step's passes stay in L2 (1 MB per core here).
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


_work = threading.local()  # each thread's int32 staging buffer for transpose_into (reused: no page faults)


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:, :] = src.T for byte matrices: the C kernel, else in two torch steps, each faster than torch's byte
    transpose (~0.6 against ~0.8 CPU-s/GB here): an int32 transpose, whose lanes hold 4 consecutive columns of a row,
    then each group of 4 output rows pulled out of those lanes (a copy with a 4-byte input stride)."""
    rows, cols = src.shape
    if _kernel is not None and _bytes_pair(dst, src):
        _kernel.transpose(src.data_ptr(), dst.data_ptr(), rows, cols)
        return
    if not (dst.is_contiguous() and src.is_contiguous() and src.element_size() == dst.element_size() == 1
            and cols % 4 == 0 and src.storage_offset() % 4 == 0 and rows * cols >= 1 << 16):
        dst.copy_(src.t() if dst.is_contiguous() else src.t().contiguous())
        return
    n = rows * cols
    buf = getattr(_work, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _work.buf = torch.empty(n, dtype=torch.uint8)
    lanes = buf[:n].view(torch.int32).view(cols // 4, rows)
    lanes.copy_(src.view(torch.uint8).view(torch.int32).t())
    out = dst.view(torch.uint8).view(cols // 4, 4, rows)
    out.copy_(buf[:n].view(cols // 4, rows, 4).transpose(1, 2))


def _bytes_pair(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """What the C kernel takes: contiguous byte matrices in CPU memory, dst shaped as src's transpose."""
    return (dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()
            and src.element_size() == dst.element_size() == 1 and src.dim() == 2
            and tuple(dst.shape) == tuple(src.shape[::-1]))


def _kernel_takes(dst: torch.Tensor, u: torch.Tensor, block: tuple[int, int]) -> bool:
    return _kernel is not None and _bytes_pair(dst, u) and u.shape[0] % block[0] == 0 and u.shape[1] % block[1] == 0


def rescale_transposed(dst: torch.Tensor, u: torch.Tensor, block: tuple[int, int],
                       name: str) -> tuple[torch.Tensor, int]:
    """dst[:, :] = u.T, every [br, bc] block of u holding a code beyond +-240 halved -> (flags [rows/br, cols/bc],
    codes rounded). The C kernel does it in one pass per strip of blocks, leaving u as it is; the torch fallback
    halves u in place."""
    rows, cols = u.shape
    br, bc = block
    if not _kernel_takes(dst, u, block):
        flag, inexact = rescale_blocks(u, block, name)
        transpose_into(dst, u)
        return flag, inexact
    flags = torch.empty(rows // br, cols // bc, dtype=torch.uint8)
    inexact = _kernel.expert(u.data_ptr(), dst.data_ptr(), rows, cols, br, bc, flags.data_ptr())
    if inexact < 0:
        raise KimiInputError(_NAN.format(name))
    return flags.bool(), inexact


def _i64(pattern: str) -> int:
    """A byte repeated over an int64 lane, as the signed value torch needs."""
    x = int(pattern * 8, 16)
    return x - (1 << 64) if x >= 1 << 63 else x


_L01, _L08, _L7F, _H80 = (_i64(b) for b in ("01", "08", "7f", "80"))
_NAN = "{}.weight: holds NaN FP8 codes (0x7f/0xff); expected finite weights"


def halve_codes(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (no NaN) -> bytes of half the value. m >= 0x10 loses one exponent step (m - 8, exact); below, the
    value is m * 2^-9, so the half is m / 2 rounded to nearest even."""
    m = b & 0x7F
    return torch.where(m < 0x10, (b & 0x80) | ((m >> 1) + (m & (m >> 1) & 1)), b - 8)


def inexact_halves(b: torch.Tensor) -> int:
    m = b & 0x7F
    return int(((m < 0x10) & (m & 1).bool()).sum())


def block_flags(b: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, bool]:
    """[rows/br, cols/bc] bool: the block holds a code beyond +-240; and whether any code is NaN."""
    return _flags(_magnitudes(b, block[0], False)[0], block[1])


def _lanes_fit(b: torch.Tensor, bc: int) -> bool:
    """Whether int64 lanes of 8 codes tile b's rows and the blocks' columns."""
    return b.shape[1] % 8 == 0 and bc % 8 == 0 and b.storage_offset() % 8 == 0


def _magnitudes(b: torch.Tensor, br: int, minima: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per column and br rows, the largest magnitude m = b & 0x7F (and per 8 rows the smallest). One mask and
    outer-dimension reductions (an inner one over a block's 32 bytes runs ~30x slower), in L2-sized chunks."""
    rows, cols = b.shape
    largest = torch.empty(rows // br, cols, dtype=torch.uint8)
    smallest = torch.empty(rows // 8, cols, dtype=torch.uint8) if minima else None
    step = br * max(1, _CHUNK // (br * cols))
    lanes = cols % 8 == 0 and b.storage_offset() % 8 == 0
    for r in range(0, rows, step):
        c = b[r: r + step]
        n = c.shape[0]
        m = (c.view(torch.int64) & _L7F).view(torch.uint8) if lanes else c & 0x7F
        torch.amax(m.view(n // br, br, cols), 1, out=largest[r // br: (r + n) // br])
        if minima:
            torch.amin(m.view(n // 8, 8, cols), 1, out=smallest[r // 8: (r + n) // 8])
    return largest, smallest


def _flags(largest: torch.Tensor, bc: int) -> tuple[torch.Tensor, bool]:
    """From the column maxima of m: blocks holding m > 0x77 (beyond +-240), and whether any m is 0x7F (NaN).
    Lane-wise, m + 0x08 (or + 0x01) sets a byte's top bit exactly when m >= 0x78 (or m == 0x7F): no carries, as
    m <= 0x7F."""
    rows, cols = largest.shape
    if not rows * cols:
        return torch.zeros(rows, cols // bc, dtype=torch.bool), False
    if not _lanes_fit(largest, bc):
        most = largest.view(rows, cols // bc, bc).amax(-1)
        return most > FP8_MAX_BYTE, int(most.max()) == 0x7F
    x = largest.view(torch.int64)
    over = (((x + _L08) & _H80) != 0).view(rows, cols // bc, bc // 8).any(-1)
    return over, bool(((x + _L01) & _H80).any())


def _grid(n: int, block: int, what: str) -> int:
    if n % block:
        raise KimiInputError(f"{what}: dimension {n} is not a multiple of the {block}-wide FP8 block")
    return n // block


def fp8_to_blockwise(w: torch.Tensor, s: torch.Tensor, src_block: tuple[int, int], block: tuple[int, int],
                     dst: torch.Tensor, name: str, inplace: bool = False) -> tuple[torch.Tensor, Stats]:
    """HF FP8 [out, in] + scale_inv -> dst[in, out] codes, scale [in/bi, out/bo]; inplace lets the torch fallback
    rescale w's own bytes."""
    check_fp8_weight(w, name)  # the rescale below works on the e4m3 bit pattern
    out_f, in_f = w.shape
    bi, bo = block
    _grid(out_f, bo, name), _grid(in_f, bi, name)
    u = w.view(torch.uint8)
    if not (inplace or _kernel_takes(dst, u, (bo, bi))):
        u = u.clone()
    flag, inexact = rescale_transposed(dst, u, (bo, bi), name)
    scale = blockwise_scale(s, (out_f, in_f), src_block, block, flag, name)
    return scale, Stats(blocks=flag.numel(), rescaled=int(flag.sum()), inexact=inexact)


def blockwise_scale(s: torch.Tensor, shape: tuple[int, int], src_block: tuple[int, int], block: tuple[int, int],
                    flag: torch.Tensor, name: str) -> torch.Tensor:
    """scale_inv repeated onto the finer grid [in/bi, out/bo], doubled where flag [out/bo, in/bi] halved codes."""
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
    """Halve in place every [br, bc] block holding a code beyond +-240 -> (flags [rows/br, cols/bc], codes rounded).
    Subtracting 8 per byte of an int64 lane is exact for magnitudes >= 0x10; lanes of 8 x 8 tiles holding a smaller
    one are redone byte by byte. Work is per matrix, not per chunk: torch's ~10 us per call would dominate."""
    br, bc = block
    rows, cols = u.shape
    if not u.numel():
        return torch.zeros(rows // br, cols // bc, dtype=torch.bool), 0
    lanes_fit = _lanes_fit(u, bc) and br % 8 == 0  # else lanes or 8-row groups straddle blocks
    largest, smallest = _magnitudes(u, br, lanes_fit)
    flag, nan = _flags(largest, bc)
    if nan:
        raise KimiInputError(_NAN.format(name))
    n_flag = int(flag.sum())
    if not n_flag:
        return flag, 0
    if not lanes_fit:  # (tiny shapes) byte by byte
        per_code = flag.repeat_interleave(br, 0).repeat_interleave(bc, 1)
        inexact = inexact_halves(u[per_code])
        u.copy_(torch.where(per_code, halve_codes(u), u))
        return flag, inexact
    # A zero byte in an int64 lane of the 8-row minima (high nibbles) marks an 8 x 8 tile holding a magnitude below
    # 0x10 ((v - 0x01..) & ~v & 0x80.. is nonzero exactly when v has a zero byte): byte arithmetic, no comparisons.
    m = smallest.bitwise_and_(0xF0).view(torch.int64)
    group, lane = ((m - _L01).bitwise_and_(~m).bitwise_and_(_H80) != 0).nonzero(as_tuple=True)
    keep = flag[group // (br // 8), lane // (bc // 8)]  # tiles of halved blocks only
    group, lane = group[keep], lane[keep]
    lanes = u.view(torch.int64).view(rows, cols // 8)
    r, c = (group[:, None] * 8 + torch.arange(8)).reshape(-1), lane.repeat_interleave(8)
    tiles = lanes[r, c].view(torch.uint8)  # the original codes of those tiles' lanes, halved byte by byte below
    inexact = inexact_halves(tiles)  # (only magnitudes below 0x10 can be inexact)
    fixed = halve_codes(tiles).view(torch.int64)
    if 2 * n_flag >= flag.numel():  # (the usual case) every lane, then the few unflagged blocks put back
        bi, bj = (~flag).nonzero(as_tuple=True)
        blocks = u.view(rows // br, br, cols // bc, bc)
        kept = blocks[bi, :, bj, :]
        lanes.sub_(_L08)
        blocks[bi, :, bj, :] = kept
    else:  # unflagged blocks subtract 0
        amount = flag.repeat_interleave(bc // 8, 1).to(torch.int64).mul_(_L08)
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
    """FP8 [in, out] codes and scale -> float32; blocks inferred from the shapes, as NxD's dequantize does."""
    if not torch.isfinite(scale).all():
        raise KimiInputError("converted expert scale contains NaN or inf")
    check_finite(codes, "converted expert codes")
    x = fp8_values(codes)
    (a, b), (sa, sb) = x.shape, scale.shape
    if a % sa or b % sb:
        raise KimiInputError(f"converted expert scale {list(scale.shape)} does not tile weight {list(x.shape)}")
    return x.view(sa, a // sa, sb, b // sb).mul_(scale[:, None, :, None]).view(a, b)
