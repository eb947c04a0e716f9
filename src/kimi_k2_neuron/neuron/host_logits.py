"""The application's part for a served model whose constrained steps are sampled on the host: under on-device
sampling with output_logits, what vllm-neuron reads as a step's result is the device's tokens, or the last position's
logits on a call vLLM's grammar masks (neuron/vllm_worker.py sets `host_logits` around that call; NXDI_CONTRACT.md:
vllm-ods-output). modeling.py composes it; it changes nothing where output_logits is off."""

from __future__ import annotations


class HostLogits:
    """NxDI's output under on-device sampling with output_logits puts an empty list where vllm-neuron reads the
    result (`hidden_states`); here it holds the tokens, or the logits for the host."""

    # True for a call whose logits a grammar masks on the host (set by neuron/vllm_worker.py around the call)
    host_logits = False

    def _construct_output_with_tokens_and_logits(self, next_tokens, logits, hidden_states=()):
        out = super()._construct_output_with_tokens_and_logits(next_tokens, logits, list(hidden_states))
        out.hidden_states = (logits[:, -1, :] if logits.dim() == 3 else logits) if self.host_logits else next_tokens
        return out
