"""Kimi-K2 as an NxDI model: the config, the traced model, the application. The math is the core's, the settings
contract.py's."""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.parallel_layers import mappings, parallel_state  # noqa: E402
from neuronx_distributed.parallel_layers.layers import (ColumnParallelLinear, ParallelEmbedding,  # noqa: E402
                                                        RowParallelLinear)
from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig  # noqa: E402
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel  # noqa: E402
from neuronx_distributed_inference.modules.generation.sampling import create_sampler  # noqa: E402
from torch import nn  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config, language_model_fields  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402
from kimi_k2_neuron.formats import layout as formats_layout  # noqa: E402
from kimi_k2_neuron.formats.record import CONVERSION_KEY, ConversionRecord  # noqa: E402
from kimi_k2_neuron.formats.scheme import ExpertScheme  # noqa: E402
from kimi_k2_neuron.model.decoder import DecoderLayer  # noqa: E402
from kimi_k2_neuron.model.mla import CHUNK_QUERY_TILE  # noqa: E402
from kimi_k2_neuron.model.norm import RMSNorm  # noqa: E402
from kimi_k2_neuron.model.rope import RotaryTable  # noqa: E402
from kimi_k2_neuron.parallel import ParallelContext, chunk_meshes, stripe  # noqa: E402

from . import chunked_prefill, contract, fused_spec, prefix_caching, vllm_request  # noqa: E402
from .latent_cache import LatentBlockKVCacheManager, LatentKVCacheManager  # noqa: E402
from .loader import load_neuron_state_dict, model_state_dict, rank_passes  # noqa: E402
from .nxd_moe import NxDRouter, build_moe  # noqa: E402,F401 (NxDRouter: the router NxD's MoE gets, named here too)
from .spec import RunSpec, layout_flags  # noqa: E402

# == the config ==================================================================================================

# HF fields NxDI reads that a plain config.json lacks; not use_return_dict, a read-only property in transformers
# (NXDI_CONTRACT.md: hf-defaults).
HF_DEFAULTS = {"output_attentions": False, "output_hidden_states": False, "return_dict": True}
_NOT_HF = ("neuron_config", "fused_spec_config", "metadata", "quantization_config")
# Beside each config rather than in it: NxDI saves every attribute to neuron_config.json.
_CORE: "weakref.WeakKeyDictionary[KimiK2InferenceConfig, KimiK2Config]" = weakref.WeakKeyDictionary()


class KimiK2InferenceConfig(InferenceConfig):
    """Derived only in add_derived_config, so a reload is the same model (NXDI_CONTRACT.md: config-construction)."""

    @classmethod
    def from_core(cls, cfg: KimiK2Config, neuron_config: MoENeuronConfig, **kwargs) -> "KimiK2InferenceConfig":
        """config.json's fields as plain JSON: no checkpoint code runs (NXDI_CONTRACT.md: remote-code-config)."""
        fields = language_model_fields(cfg.raw)
        attrs = {**HF_DEFAULTS, **{k: v for k, v in fields.items() if k not in ("torch_dtype", "dtype", "auto_map")}}

        def load_config(self):
            self.__dict__.update(attrs)

        config = cls(neuron_config, load_config=load_config, **kwargs)
        _CORE[config] = dataclasses.replace(cfg, quant=None)  # quant describes the source's storage
        return config

    @classmethod
    def for_serving(cls, cfg: KimiK2Config, spec: RunSpec) -> "KimiK2InferenceConfig":
        nc = MoENeuronConfig(**contract.neuron_config_kwargs(cfg, spec))
        return cls.from_core(cfg, nc, fused_spec_config=fused_spec.of_spec(nc, spec.draft),
                             **{contract.LAYOUT_KEY: contract.layout_attribute(spec.layout)})

    @classmethod
    def for_request(cls, request: MoENeuronConfig, checkpoint) -> "KimiK2InferenceConfig":
        if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
            raise KimiInputError(f"{checkpoint}: not a checkpoint folder with a config.json; serve the converted "
                                 f"checkpoint's folder")
        compiled = os.environ.get(vllm_request.COMPILED_ARTIFACTS_ENV)
        try:
            cfg = KimiK2Config.from_file(checkpoint)
            spec = vllm_request.spec_of_request(cfg, request, ConversionRecord.of(cfg), checkpoint)
            config = cls.for_serving(cfg, spec)
            if compiled and (Path(compiled) / "neuron_config.json").is_file():
                _check_compiled(compiled, spec, config)
        except KimiInputError as e:
            raise KimiInputError(f"serving {checkpoint} with {vllm_request.describe(request)}: {e}") from None
        return config

    def add_derived_config(self):
        if getattr(self.neuron_config, "is_eagle_draft", False):  # NXDI_CONTRACT.md: vllm-spec-config
            return fused_spec.as_vllm_draft_config(self)
        if isinstance(self.neuron_config, KimiK2ServingRequest):
            # vllm-neuron's load_pretrained_config records the checkpoint folder as _name_or_path.
            built = self.for_request(self.neuron_config, getattr(self, "_name_or_path", None))
            self.__dict__.clear()
            self.__dict__.update(vars(built))
            _CORE[self] = built.core_config()
            return
        # The latent [c_kv | k_pe] as one KV head (NXDI_CONTRACT.md: latent-kv-head).
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.num_local_experts = self.n_routed_experts
        layout = contract.layout_of(self)  # a reload's too (NXDI_CONTRACT.md: config-construction, layout-attribute)
        # G of the sequence-sharded cache; 1 is no flash decoding (NXDI_CONTRACT.md: cores-per-group, fd-config)
        self.num_cores_per_group = layout.kv_group
        for name, value in HF_DEFAULTS.items():
            setattr(self, name, getattr(self, name, value))
        contract.enforce_neuron_config(self.neuron_config, self.core_config(), layout, fused_spec.draft_of(self))

    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig

    def core_config(self) -> KimiK2Config:
        if self not in _CORE:
            raw = {k: v for k, v in vars(self).items() if k not in _NOT_HF}
            _CORE[self] = KimiK2Config.from_dict(raw, source="KimiK2InferenceConfig")
        return _CORE[self]


