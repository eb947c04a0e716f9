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


def test_a_tiny_temperature_samples_the_top_token():
    """--temperature 1e-300 (or any positive one): the top token, as the limit of sampling is (before: the logits
    over 1e-300 overflowed and multinomial refused the NaN probabilities)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.5, 30.0, -12.0, 29.99], [3.0, -1.0, 2.0, 2.5]])
    for temperature in (1e-300, 5e-324, 1e-30, 1e-8):
        for p in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_k=2),
                  SamplingParams(temperature=temperature, top_p=0.5)):
            assert sample(logits, p, g).tolist() == [1, 0], (temperature, p)
    # a tie at the top is drawn from evenly, as its limit is
    tied = {sample(torch.tensor([[1.0, 5.0, 5.0]]), SamplingParams(temperature=1e-300), g).item() for _ in range(64)}
    assert tied == {1, 2}
