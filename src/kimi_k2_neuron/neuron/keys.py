"""Checkpoint keys -> the Neuron model's state dict: the key mapping and the exact keys, shapes and dtypes the
loader must deliver (no SDK needed).

Line references: NxDI = aws-neuron/neuronx-distributed-inference @4bcdc54, src/neuronx_distributed_inference/;
NxD = aws-neuron/neuronx-distributed @fbac349 (Release 2.29), src/neuronx_distributed/.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.convert.layout import ExpertScheme, scale_key
from kimi_k2_neuron.errors import KimiInputError, listing

from .contract import EXPERT_FORMATS


# -- checkpoint keys -----------------------------------------------------------------------------------------------

# Checkpoint key (HF names, or the converted layout's fused-expert names) -> Neuron module key. Ordered; the first
# match wins. Anything that matches none is an error (no silent drops). Expert tensors must already be fused.
_KEY_RULES = (
    (re.compile(r"^(?:model\.)?(layers\.\d+\.mlp)\.gate\.weight$"), r"\1.router.weight"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.mlp)\.gate\.e_score_correction_bias$"),
     r"\1.router.e_score_correction_bias"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.mlp)\.router\.linear_router\.weight$"), r"\1.router.weight"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.mlp\.expert_mlps\.mlp_op\.(?:gate_up|down)_proj\.(?:weight|scale))$"),
     r"\1"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.mlp\.router\.(?:weight|e_score_correction_bias))$"), r"\1"),
    (re.compile(r"^(?:model\.)?((?:embed_tokens|norm)\.weight)$"), r"\1"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.(?:input_layernorm|post_attention_layernorm)\.weight)$"), r"\1"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.self_attn\.\w+\.weight)$"), r"\1"),
    (re.compile(r"^(?:model\.)?(layers\.\d+\.mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj\.weight)$"), r"\1"),
    (re.compile(r"^(lm_head\.weight)$"), r"\1"),
)
# Raw keys set aside by name (what the core's WeightSource also ignores).
IGNORED_KEYS = (re.compile(r"\.rotary_emb\.inv_freq$"),)


def neuron_key(key: str) -> str | None:
    """The module key a checkpoint key loads into; None for a key ignored by name; KimiInputError otherwise."""
    if any(p.search(key) for p in IGNORED_KEYS):
        return None
    for pattern, repl in _KEY_RULES:
        if pattern.match(key):
            return pattern.sub(repl, key)
    raise KimiInputError(f"checkpoint tensor {key} has no place in the Neuron model (per-expert HF tensors must be "
                         f"converted to the fused expert_mlps layout first: kimi_k2_neuron.convert)")


def expected_keys(cfg: KimiK2Config, experts: str) -> set[str]:
    """Every tensor the loader must deliver for the Neuron model (NxD generates the spmd_rank tensors itself,
    expert_mlps_v2.py:197-207; the loader adds rank_util.rank): the weights of expected_shapes, and a scale beside
    each fused expert weight when the experts are FP8."""
    keys = set(expected_shapes(cfg))
    if EXPERT_FORMATS[experts] is not None:
        keys |= {scale_key(k) for k in keys if ".expert_mlps." in k}
    return keys


def expected_shapes(cfg: KimiK2Config) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shapes of the non-scale tensors, for checking a converted checkpoint before NxD shards it
    (NxD would only fail per rank with `expected shape`, trace.py:824-825)."""
    h, e, i_moe = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    heads = cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,),
                                          "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       a + "q_a_proj.weight": (cfg.q_lora_rank, h), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                       a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
                       a + "kv_a_proj_with_mqa.weight": (cfg.latent_dim, h),
                       a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                       a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                       a + "o_proj.weight": (h, heads * cfg.v_head_dim)})
        if not cfg.is_moe_layer(i):
            inter = cfg.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
            continue
        m = p + "mlp."
        shapes.update({m + "router.weight": (e, h), m + "router.e_score_correction_bias": (e,),
                       m + "expert_mlps.mlp_op.gate_up_proj.weight": (e, h, 2 * i_moe),
                       m + "expert_mlps.mlp_op.down_proj.weight": (e, i_moe, h)})
        if cfg.n_shared_experts:
            s = i_moe * cfg.n_shared_experts
            shapes.update({m + "shared_experts.gate_proj.weight": (s, h), m + "shared_experts.up_proj.weight": (s, h),
                           m + "shared_experts.down_proj.weight": (h, s)})
    return shapes