class KimiK2ServingRequest(MoENeuronConfig):
    """NxDI never builds this class, so the type alone marks a request (NXDI_CONTRACT.md: vllm-generic-config)."""


def _check_compiled(folder: str, request: RunSpec, config: KimiK2InferenceConfig) -> None:
    """Before vllm-neuron loads them: a ValueError there would recompile (NXDI_CONTRACT.md: vllm-precompiled)."""
    where = f"{vllm_request.COMPILED_ARTIFACTS_ENV}={folder}"
    try:
        compiled = KimiK2InferenceConfig.load(folder)
    except KimiInputError as e:
        raise KimiInputError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- anything NxDI raises on a foreign neuron_config.json
        raise KimiInputError(f"{where}: not artifacts of this model ({type(e).__name__}: {e})") from None
    bad = vllm_request.compiled_mismatches(request, compiled.neuron_config)
    # compile_and_save.py refuses these flags with --for-vllm
    layout = contract.layout_of(compiled)
    if compiled.neuron_config.is_prefix_caching:  # chunks behind vLLM's whole-prompt prefill (prefix_caching.py)
        layout = dataclasses.replace(layout, prefill_chunk=None)
    flags = layout_flags(layout)
    if flags:  # vllm-neuron drives the prefills itself and builds the model from its request
        bad.append(f"compiled with {' '.join(flags)}, a layout vllm-neuron's request cannot carry")
    if getattr(compiled, CONVERSION_KEY, None) != getattr(config, CONVERSION_KEY, None):
        bad.append(f"compiled from another conversion than {config.neuron_config.quantized_checkpoints_path or ''}"
                   f" (its config.json's {CONVERSION_KEY} differs)")
    if bad:
        raise KimiInputError(f"{where}: " + "; ".join(bad) + "; compile for these flags with "
                             "scripts/compile_and_save.py --for-vllm, or change them")


# == the model ===================================================================================================

