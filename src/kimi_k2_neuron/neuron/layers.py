"""The Neuron decoder's layers in NxDI/NxD's contracts, on the core's modules (no SDK needed).

- attention_block: the attention half of a decoder layer as NeuronBaseModel calls it, prefill and decode, with the
  latent cache as one KV head;
- NxDRouter: the core noaux_tc router answering NxD's MoE router contract.

Line references: NxDI = aws-neuron/neuronx-distributed-inference @4bcdc54, src/neuronx_distributed_inference/;
NxD = aws-neuron/neuronx-distributed @fbac349 (Release 2.29), src/neuronx_distributed/.
"""

from __future__ import annotations

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.model.router import NoAuxTcRouter


# -- attention: prefill over the bucket, decode over the cached latent plus this step ------------------------

def decode_masks(prior_mask: torch.Tensor, s: int):
    """The two masks of one decode (TKG) step, for MLAttention.attend_split.

    prior_mask: NxDI's TKG mask [B, 1, 1, T], True exactly on the cached positions [0, pos) of each row
    (model_base.py:253-258; hf_adapter.py:369-405). The current token is not in the cache yet (the manager writes
    it after the layers, model_base.py:1407-1416), so it is attended as the active segment, visible to itself.
    -> prior [B, 1, S, T], active [B, 1, S, S] (causal among the step's S tokens)."""
    b = prior_mask.shape[0]
    prior = prior_mask.to(torch.bool).expand(b, 1, s, prior_mask.shape[-1])
    active = torch.ones(s, s, dtype=torch.bool, device=prior.device).tril()[None, None].expand(b, 1, s, s)
    return prior, active


def attention_block(attn, norm, hidden: torch.Tensor, rope, past_key_value, attention_mask: torch.Tensor):
    """The attention half of a decoder layer in NxDI's contract, on the core's MLAttention:
    hidden + attn(norm(hidden)) and the (K, V) NxDI's cache manager writes.

    Prefill (past_key_value None): the bucket attends to itself under NxDI's causal [B, 1, S, S] mask
    (model_base.py:197-215); K holds the whole bucket (fill_prefix from 0, kv_cache_manager.py:509-510).
    Decode: the cached [0, pos) plus the current token (decode_masks), attended in place by attend_split (no copy
    of the cache per layer and step, as the DSV3 contrib's separate prior/active scores); K holds the step's entries,
    scattered at
    position_ids (l.571-585). K is the latent as one KV head [B, 1, S, latent]; V is [B, 1, S, 1] zeros for
    LatentKVCacheManager's 1-wide V slot."""
    q_nope, q_pe, entries = attn.project(norm(hidden), rope)
    if past_key_value is None:
        hidden = hidden + attn.attend(q_nope, q_pe, entries, attention_mask)
    else:
        past = past_key_value[0][:, 0]
        prior, active = decode_masks(attention_mask, entries.shape[1])
        hidden = hidden + attn.attend_split(q_nope, q_pe, past, prior, entries.to(past.dtype), active)
    k_new = entries.unsqueeze(1)
    return hidden, (k_new, k_new.new_zeros(*k_new.shape[:-1], 1))


def prior_mask_for_positions(positions: torch.Tensor, cache_len: int) -> torch.Tensor:
    """The mask NxDI builds for rows decoding at `positions` [B]: [B, 1, 1, cache_len], True on [0, pos).
    (What hf_adapter's attention mask becomes in _create_simple_attn_mask; used by the tests.)"""
    return (torch.arange(cache_len)[None, :] < positions[:, None])[:, None, None, :]


# -- MoE: the router in NxD's contract ------------------------------------------------------------------------------

def scatter_affinities(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """[T, k] combine weights at expert ids [T, k] -> dense [T, E] affinities, zero off the chosen experts."""
    dense = torch.zeros(weights.shape[0], num_experts, dtype=weights.dtype, device=weights.device)
    return dense.scatter(1, ids, weights).to(dtype)


class NxDRouter(NoAuxTcRouter):
    """The core noaux_tc router (float32, bias after the sigmoid and for selection only, weights normalized and
    times routed_scaling_factor) answering NxD's router contract (routing.py:128-146):
    router(hidden [B, S, H]) -> (router_logits [T, E], expert_affinities [T, E], expert_index [T, k]).

    The affinities hold the final combine weights at the chosen experts, so ExpertMLPsV2 must not renormalize
    (normalize_top_k_affinities False). They are cast to the hidden dtype, as RouterTopK/GroupLimitedRouter do
    (routing.py:206-207, 383-384), so the expert outputs stay bf16. MoE reads num_experts, top_k, hidden_size and
    sequence_parallel_enabled from its router (model.py:105-113). Parameters keep the core's names
    (router.weight, router.e_score_correction_bias), float32 under cast_type "as-declared"."""

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
        return logits, scatter_affinities(weights, ids, self.num_experts, hidden_states.dtype), ids
