"""neuron/rules.py: what NxD can compile and run for Kimi-K2, refused in one line naming the flag, over RunSpecs
(a flag build, a reload and a vLLM request all meet these rules, once per build: test/nxdi_cpu/test_run_spec.py)."""

from __future__ import annotations

import re

import pytest

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, ExpertScheme
from kimi_k2_neuron.neuron import rules
from kimi_k2_neuron.neuron.spec import RunSpec, Sampling
from kimi_k2_neuron.placement import Layout

from specs import chunk, group, kimi_cfg, per_channel, tiny_cfg


@pytest.mark.parametrize("opts,needle", [
    (dict(tp=3), "num_attention_heads=64 is not divisible by 3"),
    (dict(tp=64, ep=4, batch=1, moe_decode="selective"), "--moe-decode selective with --ep 4: NxD's selective loading"),
    (dict(tp=64, moe_decode="sparse"), "--moe-decode 'sparse': expected one of selective, all-experts"),
    (dict(tp=64, ep=2, batch=48), "--ep 2 at --tp 64 --lnc 2: not an expert layout"),
    (dict(tp=64, ep=8, batch=48), "use --ep in [1, 4, 16, 64]"),
    (dict(tp=64, ep=16, batch=48, moe_prefill="all-experts"), "no EP variant; use --moe-prefill shard-on-block with "
     "at least 128 tokens per prefill call or --moe-prefill torch with at least 64 tokens per prefill call"),
    # 48 x 8 = 384 token-expert pairs: below the torch path's block of 512, so NxD's all-experts path
    (dict(tp=64, ep=16, batch=48, seq_len=1, max_context_length=1, moe_prefill="torch"),
     "takes NxD's all-experts path, which has no EP variant"),
    # 47 x 8 < 384 experts: a prefill on selective loading
    (dict(tp=64, ep=16, batch=47, seq_len=1, max_context_length=1), "a prefill of 47 tokens takes NxD's selective"),
    # shard-on-block at Kimi's shapes: the kernel's output tiles are 128 rows
    (dict(tp=64, seq_len=1000), "a prefill of 1000 tokens (batch x --max-context-length) must be a multiple of 128"),
    (dict(tp=64, lnc=1), "--moe-prefill shard-on-block with --lnc 1: nkilib has its MoE prefill kernels for LNC=2"),
    # 2048 / 64 = 32 expert columns per rank, 16 per physical core: below the kernel's 128-row tiles
    (dict(tp=64, moe_prefill="shard-on-intermediate"), "(16 here)"),
    (dict(tp=64, ep=4, batch=48, moe_prefill="shard-on-intermediate"), "(64 here)"),  # 2048 / 16 / 2
    (dict(tp=64, moe_prefill="kernel"), "--moe-prefill 'kernel': expected one of shard-on-block"),
    (dict(tp=64, checkpoint=None), "needs a converted checkpoint"),
    # [128, 32] blocks: a rank's 32 down-projection rows at TP 64 hold no whole 128-row block
    (dict(tp=64, scheme=ExpertScheme("fp8-blockwise", (128, 32))), "shard only [1, 2, 4, 8, 16] ways"),
    (dict(tp=64, seq_len=512, max_context_length=1024), "--max-context-length 1024"),
    (dict(tp=64, ep=3, batch=48), "--ep 3: must divide --tp 64"),
    (dict(tp=64, ep=4, batch=48, scheme=ExpertScheme("fp8-blockwise", (256, 32))), "experts split 16 ways (tp / ep)"),
    (dict(tp=64, layout=group(3)), "--kv-group 3: must divide --tp 64"),
    (dict(tp=64, layout=group(64), seq_len=1056, max_context_length=1024), "--seq-len 1056: with --kv-shard sequence"),
    (dict(tp=64, layout=group(64), max_context_length=1000, moe_prefill="torch"),
     "--max-context-length 1000: with --kv-shard"),
])
def test_bad_configurations_are_refused(opts, needle):
    with pytest.raises(KimiInputError) as e:
        rules.check(kimi_cfg(), per_channel(**opts))
    assert needle in str(e.value)


