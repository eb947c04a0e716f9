"""Kimi-K2 as an NxDI model, in NxDI's order: the config, the model, the application.

    KimiK2InferenceConfig (InferenceConfig)          config.json as plain JSON, its derived fields
    KimiK2ServingRequest (MoENeuronConfig)           what a serving framework (vllm-neuron) asks for: rebuilt
    NeuronKimiK2Model (NeuronBaseModel)              the traced graph: embed -> layers -> norm -> lm_head (+ sampler)
      KimiK2DecoderLayer (the core's DecoderLayer)   built by the core through NxDParallelContext: NxD's parallel
                                                     layers, and NxD's MoE around the core router (NxDRouter)
      LatentKVCacheManager (NxDI's KVCacheManager)   the MLA latent as one KV head, without a V copy
    NeuronKimiK2ForCausalLM (NeuronBaseForCausalLM)  the application: checkpoint, compiler arguments, pre-sharding,
                                                     NxD's CPU mode

The math is the core's (kimi_k2_neuron.model); this file wires it to NxDI's contracts. What Kimi requires of NxDI's
settings is contract.py; the NxDI/NxD code each choice here rests on is cited by name from NXDI_CONTRACT.md.
Importing it without the Neuron SDK raises the ImportError that names the missing packages.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2  # noqa: E402
from neuronx_distributed.modules.moe.model import MoE as NxDMoE  # noqa: E402
from neuronx_distributed.modules.moe.moe_configs import RoutedExpertsMLPOpsConfig  # noqa: E402
from neuronx_distributed.modules.moe.shared_experts import SharedExperts  # noqa: E402
from neuronx_distributed.parallel_layers import parallel_state  # noqa: E402
from neuronx_distributed.parallel_layers.layers import (ColumnParallelLinear, ParallelEmbedding,  # noqa: E402
                                                        RowParallelLinear)
from neuronx_distributed.trace.trace import get_sharded_checkpoint  # noqa: E402
from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig  # noqa: E402
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel  # noqa: E402
from neuronx_distributed_inference.modules.generation.sampling import create_sampler  # noqa: E402
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager  # noqa: E402
from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_process_group  # noqa: E402
from torch import nn  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config, language_model_fields  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError, listing  # noqa: E402
from kimi_k2_neuron.formats.record import CONVERSION_KEY, ConversionRecord  # noqa: E402
from kimi_k2_neuron.formats.scheme import ExpertScheme  # noqa: E402
from kimi_k2_neuron.model.decoder import DecoderLayer  # noqa: E402
from kimi_k2_neuron.model.norm import RMSNorm  # noqa: E402
from kimi_k2_neuron.model.rope import RotaryTable  # noqa: E402
from kimi_k2_neuron.model.router import NoAuxTcRouter  # noqa: E402
from kimi_k2_neuron.parallel import ParallelContext  # noqa: E402
from kimi_k2_neuron.runtime.ranks import free_port  # noqa: E402

from . import contract  # noqa: E402
from .loader import load_neuron_state_dict, read_presharded, unloaded_parameters  # noqa: E402

# == the config ==================================================================================================

# HF fields NxDI reads from the config that a plain config.json lacks; not use_return_dict, a read-only property of
# the transformers config NxDI's generation adapter builds from these attributes (NXDI_CONTRACT.md: hf-defaults).
HF_DEFAULTS = {"output_attentions": False, "output_hidden_states": False, "return_dict": True}
# InferenceConfig attributes that are not config.json fields.
_NOT_HF = ("neuron_config", "fused_spec_config", "metadata", "quantization_config")
# Each KimiK2InferenceConfig's typed core config, beside it rather than in it: NxDI saves every attribute to
# neuron_config.json.
_CORE: "weakref.WeakKeyDictionary[KimiK2InferenceConfig, KimiK2Config]" = weakref.WeakKeyDictionary()


class KimiK2InferenceConfig(InferenceConfig):
    """NxDI's InferenceConfig for Kimi-K2, from the core's typed config of the checkpoint's config.json. NxDI builds
    it, and rebuilds it from a compiled folder's neuron_config.json, through load_config, the keyword arguments,
    add_derived_config and validate_config (NXDI_CONTRACT.md: config-construction), so everything derived is derived
    in add_derived_config, from fields it never overwrites: a compiled folder's config reloads to the same model."""

    @classmethod
    def from_core(cls, cfg: KimiK2Config, neuron_config: MoENeuronConfig, **kwargs) -> "KimiK2InferenceConfig":
        """The config of a checkpoint whose config.json the core read and checked as `cfg`: its fields as plain JSON
        (no checkpoint code runs, NXDI_CONTRACT.md: remote-code-config; K2.5's text_config flattened), torch_dtype
        dropped (neuron_config carries the dtype). The core config is kept, not parsed again."""
        fields = language_model_fields(cfg.raw)
        attrs = {**HF_DEFAULTS, **{k: v for k, v in fields.items() if k not in ("torch_dtype", "dtype", "auto_map")}}

        def load_config(self):
            self.__dict__.update(attrs)

        config = cls(neuron_config, load_config=load_config, **kwargs)
        _CORE[config] = dataclasses.replace(cfg, quant=None)  # as core_config() reads it (the source's storage)
        return config

    @classmethod
    def for_serving(cls, cfg: KimiK2Config, options: contract.ServeOptions) -> "KimiK2InferenceConfig":
        """The config compile_and_save builds for these options (and NxD's CPU mode for its own)."""
        return cls.from_core(cfg, MoENeuronConfig(**contract.neuron_config_kwargs(cfg, options)))

    @classmethod
    def for_request(cls, request: MoENeuronConfig, checkpoint) -> "KimiK2InferenceConfig":
        """The config compile_and_save builds for what a serving framework requests (its generic NeuronConfig, a
        KimiK2ServingRequest) on `checkpoint`: the request's TP, batch, lengths, LNC and sampling, the contract's
        everything else; or a one-line refusal of what differs. With vllm-neuron's NEURON_COMPILED_ARTIFACTS, the
        artifacts there are checked to serve the request before vllm-neuron loads them (_check_compiled)."""
        r = contract.ServingRequest.of(request)
        if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
            raise KimiInputError(f"{checkpoint}: not a checkpoint folder with a config.json; serve the converted "
                                 f"checkpoint's folder")
        compiled = os.environ.get(contract.COMPILED_ARTIFACTS_ENV)
        try:
            cfg = KimiK2Config.from_file(checkpoint)
            config = cls.for_serving(cfg, contract.request_options(cfg, r, ConversionRecord.of(cfg), checkpoint))
            if compiled and (Path(compiled) / "neuron_config.json").is_file():
                _check_compiled(compiled, r, config)
        except KimiInputError as e:
            raise KimiInputError(f"serving {checkpoint} with {r.describe()}: {e}") from None
        return config

    def add_derived_config(self):
        if isinstance(self.neuron_config, KimiK2ServingRequest):
            # Built by a serving framework from its flags (vllm-neuron passes NxDI's load_pretrained_config, which
            # records the checkpoint folder as _name_or_path): becomes the config compile_and_save would build.
            built = self.for_request(self.neuron_config, getattr(self, "_name_or_path", None))
            self.__dict__.clear()
            self.__dict__.update(vars(built))
            _CORE[self] = built.core_config()
            return
        # The KV cache width: the latent [c_kv | k_pe] is stored as one KV head; the model's num_key_value_heads = 1
        # sizes the cache, and config.num_key_value_heads keeps its HF value (NXDI_CONTRACT.md: latent-kv-head).
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.num_local_experts = self.n_routed_experts  # NxD's name
        self.num_cores_per_group = 1  # no flash decoding (NXDI_CONTRACT.md: cores-per-group)
        # intermediate_size keeps its HF meaning (the dense MLP): unlike NxDI's DSV3/GLM models this one builds the
        # experts with moe_intermediate_size itself, so nothing is overwritten.
        for name, value in HF_DEFAULTS.items():
            setattr(self, name, getattr(self, name, value))
        contract.enforce_neuron_config(self.neuron_config, getattr(self, "n_routed_experts", None),
                                       getattr(self, "num_experts_per_tok", None))

    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig

    def core_config(self) -> KimiK2Config:
        """The core's typed config: the one this config was made from, or, for one NxDI rebuilt from
        neuron_config.json, parsed (and validated) from these attributes once. quantization_config is left out: it
        describes the source checkpoint's storage, which the Neuron model does not read."""
        if self not in _CORE:
            raw = {k: v for k, v in vars(self).items() if k not in _NOT_HF}
            _CORE[self] = KimiK2Config.from_dict(raw, source="KimiK2InferenceConfig")
        return _CORE[self]


