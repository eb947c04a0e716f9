"""YaRN rotary embedding as Kimi's modeling_deepseek.py defines it, on interleaved pairs. Easy to get wrong (tested
against transformers): the floor/ceil'd correction range makes the ramp a step at beta_fast == beta_slow == 1, and the
logits scale by mscale(factor, mscale_all_dim)**2."""

from __future__ import annotations

import math

import torch

from ..config import KimiK2Config, YarnScaling


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, orig_max_pos: int) -> float:
    """The rotary dimension whose wavelength fits `num_rotations` times into the original context."""
    return dim * math.log(orig_max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_bounds(dim: int, base: float, ys: YarnScaling) -> tuple[int, int]:
    low = math.floor(_correction_dim(ys.beta_fast, dim, base, ys.original_max_position_embeddings))
    high = math.ceil(_correction_dim(ys.beta_slow, dim, base, ys.original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def inv_freq(cfg: KimiK2Config) -> torch.Tensor:
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    # device="cpu": the layer-streamed mode builds the model under a meta-device context.
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    ys = cfg.rope_scaling
    if ys is None:
        return extra
    low, high = yarn_ramp_bounds(dim, base, ys)
    span = (high - low) if high != low else 0.001  # modeling_deepseek.py's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span).clamp(0, 1)
    keep = 1.0 - ramp  # 1 = keep the original (extrapolated) frequency, 0 = interpolate by `factor`
    return extra / ys.factor * (1 - keep) + extra * keep


def cos_sin_scale(cfg: KimiK2Config) -> float:
    """Multiplier on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim); 1.0 for every Kimi config."""
    ys = cfg.rope_scaling
    if ys is None:
        return 1.0
    return yarn_get_mscale(ys.factor, ys.mscale) / yarn_get_mscale(ys.factor, ys.mscale_all_dim)


def softmax_scale(cfg: KimiK2Config) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (2.0047 for factor 64)."""
    scale = cfg.qk_head_dim**-0.5
    ys = cfg.rope_scaling
    if ys is not None and ys.mscale_all_dim:
        m = yarn_get_mscale(ys.factor, ys.mscale_all_dim)
        scale *= m * m
    return scale


class RotaryTable:

    def __init__(self, cfg: KimiK2Config):
        self.inv_freq = inv_freq(cfg)
        self.mscale = cos_sin_scale(cfg)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin [B, S, rope_dim/2] in float32 (one angle per rotary pair)."""
        # In a traced graph the CPU table becomes a constant on the XLA device.
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return angles.cos() * self.mscale, angles.sin() * self.mscale


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjacent pairs permuted half-split as modeling_deepseek.py does, the same for q and k (the cache holds k so)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
