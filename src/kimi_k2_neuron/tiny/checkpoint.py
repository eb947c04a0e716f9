"""Tiny random Kimi-K2 checkpoints stored exactly as the real ones are.

Same tensor names, dtypes and layouts as Kimi-K2-Instruct (blockwise FP8), Kimi-K2-Thinking (compressed-tensors
INT4 routed experts) or a BF16 export; several shards with one MoE layer's experts split across two of them;
stray `rotary_emb.inv_freq` buffers as real dumps have; a tokenizer in Kimi's format. A `layout` (LAYOUTS) picks
the checkpoint around those tensors: Kimi-K2(-Instruct/-0905), -Thinking, or K2.5, K2.6 and K2.7-Code, which keep
K2.5's multimodal layout (the language model's fields under `text_config`, its tensors under `language_model.`, a
vision tower and projector beside it) with their chat templates (tiny.tokenizer_files.CHAT_TEMPLATES),
end-of-turn ids and generation configs. The dimensions are small
but chosen so that FP8 128x128 blocks are partial at the edges (none of them is a multiple of 128), INT4 groups
of 32 divide the expert input dims, and attention heads split evenly over 2 ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import KimiK2Config
from ..errors import KimiInputError
from ..interrupts import atomic_folder, save_safetensors, write_error
from ..formats.layout import is_routed_expert, logical_shapes
from ..quant.fp8 import quantize_blockwise
from ..quant.int4 import quantize_group
from ..runtime.tokenizer import KIMI_SPECIAL_BASE
from . import TINY_LAYOUTS
from .tokenizer_files import CHAT_TEMPLATES, tiny_special_id, write_tiny_tokenizer

QUANTS = ("fp8", "int4", "bf16")
EOS, IM_END = KIMI_SPECIAL_BASE + 1, KIMI_SPECIAL_BASE + 2  # [EOS] 163585, <|im_end|> 163586


@dataclass(frozen=True)
class Layout:
    """What a checkpoint of one Kimi release holds around its tensors (kimi_k2_family.md, the model cards)."""
    quant: str  # the storage format the release ships
    eos: int  # config.json's eos_token_id (a real id; the tiny one sits at the same offset)
    multimodal: bool = False  # K2.5's layout: text_config, language_model. tensors, a vision tower
    generation: dict = field(default_factory=dict)  # generation_config.json's sampling defaults


LAYOUTS = {
    "k2": Layout("fp8", EOS),
    "k2-thinking": Layout("int4", IM_END),
    "k2.5": Layout("int4", EOS, multimodal=True),
    "k2.6": Layout("int4", IM_END, multimodal=True),
    # thinking only; Moonshot recommends temperature 1.0 and top_p 0.95, which its generation config carries
    "k2.7": Layout("int4", IM_END, multimodal=True, generation={"do_sample": True, "temperature": 1.0,
                                                                 "top_p": 0.95}),
}
assert tuple(LAYOUTS) == TINY_LAYOUTS
# K2.5's vision tower and projector, a stand-in for each (their names are what the loader sets aside)
VISION_TENSORS = {"vision_tower.blocks.0.attn.qkv.weight": (48, 16), "mm_projector.proj.0.weight": (192, 64)}
TINY_BASE_TOKENS = 256  # byte-level base vocabulary; Kimi's 256 special slots follow it
FP8_BLOCK = [128, 128]
INT4_GROUP = 32


def tiny_config_dict(quant: str = "fp8") -> dict:
    """config.json of the tiny model: Kimi-K2-Instruct's structure and YaRN/router settings, small dimensions."""
    if quant not in QUANTS:
        raise KimiInputError(f"--quant {quant!r}: expected one of {', '.join(QUANTS)}")
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": TINY_BASE_TOKENS + 256, "hidden_size": 192, "intermediate_size": 320,
        "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 160, "kv_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0, "hidden_act": "silu", "attention_bias": False,
        # rms_norm_eps 1e-5 (as Kimi-K2-Thinking) differs from the 1e-6 of the q/kv LoRA norms, so a model that
        # used the wrong eps there would fail parity.
        "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": tiny_special_id(KIMI_SPECIAL_BASE, TINY_BASE_TOKENS),
        "eos_token_id": tiny_special_id(KIMI_SPECIAL_BASE + 1, TINY_BASE_TOKENS),
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if quant == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": FP8_BLOCK}
    elif quant == "int4":
        cfg["quantization_config"] = _int4_quant_config()
    return cfg


