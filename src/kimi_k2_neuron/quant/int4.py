"""compressed-tensors "pack-quantized" INT4 (Kimi-K2-Thinking / K2.5 routed experts): ``weight_packed`` int32
[O, ceil(I/8)], 8 nibbles q + 8 per word, low nibble first; ``weight_scale`` bf16 [O, ceil(I/group)]; ``weight_shape``
[O, I]. Symmetric: ``w = q * scale[:, k // group]``."""

from __future__ import annotations

import math

import torch

from kimi_k2_neuron.errors import KimiInputError

NUM_BITS = 4
PACK_FACTOR = 32 // NUM_BITS
OFFSET = 1 << (NUM_BITS - 1)  # stored nibble = q + 8, so [-8, 7] maps onto [0, 15]
Q_MIN, Q_MAX = -OFFSET, OFFSET - 1
DEFAULT_GROUP = 32

# Shifts are arithmetic (not a byte view) so the result does not depend on host endianness.
_SHIFTS = torch.arange(0, 32, NUM_BITS, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, in_features: int, *, name: str = "weight") -> torch.Tensor:
    """int32 [O, ceil(I/8)] -> int8 [O, in_features] with values in [-8, 7]."""
    out_f = packed.shape[0] if isinstance(packed, torch.Tensor) and packed.dim() == 2 else -1
    _check_packed(packed, out_f, in_features, name)
    # `& 0xF` discards `>>`'s sign extension; in place, so one int32 temporary of the unpacked size.
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)).bitwise_and_(0xF).sub_(OFFSET)
    return nibbles.flatten(1)[:, :in_features].to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [O, I] in [-8, 7] -> int32 [O, ceil(I/8)], bit-identical to compressed-tensors' pack_to_int32."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        raise KimiInputError("pack_int4: expected a 2-D int8 tensor of INT4 values")
    if q.numel() and (q.min() < Q_MIN or q.max() > Q_MAX):
        raise KimiInputError(f"pack_int4: values must lie in [{Q_MIN}, {Q_MAX}], got [{int(q.min())}, {int(q.max())}]")
    out_f, in_f = q.shape
    words = math.ceil(in_f / PACK_FACTOR)
    # Offset first, then pad with raw 0 nibbles: that is what compressed-tensors writes into the unused tail.
    u = torch.nn.functional.pad(q.to(torch.int64) + OFFSET, (0, words * PACK_FACTOR - in_f))
    # Fields are disjoint, so the sum is a bitwise OR; int64 avoids overflow when nibble 7 reaches bit 31.
    packed = (u.view(out_f, words, PACK_FACTOR) << _SHIFTS.to(q.device, torch.int64)).sum(-1)
    # Reinterpret [0, 2^32) as two's-complement int32 explicitly instead of relying on a wrapping cast.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _check_packed(packed, out_f: int, in_f: int, name: str) -> None:
    want = [out_f, math.ceil(in_f / PACK_FACTOR)]
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32 or list(packed.shape) != want:
        got = f"{packed.dtype} {list(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise KimiInputError(f"{name}.weight_packed: expected int32 {want} for weight_shape {[out_f, in_f]}, got {got}")


def _weight_shape(weight_shape, name: str) -> tuple[int, int]:
    dims = weight_shape.tolist() if isinstance(weight_shape, torch.Tensor) else list(weight_shape)
    if isinstance(weight_shape, torch.Tensor) and weight_shape.dim() != 1:
        dims = []  # a [1, 2] tensor would flatten to something that looks right
    if len(dims) != 2 or any(int(d) != d or d <= 0 for d in dims):
        raise KimiInputError(f"{name}.weight_shape: expected 2 positive integers [out, in], got {dims}")
    return int(dims[0]), int(dims[1])


def check_group_scale(scale, out_f: int, n_groups: int, group_size: int, name: str) -> None:
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or list(scale.shape) != [out_f, n_groups]:
        got = f"{scale.dtype} {list(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise KimiInputError(
            f"{name}.weight_scale: expected floating [{out_f}, {n_groups}] (group_size {group_size}), got {got}"
        )
    if not torch.isfinite(scale).all():
        raise KimiInputError(f"{name}.weight_scale: contains NaN or inf; expected finite scales")


def dequantize_group(
    packed: torch.Tensor,
    scale: torch.Tensor,
    weight_shape,
    group_size: int = DEFAULT_GROUP,
    out_dtype: torch.dtype = torch.float32,
    name: str = "weight",
) -> torch.Tensor:
    """Packed INT4 + per-group scales -> dense [O, I]; the last group may be partial, as in compressed-tensors."""
    if group_size <= 0:
        raise KimiInputError(f"{name}: group_size must be positive, got {group_size}")
    out_f, in_f = _weight_shape(weight_shape, name)
    _check_packed(packed, out_f, in_f, name)
    check_group_scale(scale, out_f, math.ceil(in_f / group_size), group_size, name)

    out = unpack_int4(packed, in_f, name=name).to(torch.float32)
    s = scale.to(torch.float32)
    # Full groups via a broadcast view, the partial tail separately: no weight-sized scale tensor is built.
    full = (in_f // group_size) * group_size
    if full:
        out[:, :full].unflatten(1, (full // group_size, group_size)).mul_(s[:, : full // group_size, None])
    if full < in_f:
        out[:, full:].mul_(s[:, -1:])
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def quantize_group(
    weight: torch.Tensor, group_size: int = DEFAULT_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [O, I] -> (weight_packed int32, weight_scale bf16, weight_shape int32), symmetric minmax per group."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise KimiInputError("weight: expected a 2-D floating-point tensor to quantise")
    if not torch.isfinite(weight).all():
        raise KimiInputError("weight: contains NaN or inf; cannot quantise to INT4")
    if group_size <= 0:
        raise KimiInputError(f"weight: group_size must be positive, got {group_size}")
    out_f, in_f = weight.shape
    n_groups = math.ceil(in_f / group_size)
    # Zero padding cannot raise a group's amax, so a partial last group gets the amax of its real part.
    w = torch.nn.functional.pad(weight.to(torch.float32), (0, n_groups * group_size - in_f))
    w = w.view(out_f, n_groups, group_size)
    amax = w.abs().amax(dim=-1)
    # compressed-tensors calculate_qparams (symmetric): scale = max|w| / ((q_max - q_min) / 2) = amax / 7.5, and a
    # zero scale becomes finfo(weight dtype).eps so all-zero groups stay divisible.
    eps = torch.finfo(weight.dtype).eps
    scale = (amax / ((Q_MAX - Q_MIN) / 2)).to(torch.bfloat16)
    # Re-check after the bf16 cast: a tiny float32 scale can round to 0 in bf16.
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=torch.bfloat16), scale)
    # Quantise with the stored (bf16-rounded) scale so dequantize_group gives exactly q * scale.
    q = torch.round(w / scale.to(torch.float32)[..., None]).clamp_(Q_MIN, Q_MAX).to(torch.int8)
    packed = pack_int4(q.view(out_f, -1)[:, :in_f])
    return packed, scale, torch.tensor([out_f, in_f], dtype=torch.int32)
