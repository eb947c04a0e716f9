"""Prefix caching through the real NxD/NxDI in NxD's CPU mode (neuron/prefix_caching.py): NxDI's prefix-caching
application path (_get_model_outputs), its model wrapper's 2D buckets (the prompt cut where its bucket starts, the
slot mapping and block table padded), BlockKVCacheManager's get_cache (a row's blocks in table order) and update_cache
(at the slot mapping, padded slots into the reserved block) under our LatentBlockKVCacheManager, and the decoder
layer's prefill over cached blocks; inputs as vllm-neuron 0.2.0's model runner builds them (a new request: the whole
prompt from position 0, the slots from its first uncached position, the block table padded with block 0; a decode
step: one token, its slot, the table).

- Warm == cold, bit for bit: a prompt whose first P positions another prompt prefilled into blocks it reads (P below,
  at and above a 16-position block boundary; vLLM hits whole blocks, so it reads P // 16 of them) gives the logits of
  the same prompt prefilled with nothing cached, and so do three decode steps after it: float32 at TP=2 (NxD's
  parallel layers over gloo), bfloat16 at TP=1. It rests on matmuls whose rows do not depend on the rows beside
  them, which every call here has (prefill buckets of 16+ rows; MKL's float32 GEMM breaks that below 12 rows).
- The same logits as NxDI's contiguous cache (the model the rest of the tier checks against the core and
  transformers), within 1e-4 of the largest |logit|: the block path attends in key tiles.
- Chunks (--prefill-chunk 32 with --prefix-caching: a prompt prefilled 32 positions a call, each over the blocks the
  calls before it wrote): the logits of the one-call build, bit for bit, cold and warm.
- The planner's model of NxDI's bucket choice (spec.prefix_caching_calls) is the wrapper's own, for every cached
  length in blocks and a range of new lengths.
- Sharing: a warm prefill reads the shared blocks and writes none of them (bitwise unchanged), its recomputed and
  padded positions going to the reserved block; two sequences whose tables share those blocks, decoded in one batch,
  each give their own logits.
Not here: vLLM's scheduler and block manager (test_vllm_prefix_caching.py), the trn2 graphs.
"""

import dataclasses

import pytest
import torch
from nxdi_support import cpu_options, rel_err

from kimi_k2_neuron.neuron.spec import prefix_caching_calls
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.placement import Layout

SEQ, BS, BATCH = 128, 16, 2
A = [(37 * i + 11) % 500 + 5 for i in range(70)]  # the prompt that fills the blocks first
TAIL = [(13 * i + 7) % 500 + 3 for i in range(20)]
STEPS = [77, 5, 300]  # tokens teacher-forced after the prompt
PS = [31, 32, 33]  # shared prefix lengths around the boundary at 32

pytestmark = pytest.mark.fp8_selective_cpu


def prefill_inputs(ids: list[int], blocks: list[int], computed: int, seq_id: int = 0) -> dict:
    """vllm-neuron's prefill of a new request (its _process_new_request_for_continuous_batching_with_prefix_caching):
    `computed` positions hit in the cache, the slots of the rest padded with -1 to --max-model-len."""
    table = torch.zeros(1, SEQ // BS, dtype=torch.long)
    table[0, :len(blocks)] = torch.tensor(blocks)
    slots = torch.full((1, SEQ), -1)
    slots[0, :len(ids) - computed] = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(computed, len(ids))])
    return dict(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                seq_ids=torch.tensor([seq_id]), slot_mapping=slots, block_table=table,
                full_context_lens=torch.tensor([[len(ids)]]), computed_context_lens=torch.tensor([[computed]]))