def _int4_quant_config() -> dict:
    # Kimi-K2-Thinking's quantization_config: only routed experts' Linear layers are INT4.
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
               "dynamic": False, "observer": "minmax", "observer_kwargs": {}, "actorder": None,
               "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}


def dense_weights(cfg: KimiK2Config, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights of every logical weight of the format, in checkpoint order (embed, layers, norm,
    lm_head), drawn by random_weight from one generator."""
    g = torch.Generator().manual_seed(seed)
    return {name: random_weight(name, shape, g) for name, shape in logical_shapes(cfg).items()}


def random_weight(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Linear weights get std 1/sqrt(fan_in) so activations and attention scores are O(1), which makes attention and
    routing depend on every detail the parity tests check; norms are 1 + 0.1 N(0, 1), the router's correction bias
    0.05 N(0, 1), the embedding N(0, 1)."""
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=g)
    if len(shape) == 1:  # norms
        return 1 + 0.1 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[1] ** 0.5


_FP8_LINEARS = ("_proj.weight", "_proj_with_mqa.weight")


def store(name: str, t: torch.Tensor, cfg: KimiK2Config) -> dict[str, torch.Tensor]:
    """One dense weight -> the raw tensors a real checkpoint of cfg's storage format holds for it: FP8 blocks of the
    config's weight_block_size, INT4 groups of its group_size."""
    base, quant = name[: -len(".weight")], cfg.storage_format
    if name.endswith("e_score_correction_bias"):
        return {name: t.float()}
    if quant == "fp8" and name.endswith(_FP8_LINEARS):
        q, s = quantize_blockwise(t, cfg.quant.weight_block_size)
        return {name: q, base + ".weight_scale_inv": s}
    if quant == "int4" and is_routed_expert(name):
        packed, scale, shape = quantize_group(t, cfg.quant.group_size)
        return {base + ".weight_packed": packed, base + ".weight_scale": scale, base + ".weight_shape": shape}
    return {name: t.to(torch.bfloat16)}


def raw_tensors(cfg: KimiK2Config, seed: int) -> dict[str, torch.Tensor]:
    raw = {}
    for name, t in dense_weights(cfg, seed).items():
        raw.update(store(name, t, cfg))
        raw.update(stray_buffer(name, cfg))
    return raw


