"""The shell's application in NxD's CPU mode: what NxDI's to_cpu does, without its two gaps (it casts the float32 router
to bf16 and skips quantize.convert, so FP8 scales drop: NXD_CPU_MODE.md: nxdi-to-cpu). The harness's class adds this
to the product's; nothing on trn2 runs it."""

from __future__ import annotations

import os

import torch
from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.trace.trace import get_sharded_checkpoint
from neuronx_distributed_inference.models.model_wrapper import ModelWrapper
from torch import nn

from kimi_k2_neuron.errors import KimiInputError, env_int, listing
from kimi_k2_neuron.neuron.loader import read_presharded, unloaded_parameters
from kimi_k2_neuron.neuron.contract import run_spec
from kimi_k2_neuron.neuron.modeling import NeuronKimiK2ForCausalLM, NxDParallelContext
from kimi_k2_neuron.runtime.ranks import free_port
from kimi_k2_neuron.runtime.tp import chunk_process_groups

from .fused_spec_cpu import FusedSpecCpu, checked_names, init_draft_group, use_device_draft_sampler
from .options import check_cpu_run


class CpuMode:
    """to_cpu for a NeuronKimiK2ForCausalLM subclass."""

    def to_cpu(self, presharded: str | None = None):
        """Built per submodel as on device, loaded strictly. `presharded`: NxD's per-rank files to load."""
        nc = self.neuron_config
        check_cpu_run(nc.torch_dtype, nc.tp_degree, getattr(nc, "moe_ep_degree", 1))
        os.environ["NXD_CPU_MODE"] = "1"
        rank = _init_cpu_process_groups(nc, self.config.num_cores_per_group)
        chunk_groups = chunk_process_groups(nc.tp_degree, run_spec(self.config).layout, rank)  # NXD_CPU_MODE.md: chunk-groups
        loaded = self.checkpoint_loader_fn() if presharded is None else read_presharded(presharded, rank)
        for wrapper in self.models:
            model = _build_as_on_device(wrapper)
            for module in model.modules():  # the shell's context, which makes device groups at first use otherwise
                if isinstance(getattr(module, "ctx", None), NxDParallelContext):
                    module.ctx.meshes.update(chunk_groups)
            state = dict(loaded)  # per submodel: get_sharded_checkpoint replaces entries by this rank's slices
            _check_no_unexpected(model, state, presharded or self.model_path)
            if presharded is None:
                get_sharded_checkpoint(state, model, rank, nc.tp_degree)
            missing = unloaded_parameters(model, model.load_state_dict(state, strict=False).missing_keys, state)
            if missing:
                raise KimiInputError(f"{presharded or self.model_path}: {len(missing)} parameter(s) of the "
                                     f"{wrapper.tag} got no tensor: {listing(missing)}")
            use_device_draft_sampler(model)
            wrapper.model = model
        self.eval()
        return self

    def _copy_past_key_values(self, outputs):
        """NxDI's CPU-mode copy of a submodel's cache into the others; the chunk submodel reads the copy the
        token-generation model got (on device the submodels share one state)."""
        super()._copy_past_key_values(outputs)
        chunk = getattr(self, "chunked_prefill_model", None)
        if chunk is not None:
            for dst, src in zip(chunk.model.kv_mgr.past_key_values,
                                self.token_generation_model.model.kv_mgr.past_key_values):
                dst.data = src.data

    def get_model_wrapper_cls(self):
        return CpuModelWrapper


class CpuModelWrapper(ModelWrapper):
    """NxDI's ModelWrapper, whose CPU branches of a batch other than the compiled one read a call's outputs as one
    head and the caches, while on-device sampling with output_logits returns two heads, tokens and logits
    (NXD_CPU_MODE.md: two-heads): in CPU mode the two travel through those branches as one tensor."""

    def _two_heads(self) -> bool:
        nc = self.neuron_config
        return (not self.is_neuron() and nc.on_device_sampling_config is not None and nc.output_logits
                and not nc.enable_fused_speculation)

    def _forward(self, *args):
        outputs = super()._forward(*args)
        if not self._two_heads():
            return outputs
        tokens, logits, *rest = outputs
        self._token_shape = tokens.shape[1:]
        column = tokens.reshape(tokens.shape[0], 1, 1).to(logits.dtype).expand(-1, logits.shape[1], 1)
        return [torch.cat([logits, column], dim=-1), *rest]  # ids below 2**24: exact in float32

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        if not self._two_heads():
            return outputs
        both, *rest = outputs
        tokens = both[:, 0, -1].round().to(torch.int32).reshape(both.shape[0], *self._token_shape)
        return [tokens, both[..., :-1], *rest]


class CpuKimiK2ForCausalLM(FusedSpecCpu, CpuMode, NeuronKimiK2ForCausalLM):
    """The product's application with to_cpu (nxdi_cpu.backend builds this one)."""


def _build_as_on_device(wrapper) -> nn.Module:
    """As ModelBuilder builds it, under AOT mode (no init): NxD's CPU master-weight init of quantized experts fails
    at TP >= 3 with stride-2 gate_up (NXD_CPU_MODE.md: aot-build)."""
    instance = wrapper.get_model_instance()
    parallel_state.set_aot_mode(True)
    try:
        instance.load_module()
    finally:
        parallel_state.set_aot_mode(False)
    # n_positions per bucket as the trace sets it; one bucket per submodel here (NXD_CPU_MODE.md: bucket-positions)
    instance.get(len(wrapper.neuron_config.buckets) - 1)
    if wrapper.neuron_config.is_prefix_caching:  # several, each call's set as the trace sets it for its bucket
        instance.module.register_forward_pre_hook(_prefix_caching_bucket)
    return instance.module


def _prefix_caching_bucket(module, args) -> None:
    """What DecoderModelInstance.get sets for the [prefill, prefix] bucket NxDI's wrapper padded this call to, read
    from its shapes: the prefix bucket is the attention mask's width, or 0 where NxDI passes a 1-element mask
    (NXD_CPU_MODE.md: prefix-caching-buckets)."""
    input_ids, attention_mask = args[0], args[1]
    nc = module.config.neuron_config
    module.prefix_size = attention_mask.shape[-1] if attention_mask.dim() == 2 else 0
    module.n_active_tokens = input_ids.shape[-1]
    module.n_positions = (module.prefix_size if nc.n_active_tokens == 1 else
                          min(module.prefix_size + module.n_active_tokens, nc.max_context_length))


def _check_no_unexpected(model: nn.Module, state: dict, where) -> None:
    """NxD only warns of tensors without a parameter (NXDI_CONTRACT.md: sharding-not-strict)."""
    names = model.state_dict().keys()
    extra = sorted(k for k in checked_names(state) if k not in names)
    if extra:
        raise KimiInputError(f"{where}: {len(extra)} tensor(s) the model has no place for: {listing(extra)}")


def _init_cpu_process_groups(nc, kv_group: int) -> int:
    """gloo as NxDI's to_cpu sets it up, from a launcher's environment or one process, and the KV group as
    ModelBuilder makes it (NXDI_CONTRACT.md: kv-group); returns this rank."""
    if not torch.distributed.is_initialized():
        world = env_int("WORLD_SIZE", 1)
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
    if kv_group > 1:
        parallel_state.initialize_kv_group(kv_group, sequential_ranks_in_group=True)
    init_draft_group(nc)
    return torch.distributed.get_rank()