@dataclass(frozen=True)
class NxDParallelContext(ParallelContext):
    """`rank` stays 0: in SPMD tracing every rank runs one graph and NxD's layers find their shard themselves."""

    gather_logits: bool = True  # False with on-device sampling: the sampler reads vocab-sharded logits
    # None reduces in the layer dtype, not NxD's float32 default (NXDI_CONTRACT.md: reduce-dtype).
    reduce_dtype: torch.dtype | None = None
    config: Any = field(default=None, compare=False)
    rank_util: Any = field(default=None, compare=False)  # the model's SPMDRank (NXDI_CONTRACT.md: fd-rank)
    meshes: dict = field(default_factory=dict, compare=False, repr=False)  # a chunk's groups, made at first use

    def replicated(self, in_features, out_features, dtype):
        # q_a_proj / kv_a_proj_with_mqa: small and shared by all heads, so every rank holds them whole.
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def gathered(self, in_features, out_features, dtype):
        # out_features % tp == 0 is checked (check_weight_sharding), so NxD pads nothing (NXDI_CONTRACT.md:
        # gathered-linear)
        return ColumnParallelLinear(in_features, out_features, bias=False, gather_output=True, dtype=dtype)

    def attention_a(self, hidden, q_lora_rank, latent_dim, dtype):
        """--shard-attn-a: q_a_proj | kv_a_proj_with_mqa as one gathered layer, one all-gather per layer; the
        state dict fuses the two weights (contract.for_layout)."""
        if not self.layout.shard_attn_a:
            return super().attention_a(hidden, q_lora_rank, latent_dim, dtype)
        return {formats_layout.FUSED_ATTENTION_A: self.gathered(hidden, q_lora_rank + latent_dim, dtype)}

    def column(self, in_features, out_features, dtype):
        return ColumnParallelLinear(in_features, out_features, bias=False, gather_output=False, dtype=dtype)

    def row(self, in_features, out_features, dtype):
        return RowParallelLinear(in_features, out_features, bias=False, input_is_parallel=True, dtype=dtype,
                                 reduce_dtype=self.reduce_dtype)

    def embedding(self, vocab, dim, dtype):
        return ParallelEmbedding(vocab, dim, dtype=dtype, shard_across_embedding=True)

    def lm_head(self, dim, vocab, dtype):
        # vocab % tp == 0 is checked, so no padding or logit masking (NXDI_CONTRACT.md: lm-head-padding).
        return ColumnParallelLinear(dim, vocab, bias=False, gather_output=self.gather_logits, dtype=dtype)

    def moe(self, cfg, dtype):
        return build_moe(cfg, dtype, self.config, self)

    # -- the KV group: fetched at each call, since under ModelBuilder it exists only inside initialize_kv_group's
    # mock_distributed block (NXDI_CONTRACT.md: kv-collectives) ------------------------------------------------

    def kv_rank(self):
        """A tensor from the model's SPMDRank (NxDI's NeuronBaseModel makes it before init_model builds this context),
        not NxD's process rank, which ModelBuilder traces as 0 on every rank (NXDI_CONTRACT.md: fd-rank)."""
        return torch.remainder(self.rank_util.get_rank(), self.kv_group).to(torch.int64)

    def gather_kv_heads(self, x):
        if self.kv_group == 1:
            return x
        return mappings.gather_from_tensor_model_parallel_region_with_dim(
            x, 1, process_group=parallel_state.get_kv_shared_group())

    def max_over_kv_group(self, x):
        if self.kv_group == 1:
            return x
        # NxD has no public max all-reduce; a copy, as NxD may reduce in place (NXDI_CONTRACT.md: kv-collectives,
        # private-members)
        return mappings._reduce(x.clone(), computation="max", process_group=parallel_state.get_kv_shared_group())

    def reduce_scatter_kv_heads(self, x):
        if self.kv_group == 1:
            return x
        # a copy: NxD may transpose the input in place (NXDI_CONTRACT.md: kv-collectives)
        return mappings.reduce_scatter_to_tensor_model_parallel_region_with_dim(
            x.clone(), 1, process_group=parallel_state.get_kv_shared_group())

    # -- a chunk's groups (Layout.chunk_group): NxD's collectives over meshes made as NxD makes its own, inside the
    # traced forward on device (NXDI_CONTRACT.md: chunk-groups) -----------------------------------------------------

    def gather_chunk_heads(self, x, chunk_group, dim=1):
        if chunk_group == 1:
            return x
        return mappings.gather_from_tensor_model_parallel_region_with_dim(x, dim, process_group=self._mesh(
            chunk_group, 0))

    def gather_chunk_cache(self, x, chunk_group):
        if chunk_group == self.kv_group:
            return x
        return mappings.gather_from_tensor_model_parallel_region_with_dim(x, 1, process_group=self._mesh(
            chunk_group, 1))

    def max_over_chunk_group(self, x, chunk_group):
        if chunk_group == 1:
            return x
        return mappings._reduce(x.clone(), computation="max", process_group=self._mesh(chunk_group, 0))

    def reduce_scatter_chunk_heads(self, x, chunk_group):
        if chunk_group == 1:
            return x
        return mappings.reduce_scatter_to_tensor_model_parallel_region_with_dim(
            x.clone(), 1, process_group=self._mesh(chunk_group, 0))

    def _mesh(self, chunk_group, which):
        """0: the Gc adjacent ranks (the KV group itself at Gc = G); 1: the ranks whose caches this one pools
        (parallel.chunk_meshes). Made at the first use, unless the harness running the shell gave its own."""
        if which == 0 and chunk_group == self.kv_group:
            return parallel_state.get_kv_shared_group()
        key = (chunk_group, which)
        if key not in self.meshes:
            self.meshes[key] = mesh_group(chunk_meshes(self.tp_size, self.kv_group, chunk_group)[which])
        return self.meshes[key]


