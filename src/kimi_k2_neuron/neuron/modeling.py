"""Kimi-K2 as an NxDI model: the core's layers, built with NxD parallel layers, inside NxDI's base classes.

    NeuronKimiK2ForCausalLM (NeuronBaseForCausalLM)  application: config, compile/load, checkpoint, compiler args
      NeuronKimiK2Model (NeuronBaseModel)           traced graph: embed -> layers -> norm -> lm_head (+ sampler)
        KimiK2DecoderLayer                          core RMSNorm + MLAttention (layers.attention_block) + MLP or MoE
          MLP (core) or NxD MoE(NxDRouter, ExpertMLPsV2, SharedExperts)

The math is the core's (kimi_k2_neuron.model): this file only wires it to NxDI's contracts. Line references are
NxDI @4bcdc54 (src/neuronx_distributed_inference/) and NxD @fbac349 (src/neuronx_distributed/).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
from neuronx_distributed.modules.moe.model import MoE
from neuronx_distributed.modules.moe.moe_configs import RoutedExpertsMLPOpsConfig
from neuronx_distributed.modules.moe.shared_experts import SharedExperts
from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from neuronx_distributed.trace.trace import get_sharded_checkpoint
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel
from neuronx_distributed_inference.modules.generation.sampling import create_sampler
from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_process_group
from torch import nn

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing
from kimi_k2_neuron.model.mla import MLAttention
from kimi_k2_neuron.model.moe import MLP
from kimi_k2_neuron.model.norm import RMSNorm
from kimi_k2_neuron.model.rope import RotaryTable
from kimi_k2_neuron.parallel import ParallelContext

from . import contract, keys, layers
from .config import KimiK2InferenceConfig
from .kv_cache import LatentKVCacheManager
from .loader import load_neuron_state_dict, read_presharded, unloaded_parameters


@dataclass(frozen=True)
class NxDParallelContext(ParallelContext):
    """The core's layer factory returning NxD layers. `rank` stays 0: in SPMD tracing every rank runs the same
    graph and NxD layers find their shard through the process group and the sharded checkpoint."""

    gather_logits: bool = True  # False with on-device sampling: the sampler reads vocab-sharded logits
    # All-reduce dtype of the row-parallel layers: NeuronConfig.rpl_reduce_dtype, as NxDI's Llama passes it
    # (llama/modeling_llama.py:386); None lets NxD reduce in the layer dtype (layers.py: reduce_dtype or dtype)
    # instead of its float32 default.
    reduce_dtype: torch.dtype | None = None

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
        # (model_base.py:990-999).
        return ColumnParallelLinear(dim, vocab, bias=False, gather_output=self.gather_logits, dtype=dtype)


def build_moe(cfg: KimiK2Config, dtype: torch.dtype, config: KimiK2InferenceConfig) -> MoE:
    """NxD's MoE with the core's router, what initialize_moe_module (moe_v2.py:23-132) builds minus its RouterTopK:
    - dropless: capacity_factor None (expert_mlps_v2.py:1486-1497; the KIMI contrib's 1.0 dropped prefill tokens);
    - no renormalization: NxDRouter returns final weights (normalize_top_k_affinities False);
    - shared expert inside the MoE: its output is added before the MoE's single all-reduce (model.py:220, 236-245),
      one collective per layer instead of two, and HF's `mlp.shared_experts.*` names load unchanged. The routed
      scaling factor is in the router weights, so it never touches the shared expert;
    - no fused TKG module (init_tkg_module False): the stock kernel applies a router bias before the sigmoid
      (moe_fused_tkg.py:366) and cannot express noaux_tc's selection-only bias."""
    nc = config.neuron_config
    tkg_tp, tkg_ep, cte_tp, cte_ep = initialize_moe_process_group(config, False)
    experts = ExpertMLPsV2(
        routed_experts_mlp_config=RoutedExpertsMLPOpsConfig(
            num_experts=cfg.n_routed_experts,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            top_k=cfg.num_experts_per_tok,
            hidden_act="silu",
            glu_mlp=True,
            glu_type=nc.glu_type,
            use_index_calc_kernel=nc.use_index_calc_kernel,
            normalize_top_k_affinities=False,
            capacity_factor=None,
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
    moe = MoE(router=layers.NxDRouter(cfg), expert_mlps=experts, shared_experts=shared,
              sequence_parallel_enabled=False, sequence_dimension=1)
    moe.eval()  # ExpertMLPsV2 takes its training path otherwise (expert_mlps_v2.py:1453)
    return moe


class KimiK2DecoderLayer(nn.Module):
    """Pre-norm MLA attention, then a pre-norm dense MLP (first_k_dense_replace layers) or MoE.

    Called as in model_base.py:1348-1370 (keyword arguments it does not use arrive in **kwargs) and returns
    (hidden, (K, V), cos, sin, None) (l.1372-1395); (K, V) as layers.attention_block describes. cos/sin are
    computed once, by layer 0, and handed on."""

    def __init__(self, cfg: KimiK2Config, layer_idx: int, dtype, ctx: NxDParallelContext, config,
                 rotary: RotaryTable | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, dtype, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = build_moe(cfg, dtype, config)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, ctx)
        # Per-row positions, so batched decode at different positions is right; one table shared by all layers.
        self.rotary = rotary or RotaryTable(cfg)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, cos_cache=None,
                sin_cache=None, padding_mask=None, **kwargs):
        if cos_cache is None:  # first layer; later layers get them back from the previous one
            cos_cache, sin_cache = self.rotary(position_ids)
        hidden_states, kv = layers.attention_block(self.self_attn, self.input_layernorm, hidden_states,
                                                     (cos_cache, sin_cache), past_key_value, attention_mask)
        x = self.post_attention_layernorm(hidden_states)
        # NxD's MoE output is already all-reduced (model.py:236-245); the core MLP reduces in its RowParallel.
        hidden_states = hidden_states + (self.mlp(x, padding_mask)[0] if self.is_moe else self.mlp(x))
        return hidden_states, kv, cos_cache, sin_cache, None


class NeuronKimiK2Model(NeuronBaseModel):
    """The traced model. NeuronBaseModel.__init__ calls setup_attr_for_model, init_model, then
    init_inference_optimization (model_base.py:77-118)."""

    def setup_attr_for_model(self, config: KimiK2InferenceConfig):
        nc = config.neuron_config
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.tp_degree = nc.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        # The latent is one KV head; this attribute, not the config, sizes the cache (model_base.py:173-179).
        self.num_key_value_heads = 1
        self.max_batch_size = nc.max_batch_size
        self.buckets = nc.buckets

    def init_model(self, config: KimiK2InferenceConfig):
        cfg, dtype = config.core_config(), config.neuron_config.torch_dtype
        # On device the sampler reads vocab-sharded logits (its top-k/argmax gather across ranks). NxDI's sampler in
        # CPU mode has no distributed path (process_group None, plain torch.topk/argmax: sampling.py:270-275,
        # 324-325, 373-374), so a CPU run gathers the vocabulary in lm_head; NxDI's own models (llama's lm_head,
        # modeling_llama.py:1128) would sample from one rank's shard there.
        gather = not self.on_device_sampling or config.neuron_config.on_cpu
        ctx = NxDParallelContext(tp_size=config.neuron_config.tp_degree, gather_logits=gather,
                                 reduce_dtype=config.neuron_config.rpl_reduce_dtype)
        self.embed_tokens = ctx.embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        rotary = RotaryTable(cfg)
        self.layers = nn.ModuleList(KimiK2DecoderLayer(cfg, i, dtype, ctx, config, rotary)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ctx.lm_head(cfg.hidden_size, cfg.vocab_size, dtype)

    def init_inference_optimization(self, config: KimiK2InferenceConfig):
        # As the base (model_base.py:161-179) but with the latent cache manager; the base's data-parallel and block
        # layouts are refused in contract.enforce_neuron_config. Same override point as GLM-5.2's contrib.
        if self.on_device_sampling:
            self.sampler = create_sampler(config.neuron_config, self.lm_head.tensor_parallel_group.size())
        self.kv_mgr = LatentKVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util)


class NeuronKimiK2ForCausalLM(NeuronBaseForCausalLM):
    """Kimi-K2 for NxDI: `NeuronKimiK2ForCausalLM(converted_dir, config)`, then compile(out) / load(out).

    The checkpoint is the converted one (kimi_k2_neuron.convert): fused expert tensors, FP8 experts with `.scale`,
    float32 router. checkpoint_loader_fn memory-maps it instead of reading it whole (application_base.py:630-683)."""

    _model_cls = NeuronKimiK2Model

    def __init__(self, model_path, config: KimiK2InferenceConfig | None = None, neuron_config=None):
        super().__init__(model_path, config=config, neuron_config=neuron_config)
        # Before compile() or load() traces or runs anything (inference_demo.py:465-467 sets the same two).
        # The scripts also set them before importing the SDK.
        os.environ.update(contract.fp8_env(self.neuron_config.quantized, self.neuron_config.quantization_dtype))

    @classmethod
    def get_config_cls(cls):
        return KimiK2InferenceConfig

    @staticmethod
    def load_hf_model(model_path, **kwargs):
        # Only NxDI's HF-quantize path calls this; it would load 1T parameters into one process.
        raise NotImplementedError("Kimi-K2 is loaded from the converted checkpoint; see kimi_k2_neuron.convert")

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config) -> dict:
        """Renames for NxDI's default get_state_dict path (application_base.py:693-739), strict both ways."""
        return keys.to_neuron_state_dict(state_dict, config.core_config(), config.neuron_config)

    def checkpoint_loader_fn(self, mmap: bool = False):
        path = self.neuron_config.quantized_checkpoints_path or self.model_path
        return load_neuron_state_dict(path, self.config)

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None):
        """NxDI's pre-sharding, a few ranks per pass (contract.rank_passes says why): the builder's rank window
        (ModelBuilder(start_rank_id=, local_ranks_size=), model_builder.py:482-483, read by shard_checkpoint at
        l.823-853) is narrowed for each pass and restored after."""
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

        NxDI's own to_cpu (application_base.py:556-628) differs from the device path in three ways that matter
        here, so this override builds each submodel the way ModelBuilder does before tracing:
        - it casts the whole model with .bfloat16(), also the parameters declared float32 (router weight and
          e_score_correction_bias under cast_type "as-declared"); here each submodel comes from NxDI's own
          DecoderModelInstance.load_module (model_wrapper.py:1454-1530), the device path's build: dtypes as declared
          and NxD's quantize.convert with the q_config NxDI derives from this NeuronConfig, so the FP8 experts are
          NxD's quantized layers with their scales (NxDI's to_cpu skips the convert, and strict=False then drops
          the scales silently);
        - it builds one model for both submodels with the application's config, so MoE's is_prefill_stage is not
          the submodel's (enable_context_encoding/enable_token_generation, model_base.py:3107-3141); here each
          submodel gets its own build with its own config, as on device, and NxDI's _copy_past_key_values shares
          the KV cache between them after every call (model_base.py:3761-3795);
        - it loads with strict=False; here every checkpoint tensor must land in a parameter and every parameter
          must get one (loader.unloaded_parameters names the only exceptions), else a one-line error.
        `presharded`: a folder of NxD's per-rank files (`tp{rank}_sharded_checkpoint.safetensors`, what
        shard_weights writes and NxDI's load() reads on device) to load instead of sharding the checkpoint here.
        float32 at any TP, or bfloat16 at TP=1 (gloo has no bfloat16 collectives, as NxDI's to_cpu says)."""
        nc = self.neuron_config
        contract.check_cpu_run(nc.torch_dtype, nc.tp_degree, getattr(nc, "moe_ep_degree", 1),
                               nc.on_device_sampling_config is not None, nc.on_cpu)
        os.environ["NXD_CPU_MODE"] = "1"
        rank = _init_cpu_process_groups(nc)
        for wrapper in self.models:
            model = _build_as_on_device(wrapper)
            if presharded is None:
                state = self.checkpoint_loader_fn()
                _check_no_unexpected(model, state, self.model_path)
                get_sharded_checkpoint(state, model, rank, nc.tp_degree)  # NxD's per-rank slicing, as pre-sharding
            else:
                state = read_presharded(presharded, rank)
                _check_no_unexpected(model, state, presharded)
            missing = unloaded_parameters(model, model.load_state_dict(state, strict=False).missing_keys, state)
            if missing:
                raise KimiInputError(f"{presharded or self.model_path}: {len(missing)} parameter(s) of the "
                                     f"{wrapper.tag} got no tensor: {listing(missing)}")
            wrapper.model = model
        self.eval()
        return self


def _add_compiler_args(wrapper) -> None:
    """ModelWrapper keeps the string it computed until get_builder hands it to ModelBuilder.add
    (application_base.py:174-181); nothing reads it in between."""
    wrapper.compiler_args = contract.compiler_args(wrapper.compiler_args)


def _build_as_on_device(wrapper) -> nn.Module:
    """A submodel as ModelBuilder builds it before tracing (model_builder.py:551-576): NxDI's load_module under
    NxD's AOT mode, which allocates parameters without initializing them (layers.py:138-140). Besides saving the
    random init, that avoids NxD's CPU master-weight init of quantized expert layers, which loses the TP factor of
    a last-dim partition (layers.py:141-150) and fails at TP >= 3 with stride-2 gate_up."""
    instance = wrapper.get_model_instance()
    parallel_state.set_aot_mode(True)
    try:
        instance.load_module()
    finally:
        parallel_state.set_aot_mode(False)
    return instance.module


def _check_no_unexpected(model: nn.Module, state: dict, where) -> None:
    """NxD's preprocess_checkpoint drops checkpoint tensors the model has no parameter for with only a warning
    (trace.py:640-644); refuse them instead."""
    names = model.state_dict().keys()
    extra = sorted(k for k in state if k not in names)
    if extra:
        raise KimiInputError(f"{where}: {len(extra)} tensor(s) the model has no place for: {listing(extra)}")


def _init_cpu_process_groups(nc) -> int:
    """gloo for NxD's CPU mode, as NxDI's to_cpu sets it up (application_base.py:573-596): a launcher's
    torch.distributed environment (WORLD_SIZE, RANK, MASTER_ADDR/PORT) for several ranks, else one process.
    Returns this process's rank."""
    if not torch.distributed.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != nc.world_size:
            raise KimiInputError(f"WORLD_SIZE={world} processes, but the NeuronConfig needs {nc.world_size} ranks "
                                 f"(tp_degree={nc.tp_degree})")
        if world == 1:  # a fresh port: one inherited from another run's environment may still be taken
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            torch.distributed.init_process_group("gloo", world_size=1, rank=0)
        else:
            torch.distributed.init_process_group("gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=nc.tp_degree,
                                                 pipeline_model_parallel_size=nc.pp_degree,
                                                 expert_model_parallel_size=nc.ep_degree, skip_collective_init=True)
    return torch.distributed.get_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
