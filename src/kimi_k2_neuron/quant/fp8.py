"""DeepSeek-V3 / Kimi-K2 blockwise FP8: ``weight_scale_inv`` is a multiplier despite its name, on a ceil-sized grid
of 128x128 blocks (kv_a_proj_with_mqa's 576 rows -> 5 blocks, the last partial)."""

from __future__ import annotations

import math

import torch

from kimi_k2_neuron.errors import KimiInputError

from . import check_finite

FP8_DTYPE = torch.float8_e4m3fn
E4M3FN_MAX = 448.0
DEFAULT_BLOCK = (128, 128)


def _check_block(block) -> tuple[int, int]:
    # The block comes from quantization_config.weight_block_size, i.e. user data.
    if len(block) != 2 or any(int(b) != b or b <= 0 for b in block):
        raise KimiInputError(f"weight_block_size: expected two positive integers, got {list(block)}")
    return int(block[0]), int(block[1])


def scale_grid_shape(weight_shape, block=DEFAULT_BLOCK) -> tuple[int, int]:
    bo, bi = _check_block(block)
    out_f, in_f = weight_shape
    return math.ceil(out_f / bo), math.ceil(in_f / bi)


def check_scales(scale_inv: torch.Tensor, what: str) -> None:
    # A NaN/inf or non-positive scale silently poisons a whole 128x128 tile, so refuse it up front.
    if not torch.isfinite(scale_inv).all():
        raise KimiInputError(f"{what}: contains NaN or inf; expected finite positive scales")
    if (scale_inv <= 0).any():
        raise KimiInputError(f"{what}: contains values <= 0; expected positive scales")


_DEQUANT_STEP = 1 << 18  # codes per step of dequantize_blockwise


def _scale_rows_inplace(x: torch.Tensor, col_scale: torch.Tensor, bo: int) -> None:
    """x[i, :] *= col_scale[i // bo, :] in place, building no weight-sized scale tensor."""
    full = (x.shape[0] // bo) * bo
    if full:
        x[:full].unflatten(0, (full // bo, bo)).mul_(col_scale[: full // bo, None, :])
    if full < x.shape[0]:
        x[full:].mul_(col_scale[-1])


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of e4m3fn codes; NaN codes come out finite, so refuse them first. Through float16, whose
    conversions are vectorized (torch's float8 ones are not): a byte shifted left by 7 is the float16 of value / 256."""
    h = codes.view(torch.int8).to(torch.int16)  # sign-extended: bit 14 comes out set on negative codes ...
    h.bitwise_left_shift_(7).bitwise_and_(~0x4000)  # ... and is cleared here
    return h.view(torch.float16).to(torch.float32).mul_(256.0)


def check_fp8_weight(weight, name: str) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8_DTYPE or weight.dim() != 2:
        got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise KimiInputError(f"{name}.weight: expected a 2-D float8_e4m3fn tensor, got {got}")


def dequantize_blockwise(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block=DEFAULT_BLOCK,
    out_dtype: torch.dtype = torch.float32,
    name: str = "weight",
) -> torch.Tensor:
    """FP8 [O, I] weight x float32 block scales -> dense [O, I] in ``out_dtype`` (math done in float32)."""
    bo, bi = _check_block(block)
    check_fp8_weight(weight, name)
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32:
        got = scale_inv.dtype if isinstance(scale_inv, torch.Tensor) else type(scale_inv).__name__
        raise KimiInputError(f"{name}.weight_scale_inv: expected float32, got {got}")
    grid = scale_grid_shape(weight.shape, (bo, bi))
    if tuple(scale_inv.shape) != grid:
        raise KimiInputError(
            f"{name}.weight_scale_inv: expected shape {list(grid)} for weight {list(weight.shape)} "
            f"with block {[bo, bi]}, got {list(scale_inv.shape)}"
        )
    check_scales(scale_inv, f"{name}.weight_scale_inv")
    check_finite(weight, f"{name}.weight")  # NaN codes (fp8_values would make them finite)

    col_scale = scale_inv.repeat_interleave(bi, dim=1)[:, : weight.shape[1]]  # [ceil(O/bo), I]: 1/bo of the weight
    out = torch.empty(weight.shape, dtype=out_dtype)
    # Whole blocks of rows at a time, ~1 MB of float32 each: the passes stay in cache and no weight-sized float32
    # buffer is made (its fresh pages cost more than the arithmetic): ~0.6 against ~3.3 ns per code here, same bits.
    step = bo * max(1, _DEQUANT_STEP // (bo * max(1, weight.shape[1])))
    for r in range(0, weight.shape[0], step):
        part = fp8_values(weight[r: r + step])
        _scale_rows_inplace(part, col_scale[r // bo: (r + part.shape[0] + bo - 1) // bo], bo)
        out[r: r + part.shape[0]].copy_(part)
    return out


def quantize_blockwise(
    weight: torch.Tensor, block=DEFAULT_BLOCK, fp8_max: float = E4M3FN_MAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [O, I] -> (float8_e4m3fn codes [O, I], float32 scale_inv grid) with scale_inv = block amax / fp8_max."""
    bo, bi = _check_block(block)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise KimiInputError("weight: expected a 2-D floating-point tensor to quantise")
    if not torch.isfinite(weight).all():
        raise KimiInputError("weight: contains NaN or inf; cannot quantise to FP8")
    out_f, in_f = weight.shape
    n_o, n_i = scale_grid_shape(weight.shape, (bo, bi))
    # Zero-pad to whole blocks: zeros never raise a block's amax, so edge blocks get the amax of their real part.
    w = torch.nn.functional.pad(weight.to(torch.float32), (0, n_i * bi - in_f, 0, n_o * bo - out_f))
    blocks = w.view(n_o, bo, n_i, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block would give scale 0 and 0/0 codes; any positive scale encodes it exactly, 1.0 is simplest.
    scale_inv = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    # Clamp because amax / (amax / fp8_max) can round to a hair above fp8_max.
    codes = (blocks / scale_inv[:, None, :, None]).clamp_(-fp8_max, fp8_max).to(FP8_DTYPE)
    return codes.view(n_o * bo, n_i * bi)[:out_f, :in_f].contiguous(), scale_inv
