"""The chunked-prefill submodel and its driver (--prefill-chunk N). A prompt longer than N is prefilled one row at a
time: NxDI's context-encoding submodel (bucket N, batch 1, continuous batching) on its first N tokens, then a third
submodel, `chunked_prefill_model`, on each further N tokens, attending to the row's cache plus causally within the
chunk through MLAttention.attend_chunk. With the replicated cache that is a KV group of 1; with the sequence-sharded
one each rank pools its chunk group's caches, attends them and its share of the chunk for the chunk group's heads,
merged across that group, and writes the chunk entries it owns (NXDI_CONTRACT.md: fd-chunk, chunk-groups). The
graph's size does not grow with the prompt (NXDI_CONTRACT.md: chunk-submodel).

Pure helpers first (no SDK); the wrapper factory, the chunk's forward and the driver import NxDI when called; last,
the parts the model and the application are built with (ChunkedPrefillModel, ChunkedPrefill), which modeling.py
composes.
"""

from __future__ import annotations

import copy

import torch

from kimi_k2_neuron.parallel import slot_of, slot_positions, stripe

from .contract import run_spec

CHUNK_MODEL_TAG = "chunked_prefill_model"


# -- the plan of a prefill (pure) -------------------------------------------------------------------------------------

def chunk_starts(length: int, chunk: int) -> list[int]:
    """The first position of each call prefilling `length` tokens: 0 (the CTE), then one per chunk."""
    return list(range(0, max(length, 1), chunk))


def chunk_inputs(ids: torch.Tensor, start: int, length: int, chunk: int, pad_id: int = 0):
    """One row's chunk from `start`: (input_ids [1, N] right-padded, position_ids [1, N], attention_mask [1, end]).
    Padding slots get the next positions: they write past the row's end, where no mask reads before decode
    overwrites them, as the CTE's padded bucket does."""
    end = min(length, start + chunk)
    real = ids[start:end]
    padded = torch.full((chunk,), pad_id, dtype=ids.dtype)
    padded[: end - start] = real
    positions = torch.arange(start, start + chunk, dtype=ids.dtype)
    return padded[None], positions[None], torch.ones(1, end, dtype=ids.dtype)


def owned_positions(position_ids: torch.Tensor, group: int = 1, rank=0) -> torch.Tensor:
    """[B, N] -> [B, N / G]: the chunk's positions this rank keeps, start + r, start + r + G, ... (NxDI's
    context-encoding filter, NXDI_CONTRACT.md: fd-cte-filter; a chunk starts at a multiple of G). G = 1: all. `rank`
    is r = rank % G, an int or a one-element tensor (the SPMD rank in a traced graph)."""
    return torch.index_select(position_ids, 1, stripe(position_ids.shape[1], group, rank, position_ids.device))