class KimiK2ServingRequest(MoENeuronConfig):
    """The NeuronConfig a serving framework builds from its own flags through the application's
    get_neuron_config_cls(): vllm-neuron's generic one (NXDI_CONTRACT.md: vllm-generic-config), which knows nothing of
    the FP8 experts, the router or the MoE. NxDI itself builds NeuronConfigs through the config class, never through
    this, so the type alone marks a request; KimiK2InferenceConfig replaces it (for_request)."""


def _check_compiled(folder: str, r: contract.ServingRequest, config: KimiK2InferenceConfig) -> None:
    """Refuse precompiled artifacts that do not serve request `r` or were compiled from another conversion than the
    checkpoint being served, in one line, before vllm-neuron loads them (a ValueError there would make it recompile:
    NXDI_CONTRACT.md: vllm-precompiled)."""
    where = f"{contract.COMPILED_ARTIFACTS_ENV}={folder}"
    try:
        compiled = KimiK2InferenceConfig.load(folder)
    except KimiInputError as e:
        raise KimiInputError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- anything NxDI raises on a foreign neuron_config.json
        raise KimiInputError(f"{where}: not artifacts of this model ({type(e).__name__}: {e})") from None
    bad = contract.compiled_mismatches(r, compiled.neuron_config)
    if getattr(compiled, CONVERSION_KEY, None) != getattr(config, CONVERSION_KEY, None):
        bad.append(f"compiled from another conversion than {config.neuron_config.quantized_checkpoints_path or ''}"
                   f" (its config.json's {CONVERSION_KEY} differs)")
    if bad:
        raise KimiInputError(f"{where}: " + "; ".join(bad) + "; compile for these flags with "
                             f"scripts/compile_and_save.py --for-vllm, or change them")


