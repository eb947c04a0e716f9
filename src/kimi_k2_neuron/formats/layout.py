"""Every tensor of a Kimi-K2 checkpoint by name, dtype and shape: the HF checkpoint's logical weights (the core
model's parameter names), the converted one (docs/converter.md) and its keys in the Neuron model's state dict. Converted
keys keep the HF `model.` prefix (neuron/NXDI_CONTRACT.md: state-dict-prefix); the routed experts are fused as NxD's
ExpertMLPsV2 holds them (neuron/NXDI_CONTRACT.md: expert-names)."""

from __future__ import annotations

import torch

from ..config import KimiK2Config
from .scheme import ExpertScheme

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
# Raw keys that are no weight: the non-persistent rotary buffer real dumps carry.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_EXPERTS = "mlp.expert_mlps.mlp_op."
_ROUTER = "mlp.gate."

def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"{layer_prefix(layer)}mlp.experts.{expert}.{proj}.weight"


def gate_up_key(layer: int) -> str:
    return f"{layer_prefix(layer)}{_EXPERTS}gate_up_proj.weight"


def down_key(layer: int) -> str:
    return f"{layer_prefix(layer)}{_EXPERTS}down_proj.weight"


def scale_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "scale"


def key_templates() -> dict[str, str]:
    """The converted key of each fused tensor, with `{L}` for the layer (recorded in config.json)."""
    def template(key: str) -> str:
        return key.replace(".0.", ".{L}.", 1)

    return {"gate_up": template(gate_up_key(0)), "down": template(down_key(0)),
            "scale": "<weight key minus 'weight'>scale"}


def is_ignored(key: str) -> bool:
    return key.endswith(IGNORED_SUFFIXES)


# -- the HF checkpoint ---------------------------------------------------------------------------------------------

def logical_shapes(cfg: KimiK2Config, routed_experts: bool = True) -> dict[str, tuple[int, ...]]:
    """Logical weight name -> full shape ([out, in] for linears), in checkpoint order; routed_experts=False leaves
    out the per-expert weights (Kimi-K2 has 70K of them)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p, a = layer_prefix(layer), layer_prefix(layer) + "self_attn."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            a + "q_a_proj.weight": (cfg.q_lora_rank, h),
            a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
            a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
            a + "kv_a_proj_with_mqa.weight": (cfg.latent_dim, h),
            a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            a + "o_proj.weight": (h, heads * cfg.v_head_dim),
            p + "post_attention_layernorm.weight": (h,),
        })
        if not cfg.is_moe_layer(layer):
            shapes.update(_mlp(p + "mlp.", h, cfg.intermediate_size))
            continue
        shapes.update({p + "mlp.gate.weight": (cfg.n_routed_experts, h),
                       p + "mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,)})
        for e in range(cfg.n_routed_experts if routed_experts else 0):
            shapes.update(_mlp(f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            shapes.update(_mlp(p + "mlp.shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts))
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)})
    return shapes


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


# -- the converted checkpoint ----------------------------------------------------------------------------------------

def converted_dtype(name: str) -> torch.dtype:
    """The router float32 (routing is sensitive to rounding), other non-expert weights bfloat16."""
    return F32 if "." + _ROUTER in name else BF16


def expert_tensors(cfg: KimiK2Config, layer: int,
                   scheme: ExpertScheme) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A MoE layer's fused expert tensors (key, dtype, full shape): gate_up [E, H, 2I], down [E, I, H], then their
    scales; bf16 experts without scales (what the Neuron model takes for them)."""
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gu, dn = gate_up_key(layer), down_key(layer)
    if not scheme.quantized:
        return [(gu, BF16, (e, h, 2 * i)), (dn, BF16, (e, i, h))]
    return [(gu, FP8, (e, h, 2 * i)), (dn, FP8, (e, i, h)),
            (scale_key(gu), F32, scheme.scale_shape(e, h, 2 * i)), (scale_key(dn), F32, scheme.scale_shape(e, i, h))]


def converted_tensors(cfg: KimiK2Config, scheme: ExpertScheme) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Converted key -> (dtype, full shape) of every tensor (the Neuron model's, with bf16 experts)."""
    out = {n: (converted_dtype(n), shape) for n, shape in logical_shapes(cfg, False).items()}
    for layer in filter(cfg.is_moe_layer, range(cfg.num_hidden_layers)):
        out.update({key: (dtype, shape) for key, dtype, shape in expert_tensors(cfg, layer, scheme)})
    return out


# -- the Neuron model ----------------------------------------------------------------------------------------------

def module_key(key: str) -> str:
    """No `model.` prefix, and the router's tensors under NxD's MoE attribute `router`."""
    return key.removeprefix("model.").replace("." + _ROUTER, ".mlp.router.")


# The Neuron shell's layers that exist under one serving option only (placement.Layout); the converted
# checkpoint keeps its own names and the shell's state dict maps them (neuron/NXDI_CONTRACT.md: gathered-linear).
ATTENTION_A = ("q_a_proj", "kv_a_proj_with_mqa")  # fused in this order (the core's split [q_lora_rank | latent])
FUSED_ATTENTION_A = "q_kv_a_proj"  # --shard-attn-a: one column-parallel layer, one all-gather
ROUTER_LINEAR = "linear_router"  # --shard-router: the router's column-parallel linear, named as NxD's own router's


def attention_a_keys(layer: int) -> tuple[str, ...]:
    return tuple(module_key(f"{layer_prefix(layer)}self_attn.{name}.weight") for name in ATTENTION_A)


def fused_attention_a_key(layer: int) -> str:
    return module_key(f"{layer_prefix(layer)}self_attn.{FUSED_ATTENTION_A}.weight")


def router_weight_key(layer: int, linear: bool = False) -> str:
    return module_key(f"{layer_prefix(layer)}{_ROUTER}{ROUTER_LINEAR + '.' if linear else ''}weight")


def neuron_tensors(cfg: KimiK2Config, scheme: ExpertScheme, fuse_attention_a: bool = False,
                   router_linear: bool = False) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What the Neuron model's loader must deliver: full tensors, which NxD shards per rank. fuse_attention_a:
    q_a_proj and kv_a_proj_with_mqa as one [q_lora_rank + latent, hidden] tensor; router_linear: the router weight
    under its linear."""
    out = {module_key(k): v for k, v in converted_tensors(cfg, scheme).items()}
    for layer in range(cfg.num_hidden_layers):
        if fuse_attention_a:
            parts = [out.pop(k) for k in attention_a_keys(layer)]
            out[fused_attention_a_key(layer)] = (parts[0][0], (sum(s[0] for _, s in parts), cfg.hidden_size))
        if router_linear and cfg.is_moe_layer(layer):
            out[router_weight_key(layer, linear=True)] = out.pop(router_weight_key(layer))
    return out