def stray_buffer(name: str, cfg: KimiK2Config) -> dict[str, torch.Tensor]:
    """Real dumps carry each layer's non-persistent rotary buffer too (next to its input_layernorm here)."""
    if not name.endswith("input_layernorm.weight"):
        return {}
    layer = name[: -len("input_layernorm.weight")]
    return {layer + "self_attn.rotary_emb.inv_freq": torch.zeros(cfg.qk_rope_head_dim // 2, dtype=torch.bfloat16)}


def shard_plan(names: list[str], n_shards: int) -> list[list[str]]:
    """Split names (in order) into n_shards; the first cut falls in the middle of the first MoE layer's experts,
    so that layer's experts span two files, as they do in the real 62-shard checkpoints."""
    if n_shards == 1:
        return [names]
    experts = [i for i, n in enumerate(names) if is_routed_expert(n)]
    if not experts:  # one layer, dense as Kimi's first: no expert to cut in
        return _even_files(names, n_shards)
    first_layer = names[experts[0]].split(".mlp.")[0]
    first_layer_experts = [i for i in experts if names[i].startswith(first_layer + ".")]
    cut = first_layer_experts[len(first_layer_experts) // 2]
    while ".experts.0." not in names[cut] and not names[cut].endswith("gate_proj.weight"):
        cut -= 1  # start the second shard at an expert boundary
    return [names[:cut]] + _even_files(names[cut:], n_shards - 1, before=1)


def _even_files(names: list[str], n: int, before: int = 0) -> list[list[str]]:
    """names (in order) in exactly n files, their sizes differing by one tensor at most; `before` files come ahead
    of them (for --shards' range in the refusal)."""
    if n > len(names):
        raise KimiInputError(f"--shards {n + before}: expected 1..{len(names) + before} (every file holds a tensor "
                             f"at least)")
    size, extra = divmod(len(names), n)
    bounds = [k * size + min(k, extra) for k in range(n + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def make_tiny(out: str | Path, quant: str | None = None, shards: int = 3, seed: int = 0,
              config_overrides: dict | None = None, layout: str = "k2") -> Path:
    """Write a tiny checkpoint to `out` (which must not exist), in `layout`, its experts stored as `quant` (default:
    what the release ships). Written to a hidden folder and renamed at the end, so an interrupted run never leaves
    something that looks like a finished checkpoint; folder and files get the modes the umask gives. A write that
    fails (a full disk) is one line naming `out`."""
    out = Path(out)
    if layout not in LAYOUTS:
        raise KimiInputError(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    spec = LAYOUTS[layout]
    quant = quant or spec.quant
    if out.exists():
        raise KimiInputError(f"{out} already exists; make-tiny writes a new folder")
    eos = tiny_special_id(spec.eos, TINY_BASE_TOKENS)
    raw_cfg = {**tiny_config_dict(quant), "eos_token_id": eos, **(config_overrides or {})}
    cfg = KimiK2Config.from_dict(raw_cfg, source="tiny config")
    tensors = raw_tensors(cfg, seed)
    generation = {"bos_token_id": raw_cfg["bos_token_id"], "eos_token_id": raw_cfg["eos_token_id"], **spec.generation}
    if spec.multimodal:
        raw_cfg, tensors = _as_multimodal(raw_cfg, tensors, seed)
    try:
        with atomic_folder(out) as tmp:
            _write(tmp, raw_cfg, tensors, shards, generation, CHAT_TEMPLATES[layout], shown=out)
    except OSError as e:
        raise KimiInputError(f"{out}: cannot write ({write_error(e)})") from None
    return out


def _as_multimodal(text_cfg: dict, tensors: dict, seed: int) -> tuple[dict, dict]:
    """K2.5's layout: the language model's config under text_config (its quantization_config on top), its tensors
    under `language_model.`, a vision tower and projector last."""
    text_cfg = dict(text_cfg)
    quant = text_cfg.pop("quantization_config", None)
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           **({"quantization_config": quant} if quant else {}), "text_config": text_cfg,
           "vision_config": {"hidden_size": 16}, "bos_token_id": text_cfg["bos_token_id"],
           "eos_token_id": text_cfg["eos_token_id"]}
    g = torch.Generator().manual_seed(seed + 1)
    out = {"language_model." + name: t for name, t in tensors.items()}
    out.update({name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in VISION_TENSORS.items()})
    return cfg, out


def _write(d: Path, raw_cfg: dict, tensors: dict[str, torch.Tensor], n_shards: int, generation: dict,
           chat_template: str, shown: Path) -> None:
    plan = shard_plan(list(tensors), n_shards)
    weight_map, total = {}, 0
    for k, names in enumerate(plan, 1):
        fname = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        save_safetensors({n: tensors[n].contiguous() for n in names}, d / fname, metadata={"format": "pt"},
                         shown=shown)
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (d / "config.json").write_text(json.dumps(raw_cfg, indent=2))
    (d / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tiny_tokenizer(d, num_base_tokens=TINY_BASE_TOKENS, chat_template=chat_template)