# == the model ===================================================================================================

@dataclass(frozen=True)
class NxDParallelContext(ParallelContext):
    """The core's layer factory returning NxD's layers. `rank` stays 0: in SPMD tracing every rank runs the same
    graph and NxD layers find their shard through the process group and the sharded checkpoint."""

    gather_logits: bool = True  # False with on-device sampling: the sampler reads vocab-sharded logits
    # All-reduce dtype of the row-parallel layers: NeuronConfig.rpl_reduce_dtype, as NxDI's Llama passes it; None
    # lets NxD reduce in the layer dtype instead of its float32 default (NXDI_CONTRACT.md: reduce-dtype).
    reduce_dtype: torch.dtype | None = None
    config: Any = field(default=None, compare=False)  # the KimiK2InferenceConfig NxD's MoE is built from

    def replicated(self, in_features, out_features, dtype):
        # q_a_proj / kv_a_proj_with_mqa: small and shared by all heads, so every rank holds them whole (as DSV3).
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def column(self, in_features, out_features, dtype):
        return ColumnParallelLinear(in_features, out_features, bias=False, gather_output=False, dtype=dtype)

    def row(self, in_features, out_features, dtype):
        return RowParallelLinear(in_features, out_features, bias=False, input_is_parallel=True, dtype=dtype,
                                 reduce_dtype=self.reduce_dtype)

    def embedding(self, vocab, dim, dtype):
        return ParallelEmbedding(vocab, dim, dtype=dtype, shard_across_embedding=True)

    def lm_head(self, dim, vocab, dtype):
        # vocab % tp == 0 is checked (contract.check_serve_options), so no pad_size and no logit masking
        # (NXDI_CONTRACT.md: lm-head-padding).
        return ColumnParallelLinear(dim, vocab, bias=False, gather_output=self.gather_logits, dtype=dtype)

    def moe(self, cfg, dtype):
        return build_moe(cfg, dtype, self.config)