def mesh_group(mesh: list[list[int]]):
    """One process group whose replica groups are the whole mesh, as NxD makes its MoE and top-k groups inside the
    traced forward (NXDI_CONTRACT.md: chunk-groups)."""
    return torch.distributed.new_group(mesh[0], pg_options={"xla_pg_options": {"mesh": mesh}})


def decode_masks(prior_mask: torch.Tensor, s: int):
    """[B, 1, 1, T] -> prior [B, 1, S, T], active (the uncached step) (NXDI_CONTRACT.md: decode-mask)."""
    b = prior_mask.shape[0]
    prior = prior_mask.to(torch.bool).expand(b, 1, s, prior_mask.shape[-1])
    active = torch.ones(s, s, dtype=torch.bool, device=prior.device).tril()[None, None].expand(b, 1, s, s)
    return prior, active


class KimiK2DecoderLayer(DecoderLayer):
    """K is the latent [B, 1, S, latent], V 1-wide zeros (NXDI_CONTRACT.md: decoder-layer-call, kv-writes).
    Sequence-sharded (flash decoding): prefill attends as replicated and returns only this rank's positions; decode
    merges the KV group's partial attention under NxDI's masks (NXDI_CONTRACT.md: fd-cte-filter, fd-masks) in
    MLAttention.attend_sharded, not NxDI's GQA attention (NXDI_CONTRACT.md: fd-attention-xla-only); a prefill chunk
    attends through MLAttention.attend_chunk and returns the chunk entries this rank owns (NXDI_CONTRACT.md: fd-chunk,
    chunk-groups)."""

    def __init__(self, cfg: KimiK2Config, layer_idx: int, dtype, ctx: NxDParallelContext, rotary: RotaryTable):
        super().__init__(cfg, layer_idx, dtype, ctx)
        self.rotary = rotary
        nc = ctx.config.neuron_config
        self.flash_decoding = bool(nc.flash_decoding_enabled)
        self.key_tile = prefix_caching.key_tile(nc) if nc.is_prefix_caching else None

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, **kwargs):
        """NxDI passes the rest by keyword (NXDI_CONTRACT.md: decoder-layer-call): active_mask, cos_cache, sin_cache,
        padding_mask, and the chunk's kimi_chunk."""
        active_mask, padding_mask = kwargs.get("active_mask"), kwargs.get("padding_mask")
        cos_cache, sin_cache = kwargs.get("cos_cache"), kwargs.get("sin_cache")
        if cos_cache is None:
            cos_cache, sin_cache = self.rotary(position_ids)
        attn = self.self_attn
        q_nope, q_pe, entries = attn.project(self.input_layernorm(hidden_states), (cos_cache, sin_cache))
        if self.key_tile and kwargs.get("is_for_context_encoding"):
            # a prefill in blocks, after cached ones or not (prefix_caching.py)
            prefix = None if past_key_value is None else past_key_value[0][:, 0]
            hidden_states = hidden_states + prefix_caching.prefill_attention(attn, q_nope, q_pe, entries, prefix,
                                                                             position_ids, self.key_tile)
        elif past_key_value is None:
            hidden_states = hidden_states + attn.attend(q_nope, q_pe, entries, attention_mask)
            if self.flash_decoding:
                entries = self._owned(entries)
        elif kwargs.get("kimi_chunk"):
            # A chunk (chunked_prefill.chunk_forward): the cache before it and the chunk itself, its scores in tiles
            # of CHUNK_QUERY_TILE queries, as the fit planner counts them; sequence-sharded, this rank writes the
            # chunk entries it owns
            past = past_key_value[0][:, 0]
            hidden_states = hidden_states + attn.attend_chunk(q_nope, q_pe, past, entries, position_ids,
                                                              CHUNK_QUERY_TILE)
            if self.flash_decoding:
                entries = self._owned(entries)
        elif self.flash_decoding:
            # a flash-decoding step: the rank's slots and the step's entry, each under mask_util's masks
            past = past_key_value[0][:, 0]
            hidden_states = hidden_states + attn.attend_sharded(q_nope, q_pe, [past, entries.to(past.dtype)],
                                                                [attention_mask, active_mask])
        else:
            past = past_key_value[0][:, 0]
            prior, active = decode_masks(attention_mask, entries.shape[1])
            hidden_states = hidden_states + attn.attend_split(q_nope, q_pe, past, prior, entries.to(past.dtype),
                                                              active)
        x = self.post_attention_layernorm(hidden_states)
        # NxD's MoE output is already all-reduced (NXDI_CONTRACT.md: moe-shared-expert).
        hidden_states = hidden_states + (self.mlp(x, padding_mask)[0] if self.is_moe else self.mlp(x))
        k_new = entries.unsqueeze(1)
        return hidden_states, (k_new, k_new.new_zeros(*k_new.shape[:-1], 1)), cos_cache, sin_cache, None

    def _owned(self, entries):
        """[B, S, latent] -> the positions r, r + G, ... this rank keeps, [B, S / G, latent]: NxDI's context-encoding
        filter, which the manager writes from slot 0 (NXDI_CONTRACT.md: fd-cte-filter)."""
        ctx = self.self_attn.ctx
        owned = stripe(entries.shape[1], ctx.kv_group, ctx.kv_rank(), entries.device)
        return torch.index_select(entries, 1, owned)


