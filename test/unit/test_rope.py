"""YaRN frequencies, the softmax factor and interleaved RoPE vs transformers (and Kimi's modeling_deepseek.py's
formulation)."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding, apply_rotary_pos_emb, yarn_apply_mscale)

from kimi_k2_neuron.tiny.transformers_oracle import hf_config
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.model.rope import RotaryTable, apply_interleaved_rope, inv_freq, softmax_scale, yarn_ramp_bounds

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def real(name, **rope_overrides):
    raw = json.loads((CONFIGS / name).read_text())
    raw["rope_scaling"].update(rope_overrides)
    return raw


CASES = {
    "k2-instruct factor 32, beta 1/1": real("kimi-k2-instruct.json"),
    "k2-0905 factor 64, beta 1/1": real("kimi-k2-instruct-0905.json"),
    "k2.5-style beta_fast 32": real("kimi-k2-instruct-0905.json", beta_fast=32.0),
}


@pytest.mark.parametrize("raw", CASES.values(), ids=CASES.keys())
def test_inv_freq_and_softmax_scale_match_transformers(raw):
    ours = KimiK2Config.from_dict(raw)
    hf = hf_config(raw)
    rot = DeepseekV3RotaryEmbedding(hf)
    torch.testing.assert_close(inv_freq(ours), rot.inv_freq, rtol=1e-6, atol=0)
    assert rot.attention_scaling == pytest.approx(1.0)  # cos/sin multiplier: mscale / mscale_all_dim = 1
    hf_scale = yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim**-0.5)
    assert softmax_scale(ours) == pytest.approx(hf_scale, rel=1e-12)


def test_softmax_factor_values():
    # 192**-0.5 * (0.1 ln(f) + 1)**2, the numbers in the reference notes
    k32 = KimiK2Config.from_dict(CASES["k2-instruct factor 32, beta 1/1"])
    k64 = KimiK2Config.from_dict(CASES["k2-0905 factor 64, beta 1/1"])
    assert softmax_scale(k32) == pytest.approx(192**-0.5 * (0.1 * math.log(32) + 1) ** 2)
    assert softmax_scale(k64) == pytest.approx(0.144680, abs=1e-6)


def test_beta_one_one_is_a_step():
    cfg = KimiK2Config.from_dict(CASES["k2-0905 factor 64, beta 1/1"])
    assert yarn_ramp_bounds(64, 50000.0, cfg.rope_scaling) == (19, 20)
    base = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    f = inv_freq(cfg)
    torch.testing.assert_close(f[:20], base[:20])  # pairs 0..19 keep the original frequency
    torch.testing.assert_close(f[20:], base[20:] / 64)  # pairs 20..31 are interpolated by the factor


def test_interleaved_rope_matches_transformers_and_modeling_deepseek():
    cfg = KimiK2Config.from_dict(CASES["k2-instruct factor 32, beta 1/1"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g)  # [B, heads, S, rope]
    pos = torch.tensor([[0, 1, 2, 3, 4], [100, 2000, 4096, 50000, 131071]])  # rows at different positions
    cos, sin = RotaryTable(cfg)(pos)
    ours = apply_interleaved_rope(x, cos, sin)
    # HF's rotary module gives cat(freqs, freqs) tables per row; modeling_deepseek.py de-interleaves, then rotate_half.
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_config(CASES["k2-instruct factor 32, beta 1/1"]))(x, pos)
    deint = x.view(2, 3, 5, 32, 2).transpose(4, 3).reshape(2, 3, 5, 64)
    ref, _ = apply_rotary_pos_emb(deint, deint, hf_cos, hf_sin)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