class NxDRouter(NoAuxTcRouter):
    """The core noaux_tc router (float32, bias after the sigmoid and for selection only, weights normalized and
    times routed_scaling_factor) answering NxD's router contract (NXDI_CONTRACT.md: router-contract):
    router(hidden [B, S, H]) -> (router_logits [T, E], expert_affinities [T, E], expert_index [T, k]).

    The affinities hold the final combine weights at the chosen experts, so ExpertMLPsV2 must not renormalize
    (contract.MOE_SETTINGS). They are cast to the hidden dtype, as NxD's own routers do, so the expert outputs stay
    bf16. MoE reads num_experts, top_k, hidden_size and sequence_parallel_enabled from its router. Parameters keep
    the core's names (router.weight, router.e_score_correction_bias), float32 under cast_type "as-declared"."""

    def __init__(self, cfg: KimiK2Config):
        super().__init__(cfg)
        self.num_experts, self.hidden_size = cfg.n_routed_experts, cfg.hidden_size
        self.sequence_parallel_enabled, self.sequence_dimension = False, None

    def forward(self, hidden_states: torch.Tensor):
        flat = hidden_states.reshape(-1, self.hidden_size)
        weights, ids = super().forward(flat)
        # Same expression as the core's first step, so XLA's CSE keeps one matmul; MoE only returns these when
        # return_router_logits is set.
        logits = flat.float() @ self.weight.T
        affinities = torch.zeros(flat.shape[0], self.num_experts, dtype=weights.dtype, device=weights.device)
        return logits, affinities.scatter(1, ids, weights).to(hidden_states.dtype), ids


def build_moe(cfg: KimiK2Config, dtype: torch.dtype, config: KimiK2InferenceConfig) -> NxDMoE:
    """NxD's MoE with the core's router: what NxDI's initialize_moe_module builds minus its RouterTopK
    (NXDI_CONTRACT.md: moe-module), with the NeuronConfig's contract.MOE_SETTINGS (dropless, GLU, no
    renormalization).
    - The shared expert sits inside the MoE: its output is added before the MoE's single all-reduce, one collective
      per layer instead of two, and HF's `mlp.shared_experts.*` names load unchanged (NXDI_CONTRACT.md:
      moe-shared-expert). The routed scaling factor is in the router weights, so it never touches the shared expert.
    - No fused TKG module: the stock kernel applies a router bias before the sigmoid and cannot express noaux_tc's
      selection-only bias (NXDI_CONTRACT.md: fused-tkg-bias)."""
    nc = config.neuron_config
    tkg_tp, tkg_ep, cte_tp, cte_ep = initialize_moe_process_group(config, False)
    experts = ExpertMLPsV2(
        routed_experts_mlp_config=RoutedExpertsMLPOpsConfig(
            num_experts=cfg.n_routed_experts,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            top_k=cfg.num_experts_per_tok,
            hidden_act="silu",
            glu_mlp=nc.glu_mlp,
            glu_type=nc.glu_type,
            use_index_calc_kernel=nc.use_index_calc_kernel,
            normalize_top_k_affinities=nc.normalize_top_k_affinities,
            capacity_factor=nc.capacity_factor,
            enable_spmd_rank=nc.blockwise_matmul_config.parallelize_token_to_block_mapping,
        ),
        blockwise_matmul_config=nc.blockwise_matmul_config,
        sequence_parallel_enabled=False,
        dtype=dtype,
        is_prefill=nc.is_prefill_stage,
        enabled_hybrid_sharding=False,
        tensor_model_parallel_group=parallel_state.get_tensor_model_parallel_group(),
        expert_model_parallel_group=parallel_state.get_expert_model_parallel_group(),
        cte_tensor_model_parallel_group=cte_tp,
        cte_expert_model_parallel_group=cte_ep,
        tkg_tensor_model_parallel_group=tkg_tp,
        tkg_expert_model_parallel_group=tkg_ep,
    )
    shared = None
    if cfg.n_shared_experts:
        shared = SharedExperts(hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
                               num_shared_experts=cfg.n_shared_experts, hidden_act="silu", dtype=dtype,
                               reduce_dtype=nc.rpl_reduce_dtype)
    moe = NxDMoE(router=NxDRouter(cfg), expert_mlps=experts, shared_experts=shared,
                 sequence_parallel_enabled=False, sequence_dimension=1)
    moe.eval()  # ExpertMLPsV2 takes its training path otherwise (NXDI_CONTRACT.md: moe-eval)
    return moe


