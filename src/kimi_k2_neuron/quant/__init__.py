"""Weight (de)quantisation for the Kimi-K2 checkpoint formats: blockwise FP8 and packed INT4."""

import torch

from ..errors import KimiInputError

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # an unquantized source weight's


def check_plain(t: torch.Tensor, what: str) -> None:
    """A source weight with no scales beside it is a float tensor; integer or FP8 bytes alone mean nothing."""
    if t.dtype not in PLAIN_DTYPES:
        raise KimiInputError(f"{what} has dtype {t.dtype}, expected bf16/fp16/fp32 (or a quantized weight with its "
                             f"scales)")
