"""NxDI's fused speculation (neuron/fused_spec.py) in NxD's CPU mode: what ModelBuilder and the device's aliased state
do on trn2, and NxDI's CPU branches get wrong (NXD_CPU_MODE.md: fused-spec-cpu). Mixed into the harness's application
before CpuMode; nothing on trn2 runs it."""

from __future__ import annotations

import torch
from neuronx_distributed.operators.argmax import argmax as nxd_argmax
from neuronx_distributed.parallel_layers import parallel_state
from torch import nn

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron.fused_spec import DRAFT_PREFIX

# the fused outputs' head: accepted tokens, next input ids, next mask, next positions (+ draft and target logits)
HEAD, HEAD_WITH_LOGITS = 4, 6


class FusedSpecCpu:
    """The state a fused call returns copied into both submodels' modules (on device one aliased state), and the
    outputs' head kept as fused_outputs."""

    def _copy_past_key_values(self, outputs):
        """NxDI's CPU branch reads a draft_model the wrapper does not have and slices the outputs from 2."""
        if not self.neuron_config.enable_fused_speculation:
            return super()._copy_past_key_values(outputs)
        fused = self.fused_spec_model.model
        nd, nt = len(fused.draft_model.kv_mgr.past_key_values), len(fused.target_model.kv_mgr.past_key_values)
        head = HEAD_WITH_LOGITS if self.neuron_config.output_logits else HEAD
        draft, target = outputs[head:head + nd], outputs[head + nd:head + nd + nt]
        buffer = outputs[head + nd + nt]  # the rolling hidden-state buffer, whole
        for wrapper in (self.context_encoding_model, self.fused_spec_model):
            model = wrapper.model
            for dst, src in (*zip(model.draft_model.kv_mgr.past_key_values, draft),
                             *zip(model.target_model.kv_mgr.past_key_values, target)):
                dst.data = src
            model.hidden_state_rolling_buffer.hidden_states.data = buffer

    def _get_model_outputs(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args,
                           **kwargs):
        """A fused prefill of more rows than the prefill submodel's batch (continuous batching: one) runs one call per
        row group here, each group's state copied before the next, the heads concatenated: NxDI's wrapper would split
        the rows itself, but its CPU branch of that split writes the state into a kv_mgr the fused model does not have
        (NXD_CPU_MODE.md: fused-spec-cpu)."""
        rows, step = seq_ids.shape[0], self.neuron_config.ctx_batch_size
        if not (self.neuron_config.enable_fused_speculation and self._is_prefill(position_ids) and rows > step):
            return super()._get_model_outputs(input_ids, attention_mask, position_ids, seq_ids, sampling_params,
                                              *args, **kwargs)
        head = HEAD_WITH_LOGITS if self.neuron_config.output_logits else HEAD
        parts = []
        for start in range(0, rows, step):
            group = slice(start, start + step)
            outputs, on_neuron = super()._get_model_outputs(input_ids[group], attention_mask[group],
                                                            position_ids[group], seq_ids[group],
                                                            None if sampling_params is None else
                                                            sampling_params[group], *args, **kwargs)
            self._copy_past_key_values(outputs)
            parts.append(outputs)
        return [torch.cat([p[i] for p in parts]) for i in range(head)] + list(parts[-1][head:]), on_neuron

    def _get_constructed_outputs(self, outputs, is_run_on_neuron):
        """NxDI's CPU branch keeps outputs[0] alone."""
        if self.neuron_config.enable_fused_speculation and not is_run_on_neuron:
            head = HEAD_WITH_LOGITS if self.neuron_config.output_logits else HEAD
            return self._construct_output(list(outputs[:head]))
        return super()._get_constructed_outputs(outputs, is_run_on_neuron)


class DeviceDraftSampler(nn.Module):
    """The fused step's draft sampler (greedy: NxDI forces it) as its device branch runs: NxD's argmax over the draft
    lm_head's vocab-sharded logits, with probability 1 for the pick. NxDI's CPU branch returns the argmax alone, of
    this rank's shard only, which the sampled acceptance unpacks as (tokens, probabilities) (NXD_CPU_MODE.md:
    fused-spec-cpu)."""

    def __init__(self, lm_head):
        super().__init__()
        self.group = None if getattr(lm_head, "gather_output", True) else lm_head.tensor_parallel_group

    def forward(self, logits, sampling_params=None, return_values=False, rank_id=None):
        dim = logits.dim() - 1
        tokens = torch.argmax(logits, dim=dim) if self.group is None else \
            nxd_argmax(logits, dim=dim, gather_dim=dim, keepdim=False, process_group=self.group)
        return (tokens, torch.ones(tokens.shape, dtype=logits.dtype)) if return_values else tokens


def use_device_draft_sampler(model) -> None:
    """On a built NeuronFusedSpecModel (both fused submodels build one)."""
    if hasattr(model, "draft_sampler") and hasattr(model, "draft_model"):
        model.draft_sampler = DeviceDraftSampler(model.draft_model.lm_head)


def init_draft_group(nc) -> None:
    """The draft's embedding, lm_head and sampler run on NxD's speculative draft group, which ModelBuilder makes on
    device (NxDI's init_custom_process_group_fn); the draft runs at the target's TP (NXDI_CONTRACT.md: draft-tp)."""
    if nc.enable_fused_speculation:
        parallel_state.initialize_speculative_draft_group(nc.tp_degree)


def forget_draft_group() -> None:
    """NxD keeps its speculative draft group for the process and allows one size, and destroy_model_parallel leaves
    it; where the harness resets NxD's state between runs of other
    TP degrees in one process, the draft group goes too (NXD_CPU_MODE.md: fused-spec-cpu)."""
    for name in ("_SPECULATIVE_DRAFT_GROUP", "_SPECULATIVE_DRAFT_GROUP_SPMD", "_SPECULATIVE_DRAFT_GROUP_SIZE"):
        setattr(parallel_state, name, None)


def checked_names(state: dict) -> list[str]:
    """The names to_cpu checks against the model: the draft's are renamed by NxDI's pre-shard hooks (q/k/v into
    qkv_proj) before they match, and checkpoint/draft.py has checked them strictly as read."""
    return [k for k in state if not k.startswith(DRAFT_PREFIX)]


def check_device_ops() -> None:
    """NxD's greedy speculation calls torch_neuronx's Argmax custom op directly (NXD_CPU_MODE.md: fused-spec-cpu),
    binary-only; the tier's import shim computes it (scripts/nxdi_cpu_tier/device_ops.py). Where a shim only raises,
    refused here, before any work, rather than mid-run."""
    import importlib

    import torch

    # (the package re-exports the function under the module's name)
    module = importlib.import_module("neuronx_distributed.operators.argmax")
    try:
        module.Argmax.apply(torch.zeros(1, 2), 1, False)
    except NotImplementedError:
        raise KimiInputError("--draft in NxD's CPU mode: NxD's greedy speculation calls torch_neuronx's Argmax "
                             "custom op, which this torch_neuronx (an import shim) does not implement; the tier "
                             "scripts/build_nxdi_cpu_tier.sh builds computes it (NXD_CPU_MODE.md: "
                             "fused-spec-cpu)") from None