def decode_masks(prior_mask: torch.Tensor, s: int):
    """The two masks of one decode (TKG) step, for MLAttention.attend_split.

    prior_mask: NxDI's TKG mask [B, 1, 1, T], True exactly on the cached positions [0, pos) of each row. The current
    token is not in the cache yet (the manager writes it after the layers), so it is attended as the active segment,
    visible to itself (NXDI_CONTRACT.md: decode-mask).
    -> prior [B, 1, S, T], active [B, 1, S, S] (causal among the step's S tokens)."""
    b = prior_mask.shape[0]
    prior = prior_mask.to(torch.bool).expand(b, 1, s, prior_mask.shape[-1])
    active = torch.ones(s, s, dtype=torch.bool, device=prior.device).tril()[None, None].expand(b, 1, s, s)
    return prior, active


class KimiK2DecoderLayer(DecoderLayer):
    """The core's decoder layer answering NxDI's call: NeuronBaseModel calls it with keyword arguments (those it
    does not use arrive in **kwargs) and takes (hidden, (K, V), cos, sin, None) back (NXDI_CONTRACT.md:
    decoder-layer-call). cos/sin are computed once, by layer 0, and handed on.

    K is the latent as one KV head [B, 1, S, latent]; V is [B, 1, S, 1] zeros for LatentKVCacheManager's 1-wide V
    slot. Prefill (past_key_value None): the bucket attends to itself under NxDI's causal [B, 1, S, S] mask and K
    holds the whole bucket. Decode: the cached [0, pos) plus the current token (decode_masks), attended in place by
    attend_split (no copy of the cache per layer and step); K holds the step's entries, which the manager scatters
    at position_ids (NXDI_CONTRACT.md: kv-writes)."""

    def __init__(self, cfg: KimiK2Config, layer_idx: int, dtype, ctx: NxDParallelContext, rotary: RotaryTable):
        super().__init__(cfg, layer_idx, dtype, ctx)
        # Per-row positions, so batched decode at different positions is right; one table shared by all layers.
        self.rotary = rotary

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, cos_cache=None,
                sin_cache=None, padding_mask=None, **kwargs):
        if cos_cache is None:  # first layer; later layers get them back from the previous one
            cos_cache, sin_cache = self.rotary(position_ids)
        attn = self.self_attn
        q_nope, q_pe, entries = attn.project(self.input_layernorm(hidden_states), (cos_cache, sin_cache))
        if past_key_value is None:
            hidden_states = hidden_states + attn.attend(q_nope, q_pe, entries, attention_mask)
        else:
            past = past_key_value[0][:, 0]
            prior, active = decode_masks(attention_mask, entries.shape[1])
            hidden_states = hidden_states + attn.attend_split(q_nope, q_pe, past, prior, entries.to(past.dtype),
                                                              active)
        x = self.post_attention_layernorm(hidden_states)
        # NxD's MoE output is already all-reduced (NXDI_CONTRACT.md: moe-shared-expert); the core MLP reduces in
        # its RowParallel.
        hidden_states = hidden_states + (self.mlp(x, padding_mask)[0] if self.is_moe else self.mlp(x))
        k_new = entries.unsqueeze(1)
        return hidden_states, (k_new, k_new.new_zeros(*k_new.shape[:-1], 1)), cos_cache, sin_cache, None


