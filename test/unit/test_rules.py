"""neuron/rules.py: what NxD can compile and run for Kimi, each rule once (most rules are exercised through the
contract, test_contract.py; the sampler's per-request bounds here)."""

from __future__ import annotations

from kimi_k2_neuron.neuron import rules
from kimi_k2_neuron.neuron.spec import Sampling


def test_a_temperature_nxdis_sampler_cannot_divide_by_is_refused_with_the_smallest_it_takes(one_line_error):
    """NxDI's sampler divides the logits by the temperature in float32: 1e-300 is 0 there (inf logits, a NaN draw).
    The smallest taken (rules.MIN_TEMPERATURE) samples the greedy tokens in NxDI's own sampler (the tier's
    test_backend.py)."""
    rules.check_top_k(Sampling.of(rules.MIN_TEMPERATURE, 0, 1.0))
    rules.check_top_k(Sampling.of(0.0, 0, 1.0))  # greedy: no division
    for t in (1e-300, 9.9e-31):
        one_line_error(lambda: rules.check_top_k(Sampling.of(t, 0, 1.0)), f"--temperature {t:g}: below 1e-30",
                       "give 1e-30 or more, or 0 for greedy decoding")
