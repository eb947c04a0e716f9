"""The application's part for a served model whose constrained steps are sampled on the host: under on-device
sampling with output_logits, what vllm-neuron reads as a step's result is the device's tokens, or, on a call vLLM's
grammar masks, the last position's logits with the device's tokens beside them (neuron/vllm_worker.py sets
`host_logits` around that call and samples only the masked rows on the host; NXDI_CONTRACT.md: vllm-ods-output).
modeling.py composes it; it changes nothing where output_logits is off."""

from __future__ import annotations

import torch


class HostLogits:
    """NxDI's output under on-device sampling with output_logits puts an empty list where vllm-neuron reads the
    result (`hidden_states`); here it holds the tokens, or [B, vocab + 1] float32: the logits, then each row's device
    token (exact in float32: ids < 2**24). One tensor, because vllm-neuron reorders that one by sequence id."""

    # True for a call whose logits a grammar masks on the host (set by neuron/vllm_worker.py around the call)
    host_logits = False

    def _construct_output_with_tokens_and_logits(self, next_tokens, logits, hidden_states=()):
        out = super()._construct_output_with_tokens_and_logits(next_tokens, logits, list(hidden_states))
        if self.host_logits:
            last = (logits[:, -1, :] if logits.dim() == 3 else logits).float()
            device = next_tokens.reshape(last.shape[0], -1)[:, -1:].float()  # one token a row: no speculation here
            out.hidden_states = torch.cat([last, device], dim=1)
        else:
            out.hidden_states = next_tokens
        return out
