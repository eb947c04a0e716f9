"""The transformers oracle: transformers' DeepseekV3ForCausalLM fed weights dequantized by other people's code.

Used by the tests and by `kimi-k2-neuron demo`; needs the `test` extra (transformers, compressed-tensors).

- FP8 blocks: transformers' own Fp8Dequantize. It derives the block size from the scale grid, which is only right
  when every dimension is a multiple of 128, so each weight is zero-padded to whole blocks first and cropped after.
- INT4: compressed-tensors' unpack_from_int32, times the group scales expanded by hand.
Nothing from kimi_k2_neuron is used to read or dequantize the checkpoint here.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize


def hf_config(raw: dict) -> DeepseekV3Config:
    rs = raw["rope_scaling"]
    keys = ("vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
            "n_shared_experts n_routed_experts routed_scaling_factor kv_lora_rank q_lora_rank qk_rope_head_dim "
            "v_head_dim qk_nope_head_dim n_group topk_group num_experts_per_tok first_k_dense_replace "
            "norm_topk_prob rms_norm_eps max_position_embeddings").split()
    rope = {"rope_type": "yarn", "rope_theta": raw["rope_theta"],
            **{k: rs[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                  "mscale", "mscale_all_dim")}}
    cfg = DeepseekV3Config(**{k: raw[k] for k in keys}, num_key_value_heads=raw["num_attention_heads"],
                           rope_parameters=rope, rope_interleave=True, num_mtp_layers=0,
                           tie_word_embeddings=False, attention_bias=False)
    cfg._attn_implementation = "eager"
    return cfg


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def hf_fp8_dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = q.shape
    padded = torch.zeros(s.shape[0] * block, s.shape[1] * block, dtype=torch.float32)
    padded[:rows, :cols] = q.float()
    deq = Fp8Dequantize(None)._dequantize_one(padded.to(torch.float8_e4m3fn), s, output_dtype=torch.float32)
    return deq[:rows, :cols]


def ct_int4_dequant(packed, scale, shape, group: int) -> torch.Tensor:
    o, i = (int(v) for v in shape)
    q = unpack_from_int32(packed, 4, torch.Size([o, i])).float()
    return q * scale.float().repeat_interleave(group, dim=1)[:, :i]


def dense_state(model_dir: Path, raw_cfg: dict) -> dict[str, torch.Tensor]:
    raw = _read_all(model_dir)
    group = None
    if raw_cfg.get("quantization_config", {}).get("quant_method") == "compressed-tensors":
        group = raw_cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    dense = {}
    for k, t in raw.items():
        if k.endswith("rotary_emb.inv_freq") or k.endswith(("_scale_inv", "weight_scale", "weight_shape")):
            continue
        if k.endswith(".weight_packed"):
            base = k[: -len("_packed")]
            dense[base] = ct_int4_dequant(t, raw[base + "_scale"], raw[base + "_shape"], group)
        elif t.dtype == torch.float8_e4m3fn:
            dense[k] = hf_fp8_dequant(t, raw[k + "_scale_inv"])
        else:
            dense[k] = t.float()
    return dense


def hf_state_dict(dense: dict[str, torch.Tensor], raw_cfg: dict) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> HF's fused expert parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    sd = {k: v for k, v in dense.items() if ".mlp.experts." not in k}
    for layer in range(raw_cfg["first_k_dense_replace"], raw_cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        e_range = range(raw_cfg["n_routed_experts"])
        sd[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([dense[f"{p}.{e}.gate_proj.weight"], dense[f"{p}.{e}.up_proj.weight"]]) for e in e_range])
        sd[f"{p}.down_proj"] = torch.stack([dense[f"{p}.{e}.down_proj.weight"] for e in e_range])
    return sd


def hf_model(model_dir, dtype=torch.float32) -> DeepseekV3ForCausalLM:
    model_dir = Path(model_dir)
    raw_cfg = json.loads((model_dir / "config.json").read_text())
    model = DeepseekV3ForCausalLM(hf_config(raw_cfg)).eval()
    sd = hf_state_dict(dense_state(model_dir, raw_cfg), raw_cfg)
    model.load_state_dict(sd, strict=True)
    return model.to(dtype)


@torch.no_grad()
def hf_logits(model, rows: list[list[int]], prefill_len: int | None = None) -> torch.Tensor:
    """Prefill the first K tokens in one call, then feed the rest one at a time through HF's KV cache."""
    ids = torch.tensor(rows)
    k = ids.shape[1] if prefill_len is None else prefill_len
    # transformers 5.x names the KV cache `cache` (past_key_values still works, with a deprecation warning per call)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids[:, :k], use_cache=True)
    logits, past = [out.logits.float()], getattr(out, key)
    for t in range(k, ids.shape[1]):
        out = model(ids[:, t:t + 1], **{key: past}, use_cache=True)
        logits.append(out.logits.float())
        past = getattr(out, key)
    return torch.cat(logits, dim=1)
