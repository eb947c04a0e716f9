"""Generation through NxDI's HuggingFaceGenerationAdapter and NxDI's on-device sampler (its CPU branches) at TP=2: the
tokens are the argmax of the full logits the model computes (teacher-forced, TP=1).

On device the sampler takes vocab-sharded logits and gathers its top-k/argmax across ranks with torch-neuronx ops;
its CPU branches have no distributed path, so in CPU mode the model's lm_head gathers the vocabulary first
(modeling.py, init_model). Without that gather the TP=2 tokens come from one rank's half of the vocabulary (seen: row
1's first token differed). The sharded path itself awaits trn2."""

import pytest
import torch

from kimi_k2_neuron.neuron import cpu

PROMPTS = [[5, 17, 300, 42, 256, 9, 77], [400, 3, 3, 260]]
NEW = 5

pytestmark = pytest.mark.fp8_selective_cpu


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling-top_k-1"])
def test_on_device_sampler_at_tp2_picks_the_argmax_of_the_full_logits(converted, do_sample):
    o = cpu.CpuOptions(model=str(converted[("fp8", "fp8-blockwise")]), tp=2)
    g = cpu.Generation(rows=PROMPTS, stop_ids=(), max_new_tokens=NEW, do_sample=do_sample, top_k=1, seed=3)
    new, report = cpu.generate(o, g)
    assert "on-device sampling: NxDI's CPU branch over logits gathered in lm_head" in report
    assert [len(r) for r in new] == [NEW, NEW]
    full = [p + n for p, n in zip(PROMPTS, new)]
    logits, _ = cpu.logits(cpu.CpuOptions(model=o.model), full, prefill_len=None)
    for r, (p, n) in enumerate(zip(PROMPTS, new)):
        assert logits[r, len(p) - 1:len(p) - 1 + NEW].argmax(-1).tolist() == n, f"row {r}"
