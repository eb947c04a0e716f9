"""Weight (de)quantisation for the Kimi-K2 checkpoint formats: blockwise FP8 and packed INT4; and the checks every
stored weight passes (dtype, finiteness)."""

import math

import torch

from ..errors import KimiInputError

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # an unquantized source weight's
_NAN_CODES = (0x7F, 0xFF)  # float8_e4m3fn has no inf; these two bytes are its NaNs


def check_plain(t: torch.Tensor, what: str) -> None:
    """A source weight with no scales beside it is a float tensor; integer or FP8 bytes alone mean nothing."""
    if t.dtype not in PLAIN_DTYPES:
        raise KimiInputError(f"{what} has dtype {t.dtype}, expected bf16/fp16/fp32 (or a quantized weight with its "
                             f"scales)")


def nan_codes(codes: torch.Tensor) -> bool:
    """Whether float8_e4m3fn bytes hold a NaN (0x7f or 0xff): two byte-max reductions, no per-element pass."""
    u = codes.view(torch.uint8)
    return u.numel() > 0 and (int(u.max()) == 0xFF or int(u.view(torch.int8).max()) == 0x7F)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in a float tensor. Summed first (a NaN or inf anywhere makes the sum NaN or inf, and torch's
    sum runs several times faster than isfinite); only a non-finite sum, which finite values can also give by
    overflowing, is checked element by element."""
    if not t.is_floating_point() or t.numel() == 0 or math.isfinite(float(t.sum())):  # (a dtype= copies bf16)
        return True
    return bool(torch.isfinite(t).all())


def check_finite(t: torch.Tensor, what: str) -> None:
    """A NaN or inf weight poisons every activation after it, silently: refuse it by name. FP8 codes are checked
    for the NaN bytes."""
    if t.dtype == torch.float8_e4m3fn:
        if nan_codes(t):
            raise KimiInputError(f"{what}: holds NaN FP8 codes ({'/'.join(hex(c) for c in _NAN_CODES)}); "
                                 f"expected finite weights")
    elif not all_finite(t):
        raise KimiInputError(f"{what}: contains NaN or inf; expected finite values")