class NeuronKimiK2Model(NeuronBaseModel):
    """chunk: the chunked-prefill submodel (chunked_prefill.chunk_forward), else NxDI's forward."""

    def __init__(self, config: KimiK2InferenceConfig, optimize_inference: bool = True, chunk: bool = False):
        self.chunk = chunk
        super().__init__(config, optimize_inference)

    def forward(self, *args, **kwargs):
        if self.chunk:
            return chunked_prefill.chunk_forward(self, *args, **kwargs)
        return super().forward(*args, **kwargs)

    def get_model_output(self, *args, **kwargs):
        """EAGLE3's target capture gathered 4H wide (NXDI_CONTRACT.md: eagle3-cte-gather)."""
        return fused_spec.target_output(self, super().get_model_output(*args, **kwargs), kwargs)

    def setup_attr_for_model(self, config: KimiK2InferenceConfig):
        nc = config.neuron_config
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.tp_degree = nc.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        # This, not the config, sizes the cache (NXDI_CONTRACT.md: latent-kv-head).
        self.num_key_value_heads = 1
        self.max_batch_size = nc.max_batch_size
        self.buckets = nc.buckets

    def init_model(self, config: KimiK2InferenceConfig):
        cfg, dtype = config.core_config(), config.neuron_config.torch_dtype
        # NXDI_CONTRACT.md: cpu-sampler
        gather = not self.on_device_sampling or config.neuron_config.on_cpu
        layout = contract.layout_of(config)
        ctx = NxDParallelContext(tp_size=config.neuron_config.tp_degree, layout=layout, gather_logits=gather,
                                 reduce_dtype=config.neuron_config.rpl_reduce_dtype, config=config,
                                 rank_util=self.rank_util)
        self.embed_tokens = ctx.embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        rotary = RotaryTable(cfg)
        self.layers = nn.ModuleList(KimiK2DecoderLayer(cfg, i, dtype, ctx, rotary)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ctx.lm_head(cfg.hidden_size, cfg.vocab_size, dtype)

    def init_inference_optimization(self, config: KimiK2InferenceConfig):
        # As the base but with the latent cache manager (NXDI_CONTRACT.md: model-init).
        if self.on_device_sampling:
            self.sampler = create_sampler(config.neuron_config, self.lm_head.tensor_parallel_group.size())
        if config.neuron_config.is_block_kv_layout:  # vLLM's prefix caching (prefix_caching.py)
            self.kv_mgr = LatentBlockKVCacheManager(config, num_kv_head=self.num_key_value_heads)
        else:
            self.kv_mgr = LatentKVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util)


# == the application ==============================================================================================

