"""The host's work on a step a grammar constrains (docs/vllm.md, "Structured outputs", cost per step), measured at
Kimi's vocabulary: vLLM's bitmask unpacked and Kimi's rule applied (runtime/grammar_mask.apply), then vllm-neuron's
own CPU sampling of the step (its runner's `_cpu_sample`, vLLM's Sampler inside, each row at temperature 1.0 and
top_p 0.95, as Kimi's fixed sampling). Every row constrained, half inside a JSON string (nearly the whole vocabulary
allowed, the special tokens dropped by the rule) and half at a structural position (a few tokens); and, as the worker
runs under on-device sampling, one row of the batch constrained and sampled alone (vllm_worker.host_rows). Not a
test; run in the tier's venv:

    PYTHONPATH=src ~/.cache/kimi-k2-neuron/nxdi-cpu-venv/bin/python test/nxdi_cpu/grammar_host_cost.py
"""

from __future__ import annotations

import os
import statistics
import time
from types import SimpleNamespace

import nxdi_cpu_vllm
import numpy as np
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from kimi_k2_neuron.runtime import grammar_mask

nxdi_cpu_vllm.adapt()  # vllm-neuron 0.2.0's imports on vLLM 0.13, as the tier's platform plugin adapts them
from vllm_neuron.worker.neuronx_distributed_model_runner import NeuronxDistributedModelRunner  # noqa: E402

from kimi_k2_neuron.neuron.vllm_worker import host_rows  # noqa: E402

VOCAB, NUM_BASE, EOS = 163_840, 163_584, 163_585  # Kimi-K2's config vocab_size, tiktoken ranks, [EOS]
REPEATS = 20


def special_tokens() -> grammar_mask.SpecialTokens:
    """Kimi's layout: ids from NUM_BASE special; eight markers, each spelled by a few ordinary tokens."""
    gen = torch.Generator().manual_seed(0)
    special = torch.zeros(VOCAB, dtype=torch.bool)
    special[NUM_BASE:] = True
    spellers = {}
    for i in range(NUM_BASE, NUM_BASE + 8):
        row = torch.zeros(VOCAB, dtype=torch.bool)
        row[torch.randint(0, NUM_BASE, (6,), generator=gen)] = True
        spellers[i] = row
    return grammar_mask.SpecialTokens(VOCAB, special, EOS, spellers)


def bitmask(rows: int) -> torch.Tensor:
    """vLLM's int32 words: even rows a JSON string's position (all but ~1 % of the tokens), odd rows a few tokens."""
    gen = torch.Generator().manual_seed(1)
    allowed = torch.zeros(rows, VOCAB, dtype=torch.bool)
    for r in range(rows):
        if r % 2 == 0:
            allowed[r] = torch.rand(VOCAB, generator=gen) > 0.01
        else:
            allowed[r, torch.randint(0, NUM_BASE, (12,), generator=gen)] = True
    return torch.from_numpy(np.packbits(allowed.numpy(), axis=1, bitorder="little").view(np.int32).copy())


def metadata(rows: int) -> SamplingMetadata:
    zeros = torch.zeros(rows)
    return SamplingMetadata(temperature=torch.ones(rows), all_greedy=False, all_random=True,
                            top_p=torch.full((rows,), 0.95), top_k=None, generators={}, max_num_logprobs=None,
                            no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros,
                            presence_penalties=zeros, repetition_penalties=torch.ones(rows),
                            output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None,
                            bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def runner(rows: int) -> NeuronxDistributedModelRunner:
    """vllm-neuron's runner with only what its `_cpu_sample` reads."""
    r = NeuronxDistributedModelRunner.__new__(NeuronxDistributedModelRunner)
    r.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB)
    r.input_batch = SimpleNamespace(sampling_metadata=metadata(rows))
    r.cpu_sampler = Sampler()
    return r


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    tokens = special_tokens()
    print(f"torch threads {torch.get_num_threads()}, median of {REPEATS}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    for rows in (1, 4, 8, 32):
        logits, words, run = torch.randn(rows, VOCAB), bitmask(rows), runner(rows)
        stops = [(EOS, EOS + 1)] * rows
        mask = median_ms(lambda: grammar_mask.apply(logits.clone(), list(range(rows)), words, stops, tokens))
        sample = median_ms(lambda: run._cpu_sample(logits.clone(), SimpleNamespace(request_ids=list(range(rows)))))
        sampler = median_ms(lambda: run.cpu_sampler(logits.clone(), run.input_batch.sampling_metadata))
        # on-device sampling: one row of the step constrained, the host samples it alone (vllm_worker.host_rows)
        device = torch.zeros(rows, dtype=torch.long)
        one_mask = median_ms(lambda: grammar_mask.apply(logits.clone(), [0], words[:1], stops[:1], tokens))
        one = median_ms(lambda: host_rows(run.cpu_sampler, logits.clone(), run.input_batch.sampling_metadata, [0],
                                          device))
        print(f"batch {rows:3d}: mask {mask:7.2f} ms, vllm-neuron's CPU sampling {sample:7.2f} ms (vLLM's Sampler "
              f"in it {sampler:7.2f} ms), together {mask + sample:7.2f} ms a constrained step; on-device sampling "
              f"with one row constrained: {one_mask + one:7.2f} ms")


if __name__ == "__main__":
    main()
