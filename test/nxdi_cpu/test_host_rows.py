"""A constrained step under on-device sampling (neuron/vllm_worker.py): the rows vLLM's grammar masks are sampled on
the host, the others keep the device's token. The oracle is vLLM's own Sampler over the whole batch (what the worker
did before, and vllm-neuron's CPU sampling does): at the host's rows, cut to those rows with the same per-request
seeds, it must draw the same tokens, for greedy, seeded top-p / top-k and mixed batches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
nxdi_cpu_vllm = pytest.importorskip("nxdi_cpu_vllm", reason="the tier's vLLM-on-CPU adapter is not installed here")
nxdi_cpu_vllm.adapt()  # vllm-neuron 0.2.0's imports on vLLM 0.13, as the tier's platform plugin adapts them

from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from kimi_k2_neuron.neuron.vllm_worker import host_rows, rows_of  # noqa: E402

VOCAB = 1000
SEEDS = [11, 22, 33, 44, 55, 66]


def metadata(temperature: list[float], top_p: list[float], top_k: list[int], seeded: bool) -> SamplingMetadata:
    """As vLLM 0.13's InputBatch makes it: a greedy request at temperature 0, the tensor left out when every row is
    greedy; a seeded request's generator at its row; no token lists (no penalties, no bad words)."""
    rows = len(temperature)
    greedy = [t < 1e-5 for t in temperature]
    gens = {r: torch.Generator().manual_seed(SEEDS[r]) for r in range(rows) if seeded and not greedy[r]}
    zeros = torch.zeros(rows)
    return SamplingMetadata(
        temperature=None if all(greedy) else torch.tensor([0.0 if g else t for g, t in zip(greedy, temperature)]),
        all_greedy=all(greedy), all_random=not any(greedy), top_p=torch.tensor(top_p), top_k=torch.tensor(top_k),
        generators=gens, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros,
        presence_penalties=zeros, repetition_penalties=torch.ones(rows), output_token_ids=[],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


CASES = {
    "greedy": ([0.0] * 4, [1.0] * 4, [VOCAB] * 4),
    "seeded top-p": ([1.0, 0.7, 1.0, 0.9], [0.95, 0.8, 0.95, 0.5], [VOCAB] * 4),
    "seeded top-k": ([1.0] * 4, [1.0] * 4, [5, 50, 2, 20]),
    "mixed": ([0.0, 1.0, 0.0, 0.6, 1.0, 0.0], [0.95] * 6, [VOCAB, 40, VOCAB, VOCAB, 7, VOCAB]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_host_rows_are_vllms_draws_and_the_rest_the_devices(case):
    temperature, top_p, top_k = CASES[case]
    rows = len(temperature)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    logits[1, 10:] = float("-inf")  # a masked row: only ten tokens left
    sampler = Sampler()
    whole = sampler(logits.clone(), metadata(temperature, top_p, top_k, seeded=True)).sampled_token_ids[:, 0]
    device = torch.full((rows,), -7, dtype=torch.long)  # no token of the vocabulary: the device's, kept as it is
    for masked in ([1], [1, 3], [0, 2, 3], list(range(rows)), []):
        got = host_rows(sampler, logits.clone(), metadata(temperature, top_p, top_k, seeded=True), masked, device)
        want = device.clone()
        want[masked] = whole[masked].long()
        assert torch.equal(got, want), (case, masked, got, want)
    assert int(whole[1]) < 10


def test_the_cut_metadata_keeps_each_requests_fields():
    meta = metadata([0.0, 1.0, 0.5], [0.9, 0.8, 0.7], [3, 4, 5], seeded=True)
    assert rows_of(meta, [2, 0]).output_token_ids == []  # vLLM keeps none: nothing to cut
    meta.output_token_ids = [[], [], [9]]  # as with bad words: vLLM keeps every request's
    meta.bad_words_token_ids[2] = [[1, 2]]
    cut = rows_of(meta, [2, 0])
    assert cut.temperature.tolist() == [0.5, 0.0] and not cut.all_greedy and not cut.all_random
    assert cut.top_p.tolist() == pytest.approx([0.7, 0.9]) and cut.top_k.tolist() == [5, 3]
    assert cut.generators == {0: meta.generators[2]} and cut.output_token_ids == [[9], []]
    assert cut.bad_words_token_ids == {0: [[1, 2]]}
    only_greedy = rows_of(meta, [0])
    assert only_greedy.all_greedy and not only_greedy.all_random
    only_random = rows_of(meta, [1, 2])
    assert only_random.all_random and not only_random.all_greedy