def decode_inputs(tokens: list[int], positions: list[int], tables: list[list[int]]) -> dict:
    """vllm-neuron's decode step of len(tokens) running requests."""
    table = torch.zeros(len(tokens), SEQ // BS, dtype=torch.long)
    for r, blocks in enumerate(tables):
        table[r, :len(blocks)] = torch.tensor(blocks)
    pos = torch.tensor(positions)[:, None]
    slots = torch.tensor([[t[p // BS] * BS + p % BS] for t, p in zip(tables, positions)])
    return dict(input_ids=torch.tensor(tokens)[:, None], position_ids=pos, seq_ids=torch.arange(len(tokens)),
                slot_mapping=slots, block_table=table, full_context_lens=pos + 1, computed_context_lens=pos)


def blocks_for(prompt_len: int, first: list[int], fresh: list[int]) -> list[int]:
    """A table reading `first` (the cached blocks), then fresh blocks up to the prompt and its decode steps."""
    need = -(-(prompt_len + len(STEPS)) // BS)
    return first + fresh[:need - len(first)]


def _run_one(app, prompt, table, computed):
    logits = [app.forward(**prefill_inputs(prompt, table, computed)).logits.float()[0, -1]]
    for k, tok in enumerate(STEPS):
        logits.append(app.forward(**decode_inputs([tok], [len(prompt) + k], [table])).logits.float()[0, -1])
    return torch.stack(logits)


def warm_cold_job(rank, o, ps):
    """Per P: the prompt cold (fresh blocks, nothing cached); then A prefilled into other blocks and the prompt warm,
    reading A's first P // BS blocks. -> {P: (cold, warm)} logits [prefill + steps, V]."""
    app = backend.build(o, seq_len=SEQ, batch=BATCH)
    out = {}
    with torch.no_grad():
        for p in ps:
            prompt = A[:p] + TAIL
            cold = _run_one(app, prompt, blocks_for(len(prompt), [], [1, 2, 3, 4, 5, 6, 7]), 0)
            a_blocks = [8, 9, 10, 11, 12]
            app.forward(**prefill_inputs(A, a_blocks, 0))
            shared = a_blocks[:p // BS]
            fresh = [13, 14, 15, 16, 17, 18, 19]
            warm = _run_one(app, prompt, blocks_for(len(prompt), shared, fresh), len(shared) * BS)
            out[p] = cold, warm
    return out


@pytest.fixture(scope="module")
def ckpt(converted):
    return str(converted[("fp8", "fp8-blockwise")])


def _options(ckpt, **fields):
    return backend.prepare(cpu_options(model=ckpt, prefix_caching=True, block_size=BS, **fields), SEQ, BATCH)


@pytest.fixture(scope="module")
def tp2(ckpt):
    return backend.run(_options(ckpt, tp=2), warm_cold_job, PS)


@pytest.mark.parametrize("p", PS)
def test_a_warm_request_gives_the_cold_logits_bit_for_bit_in_float32_at_tp2(tp2, p):
    cold, warm = tp2[p]
    assert torch.equal(warm, cold), f"P={p}: max |diff| {(warm - cold).abs().max()}"
    assert not cold.isnan().any()


def test_a_warm_request_gives_the_cold_logits_bit_for_bit_in_bfloat16(ckpt):
    got = backend.run(_options(ckpt, dtype="bfloat16"), warm_cold_job, PS)
    for p, (cold, warm) in got.items():
        assert torch.equal(warm, cold), f"P={p}: max |diff| {(warm - cold).abs().max()}"


def _contiguous_job(rank, o, rows):
    app = backend.build(o, seq_len=SEQ, batch=1)
    return backend.teacher_forced_logits(app, rows, [len(rows[0]) - len(STEPS)])


def test_the_block_layout_gives_the_contiguous_caches_logits(ckpt, tp2):
    """NxDI's contiguous latent cache (no prefix caching), the same prompt and steps teacher-forced, at TP=2."""
    prompt = A[:PS[0]] + TAIL
    o = backend.prepare(cpu_options(model=ckpt, tp=2), SEQ, 1)
    want = backend.run(o, _contiguous_job, [prompt + STEPS])[0, len(prompt) - 1:len(prompt) + len(STEPS)]
    _, warm = tp2[PS[0]]
    assert rel_err(warm[:len(STEPS) + 1], want) < 1e-4


def sharing_job(rank, o):
    """A prefilled; B (A's first 48 positions, then its own) prefilled reading A's first 3 blocks: the pool before and
    after B's prefill; then A and B decoded together in one batch, and each alone."""
    app = backend.build(o, seq_len=SEQ, batch=BATCH)
    pool = app.context_encoding_model.model.kv_mgr.past_key_values  # K of layer i at 2i
    b = A[:48] + TAIL
    ta, tb = [1, 2, 3, 4, 5], [1, 2, 3, 6, 7]
    with torch.no_grad():
        app.forward(**prefill_inputs(A, ta, 0))
        before = [p.data.clone() for p in pool]
        app.forward(**prefill_inputs(b, tb, 48, seq_id=1))
        after = [p.data.clone() for p in pool]
        both = app.forward(**decode_inputs([9, 9], [len(A), len(b)], [ta, tb])).logits.float()[:, -1]
    alone = []
    for prompt, table in ((A, ta), (b, tb)):
        solo = backend.build(o, seq_len=SEQ, batch=BATCH)
        with torch.no_grad():
            solo.forward(**prefill_inputs(prompt, table, 0))
            alone.append(solo.forward(**decode_inputs([9], [len(prompt)], [table])).logits.float()[0, -1])
    return before, after, both, torch.stack(alone)


def test_shared_blocks_are_read_not_written_and_each_sequence_decodes_as_alone(ckpt):
    before, after, both, alone = backend.run(_options(ckpt), sharing_job)
    for layer, (k0, k1) in enumerate(zip(before[0::2], after[0::2])):
        assert torch.equal(k1[1:4], k0[1:4]), f"layer {layer}: a shared block was written"
        assert k1[6].abs().sum() > 0 and torch.equal(k1[4:6], k0[4:6])  # B's own blocks; A's tail untouched
    assert torch.equal(both, alone)


def chunk_job(rank, o):
    """A prompt of 90 positions cold, then one sharing A's first 48 warm: their prefill logits and a decode step's."""
    app = backend.build(o, seq_len=SEQ, batch=BATCH)
    calls = []
    app.context_encoding_model.model.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[-1]))
    prompt = A[:70] + TAIL
    with torch.no_grad():
        cold = _run_one(app, prompt, [1, 2, 3, 4, 5, 6, 7], 0)
        app.forward(**prefill_inputs(A, [8, 9, 10, 11, 12], 0))
        warm = _run_one(app, A[:48] + TAIL + TAIL, [8, 9, 10, 13, 14, 15, 16], 48)
    return cold, warm, calls


def test_chunks_through_the_block_table_give_the_one_call_logits_bit_for_bit(ckpt):
    got = backend.run(_options(ckpt, layout=Layout(prefill_chunk=32)), chunk_job)
    want = backend.run(_options(ckpt), chunk_job)
    assert got[2][:3] == [32, 32, 32] and want[2][0] == 128  # 90 positions: 3 calls of the 32-bucket; one of 128
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_planners_bucket_choice_is_nxdis(ckpt):
    """NxDI's ModelWrapper.get_target_2d_bucket_for_prefix_caching on the context-encoding wrapper (nothing loaded)."""
    o = _options(ckpt)
    app = backend.application(o, SEQ, BATCH)
    spec = dataclasses.replace(backend.request_spec(o, SEQ, BATCH), scheme=o.record.scheme)
    wrapper, seen = app.context_encoding_model, 0
    for computed in range(0, SEQ, BS):
        for new in (1, 5, 16, 17, 40, 64, 100):
            if computed + new > SEQ:
                continue
            args = [None] * 15
            args[13], args[14] = torch.tensor([[new]]), torch.tensor([[computed]])  # num_queries, computed lengths
            got = tuple(wrapper.get_target_2d_bucket_for_prefix_caching(*args).tolist())
            assert [got] == prefix_caching_calls(spec, computed, new), (computed, new)
            seen += 1
    assert seen > 40
