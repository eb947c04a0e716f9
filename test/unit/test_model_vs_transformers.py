"""Logits of the core model (KimiK2ForCausalLM, run by the CPU runner) vs transformers' DeepseekV3ForCausalLM on the
same tiny checkpoints.

The oracle reads and dequantizes the checkpoint with transformers' / compressed-tensors' code
(kimi_k2_neuron.tiny.transformers_oracle), so this covers our shard reading, dequantization, weight loading and all
of the model math at once.
"""

import pytest
import torch

from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.tiny.transformers_oracle import hf_logits, hf_model

ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100, 2, 90, 91, 92]]
TOL = 1e-3  # of max |logit|, float32


def rel_err(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def hf_models(tiny):
    return {q: hf_model(d) for q, d in tiny.items()}


@pytest.mark.parametrize("quant", ["fp8", "int4", "bf16"])
@pytest.mark.parametrize("prefill_len", [10, 4, 1])
def test_logits_match_transformers(tiny, hf_models, quant, prefill_len):
    ref = hf_logits(hf_models[quant], ROWS, prefill_len)
    ours = CpuRunner(tiny[quant]).logits(ROWS, prefill_len)
    assert ours.shape == ref.shape == (2, 10, 512)
    assert rel_err(ours, ref) < TOL


def test_bfloat16_close_to_float32_reference(tiny, hf_models):
    ours = CpuRunner(tiny["bf16"], dtype=torch.bfloat16).logits(ROWS, 5)
    ref = hf_logits(hf_models["bf16"], ROWS, 5)
    # bf16 compute is a sanity check, not the parity criterion: a routing decision near a tie can flip in bf16 and
    # move one position's logits a lot, so bound the typical error and the greedy choices, not the worst case.
    assert (ours - ref).abs().median() / ref.abs().max() < 2e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_rows_of_different_lengths_match_transformers_row_by_row(tiny, hf_models):
    """Ragged rows: each prefills min(prefill_len, its length) tokens, and is NaN past its end (the nxdi-cpu
    backend's output shape)."""
    rows = [ROWS[0], ROWS[1][:6]]
    ours = CpuRunner(tiny["fp8"]).logits(rows, prefill_len=4)
    assert ours.shape == (2, 10, 512) and torch.isnan(ours[1, 6:]).all() and not torch.isnan(ours[1, :6]).any()
    for r, row in enumerate(rows):
        assert rel_err(ours[r, :len(row)], hf_logits(hf_models["fp8"], [row], 4)[0]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["fp8", "int4"])
@pytest.mark.parametrize("prefill_len", [10, 8])
def test_chunked_prefill_matches_transformers(tiny, hf_models, quant, prefill_len):
    """A prefill of 10 or 8 tokens in calls of 3 (3.3 or 2.7 chunks, the last one short: each call attends to the
    cache written so far and causally within itself), then the rest one token at a time: transformers' one-shot
    prefill's logits."""
    ours = CpuRunner(tiny[quant], prefill_chunk=3).logits(ROWS, prefill_len)
    assert rel_err(ours, hf_logits(hf_models[quant], ROWS, prefill_len)) < TOL


@pytest.mark.slow
def test_prefill_len_zero_decodes_every_token(tiny, hf_models):
    """--prefill-len 0: no prefill call, every position through the decode path (transformers prefills the first
    token, the same math for one token)."""
    ours = CpuRunner(tiny["fp8"]).logits(ROWS, 0)
    assert rel_err(ours, hf_logits(hf_models["fp8"], ROWS, 1)) < TOL
