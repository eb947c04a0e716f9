"""A tiny random EAGLE3 draft for a tiny target (`make-tiny OUT --draft-for TARGET --draft-layout L`), stored as the
public drafts of each layout are (config.json + one model.safetensors, the layer named `midlayer.`, bf16, the target's
embedding copied in as trained drafts carry it frozen), so `--draft` reads it as it reads a real one
(checkpoint/draft.py):

- eagle3: TorchSpec's Kimi-K2.5 draft (LlamaForCausalLMEagle3, the target's vocabulary, aux ids in vLLM's input
  convention [2, N//2, N - 3] at the top level, as lightseekorg/kimi-k2.5-eagle3);
- eagle3-d2t: SpecForge's Kimi drafts (AQ-MedAI/Kimi-K2-Instruct-eagle3: draft_vocab_size 32000 of 163840, d2t
  offsets and a t2d mask saved beside the weights), here a quarter of the target's vocabulary, and aux ids in the output
  convention [1, N//2 - 1, N - 4] under eagle_config (SpecForge's DeepSeek-V3 config; a K2.7-Code SpecForge draft
  declares [1, 29, 57]);
- eagle3.1-mla: lightseekorg's Kimi-K2.6/K2.7 EAGLE3.1 MLA drafts (Eagle3DeepseekV2ForCausalLM with the target's MLA
  ranks and YaRN, fc_norm and norm_output set, fc_norm.0-2 beside fc; aux ids [1, N//2 - 1, N - 4], the card's "target
  layers 1, 29 and 57"; the full vocabulary, as k-l-lambda/Kimi-K2.5-Eagle3's config declares).

A test fixture: its weights are random, so it proposes tokens the target rarely accepts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.draft import MIN_TARGET_LAYERS, aux_conventions
from ..checkpoint.source import WeightSource
from ..config import KimiK2Config
from ..errors import KimiInputError
from ..interrupts import atomic_folder, save_safetensors, write_error
from . import DRAFT_LAYOUTS

DRAFT_HEADS = 4  # splits over 2 ranks, as the tier runs
DRAFT_INTERMEDIATE_FACTOR = 2
DRAFT_VOCAB_FRACTION = 4  # eagle3-d2t: a quarter of the target's ids
EMBEDDING = "model.embed_tokens.weight"  # the logical name (WeightSource's), whatever the target stores it under


def tiny_draft_config(target: KimiK2Config, layout: str = "eagle3") -> dict:
    """config.json of the layout's public draft at the target's size."""
    h, n = target.hidden_size, target.num_hidden_layers
    common = {"hidden_size": h, "intermediate_size": DRAFT_INTERMEDIATE_FACTOR * h, "num_hidden_layers": 1,
              "num_attention_heads": DRAFT_HEADS, "num_key_value_heads": DRAFT_HEADS,
              "vocab_size": target.vocab_size, "max_position_embeddings": target.max_position_embeddings,
              "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "bos_token_id": target.bos_token_id, "eos_token_id": target.eos_token_ids[0]}
    if layout == "eagle3":
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **common,
                "head_dim": h // DRAFT_HEADS, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
                "eagle_aux_hidden_state_layer_ids": list(aux_conventions(n)["input"])}
    aux = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_conventions(n)["output"]),
                            "use_aux_hidden_state": True}}
    if layout == "eagle3-d2t":
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **common,
                "head_dim": h // DRAFT_HEADS, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
                "draft_vocab_size": target.vocab_size // DRAFT_VOCAB_FRACTION, **aux}
    rope = None if target.rope_scaling is None else {"type": "yarn", **target.rope_scaling.__dict__}
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", **common,
            "q_lora_rank": target.q_lora_rank, "kv_lora_rank": target.kv_lora_rank,
            "qk_nope_head_dim": target.qk_nope_head_dim, "qk_rope_head_dim": target.qk_rope_head_dim,
            "v_head_dim": target.v_head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
            "rope_scaling": rope, "draft_vocab_size": target.vocab_size, "fc_norm": True, "norm_output": True, **aux}


def tiny_draft_tensors(cfg: dict, embedding: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """The layout's tensors: linear weights N(0, 1/fan_in), norms 1 + 0.1 N(0, 1); d2t offsets and the t2d mask of a
    sorted random draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    rows = cfg.get("draft_vocab_size", v)
    heads = cfg["num_attention_heads"]

    def linear(out, inp):
        return torch.randn(out, inp, generator=g) / inp ** 0.5

    def norm(n=h):
        return 1 + 0.1 * torch.randn(n, generator=g)

    layer = {"input_layernorm.weight": norm(), "hidden_norm.weight": norm(), "post_attention_layernorm.weight": norm(),
             "mlp.gate_proj.weight": linear(i, h), "mlp.up_proj.weight": linear(i, h),
             "mlp.down_proj.weight": linear(h, i)}
    if "kv_lora_rank" in cfg:
        ql, kvr, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        nope, vd = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        layer.update({"self_attn.q_a_proj.weight": linear(ql, 2 * h), "self_attn.q_a_layernorm.weight": norm(ql),
                      "self_attn.q_b_proj.weight": linear(heads * (nope + rope), ql),
                      "self_attn.kv_a_proj_with_mqa.weight": linear(kvr + rope, 2 * h),
                      "self_attn.kv_a_layernorm.weight": norm(kvr),
                      "self_attn.kv_b_proj.weight": linear(heads * (nope + vd), kvr),
                      "self_attn.o_proj.weight": linear(h, heads * vd)})
    else:
        q = heads * cfg["head_dim"]
        layer.update({"self_attn.q_proj.weight": linear(q, 2 * h), "self_attn.k_proj.weight": linear(q, 2 * h),
                      "self_attn.v_proj.weight": linear(q, 2 * h), "self_attn.o_proj.weight": linear(h, q)})
    t = {"embed_tokens.weight": embedding.float(), "fc.weight": linear(h, 3 * h),
         **({f"fc_norm.{k}.weight": norm() for k in range(3)} if cfg.get("fc_norm") else {}),
         **{f"midlayer.{k}": x for k, x in layer.items()}, "norm.weight": norm(), "lm_head.weight": linear(rows, h)}
    t = {k: x.to(torch.bfloat16).contiguous() for k, x in t.items()}
    if rows < v:
        ids = torch.randperm(v, generator=g)[:rows].sort().values
        t["d2t"] = ids - torch.arange(rows)  # offsets, int64, as SpecForge saves them
        t["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    return t


def make_tiny_draft(out: str | Path, target: str | Path, seed: int = 0, layout: str = "eagle3") -> Path:
    """Write a tiny draft of `layout` (DRAFT_LAYOUTS) for the checkpoint `target` (raw in any release's layout, or
    converted) to the new folder `out`, apart from it; written to a hidden folder and renamed at the end
    (interrupts.atomic_folder), files and folder with the umask's modes, as make_tiny does."""
    out = Path(out)
    if not str(target).strip():  # an unset shell variable: a draft for nothing, not a target checkpoint
        raise KimiInputError(f"--draft-for {str(target)!r}: expected the target checkpoint's folder")
    if layout not in DRAFT_LAYOUTS:
        raise KimiInputError(f"--draft-layout {layout!r}: expected one of {', '.join(DRAFT_LAYOUTS)}")
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
    config = tiny_draft_config(cfg, layout)
    tensors = tiny_draft_tensors(config, embedding, seed)
    try:
        with atomic_folder(out) as tmp:
            save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"}, shown=out)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
    except OSError as e:
        raise KimiInputError(f"{out}: cannot write ({write_error(e)})") from None
    return out