class LatentKVCacheManager(KVCacheManager):
    """NxDI's KVCacheManager holding the MLA latent without the dead V copy. Per layer the stock manager allocates K
    and V of one shape, [batch, kv_heads_per_rank, max_len, head_dim]; the latent [c_kv | k_pe] is one KV head of
    width head_dim (576 for Kimi-K2) in the K slot, and NxDI's DSV3 and community Kimi ports write it into V too,
    doubling the cache. Here V keeps every dimension but the last, which is 1: the manager's reads and writes index
    V along dims 0 and 2 only, and NxDI reads the cached length from V's dim 2 (NXDI_CONTRACT.md: latent-v-slot).
    Cost per rank: B * max_len * 2 bytes per layer (vs 1152 for a 576-wide bf16 V). _init_kv_shape is the
    extension point NxDI's own BlockKVCacheManager overrides."""

    def _init_kv_shape(self, config, layer_to_cache_size_mapping=None):
        super()._init_kv_shape(config, layer_to_cache_size_mapping)
        if layer_to_cache_size_mapping:
            raise ValueError("Kimi-K2 has one cache length for every layer (no layer_to_cache_size_mapping)")
        if self.is_kv_cache_tiled or self.k_cache_transposed:
            raise ValueError("the latent cache supports neither kv_cache_tiling nor k_cache_transposed")
        self.v_shape = (*self.v_shape[:-1], 1)
        # NxD's StateInitializer can allocate each layer's K and V as one buffer, which needs K and V of one numel
        # (NXDI_CONTRACT.md: combined-kv-allocation): refuse it here, at build time, with the reason.
        if int(os.environ.get("NEURON_COMBINE_KV_ALLOCATIONS", "0")):
            raise ValueError("NEURON_COMBINE_KV_ALLOCATIONS=1 needs K and V of one shape; the latent cache's V slot "
                             "is 1 wide. Unset it.")


class NeuronKimiK2Model(NeuronBaseModel):
    """The traced model. NeuronBaseModel.__init__ calls setup_attr_for_model, init_model, then
    init_inference_optimization (NXDI_CONTRACT.md: model-init)."""

    def setup_attr_for_model(self, config: KimiK2InferenceConfig):
        nc = config.neuron_config
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.tp_degree = nc.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        # The latent is one KV head; this attribute, not the config, sizes the cache (NXDI_CONTRACT.md:
        # latent-kv-head).
        self.num_key_value_heads = 1
        self.max_batch_size = nc.max_batch_size
        self.buckets = nc.buckets

    def init_model(self, config: KimiK2InferenceConfig):
        cfg, dtype = config.core_config(), config.neuron_config.torch_dtype
        # On device the sampler reads vocab-sharded logits (its top-k/argmax gather across ranks); NxDI's sampler in
        # CPU mode has no distributed path, so a CPU run gathers the vocabulary in lm_head, where NxDI's own models
        # would sample from one rank's shard (NXDI_CONTRACT.md: cpu-sampler).
        gather = not self.on_device_sampling or config.neuron_config.on_cpu
        ctx = NxDParallelContext(tp_size=config.neuron_config.tp_degree, gather_logits=gather,
                                 reduce_dtype=config.neuron_config.rpl_reduce_dtype, config=config)
        self.embed_tokens = ctx.embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        rotary = RotaryTable(cfg)
        self.layers = nn.ModuleList(KimiK2DecoderLayer(cfg, i, dtype, ctx, rotary)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ctx.lm_head(cfg.hidden_size, cfg.vocab_size, dtype)

    def init_inference_optimization(self, config: KimiK2InferenceConfig):
        # As the base, but with the latent cache manager; the base's data-parallel and block layouts are refused in
        # contract.enforce_neuron_config. The same override point as NxDI's GLM-5.2 contrib (NXDI_CONTRACT.md:
        # model-init).
        if self.on_device_sampling:
            self.sampler = create_sampler(config.neuron_config, self.lm_head.tensor_parallel_group.size())
        self.kv_mgr = LatentKVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util)


# == the application ==============================================================================================

