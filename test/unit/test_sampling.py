"""Next-token choice: greedy, top-k and top-p filters, and sampling parameters refused in one line."""

import torch

from kimi_k2_neuron.runtime.sampling import SamplingParams, sample


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    assert sample(logits, SamplingParams()).item() == 4
    g = torch.Generator().manual_seed(0)
    topk = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g).item() for _ in range(200)}
    assert topk == {3, 4}
    # probs of 4 and 3 are ~0.64 and ~0.24: top_p 0.7 keeps exactly those two
    topp = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), g).item() for _ in range(200)}
    assert topp == {3, 4}


def test_bad_sampling_params(one_line_error):
    one_line_error(lambda: SamplingParams(temperature=float("nan")), "temperature nan", "expected a finite number")
    one_line_error(lambda: SamplingParams(temperature=1.0, top_p=float("nan")), "top_p nan")
    one_line_error(lambda: SamplingParams(top_k=-3), "top_k -3", "expected an integer >= 0")