@pytest.mark.parametrize("tokens", [1, 16, 47])
def test_the_ep_refusals_advice_is_accepted_and_is_the_least(tokens):
    """A prefill too short for a blockwise path with EP is refused with, per suggested mode, a token count; each is
    accepted by the same check, and one token fewer is not (the selective path below 384 / 8 = 48 tokens, the
    all-experts path below a block / 8, the kernel's whole 128-row tiles)."""
    from kimi_k2_neuron.neuron import moe_paths

    cfg = kimi_cfg()
    with pytest.raises(KimiInputError) as e:
        moe_paths.check_prefill_mode(cfg, "shard-on-block", 64, 4, 2, tokens)
    advice = re.findall(r"--moe-prefill (\S+) with at least (\d+) tokens", str(e.value))
    assert [m for m, _ in advice] == ["shard-on-block", "torch"]
    for mode_name, n in advice:
        moe_paths.check_prefill_mode(cfg, mode_name, 64, 4, 2, int(n))
        with pytest.raises(KimiInputError):
            moe_paths.check_prefill_mode(cfg, mode_name, 64, 4, 2, int(n) - 1)


def test_prefill_rules_count_one_sequence_under_continuous_batching():
    """The kernel's 128-row tiles: 2 x 576 tokens would pass, but each prefill call holds one sequence of 576."""
    rules.check(kimi_cfg(), per_channel(tp=64, batch=2, seq_len=576))
    with pytest.raises(KimiInputError, match="a prefill of 576 tokens"):
        rules.check(kimi_cfg(), per_channel(tp=64, batch=2, seq_len=576, continuous_batching=True))


@pytest.mark.parametrize("over,needle", [
    (dict(seq_len=4096, layout=chunk(1000)), "--prefill-chunk 1000: must divide --seq-len 4096"),
    (dict(seq_len=4096, layout=chunk(1024), max_context_length=2048),
     "--max-context-length 2048: with --prefill-chunk 1024 the prefill bucket is the chunk"),
    # shard-on-block, the default mode at these shapes: the kernel's 128-row output tiles, counted per chunk call
    (dict(seq_len=1536, layout=chunk(192)), "a prefill of 192 tokens"),
])
def test_what_a_prefill_chunk_cannot_run_is_refused_in_one_line(over, needle, one_line_error):
    one_line_error(lambda: rules.check(kimi_cfg(), per_channel(tp=64, **over)), needle)


def test_a_one_token_prompt_is_not_batched_with_longer_ones():
    rules.check_prompt_lengths([1, 1])
    rules.check_prompt_lengths([3, 2, 7])
    with pytest.raises(KimiInputError, match="one-token prompt cannot share a batch"):
        rules.check_prompt_lengths([5, 1])


@pytest.mark.parametrize("options,message", [
    (Layout(shard_router=True), "--shard-router --tp 4: config.json field n_routed_experts=6 is not "
                                                "divisible by 4"),
    (Layout(shard_attn_a=True), "--shard-attn-a --tp 4: config.json field q_lora_rank=162 is not "
                                                "divisible by 4"),
])
def test_the_shell_refuses_layouts_it_cannot_build_in_one_line(one_line_error, options, message):
    """Uneven splits (NxD would pad the layer)."""
    cfg = tiny_cfg(n_routed_experts=6, q_lora_rank=162)
    o = RunSpec(tp=4, lnc=None, seq_len=16, scheme=BF16_EXPERTS, moe_prefill="torch", layout=options)
    one_line_error(lambda: rules.check(cfg, o), message)


def test_a_temperature_nxdis_sampler_cannot_divide_by_is_refused_with_the_smallest_it_takes(one_line_error):
    """NxDI's sampler divides the logits by the temperature in float32: 1e-300 is 0 there (inf logits, a NaN draw).
    The smallest taken (rules.MIN_TEMPERATURE) samples the greedy tokens in NxDI's own sampler (the tier's
    test_backend.py)."""
    rules.check_top_k(Sampling.of(rules.MIN_TEMPERATURE, 0, 1.0))
    rules.check_top_k(Sampling.of(0.0, 0, 1.0))  # greedy: no division
    for t in (1e-300, 9.9e-31):
        one_line_error(lambda: rules.check_top_k(Sampling.of(t, 0, 1.0)), f"--temperature {t:g}: below 1e-30",
                       "give 1e-30 or more, or 0 for greedy decoding")
