"""Weight (de)quantisation (blockwise FP8, packed INT4) and the dtype and finiteness checks every weight passes."""

import math

import torch

from ..errors import KimiInputError

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAN_CODES = (0x7F, 0xFF)  # float8_e4m3fn has no inf; these two bytes are its NaNs


def check_plain(t: torch.Tensor, what: str) -> None:
    if t.dtype not in PLAIN_DTYPES:
        raise KimiInputError(f"{what} has dtype {t.dtype}, expected bf16/fp16/fp32 (or a quantized weight with its "
                             f"scales)")


def nan_codes(codes: torch.Tensor) -> bool:
    """Two byte-max reductions, no per-element pass."""
    u = codes.view(torch.uint8)
    return u.numel() > 0 and (int(u.max()) == 0xFF or int(u.view(torch.int8).max()) == 0x7F)


def all_finite(t: torch.Tensor) -> bool:
    """Summed first, several times faster than isfinite; only a non-finite sum (or an overflow) is checked per
    element."""
    if not t.is_floating_point() or t.numel() == 0 or math.isfinite(float(t.sum())):  # (a dtype= copies bf16)
        return True
    return bool(torch.isfinite(t).all())


def check_finite(t: torch.Tensor, what: str) -> None:
    if t.dtype == torch.float8_e4m3fn:
        if nan_codes(t):
            raise KimiInputError(f"{what}: holds NaN FP8 codes ({'/'.join(hex(c) for c in _NAN_CODES)}); "
                                 f"expected finite weights")
    elif not all_finite(t):
        raise KimiInputError(f"{what}: contains NaN or inf; expected finite values")