class NeuronKimiK2ForCausalLM(NeuronBaseForCausalLM):
    """Kimi-K2 for NxDI: `NeuronKimiK2ForCausalLM(converted_dir, config)`, then compile(out) / load(out).

    The checkpoint is the converted one (kimi_k2_neuron.formats): fused expert tensors, FP8 experts with `.scale`,
    float32 router. checkpoint_loader_fn memory-maps it instead of reading it whole (loader.py)."""

    _model_cls = NeuronKimiK2Model

    def __init__(self, model_path, config: KimiK2InferenceConfig | None = None, neuron_config=None):
        super().__init__(model_path, config=config, neuron_config=neuron_config)
        # Before compile() or load() traces or runs anything; the scripts also set it before importing the SDK.
        os.environ.update(contract.fp8_env(self.neuron_config.quantized, self.neuron_config.quantization_dtype))

    @classmethod
    def get_config_cls(cls):
        return KimiK2InferenceConfig

    @classmethod
    def get_neuron_config_cls(cls):
        # What vllm-neuron builds its generic NeuronConfig with (NXDI_CONTRACT.md: vllm-generic-config).
        return KimiK2ServingRequest

    @classmethod
    def save_quantized_state_dict(cls, model_path, config):
        """NxDI's quantize-from-HF step, which vllm-neuron runs before compiling a quantized config
        (NXDI_CONTRACT.md: vllm-compile-branch). The converted checkpoint already is the quantized state dict NxD
        loads (kimi_k2_neuron.convert): nothing is written, and the checkpoint is checked to hold the experts the
        config compiles."""
        path = config.neuron_config.quantized_checkpoints_path or model_path
        record, want = ConversionRecord.read(path), ExpertScheme.from_nxd(vars(config.neuron_config))
        if record is None or record.scheme != want:
            raise KimiInputError(f"{path}: holds {record.scheme.name if record else 'no converted'} experts, the "
                                 f"config compiles {want.name}; serve a checkpoint kimi-k2-neuron convert wrote")

    @staticmethod
    def load_hf_model(model_path, **kwargs):
        # Only NxDI's HF-quantize path calls this; it would load 1T parameters into one process.
        raise NotImplementedError("Kimi-K2 is loaded from the converted checkpoint; see kimi_k2_neuron.convert")

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config) -> dict:
        """Renames for NxDI's default get_state_dict path, strict both ways (NXDI_CONTRACT.md: state-dict-prefix)."""
        return contract.to_neuron_state_dict(state_dict, config.core_config(), config.neuron_config)

    def checkpoint_loader_fn(self, mmap: bool = False):
        path = self.neuron_config.quantized_checkpoints_path or self.model_path
        return load_neuron_state_dict(path, self.config)

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None):
        """NxDI's pre-sharding, a few ranks per pass (contract.rank_passes says why): the builder's rank window is
        narrowed for each pass and restored after (NXDI_CONTRACT.md: builder-rank-window)."""
        nc = self.neuron_config
        if nc.skip_sharding or not nc.save_sharded_checkpoint:  # NxDI only logs that it skips
            return super().shard_weights(compiled_model_path, debug, pre_shard_weights_hook)
        if pre_shard_weights_hook:
            pre_shard_weights_hook(self)
        builder = self.get_builder(debug)
        window = (builder.start_rank_id, builder.local_ranks_size)
        try:
            for start, size in contract.rank_passes(*window, os.environ):
                builder.start_rank_id, builder.local_ranks_size = start, size
                super().shard_weights(compiled_model_path, debug)
        finally:
            builder.start_rank_id, builder.local_ranks_size = window

    # NxDI computes each submodel's compiler arguments in its ModelWrapper when get_compiler_args returns None (the
    # base's default); Kimi's are added to those, so NxDI's per-submodel choices all stay (contract.compiler_args).
    def enable_context_encoding(self, **model_init_kwargs):
        super().enable_context_encoding(**model_init_kwargs)
        _add_compiler_args(self.context_encoding_model)

    def enable_token_generation(self, enable_wlt_optimization: bool = True, **model_init_kwargs):
        super().enable_token_generation(enable_wlt_optimization, **model_init_kwargs)
        _add_compiler_args(self.token_generation_model)

    # -- NxD's CPU mode ---------------------------------------------------------------------------------------------

    def to_cpu(self, presharded: str | None = None):
        """This model in NxD's CPU mode (NXD_CPU_MODE=1, gloo), built as the device path builds it.

        NxDI's own to_cpu differs from the device path in three ways that matter here (NXDI_CONTRACT.md:
        nxdi-to-cpu), so this override builds each submodel the way ModelBuilder does before tracing:
        - it casts the whole model to bfloat16, also the parameters declared float32 (router weight and
          e_score_correction_bias under cast_type "as-declared"); here each submodel comes from NxDI's own
          load_module, the device path's build: dtypes as declared and NxD's quantize.convert with the q_config
          NxDI derives from this NeuronConfig, so the FP8 experts are NxD's quantized layers with their scales
          (NxDI's to_cpu skips the convert, and strict=False then drops the scales silently);
        - it builds one model for both submodels with the application's config, so MoE's is_prefill_stage is not
          the submodel's; here each submodel gets its own build with its own config, as on device, and NxDI shares
          the KV cache between them after every call;
        - it loads with strict=False; here every checkpoint tensor must land in a parameter and every parameter
          must get one (loader.unloaded_parameters names the only exceptions), else a one-line error.
        `presharded`: a folder of NxD's per-rank files (`tp{rank}_sharded_checkpoint.safetensors`, what
        shard_weights writes and NxDI's load() reads on device) to load instead of sharding the checkpoint here.
        float32 at any TP, or bfloat16 at TP=1 (gloo has no bfloat16 collectives, as NxDI's to_cpu says)."""
        nc = self.neuron_config
        contract.check_cpu_run(nc.torch_dtype, nc.tp_degree, getattr(nc, "moe_ep_degree", 1))
        os.environ["NXD_CPU_MODE"] = "1"
        rank = _init_cpu_process_groups(nc)
        loaded = self.checkpoint_loader_fn() if presharded is None else read_presharded(presharded, rank)
        for wrapper in self.models:
            model = _build_as_on_device(wrapper)
            state = dict(loaded)  # once per submodel: get_sharded_checkpoint replaces entries by this rank's slices
            _check_no_unexpected(model, state, presharded or self.model_path)
            if presharded is None:
                get_sharded_checkpoint(state, model, rank, nc.tp_degree)  # NxD's per-rank slicing, as pre-sharding
            missing = unloaded_parameters(model, model.load_state_dict(state, strict=False).missing_keys, state)
            if missing:
                raise KimiInputError(f"{presharded or self.model_path}: {len(missing)} parameter(s) of the "
                                     f"{wrapper.tag} got no tensor: {listing(missing)}")
            wrapper.model = model
        self.eval()
        return self