def owned_slots(position_ids: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[B, N] -> [B, N / G]: the cache slots of the owned positions, the same on every rank of the group (the j-th
    owned entry's slot is start / G + j, as r < G). G = 1: the positions."""
    return slot_of(position_ids[:, ::group], group)


def chunk_masks(position_ids: torch.Tensor, cache_len: int, group: int = 1, rank=0):
    """-> prior [B, 1, N, cache_len], active [B, 1, N, N / G]; True = visible on this rank.
    prior: slot s holds position s * G + r, visible when before the chunk's first position (so never a reserve slot);
    active: the owned chunk entries (owned_positions), causal by position. Each key is then visible on exactly one
    rank of the group. G = 1, r = 0: the replicated cache before the chunk, and tril. NxDI's get_model_output takes
    them; the decoder layer's chunk branch derives the same visibility for its chunk group (MLAttention.attend_chunk).
    """
    b, n = position_ids.shape
    start = position_ids[:, :1]
    held = slot_positions(cache_len, group, rank, position_ids.device)  # [cache_len]
    prior = held[None, :] < start  # [B, cache_len]
    keys = owned_positions(position_ids, group, rank)
    active = keys[:, None, :] <= position_ids[:, :, None]  # [B, N, N / G]
    return prior[:, None, None, :].expand(b, 1, n, cache_len), active[:, None]


def last_real_index(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the chunk slot of each row's last real token, by tensor ops (no host sync in the graph). The mask is 1
    on the row's positions [0, end) and padded with 0 by the model wrapper."""
    n = position_ids.shape[1]
    return (attention_mask.sum(-1, keepdim=True) - 1 - position_ids[:, :1]).clamp(0, n - 1)


def hidden_rows(calls: list[torch.Tensor], lengths: list[int], chunk: int | None) -> list[torch.Tensor]:
    """Each row's prefill hidden states [length, H] from the normed outputs of the prefill calls in the driver's
    order (one call for all rows; or per row its CTE call, then its chunks)."""
    if len(calls) == 1 and calls[0].shape[0] == len(lengths):
        return [calls[0][r, :n] for r, n in enumerate(lengths)]
    per_row = [len(chunk_starts(n, chunk)) if chunk else 1 for n in lengths]
    if sum(per_row) != len(calls):
        raise RuntimeError(f"{len(calls)} prefill calls seen, {sum(per_row)} expected for rows of {lengths}")
    out, i = [], 0
    for n, k in zip(lengths, per_row):
        out.append(torch.cat([c[0] for c in calls[i:i + k]], dim=0)[:n])
        i += k
    return out


# -- the submodel ----------------------------------------------------------------------------------------------------

def enable_chunked_prefill(app, **model_init_kwargs) -> None:
    """The third ModelWrapper: batch 1, N active tokens, the token-generation buckets (it reads the cache up to them),
    built for prefill (NxD's MoE prefill path), compiled with the context-encoding submodel's arguments; its class
    is the application's _model_cls, as NxDI builds its own (NXDI_CONTRACT.md: private-members)."""
    from neuronx_distributed_inference.modules.autobucketing import generate_buckets_for_tkg

    config = copy.deepcopy(app.config)
    nc = config.neuron_config
    nc.batch_size = 1
    nc.n_active_tokens = run_spec(app.config).layout.prefill_chunk
    nc.bucket_n_active_tokens = False
    nc.is_prefill_stage = True
    nc.sequence_parallel_enabled = False
    nc.buckets = generate_buckets_for_tkg(config)
    app.chunked_prefill_model = app.model_wrapper(
        config=config, model_cls=app._model_cls, tag=CHUNK_MODEL_TAG,
        model_init_kwargs={**model_init_kwargs, "chunk": True})
    # The finished context-encoding string as it is: given as compiler_args, ModelWrapper would append a second
    # --internal-hlo2tensorizer-options (NXDI_CONTRACT.md: compiler-args)
    app.chunked_prefill_model.compiler_args = app.context_encoding_model.compiler_args
    app.models.append(app.chunked_prefill_model)


def write_rows(cache: torch.Tensor, update: torch.Tensor, seq_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [lines, heads, T, D] with one row's update [1, heads, N, D] written at line seq_ids[0] from slot
    slots[0, 0]: a chunk's slots are contiguous (sequence-sharded: its owned entries' p // G), so one
    dynamic-update-slice, as NxDI writes a prefill into its line, not a scatter of dynamic indices
    (NXDI_CONTRACT.md: chunk-write)."""
    from neuronx_distributed_inference.modules.kvcache.utils import dynamic_update_slice

    zero = torch.zeros((), dtype=torch.int32, device=cache.device)
    start = [seq_ids[0].to(torch.int32), zero, slots[0, 0].to(torch.int32), zero]
    return dynamic_update_slice(cache, update.to(cache.dtype), start)


def chunk_forward(model, input_ids, attention_mask, position_ids, seq_ids, sampling_params, *_unused):
    """NeuronKimiK2Model.forward of the chunk submodel: NxDI's get_model_output over the row's cached line
    (is_for_speculation reads line seq_ids when the batch is below the cache's), the decoder layers' chunk branch,
    the write into line seq_ids, then the last real token's logits or sample, in NxDI's output order
    (NXDI_CONTRACT.md: chunk-submodel, submodel-outputs, private-members). Sequence-sharded, each rank attends for
    its chunk group (MLAttention.attend_chunk) and writes the chunk entries it owns at p // G (NXDI_CONTRACT.md:
    fd-chunk). get_model_output takes chunk_masks' masks as NxDI's attention and active masks; the chunk branch
    derives the same visibility for its chunk group."""
    from neuronx_distributed.parallel_layers.mappings import gather_from_tensor_model_parallel_region_with_dim
    from neuronx_distributed_inference.modules.flashdecode.utils import get_cache_size
    from neuronx_distributed_inference.utils.distributed import get_tp_group

    # the slots get_model_output reads: NxDI's flash-decoding cache size, else the bucket (model_base.py)
    if model.neuron_config.flash_decoding_enabled:
        ctx = model.layers[0].self_attn.ctx
        group, rank = ctx.kv_group, ctx.kv_rank()
        cache_len = get_cache_size(model.n_positions, group)
    else:
        group, rank, cache_len = 1, 0, model.n_positions
    prior, active = chunk_masks(position_ids, cache_len, group, rank)
    hidden, new_kv = model.get_model_output(
        input_ids=input_ids, seq_ids=seq_ids, attention_mask=prior, position_ids=position_ids, active_mask=active,
        is_for_context_encoding=False, is_for_speculation=True, update_cache=False)
    cache = model.kv_mgr.past_key_values  # K of layer i at 2i, V at 2i + 1 (NXDI_CONTRACT.md: chunk-submodel)
    if 2 * len(new_kv) != len(cache):
        raise RuntimeError(f"{len(new_kv)} layers' entries, the manager holds {len(cache)} cache tensors")
    slots = owned_slots(position_ids, group)
    updated = [write_rows(cache[2 * i + j], kv[j], seq_ids, slots)
               for i, kv in enumerate(new_kv) for j in (0, 1)]
    index = last_real_index(attention_mask, position_ids)
    hidden = torch.gather(hidden, 1, index[:, :, None].expand(-1, 1, hidden.shape[-1]))
    logits = model.lm_head(hidden).float()
    res = model._sample_on_device(logits, sampling_params, False, True) if model.on_device_sampling else logits
    outputs = [res]
    if model.neuron_config.output_logits:
        tp = get_tp_group(model.config)
        outputs.append(gather_from_tensor_model_parallel_region_with_dim(logits, 2, process_group=tp))
    return outputs + updated


# -- the driver ------------------------------------------------------------------------------------------------------

def takes(app, input_ids, position_ids) -> bool:
    """A prefill wider than the chunk; anything else is NxDI's own dispatch (NXDI_CONTRACT.md: private-members)."""
    spec = run_spec(app.config)
    return spec.chunk_submodel and input_ids.shape[-1] > spec.layout.prefill_chunk and app._is_prefill(position_ids)


def prefill(app, input_ids, attention_mask, position_ids, seq_ids, sampling_params):
    """Row by row: the CTE on the first N tokens, then the chunk submodel; the KV shared after every call in CPU mode.
    -> (NxDI's outputs of a prefill: each row's last output, then the cache; is_run_on_neuron)."""
    chunk = run_spec(app.config).layout.prefill_chunk
    lengths = attention_mask.sum(-1).tolist()
    on_neuron = app.context_encoding_model.is_neuron()
    nc = app.neuron_config
    # the sampled tokens, then the logits with output_logits under on-device sampling; in CPU mode the cache follows
    front = 2 if nc.on_device_sampling_config is not None and nc.output_logits else 1
    results, out = [], None
    for b, length in enumerate(lengths):
        row = slice(b, b + 1)
        for start in chunk_starts(int(length), chunk):
            if start == 0:
                end = min(int(length), chunk)
                wrapper = app.context_encoding_model
                args = (input_ids[row, :end], attention_mask[row, :end], position_ids[row, :end])
            else:
                wrapper = app.chunked_prefill_model
                ids, pos, mask = chunk_inputs(input_ids[b], start, int(length), chunk)
                args = (ids, mask, pos)
            out = wrapper(*args, seq_ids[row], sampling_params[row], None, None)
            if not wrapper.is_neuron():
                app._copy_past_key_values(out)
        results.append([out] if torch.is_tensor(out) else list(out[:front]))
    app.kv_cache_populated = True
    heads = [torch.cat(parts, dim=0) for parts in zip(*results)]
    if on_neuron:
        return (heads[0] if front == 1 else heads), True
    return [*heads, *out[front:]], False


# -- the parts of the model and the application (modeling.py composes them) ----------------------------------------

class ChunkedPrefillModel:
    """The model's part: built as the chunk submodel (chunk=True, as enable_chunked_prefill asks), its decoder layers
    attend as a chunk and its forward is chunk_forward."""

    def __init__(self, config, optimize_inference: bool = True, chunk: bool = False):
        self.chunk = chunk  # before NxDI's __init__ builds the layers (init_model)
        super().__init__(config, optimize_inference)

    def attention_kind(self, config) -> str:
        from .base import CHUNK

        return CHUNK if self.chunk else super().attention_kind(config)

    def forward(self, *args, **kwargs):
        if self.chunk:
            return chunk_forward(self, *args, **kwargs)
        return super().forward(*args, **kwargs)


class ChunkedPrefill:
    """The application's part, with --prefill-chunk (without prefix caching): the chunk submodel beside the
    token-generation one, and a prefill wider than the chunk sent to the driver."""

    def enable_token_generation(self, enable_wlt_optimization: bool = True, **model_init_kwargs):
        super().enable_token_generation(enable_wlt_optimization, **model_init_kwargs)
        if run_spec(self.config).chunk_submodel:
            enable_chunked_prefill(self, **model_init_kwargs)

    def _get_model_outputs(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args, **kwargs):
        """NXDI_CONTRACT.md: private-members."""
        if takes(self, input_ids, position_ids):
            return prefill(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params)
        return super()._get_model_outputs(input_ids, attention_mask, position_ids, seq_ids, sampling_params, *args,
                                          **kwargs)