class NeuronKimiK2ForCausalLM(NeuronBaseForCausalLM):
    """`NeuronKimiK2ForCausalLM(converted_dir, config)`, then compile(out) / load(out)."""

    _model_cls = NeuronKimiK2Model

    def __init__(self, model_path, config: KimiK2InferenceConfig | None = None, neuron_config=None):
        super().__init__(model_path, config=config, neuron_config=neuron_config)
        # Before compile() or load() traces or runs anything.
        os.environ.update(contract.fp8_env(self.neuron_config.quantized, self.neuron_config.quantization_dtype))

    @classmethod
    def get_config_cls(cls):
        return KimiK2InferenceConfig

    @classmethod
    def get_neuron_config_cls(cls):
        return KimiK2ServingRequest

    @classmethod
    def save_quantized_state_dict(cls, model_path, config):
        """Only checks the converted experts (NXDI_CONTRACT.md: vllm-compile-branch)."""
        path = config.neuron_config.quantized_checkpoints_path or model_path
        record, want = ConversionRecord.read(path), ExpertScheme.from_nxd(vars(config.neuron_config))
        if record is None or record.scheme != want:
            raise KimiInputError(f"{path}: holds {record.scheme.name if record else 'no converted'} experts, the "
                                 f"config compiles {want.name}; serve a checkpoint kimi-k2-neuron convert wrote")

    @staticmethod
    def load_hf_model(model_path, **kwargs):
        # Only NxDI's HF-quantize path calls this: 1T parameters in one process.
        raise NotImplementedError("Kimi-K2 is loaded from the converted checkpoint; see kimi_k2_neuron.convert")

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config) -> dict:
        """Renames for NxDI's default get_state_dict path, strict both ways (NXDI_CONTRACT.md: state-dict-prefix)."""
        return model_state_dict(state_dict, config)

    def checkpoint_loader_fn(self, mmap: bool = False):
        path = self.neuron_config.quantized_checkpoints_path or self.model_path
        return fused_spec.state_dict(self, load_neuron_state_dict(path, self.config))

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None):
        """A few ranks per pass (NXDI_CONTRACT.md: builder-rank-window)."""
        nc = self.neuron_config
        if nc.skip_sharding or not nc.save_sharded_checkpoint:  # NxDI only logs that it skips
            return super().shard_weights(compiled_model_path, debug, pre_shard_weights_hook)
        if pre_shard_weights_hook:
            pre_shard_weights_hook(self)
        builder = self.get_builder(debug)
        window = (builder.start_rank_id, builder.local_ranks_size)
        try:
            for start, size in rank_passes(*window, os.environ):
                builder.start_rank_id, builder.local_ranks_size = start, size
                super().shard_weights(compiled_model_path, debug)
        finally:
            builder.start_rank_id, builder.local_ranks_size = window

    # Kimi's compiler arguments are added to each ModelWrapper's own, so NxDI's per-submodel choices stay.
    def enable_context_encoding(self, **model_init_kwargs):
        fused_spec.complete(self)  # first thing NxDI's __init__ builds (NXDI_CONTRACT.md: fused-spec)
        super().enable_context_encoding(**model_init_kwargs)
        _add_compiler_args(self.context_encoding_model)

    def enable_fused_spec(self):
        super().enable_fused_spec()
        _add_compiler_args(self.fused_spec_model)

    def enable_token_generation(self, enable_wlt_optimization: bool = True, **model_init_kwargs):
        super().enable_token_generation(enable_wlt_optimization, **model_init_kwargs)
        _add_compiler_args(self.token_generation_model)
        if contract.layout_of(self.config).prefill_chunk and not self.neuron_config.is_prefix_caching:
            chunked_prefill.enable_chunked_prefill(self, **model_init_kwargs)

    def _get_model_outputs(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args, **kwargs):
        """A prefill wider than the chunk to the chunk driver (NXDI_CONTRACT.md: private-members)."""
        if chunked_prefill.takes(self, input_ids, position_ids):
            return chunked_prefill.prefill(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params)
        if prefix_caching.takes(self, input_ids, position_ids, args[4:8]):
            return prefix_caching.prefill(self, super()._get_model_outputs, (input_ids, attention_mask, position_ids,
                                          seq_ids, sampling_params), args[:4], args[4:8])
        return super()._get_model_outputs(input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args,
                                          **kwargs)


def _add_compiler_args(wrapper) -> None:
    """Nothing reads the string between ModelWrapper and ModelBuilder (NXDI_CONTRACT.md: compiler-args)."""
    wrapper.compiler_args = contract.compiler_args(wrapper.compiler_args)