def _add_compiler_args(wrapper) -> None:
    """ModelWrapper keeps the string it computed until get_builder hands it to ModelBuilder, and nothing reads it in
    between (NXDI_CONTRACT.md: compiler-args)."""
    wrapper.compiler_args = contract.compiler_args(wrapper.compiler_args)


def _build_as_on_device(wrapper) -> nn.Module:
    """A submodel as ModelBuilder builds it before tracing: NxDI's load_module under NxD's AOT mode, which allocates
    parameters without initializing them. Besides saving the random init, that avoids NxD's CPU master-weight init of
    quantized expert layers, which loses the TP factor of a last-dim partition and fails at TP >= 3 with stride-2
    gate_up (NXDI_CONTRACT.md: aot-build)."""
    instance = wrapper.get_model_instance()
    parallel_state.set_aot_mode(True)
    try:
        instance.load_module()
    finally:
        parallel_state.set_aot_mode(False)
    return instance.module


def _check_no_unexpected(model: nn.Module, state: dict, where) -> None:
    """NxD drops checkpoint tensors the model has no parameter for with only a warning (NXDI_CONTRACT.md:
    sharding-not-strict); refuse them instead."""
    names = model.state_dict().keys()
    extra = sorted(k for k in state if k not in names)
    if extra:
        raise KimiInputError(f"{where}: {len(extra)} tensor(s) the model has no place for: {listing(extra)}")


def _init_cpu_process_groups(nc) -> int:
    """gloo for NxD's CPU mode, as NxDI's to_cpu sets it up: a launcher's torch.distributed environment (WORLD_SIZE,
    RANK, MASTER_ADDR/PORT) for several ranks, else one process (NXDI_CONTRACT.md: nxdi-to-cpu). Returns this
    process's rank."""
    if not torch.distributed.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != nc.world_size:
            raise KimiInputError(f"WORLD_SIZE={world} processes, but the NeuronConfig needs {nc.world_size} ranks "
                                 f"(tp_degree={nc.tp_degree})")
        if world == 1:  # a fresh port: one inherited from another run's environment may still be taken
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            torch.distributed.init_process_group("gloo", world_size=1, rank=0)
        else:
            torch.distributed.init_process_group("gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=nc.tp_degree,
                                                 pipeline_model_parallel_size=nc.pp_degree,
                                                 expert_model_parallel_size=nc.ep_degree, skip_collective_init=True)
    return torch.distributed.get_rank()
