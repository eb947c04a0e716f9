"""Kimi-K2 as an NxDI model, without its optional parts: the parallel context over NxD's layers, the decoder layer
(the core's, its attention path chosen when it is built), NeuronBaseModel's Kimi and the base application. The parts
a run may add (chunked_prefill.py, prefix_caching.py, fused_spec.py) are mixins that modeling.py composes with
these."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.parallel_layers import mappings, parallel_state  # noqa: E402
from neuronx_distributed.parallel_layers.layers import (ColumnParallelLinear, ParallelEmbedding,  # noqa: E402
                                                        RowParallelLinear)
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel  # noqa: E402
from neuronx_distributed_inference.modules.generation.sampling import create_sampler  # noqa: E402
from torch import nn  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402
from kimi_k2_neuron.formats import layout as formats_layout  # noqa: E402
from kimi_k2_neuron.formats.record import ConversionRecord  # noqa: E402
from kimi_k2_neuron.formats.scheme import ExpertScheme  # noqa: E402
from kimi_k2_neuron.model.decoder import DecoderLayer  # noqa: E402
from kimi_k2_neuron.model.mla import CHUNK_QUERY_TILE  # noqa: E402
from kimi_k2_neuron.model.norm import RMSNorm  # noqa: E402
from kimi_k2_neuron.model.rope import RotaryTable  # noqa: E402
from kimi_k2_neuron.parallel import ParallelContext, stripe  # noqa: E402
from kimi_k2_neuron.placement import chunk_meshes  # noqa: E402

from . import contract, prefix_caching  # noqa: E402
from .inference_config import KimiK2InferenceConfig, KimiK2ServingRequest  # noqa: E402
from .latent_cache import LatentKVCacheManager  # noqa: E402
from .loader import load_neuron_state_dict, model_state_dict, rank_passes  # noqa: E402
from .nxd_moe import build_moe  # noqa: E402

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
        (placement.chunk_meshes). Made at the first use, unless the harness running the shell gave its own."""
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


# The decoder layer's attention, one per kind of submodel: a prefill (CTE) over its own tokens, a prefill chunk over
# the cache and itself (chunked_prefill.py), a prefill over cached blocks and itself (prefix_caching.py), a decode step
# over the replicated cache, or over the sequence-sharded one
PREFILL, CHUNK, DECODE, SHARDED_DECODE = "prefill", "chunk", "decode", "sharded-decode"
BLOCK_PREFILL = prefix_caching.BLOCK_PREFILL


class KimiK2DecoderLayer(DecoderLayer):
    """K is the latent [B, 1, S, latent], V 1-wide zeros (NXDI_CONTRACT.md: decoder-layer-call, kv-writes).
    Sequence-sharded (flash decoding): prefill attends as replicated and returns only this rank's positions; decode
    merges the KV group's partial attention under NxDI's masks (NXDI_CONTRACT.md: fd-cte-filter, fd-masks) in
    MLAttention.attend_sharded, not NxDI's GQA attention (NXDI_CONTRACT.md: fd-attention-xla-only); a prefill chunk
    attends through MLAttention.attend_chunk and returns the chunk entries this rank owns (NXDI_CONTRACT.md: fd-chunk,
    chunk-groups). Which of these a layer runs is fixed when it is built, as the submodel it belongs to is."""

    def __init__(self, cfg: KimiK2Config, layer_idx: int, dtype, ctx: NxDParallelContext, rotary: RotaryTable,
                 attention: str):
        super().__init__(cfg, layer_idx, dtype, ctx)
        self.rotary = rotary
        self.flash_decoding = bool(ctx.config.neuron_config.flash_decoding_enabled)
        self.attend = {PREFILL: self._prefill, CHUNK: self._chunk, BLOCK_PREFILL: self._block_prefill,
                       DECODE: self._decode, SHARDED_DECODE: self._sharded_decode}[attention]

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, **kwargs):
        """NxDI passes the rest by keyword (NXDI_CONTRACT.md: decoder-layer-call): active_mask, cos_cache, sin_cache,
        padding_mask."""
        cos_cache, sin_cache = kwargs.get("cos_cache"), kwargs.get("sin_cache")
        if cos_cache is None:
            cos_cache, sin_cache = self.rotary(position_ids)
        attn_in, hidden_states = self.attention_input(hidden_states)  # an EAGLE3 draft's layer reads two (eagle3.py)
        q_nope, q_pe, entries = self.self_attn.project(attn_in, (cos_cache, sin_cache))
        out, entries = self.attend(q_nope, q_pe, entries, attention_mask, past_key_value, position_ids,
                                   kwargs.get("active_mask"))
        hidden_states = hidden_states + out
        x = self.post_attention_layernorm(hidden_states)
        # NxD's MoE output is already all-reduced (NXDI_CONTRACT.md: moe-shared-expert).
        hidden_states = hidden_states + (self.mlp(x, kwargs.get("padding_mask"))[0] if self.is_moe else self.mlp(x))
        k_new = entries.unsqueeze(1)
        return hidden_states, (k_new, k_new.new_zeros(*k_new.shape[:-1], 1)), cos_cache, sin_cache, None

    # each: (q_nope, q_pe, entries, mask, past_key_value, position_ids, active_mask) -> (the attention output, the
    # entries this rank writes)

    def _prefill(self, q_nope, q_pe, entries, mask, past, position_ids, active_mask):
        out = self.self_attn.attend(q_nope, q_pe, entries, mask)
        return out, self._owned(entries) if self.flash_decoding else entries

    def _chunk(self, q_nope, q_pe, entries, mask, past, position_ids, active_mask):
        """The cache before the chunk and the chunk itself, its scores in tiles of CHUNK_QUERY_TILE queries, as the
        fit planner counts them; sequence-sharded, this rank writes the chunk entries it owns."""
        out = self.self_attn.attend_chunk(q_nope, q_pe, past[0][:, 0], entries, position_ids, CHUNK_QUERY_TILE)
        return out, self._owned(entries) if self.flash_decoding else entries

    def _block_prefill(self, q_nope, q_pe, entries, mask, past, position_ids, active_mask):
        """The positions before the call read through the block table (none in a prefix bucket of 0) and the call's
        own, by position in fixed key tiles (prefix_caching.prefill_attention)."""
        return prefix_caching.prefill_attention(self.self_attn, q_nope, q_pe, entries, past, position_ids), entries

    def _sharded_decode(self, q_nope, q_pe, entries, mask, past, position_ids, active_mask):
        """The rank's slots and the step's entry, each under mask_util's masks."""
        cache = past[0][:, 0]
        out = self.self_attn.attend_sharded(q_nope, q_pe, [cache, entries.to(cache.dtype)], [mask, active_mask])
        return out, entries

    def _decode(self, q_nope, q_pe, entries, mask, past, position_ids, active_mask):
        cache = past[0][:, 0]
        prior, active = decode_masks(mask, entries.shape[1])
        return self.self_attn.attend_split(q_nope, q_pe, cache, prior, entries.to(cache.dtype), active), entries

    def _owned(self, entries):
        """[B, S, latent] -> the positions r, r + G, ... this rank keeps, [B, S / G, latent]: NxDI's context-encoding
        filter, which the manager writes from slot 0 (NXDI_CONTRACT.md: fd-cte-filter)."""
        ctx = self.self_attn.ctx
        owned = stripe(entries.shape[1], ctx.kv_group, ctx.kv_rank(), entries.device)
        return torch.index_select(entries, 1, owned)


