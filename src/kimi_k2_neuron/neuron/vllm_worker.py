"""vLLM's structured outputs on vllm-neuron 0.2.0: its worker with the grammar bitmask applied, given to vLLM by its
own `--worker-cls` option (docs/vllm.md, "Structured outputs"):

    vllm serve ... --worker-cls kimi_k2_neuron.neuron.vllm_worker.KimiNeuronWorker \\
        --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'

vLLM 0.13's engine computes a step's grammar bitmask (its structured output manager, xgrammar) while the worker runs
the forward, and hands it to the worker's sample_tokens(), which it calls only when execute_model() returned None;
vllm-neuron 0.2.0's worker always returns the sampled tokens from execute_model(), so the bitmask is dropped
(NXDI_CONTRACT.md: vllm-grammar-bitmask). Here a step that schedules a constrained request keeps its logits, returns
None, and samples in sample_tokens(), the mask applied (runtime/grammar_mask.py), by vLLM's sampler on the host as
vllm-neuron's CPU sampling does (each request's temperature, top_k, top_p, seed). Other steps run as in vllm-neuron.

Where the logits come from: without on-device sampling they are what the model returns; with it, the application
compiled with output_logits (vllm_request.for_vllm) returns them beside the device's tokens and, on a constrained
step, hands them on instead (host_logits.py, set here around the call). What cannot be constrained stops the step with
one line (vllm_request.unconstrained_why): the API middleware refuses such requests before (vllm_api.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from vllm_neuron.worker.neuron_worker import NeuronWorker
from vllm_neuron.worker.neuronx_distributed_model_runner import NeuronxDistributedModelRunner

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.runtime import grammar_mask
from kimi_k2_neuron.runtime.tokenizer import VOCAB_NAME, KimiTokenizer

from .contract import run_spec
from .vllm_request import unconstrained_why


class KimiModelRunner(NeuronxDistributedModelRunner):
    """vllm-neuron's runner; a constrained step's logits held for sample_tokens()."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._constrained = False
        self._held: tuple[torch.Tensor, object] | None = None
        self._special: grammar_mask.SpecialTokens | None = None
        self.cannot_constrain: str | None = None
        self._on_device = False

    def load_model(self) -> None:
        super().load_model()
        spec = run_spec(self.model.model.config)  # the application's RunSpec, as it was built
        self.cannot_constrain, self._on_device = unconstrained_why(spec), spec.sampling.on_device

    @property
    def awaiting_grammar(self) -> bool:
        return self._held is not None

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._constrained = self._schedules_grammar(scheduler_output)
        if self._constrained and self.cannot_constrain:
            raise KimiInputError(f"a request with structured outputs cannot be served here: {self.cannot_constrain}")
        app = self.model.model
        app.host_logits = self._constrained and self._on_device
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            app.host_logits = False

    def _schedules_grammar(self, scheduler_output) -> bool:
        """Whether a request of this step has structured outputs (vLLM's Request.use_structured_output)."""
        new = (r.sampling_params for r in scheduler_output.scheduled_new_reqs)
        cached = (self.requests[r].sampling_params for r in scheduler_output.scheduled_cached_reqs.req_ids
                  if r in self.requests)
        return any(p is not None and p.structured_outputs is not None for p in (*new, *cached))

    def _sample(self, hidden_states, model_input):
        """A constrained step's logits held, in the input batch's order (as vllm-neuron's own _sample orders them);
        None makes its execute_model return the empty output."""
        if not self._constrained:
            return super()._sample(hidden_states, model_input)
        row = {req_id: i for i, req_id in enumerate(model_input.request_ids)}
        order = torch.tensor([row[req_id] for req_id in self.input_batch.req_ids])
        self._held = (hidden_states[order].float(), model_input)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output):
        """The held step sampled on the host with the grammar's mask (vLLM's GrammarOutput; None: no row is
        constrained this step)."""
        logits, model_input = self._held
        self._held = None
        if grammar_output is not None:
            ids = grammar_output.structured_output_request_ids
            grammar_mask.apply(logits, [self.input_batch.req_id_to_index[i] for i in ids],
                               torch.from_numpy(grammar_output.grammar_bitmask),
                               [self.requests[i].sampling_params.all_stop_token_ids for i in ids],
                               self.special_tokens(logits.shape[-1]))
        return self._generate_model_runner_output(self._cpu_sample(logits, model_input))

    def special_tokens(self, vocab: int) -> grammar_mask.SpecialTokens:
        """Kimi's tokenizer's special tokens (read once, from the tokenizer folder vLLM serves or the checkpoint's:
        a transformers tokenizer folder holds no tiktoken.model)."""
        if self._special is None:
            folders = [Path(p) for p in (self.model_config.tokenizer, self.model_config.model) if p]
            folder = next((f for f in folders if (f / VOCAB_NAME).is_file()), None)
            if folder is None:
                raise KimiInputError(f"{folders[0]}: no {VOCAB_NAME}; structured outputs need Kimi's tokenizer files")
            self._special = grammar_mask.SpecialTokens.of_kimi(KimiTokenizer.from_dir(folder), vocab)
        return self._special


class KimiNeuronWorker(NeuronWorker):
    """vllm-neuron's worker over KimiModelRunner: execute_model() returns None for a constrained step, and vLLM then
    calls sample_tokens() with the step's grammar bitmask (vllm/v1/worker/worker_base.py)."""

    def get_neuronx_distributed_model_runner(self, vllm_config, device):
        return KimiModelRunner(vllm_config=vllm_config, device=device)

    def execute_model(self, scheduler_output):
        output = self.model_runner.execute_model(scheduler_output)
        if self.model_runner.awaiting_grammar:
            return None
        return output if self.is_driver_worker else None

    def sample_tokens(self, grammar_output):
        output = self.model_runner.sample_tokens(grammar_output)
        return output if self.is_driver_worker else None