def expert_scale_shapes(cfg: KimiK2Config, nc) -> dict[str, tuple[int, ...]]:
    """Full shapes of the FP8 expert scales the NeuronConfig's scheme loads (NxD sizes them per rank from the block,
    quantization_layers.py:244-299; the sharder slices the full tensor to that)."""
    fmt = experts_format(nc)
    if fmt == "bf16":
        return {}
    scheme = ExpertScheme(fmt, None if fmt == "fp8-per-channel" else tuple(nc.quantization_block_size))
    e, h, i_moe = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = {}
    for layer in (i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)):
        m = f"layers.{layer}.mlp.expert_mlps.mlp_op."
        out[m + "gate_up_proj.scale"] = scheme.scale_shape(e, h, 2 * i_moe)
        out[m + "down_proj.scale"] = scheme.scale_shape(e, i_moe, h)
    return out


def experts_format(nc) -> str:
    """The expert storage format a NeuronConfig describes (inverse of EXPERT_FORMATS)."""
    if not getattr(nc, "quantized", False):
        return "bf16"
    for name, qtype in EXPERT_FORMATS.items():
        if qtype == nc.quantization_type:
            return name
    raise KimiInputError(f"quantization_type {nc.quantization_type!r} is not one Kimi-K2 supports: "
                         f"{', '.join(q for q in EXPERT_FORMATS.values() if q)}")


def to_neuron_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: KimiK2Config, nc,
                         where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the Neuron model's state dict, strict both ways (NxD would drop an unexpected key with a
    warning and skip a missing one, trace.py:640-644, 773-774). Shapes of full tensors are checked here, before
    NxD shards them; FP8 expert weights must be float8_e4m3fn and their scales float32 (NxD would silently cast,
    model_builder.py:801-815). Adds rank_util.rank, the per-rank index NeuronBaseModel's SPMDRank reads."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        nk = neuron_key(key)
        if nk is None:
            continue
        if nk in out:
            raise KimiInputError(f"{where}: two tensors load into {nk} (the second is {key})")
        out[nk] = tensor
    experts = experts_format(nc)
    want = expected_keys(cfg, experts)
    missing, unexpected = want - set(out), set(out) - want
    if missing:
        raise KimiInputError(f"{where}: {len(missing)} tensor(s) missing for experts={experts}: "
                             f"{listing(sorted(missing))}")
    if unexpected:
        raise KimiInputError(f"{where}: {len(unexpected)} tensor(s) the model has no place for (experts={experts}): "
                             f"{listing(sorted(unexpected))}")
    for name, shape in (expected_shapes(cfg) | expert_scale_shapes(cfg, nc)).items():
        if tuple(out[name].shape) != shape:
            raise KimiInputError(f"{where}: tensor {name} has shape {list(out[name].shape)}, expected {list(shape)}")
    fp8 = experts != "bf16"
    for name, t in out.items():
        if ".expert_mlps." in name:
            want_dtype = torch.float32 if name.endswith(".scale") else (torch.float8_e4m3fn if fp8 else None)
            if want_dtype is not None and t.dtype != want_dtype:
                raise KimiInputError(f"{where}: tensor {name} is {t.dtype}, expected {want_dtype} for "
                                     f"experts={experts}")
        elif name.startswith(("layers.", "embed_tokens", "norm", "lm_head")) and t.dtype == torch.float8_e4m3fn:
            raise KimiInputError(f"{where}: tensor {name} is FP8; only routed experts may be (dequantize the rest)")
    out["rank_util.rank"] = torch.arange(nc.tp_degree, dtype=torch.int32)
    return out
