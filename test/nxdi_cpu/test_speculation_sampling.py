"""Sampled speculation is lossless in distribution (issue 38), through the real NxDI fused step's sampling branch in
NxD's CPU mode at TP 2, for each public draft layout: the draft proposes (greedily, as NxDI forces) a token of known
target probability, NxDI's acceptance keeps it with that probability and otherwise draws from the target's distribution
without it (NXDI_CONTRACT.md: fused-acceptance), so the step's first token must follow the target's filtered
distribution p' (top-k, temperature) whatever the draft proposed.

Oracle: the target's own softmax, p' = softmax(top-k of its logits / temperature), the logits from the same model
without a draft (NxDI's context encoding and token generation, teacher-forced). The prefill is drawn at top_k 1 (the
target's argmax, the same prefix every time), then one fused step at top_k TOP_K and TEMPERATURE; ROWS identical rows a
call (each draws its own uniforms), RUNS calls, each rank seeding torch's generator alike (on device one program draws
for all ranks). The draft proposes the token p' ranks second (p' about 0.2-0.3 here), so both branches run: accepted
and, after a rejection, NxDI's draw from the renormalised rest. Test: Pearson's chi-square of the first tokens' counts
against N p' (categories expected below 5 merged), rejected at p < ALPHA: a correct sampler fails it with probability
ALPHA = 1e-3 per layout (the seeds are fixed, so a given torch gives the same counts each run); a rule that kept every
proposal, or drew the replacement from p' itself, puts about 0.3 more, or 0.7 p'(d) more, of the mass on the proposal
and fails it by tens of standard deviations at N = ROWS x RUNS = 512.

Device-only ops stood in by test code: NxD's Argmax, and NxDI's rand_like (an XLA Rng: torch.rand here,
scripts/nxdi_cpu_tier/device_ops.py); the draft sampler's device branch (NxDI's CPU branch returns no probabilities:
nxdi_cpu/fused_spec_cpu.py DeviceDraftSampler)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nxdi_support import cpu_options, stand_in_device_ops
from test_speculation import K, Proposer, draft_specs

from kimi_k2_neuron.neuron.spec import GREEDY, Sampling
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from kimi_k2_neuron.tiny import DRAFT_LAYOUTS
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft

ROWS, RUNS = 8, 64
TOP_K, TEMPERATURE = 8, 2.0
ALPHA = 1e-3
SEED = 1234

pytestmark = pytest.mark.fp8_selective_cpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = make_tiny(root / "target", quant="fp8", shards=2, seed=1, config_overrides={"num_hidden_layers": 7})
    return target, {layout: make_tiny_draft(root / layout, target, seed=2, layout=layout) for layout in DRAFT_LAYOUTS}


def _sample_job(rank: int, o, prompt: list[int], drafts: dict):
    """-> {"logits": the target's next-token logits after the prefill's argmax token, layout: (first tokens of the
    fused step, tokens each row's step emitted)}."""
    from neuronx_distributed_inference.modules.generation.sampling import prepare_sampling_params

    seq_len = len(prompt) + 2 * K
    plain = backend.build(dataclasses.replace(o, spec=dataclasses.replace(o.spec, draft=None)), seq_len, 1, None)
    first = backend.teacher_forced_logits(plain, [prompt])[0, -1]
    t0 = int(first.argmax())
    logits = backend.teacher_forced_logits(plain, [prompt + [t0]])[0, -1]
    p = torch.softmax(logits.topk(TOP_K).values / TEMPERATURE, -1)
    proposal = int(logits.topk(TOP_K).indices[1])  # the second most likely: accepted with p'(proposal) < 1
    out = {"logits": logits, "t0": t0}
    # the compiled top-k pre-selection at most the eagle3-d2t draft's 128 ids (its prefill samples too; at Kimi's
    # 32000 of 163840 at TP 64, 500 a rank, NxDI's 256 fits)
    sampling = Sampling(do_sample=True, top_k=TOP_K, temperature=TEMPERATURE, global_topk=64)
    ids = torch.tensor([prompt] * ROWS)
    mask = torch.ones_like(ids)
    positions = torch.arange(len(prompt))[None].expand(ROWS, -1)
    seq_ids = torch.arange(ROWS, dtype=torch.int32)
    prefill = prepare_sampling_params(batch_size=ROWS, top_k=[1], top_p=[1.0], temperature=[1.0])
    params = prepare_sampling_params(batch_size=ROWS, top_k=[TOP_K], top_p=[1.0], temperature=[TEMPERATURE])
    # the draft proposes `proposal` after t0 (index len(prompt) + 1), then t0 again (its later proposals do not
    # bear on the first token)
    truth = [prompt + [t0, proposal] + [t0] * K] * ROWS
    for layout, (spec, vocab) in drafts.items():
        o_draft = dataclasses.replace(o, spec=dataclasses.replace(o.spec, draft=spec))
        app = backend.build(o_draft, seq_len, ROWS, sampling)
        proposer = Proposer(app, truth, lambda q: False, vocab)
        firsts, emitted = [], []
        for run in range(RUNS):
            torch.manual_seed(SEED + run)
            with torch.no_grad():
                head = app(input_ids=ids, attention_mask=mask, position_ids=positions, seq_ids=seq_ids,
                           sampling_params=prefill).fused_outputs
                assert head[0][:, 0].tolist() == [t0] * ROWS  # top_k 1: the prefill is the argmax
                step = app(input_ids=head[1], attention_mask=None, position_ids=head[3], seq_ids=seq_ids,
                           sampling_params=params).fused_outputs
            firsts += step[0][:, 0].tolist()
            emitted += (step[3] - head[3]).view(-1).tolist()
        proposer.remove()
        out[layout] = (firsts, emitted, proposal in vocab, proposal, p.tolist(), logits.topk(TOP_K).indices.tolist())
    return out


@pytest.fixture(scope="module")
def sampled(models):
    stand_in_device_ops()
    target, drafts = models
    specs = draft_specs(target, drafts)
    tok = KimiTokenizer.from_dir(target)
    prompt = tok.encode("Hello there, how are you today?")
    o = backend.prepare(cpu_options(target, tp=2, draft=specs["eagle3"][0]), len(prompt) + 2 * K, ROWS, GREEDY,
                        [prompt])
    return backend.run(o, _sample_job, prompt, specs)


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """Pearson's X^2 of counts against n p, categories expected below 5 merged into one, and its upper-tail
    probability under chi-square with (categories - 1) degrees of freedom (the regularized upper incomplete gamma)."""
    n = sum(counts)
    cells, rest_obs, rest_exp = [], 0, 0.0
    for c, q in zip(counts, probs):
        if n * q >= 5:
            cells.append((c, n * q))
        else:
            rest_obs, rest_exp = rest_obs + c, rest_exp + n * q
    if rest_exp > 0:
        cells.append((rest_obs, rest_exp))
    x2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_the_first_sampled_token_follows_the_targets_distribution(layout, sampled):
    firsts, emitted, in_vocab, proposal, p, top = sampled[layout]
    assert len(firsts) == ROWS * RUNS and set(firsts) <= set(top)  # nothing outside the target's top-k
    counts = [firsts.count(t) for t in top]
    assert chi_square_p_value(counts, p) > ALPHA, (counts, [round(q * len(firsts), 1) for q in p])
    kept = sum(n > 1 for n in emitted)  # the proposal accepted: the step went on past it
    if in_vocab:  # both of NxDI's branches ran: kept with p'(proposal), else the draw from the rest
        share = p[top.index(proposal)]
        assert 0 < kept < len(emitted) and abs(kept / len(emitted) - share) < 5 * (share / len(emitted)) ** 0.5


def test_the_chi_square_test_rejects_a_sampler_that_keeps_every_proposal():
    """The statistic's power against the failure the test guards: all mass moved to the proposal's share."""
    p = [0.35, 0.25, 0.15, 0.1, 0.06, 0.05, 0.03, 0.01]
    n = ROWS * RUNS
    fair = [round(n * q) for q in p]
    assert chi_square_p_value(fair, p) > 0.5
    kept = [round(n * q) for q in p]
    kept[1] += int(0.3 * n)
    kept[0] -= int(0.3 * n)
    assert chi_square_p_value(kept, p) < 1e-12