def set_model_attrs(model, config) -> None:
    """What NxDI's NeuronBaseModel reads of a model (its setup_attr_for_model), for the target and the MLA draft."""
    nc = config.neuron_config
    model.on_device_sampling = nc.on_device_sampling_config is not None
    model.tp_degree = nc.tp_degree
    model.hidden_size = config.hidden_size
    model.num_attention_heads = config.num_attention_heads
    model.num_key_value_heads = 1  # this, not the config, sizes the cache (NXDI_CONTRACT.md: latent-kv-head)
    model.max_batch_size = nc.max_batch_size
    model.buckets = nc.buckets


class KimiK2Model(NeuronBaseModel):
    """NxDI's model of one submodel; its decoder layers attend as attention_kind says."""

    def attention_kind(self, config: KimiK2InferenceConfig) -> str:
        """A prefill submodel's (NxDI sets is_prefill_stage on each submodel's config), else a decode step's."""
        if config.neuron_config.is_prefill_stage:
            return PREFILL
        return SHARDED_DECODE if config.neuron_config.flash_decoding_enabled else DECODE

    def setup_attr_for_model(self, config: KimiK2InferenceConfig):
        set_model_attrs(self, config)

    def init_model(self, config: KimiK2InferenceConfig):
        cfg, dtype = config.core_config(), config.neuron_config.torch_dtype
        # NXDI_CONTRACT.md: cpu-sampler
        gather = not self.on_device_sampling or config.neuron_config.on_cpu
        ctx = NxDParallelContext(tp_size=config.neuron_config.tp_degree, layout=contract.run_spec(config).layout,
                                 gather_logits=gather, reduce_dtype=config.neuron_config.rpl_reduce_dtype,
                                 config=config, rank_util=self.rank_util)
        self.embed_tokens = ctx.embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        rotary, kind = RotaryTable(cfg), self.attention_kind(config)
        self.layers = nn.ModuleList(KimiK2DecoderLayer(cfg, i, dtype, ctx, rotary, kind)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ctx.lm_head(cfg.hidden_size, cfg.vocab_size, dtype)

    def init_inference_optimization(self, config: KimiK2InferenceConfig):
        # As the base but with the latent cache manager (NXDI_CONTRACT.md: model-init).
        if self.on_device_sampling:
            self.sampler = create_sampler(config.neuron_config, self.lm_head.tensor_parallel_group.size())
        self.kv_mgr = self.cache_manager(config)

    def cache_manager(self, config: KimiK2InferenceConfig):
        """The latent cache in NxDI's contiguous layout (prefix_caching.PrefixCachingModel's in blocks)."""
        return LatentKVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util)


# == the application ==============================================================================================

class KimiK2Application(NeuronBaseForCausalLM):
    """The application NxDI builds its submodels from; modeling.NeuronKimiK2ForCausalLM adds the optional parts."""

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
        return load_neuron_state_dict(path, self.config)

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
        super().enable_context_encoding(**model_init_kwargs)
        add_compiler_args(self.context_encoding_model)

    def enable_token_generation(self, enable_wlt_optimization: bool = True, **model_init_kwargs):
        super().enable_token_generation(enable_wlt_optimization, **model_init_kwargs)
        add_compiler_args(self.token_generation_model)


def add_compiler_args(wrapper) -> None:
    """Nothing reads the string between ModelWrapper and ModelBuilder (NXDI_CONTRACT.md: compiler-args)."""
    wrapper.compiler_args = contract.compiler_args(wrapper.compiler_args)
