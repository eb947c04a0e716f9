"""The MoE layer the shell gives NxD: its router answering NxD's router contract with the core's noaux_tc selection,
its routed experts running the token-generation path the run spec names, and NxD's MoE module around them (shared
expert inside, one all-reduce)."""

from __future__ import annotations

from functools import partial

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2  # noqa: E402
from neuronx_distributed.modules.moe.model import MoE as NxDMoE  # noqa: E402
from neuronx_distributed.modules.moe.moe_configs import (BlockwiseMatmulConfig,  # noqa: E402
                                                          RoutedExpertsMLPOpsConfig)
from neuronx_distributed.modules.moe.shared_experts import SharedExperts  # noqa: E402
from neuronx_distributed.parallel_layers import parallel_state  # noqa: E402
from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_process_group  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.formats import layout as formats_layout  # noqa: E402
from kimi_k2_neuron.model.router import NoAuxTcRouter  # noqa: E402
from kimi_k2_neuron.parallel import SINGLE, ParallelContext  # noqa: E402

from . import contract, moe_decode, moe_paths  # noqa: E402
from .inference_config import KimiK2InferenceConfig  # noqa: E402


class NxDRouter(NoAuxTcRouter):
    """-> (logits, final weights [T, E] in the hidden dtype, ids [T, k]) (NXDI_CONTRACT.md: router-contract).
    With shard_router its float32 weight is a gathered column-parallel linear: each rank computes its experts' logits
    and every rank selects from the same gathered float32 [T, E]."""

    def __init__(self, cfg: KimiK2Config, ctx: ParallelContext = SINGLE):
        super().__init__(cfg, ctx)
        self.num_experts, self.hidden_size = cfg.n_routed_experts, cfg.hidden_size
        self.sequence_parallel_enabled, self.sequence_dimension = False, None

    def _init_logits(self, cfg, ctx):
        if not ctx.layout.shard_router:
            return super()._init_logits(cfg, SINGLE)  # a replicated float32 weight, whole on every rank
        self.ctx, self.shard_dim = ctx, None
        # float32, unquantized, named as NxD's own router names its linear (NXDI_CONTRACT.md: router-linear)
        setattr(self, formats_layout.ROUTER_LINEAR, ctx.gathered(cfg.hidden_size, cfg.n_routed_experts, torch.float32))

    def logits(self, x):
        linear = getattr(self, formats_layout.ROUTER_LINEAR, None)
        return super().logits(x) if linear is None else linear(x.float())

    def forward(self, hidden_states: torch.Tensor):
        flat = hidden_states.reshape(-1, self.hidden_size)
        logits = self.logits(flat)
        weights, ids = self.select(logits)
        affinities = torch.zeros(flat.shape[0], self.num_experts, dtype=weights.dtype, device=weights.device)
        return logits, affinities.scatter(1, ids, weights).to(hidden_states.dtype), ids


class KimiExpertMLPs(ExpertMLPsV2):
    """NxD's routed experts in a token-generation graph (one token a sequence), running the path the run spec names
    through NxD's public methods, where NxD's own forward picks by a fixed threshold (NXDI_CONTRACT.md: moe-paths,
    moe-decode): forward_selective_loading, or forward_all_experts (forward_all_experts_EP under EP). The method is
    chosen when built; the graph is traced for one path."""

    def __init__(self, *args, decode_path: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_path = decode_path
        ep = self.moe_expert_model_parallel_group.size() > 1
        self.decode_method = ("forward_selective_loading" if decode_path == "selective" else
                              "forward_all_experts_EP" if ep else "forward_all_experts")

    def forward(self, hidden_states, expert_affinities, expert_index, seq_len, padding_mask=None,
                expert_affinities_masked_full=None):
        return getattr(self, self.decode_method)(hidden_states, expert_affinities, expert_index)


def build_moe(cfg: KimiK2Config, dtype: torch.dtype, config: KimiK2InferenceConfig,
              ctx: ParallelContext) -> NxDMoE:
    """initialize_moe_module minus RouterTopK (NXDI_CONTRACT.md: moe-module); shared expert inside, one all-reduce
    (NXDI_CONTRACT.md: moe-shared-expert); no fused TKG (NXDI_CONTRACT.md: fused-tkg-bias)."""
    nc = config.neuron_config
    tkg_tp, tkg_ep, cte_tp, cte_ep = initialize_moe_process_group(config, False)
    experts = _experts_class(cfg, config)(
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
        blockwise_matmul_config=_blockwise_config(nc),
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
    moe = NxDMoE(router=NxDRouter(cfg, ctx), expert_mlps=experts, shared_experts=shared,
                 sequence_parallel_enabled=False, sequence_dimension=1)
    moe.eval()  # ExpertMLPsV2 takes its training path otherwise (NXDI_CONTRACT.md: moe-eval)
    return moe


def _blockwise_config(nc):
    """The MoE config of the graph: a fused graph's verify call runs batch x speculation_length tokens, which NxD would
    send to the blockwise prefill kernel from 48 tokens at Kimi's shapes; it runs moe_paths.VERIFY_MODE instead
    (NXDI_CONTRACT.md: verify-moe-path)."""
    bmm = nc.blockwise_matmul_config
    if nc.is_prefill_stage or not nc.speculation_length:
        return bmm
    return BlockwiseMatmulConfig.from_kwargs(logical_nc_config=bmm.logical_nc_config,
                                             **moe_paths.MODES[moe_paths.VERIFY_MODE].blockwise)


def _experts_class(cfg: KimiK2Config, config: KimiK2InferenceConfig):
    """The token-generation graph's experts run the spec's decode path (KimiExpertMLPs); a prefill's, a chunk's and a
    fused graph's verify of several tokens a sequence are NxD's own forward."""
    nc = config.neuron_config
    if nc.is_prefill_stage or nc.speculation_length:
        return ExpertMLPsV2
    return partial(KimiExpertMLPs, decode_path=moe_decode.choose(cfg, contract.run_spec(config)))
