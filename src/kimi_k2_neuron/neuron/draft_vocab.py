"""A draft's own vocabulary inside NxDI's fused graph (NXDI_CONTRACT.md: draft-vocab-map): NxDI treats whatever the
draft model returns as target token ids (greedy: the draft's argmax; sampling: logits its greedy draft sampler reads),
and builds the draft's lm_head from the config's vocab_size. A draft trained on a reduced vocabulary (draft_vocab_size
rows, checkpoint/draft.py's d2t) is mapped here, in the draft model, so that the verify and NxDI's acceptance see
target ids and nothing of NxDI changes:

- its lm_head has draft_vocab_size rows (NxDI's Llama builds vocab_size: replaced after init_model);
- a greedy id j (NxDI's distributed argmax over the draft's sharded logits) becomes DRAFT_IDS[j], a gather from a
  replicated int32 table loaded with the weights;
- under on-device sampling the draft returns its logits for the fused step's greedy draft sampler: they are laid into
  the target's vocabulary (all-gathered over the draft's lm_head group, scattered to their target ids, every other id
  the float minimum) and this rank's vocab_size / TP shard returned, what a full-vocabulary lm_head would give.
"""

from __future__ import annotations

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.parallel_layers import mappings  # noqa: E402
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear  # noqa: E402
from neuronx_distributed_inference.utils.distributed import get_tp_group  # noqa: E402
from torch import nn  # noqa: E402

from kimi_k2_neuron.checkpoint.draft import DRAFT_IDS  # noqa: E402

# The draft config's attribute saying it carries DRAFT_IDS (saved with the fused config, so a reload builds it too)
MAPPED = "kimi_draft_vocab_mapped"


def draft_rows(config) -> int:
    """The draft lm_head's rows: draft_vocab_size, else vocab_size."""
    return getattr(config, "draft_vocab_size", None) or config.vocab_size


def draft_lm_head(config, gather_output: bool) -> ColumnParallelLinear:
    """NxDI Llama's lm_head (its arguments, modeling_llama.py init_model) with the draft vocabulary's rows."""
    return ColumnParallelLinear(config.hidden_size, draft_rows(config), gather_output=gather_output,
                                dtype=config.neuron_config.torch_dtype, bias=False, pad=True,
                                tensor_model_parallel_group=get_tp_group(config))


class DraftVocabMap:
    """Mixed into a draft model class before NxDI's: call `init_vocab_map(config)` at the end of init_model."""

    def init_vocab_map(self, config) -> None:
        if getattr(config, MAPPED, False):
            setattr(self, DRAFT_IDS, nn.Parameter(torch.zeros(draft_rows(config), dtype=torch.int32),
                                                  requires_grad=False))
        self.target_vocab = config.vocab_size

    def _sample_on_device(self, logits, sampling_params, is_for_speculation, is_for_context_encoding):
        res = super()._sample_on_device(logits, sampling_params, is_for_speculation, is_for_context_encoding)
        ids = getattr(self, DRAFT_IDS, None)
        if ids is None:
            return res
        if res.is_floating_point():  # logits for the fused step's draft sampler
            return self._in_target_vocab(res, ids)
        return torch.index_select(ids, 0, res.reshape(-1).to(torch.int64)).view(res.shape).to(res.dtype)

    def _in_target_vocab(self, logits, ids):
        head = self.lm_head
        group = getattr(head, "tensor_parallel_group", None)
        size = group.size() if group is not None and not head.gather_output else 1
        full = logits if size == 1 else mappings.gather_from_tensor_model_parallel_region_with_dim(
            logits, 2, process_group=group)
        full = full[..., :ids.shape[0]]  # NxD's padding of the draft vocabulary
        out = full.new_full((*full.shape[:-1], self.target_vocab), torch.finfo(full.dtype).min)
        out = out.index_copy(2, ids.to(torch.int64), full)
        if size == 1:
            return out
        shard = -(-self.target_vocab // size)
        out = nn.functional.pad(out, (0, shard * size - self.target_vocab), value=torch.finfo(full.dtype).min)
        rank = torch.remainder(self.rank_util.get_rank(), size).to(torch.int64)
        index = rank * shard + torch.arange(shard, device=out.device)
        return torch.index_select(out, 2, index)
