"""A tiny random EAGLE3 draft for a tiny target (`make-tiny OUT --draft-for TARGET`), stored as the public Llama EAGLE3
drafts are (TorchSpec's and SpecForge's LlamaForCausalLMEagle3: config.json + one model.safetensors, the layer named
`midlayer.`, bf16, the target's embedding copied in as trained drafts carry it frozen), so `--draft` reads it as it
reads a real one (checkpoint/draft.py). A test fixture: its weights are random, so it proposes tokens the target
rarely accepts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.draft import ARCHITECTURE, MIN_TARGET_LAYERS, aux_layer_ids
from ..checkpoint.source import WeightSource
from ..config import KimiK2Config
from ..errors import KimiInputError
from ..interrupts import atomic_folder, save_safetensors, write_error

DRAFT_HEADS = 4  # splits over 2 ranks, as the tier runs
DRAFT_INTERMEDIATE_FACTOR = 2
EMBEDDING = "model.embed_tokens.weight"  # the logical name (WeightSource's), whatever the target stores it under


def tiny_draft_config(target: KimiK2Config) -> dict:
    """config.json of TorchSpec's Kimi-K2.5 draft (configs/draft_models/kimi_k25_eagle3.json) at the target's size."""
    h = target.hidden_size
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": h,
            "intermediate_size": DRAFT_INTERMEDIATE_FACTOR * h, "num_hidden_layers": 1,
            "num_attention_heads": DRAFT_HEADS, "num_key_value_heads": DRAFT_HEADS, "head_dim": h // DRAFT_HEADS,
            "vocab_size": target.vocab_size, "max_position_embeddings": target.max_position_embeddings,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": target.bos_token_id, "eos_token_id": target.eos_token_ids[0],
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids(target.num_hidden_layers))}


def tiny_draft_tensors(cfg: dict, embedding: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """The public layout's tensors: linear weights N(0, 1/fan_in), norms 1 + 0.1 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = kv = cfg["num_attention_heads"] * cfg["head_dim"]

    def linear(rows, cols):
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    def norm():
        return 1 + 0.1 * torch.randn(h, generator=g)

    t = {"embed_tokens.weight": embedding.float(), "fc.weight": linear(h, 3 * h),
         "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
         "midlayer.post_attention_layernorm.weight": norm(),
         "midlayer.self_attn.q_proj.weight": linear(q, 2 * h), "midlayer.self_attn.k_proj.weight": linear(kv, 2 * h),
         "midlayer.self_attn.v_proj.weight": linear(kv, 2 * h), "midlayer.self_attn.o_proj.weight": linear(h, q),
         "midlayer.mlp.gate_proj.weight": linear(i, h), "midlayer.mlp.up_proj.weight": linear(i, h),
         "midlayer.mlp.down_proj.weight": linear(h, i), "norm.weight": norm(), "lm_head.weight": linear(v, h)}
    return {k: x.to(torch.bfloat16).contiguous() for k, x in t.items()}


def make_tiny_draft(out: str | Path, target: str | Path, seed: int = 0) -> Path:
    """Write a tiny draft for the checkpoint `target` (raw in any release's layout, or converted) to the new folder
    `out`, apart from it; written to a hidden folder and renamed at the end (interrupts.atomic_folder), files and
    folder with the umask's modes, as make_tiny does."""
    out = Path(out)
    if not str(target).strip():  # an unset shell variable: a draft for nothing, not a target checkpoint
        raise KimiInputError(f"--draft-for {str(target)!r}: expected the target checkpoint's folder")
    if out.exists():
        raise KimiInputError(f"{out} already exists; make-tiny writes a new folder")
    if Path(target).resolve() in out.resolve().parents:
        raise KimiInputError(f"OUT {out}: is inside --draft-for {target}; expected a folder apart from the checkpoint "
                             f"it reads")
    cfg = KimiK2Config.from_file(target)
    if cfg.num_hidden_layers < MIN_TARGET_LAYERS:
        raise KimiInputError(f"--draft-for {target}: num_hidden_layers={cfg.num_hidden_layers}; an EAGLE3 target "
                             f"needs >= {MIN_TARGET_LAYERS} (make one with make-tiny --layers {MIN_TARGET_LAYERS})")
    source = WeightSource(target, cfg)  # the embedding under any layout's name (K2.5's language_model. prefix too)
    try:
        embedding = source.get(EMBEDDING, torch.float32)
    finally:
        source.close()
    config = tiny_draft_config(cfg)
    tensors = tiny_draft_tensors(config, embedding, seed)
    try:
        with atomic_folder(out) as tmp:
            save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"}, shown=out)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
    except OSError as e:
        raise KimiInputError(f"{out}: cannot write ({write_error(e)})") from None
    return out
