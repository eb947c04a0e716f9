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

Where the logits come from: without on-device sampling they are what the model returns, and the host samples every
row; with it, the application compiled with output_logits (vllm_request.for_vllm) returns them beside the device's
tokens and, on a constrained step, hands on both (host_logits.py, set here around the call): the host samples only
the rows the grammar masks, the others keep the device's token (vLLM's sampler costs the host about one full-vocabulary
sort a row: docs/vllm.md, cost per step). What cannot be constrained stops the step with one line
(vllm_request.unconstrained_why): the API middleware refuses such requests before (vllm_api.py).

Every step, constrained or not, the device's sampler is handed each row's own temperature, top_k and top_p
(vllm-neuron's are by the order its runner holds the requests: NXDI_CONTRACT.md, vllm-ods-params).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from neuronx_distributed_inference.modules.generation.sampling import prepare_sampling_params
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import _SAMPLING_EPS
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
        self._held: tuple[torch.Tensor, torch.Tensor | None, object] | None = None
        self._special: grammar_mask.SpecialTokens | None = None
        self.cannot_constrain: str | None = None
        self._on_device = False

    def load_model(self) -> None:
        super().load_model()
        spec = run_spec(self.model.model.config)  # the application's RunSpec, as it was built
        self.cannot_constrain, self._on_device = unconstrained_why(spec), spec.sampling.on_device

    def _prepare_model_input(self, scheduler_output):
        """vllm-neuron's step input, with the device's sampling parameters in the step's row order: its
        get_nxd_sampling_params gives row i the i-th request the runner holds (self.requests, in arrival order, those
        not in this step too), so a request sampled beside others can take another's temperature, top_k and top_p
        (NXDI_CONTRACT.md: vllm-ods-params)."""
        model_input = super()._prepare_model_input(scheduler_output)
        if not self._on_device or model_input.sampling_params is None or not model_input.request_ids:
            return model_input
        return replace(model_input, sampling_params=self._row_sampling_params(model_input))

    def _row_sampling_params(self, model_input) -> torch.Tensor:
        """[rows, 3] top_k, top_p, temperature of each row's request, as vllm-neuron maps one request's (a greedy
        one top_k 1 at temperature 1; top_k capped at the compiled global top-k); rows past the step's requests keep
        vllm-neuron's."""
        cap = min(self.model.neuron_config.on_device_sampling_config.global_topk, self._MAX_NEURON_SAMPLING_TOP_K)
        rows = model_input.sampling_params.clone()
        params = [self.requests[r].sampling_params for r in model_input.request_ids[:rows.shape[0]]]
        greedy = [p.temperature == 0.0 for p in params]
        rows[:len(params)] = prepare_sampling_params(
            len(params), [1 if g else (p.top_k if 0 < p.top_k < cap else cap) for g, p in zip(greedy, params)],
            [p.top_p for p in params], [1.0 if g else p.temperature for g, p in zip(greedy, params)])
        return rows

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
        held = hidden_states[order].float()
        if self._on_device:  # the logits, then the device's token (host_logits.py)
            self._held = (held[:, :-1], held[:, -1].long(), model_input)
        else:
            self._held = (held, None, model_input)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output):
        """The held step sampled on the host with the grammar's mask (vLLM's GrammarOutput; None: no row is
        constrained this step)."""
        logits, device_tokens, model_input = self._held
        self._held = None
        masked = []
        if grammar_output is not None:
            ids = grammar_output.structured_output_request_ids
            masked = grammar_mask.apply(logits, [self.input_batch.req_id_to_index[i] for i in ids],
                                        torch.from_numpy(grammar_output.grammar_bitmask),
                                        [self.requests[i].sampling_params.all_stop_token_ids for i in ids],
                                        self.special_tokens(logits.shape[-1]))
        if device_tokens is None:
            return self._generate_model_runner_output(self._cpu_sample(logits, model_input))
        tokens = host_rows(self.cpu_sampler, logits, self.input_batch.sampling_metadata, masked, device_tokens)
        return self._generate_model_runner_output(SamplerOutput(sampled_token_ids=tokens.unsqueeze(-1),
                                                                logprobs_tensors=None))

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


def host_rows(sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int],
              device_tokens: torch.Tensor) -> torch.Tensor:
    """[B] the step's tokens: the device's, but at `rows` what vLLM's sampler draws from those rows' (masked) logits
    with those requests' sampling parameters."""
    tokens = device_tokens.clone()
    if rows:
        at = torch.tensor(rows)
        tokens[at] = sampler(logits[at], rows_of(meta, rows)).sampled_token_ids[:, 0].to(tokens.dtype)
    return tokens


def rows_of(meta: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    """vLLM's sampling metadata of the input batch, cut to `rows` (in that order): each per-request field taken at
    those rows (the token lists only where the batch keeps them: vLLM leaves them empty when no request needs
    them), the per-request generators renumbered. Logits processors hold per-batch state that cannot be cut;
    vllm-neuron's input batch has none."""
    if any(True for _ in meta.logitsprocs.all):
        raise NotImplementedError("logits processors in vllm-neuron's input batch: their batch state cannot be cut")
    at = torch.tensor(rows)
    pick = {new: old for new, old in enumerate(rows)}
    temperature = None if meta.temperature is None else meta.temperature[at]
    greedy = temperature is None or bool((temperature < _SAMPLING_EPS).all())
    return replace(
        meta, temperature=temperature, all_greedy=greedy,
        all_random=temperature is not None and bool((temperature >= _SAMPLING_EPS).all()),
        top_p=None if meta.top_p is None else meta.top_p[at], top_k=None if meta.top_k is None else meta.top_k[at],
        generators={new: meta.generators[old] for new, old in pick.items() if old in meta.generators},
        prompt_token_ids=None if meta.prompt_token_ids is None else meta.prompt_token_ids[at],
        frequency_penalties=meta.frequency_penalties[at], presence_penalties=meta.presence_penalties[at],
        repetition_penalties=meta.repetition_penalties[at],
        output_token_ids=[meta.output_token_ids[old] for old in rows] if meta.output_token_ids else [],
        allowed_token_ids_mask=None if meta.allowed_token_ids_mask is None else meta.allowed_token_ids_mask[at],
        bad_words_token_ids={new: meta.bad_words_token_ids[old] for new, old in pick.items()
                             if old in meta.bad_words_token_ids},
        spec_token_ids=[meta.spec_token_ids[old] for old in rows] if meta.spec_token_ids else meta.spec_token_ids)


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
