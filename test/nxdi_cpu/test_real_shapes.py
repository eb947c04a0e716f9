"""The recommended trn2 configuration at Kimi-K2's real per-rank shapes, through the real NxD/NxDI on CPU.

Which branch NxD takes depends on the shapes, and tiny configs are below every kernel's, so these tests use
checkpoints whose tensors are one TP=64 rank's exactly (testing/rank_slice.py: hidden 7168, one head, q_lora 1536,
latent 512 + 64, 384 experts of 32 columns, vocab 2560; one dense and two MoE layers; random weights stored as
Kimi-K2-Instruct-0905's FP8 and Kimi-K2-Thinking's INT4 are, converted to fp8-blockwise), with the real buckets: a
1024-token prefill and decode at batch 1 and 4.

- In NxD's device mode, on torch_xla's CPU device (what ModelBuilder traces), the prefill reaches nkilib's
  shard-on-block kernel entry with arguments that match the kernel's signature and asserts. The kernel cannot run
  here (it needs a NeuronCore): a test stand-in records the call and computes NxD's torch path for one block, so the
  rest of the graph traces at real shapes. Decode takes selective loading at batch 1 and 4 and traces clean.
- In NxD's CPU mode at TP=2 over gloo (a two-rank checkpoint, so each rank holds the TP=64 slice), the logits equal
  the core runner's, and NxD's functions are the traced ones but for the one documented CPU substitution: NxD runs
  its torch loop where trn2 runs the kernel.
- The sampler trn2 runs: on-device greedy sampling over vocab-sharded logits at TP=2, NxD's distributed argmax
  over gloo (its two device-only ops replaced by torch in the test process), picks the argmax of the gathered logits.

What still awaits trn2: the kernel's numerics, neuronx-cc accepting the graphs (and its instruction limits), HBM.
"""

from __future__ import annotations

import os

import pytest
import torch
from nxdi_support import REPO, rel_err
from real_shapes import (NxdCalls, ShardOnBlockEntry, as_meta, core_routed_experts, device_sampler_greedy,
                         logits_and_calls, moe_difference, reference_output, shard_on_block_problems, split_call)

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron import moe_paths
from kimi_k2_neuron.nxdi_cpu import backend, xla_trace
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.testing.rank_slice import make_rank_slice

CONFIGS = REPO / "test/data/configs"
TP_REAL = 64
PREFILL_TOKENS = 1024  # the real prefill bucket
pytestmark = pytest.mark.fp8_selective_cpu

xla_trace.sync_log()  # torch_xla latches its debug settings at its first execution (test_xla_trace.py says why)


@pytest.fixture(scope="session")
def rank_slices(tmp_path_factory):
    """(source format, ranks) -> a converted fp8-blockwise checkpoint of `ranks` TP=64 ranks' shapes."""
    from kimi_k2_neuron.convert import convert

    root = tmp_path_factory.mktemp("rank-slices")
    out = {}
    for source, config, ranks in (("fp8", "kimi-k2-instruct-0905.json", 2), ("int4", "kimi-k2-thinking.json", 2),
                                  ("fp8", "kimi-k2-instruct-0905.json", 1)):
        raw = make_rank_slice(root / f"{source}-{ranks}", CONFIGS / config, TP_REAL, ranks)
        out[(source, ranks)] = root / f"{source}-{ranks}-blockwise"
        convert(raw, out[(source, ranks)], "fp8-blockwise", progress=False)
    return out


def test_the_rank_slice_is_one_real_rank(rank_slices):
    """Per rank at TP=2 (and whole at TP=1), every split tensor is Kimi-K2's TP=64 slice; what NxD keeps whole per rank
    keeps its real size."""
    real = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    for ranks in (1, 2):
        c = KimiK2Config.from_file(rank_slices[("fp8", ranks)])
        assert c.num_attention_heads // ranks == real.num_attention_heads // TP_REAL == 1
        assert c.moe_intermediate_size // ranks == real.moe_intermediate_size // TP_REAL == 32
        assert c.intermediate_size // ranks == real.intermediate_size // TP_REAL
        assert c.vocab_size // ranks == real.vocab_size // TP_REAL
        assert (c.hidden_size, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.n_routed_experts,
                c.num_experts_per_tok) == (real.hidden_size, real.q_lora_rank, real.kv_lora_rank,
                                           real.qk_rope_head_dim, real.n_routed_experts, real.num_experts_per_tok)
        assert (c.num_hidden_layers, c.first_k_dense_replace) == (3, 1)


def test_the_recommended_mode_is_nxds_shard_on_block_kernel_config(rank_slices):
    """The CPU harness builds the trn2 NeuronConfig at these shapes, and NxD parses its blockwise keys into the flags
    that select the shard-on-block kernel (NxD's from_kwargs drops a key it does not know without a word)."""
    app = backend.application(backend.CpuOptions(model=str(rank_slices[("fp8", 1)])), seq_len=PREFILL_TOKENS, batch=1)
    bmm = app.neuron_config.blockwise_matmul_config
    assert moe_paths.mode_of(bmm) == "shard-on-block"
    assert bmm.use_shard_on_block_dynamic_while is True and not bmm.use_shard_on_intermediate_dynamic_while
    assert bmm.block_sharding_strategy.name == "PING_PONG" and bmm.block_size == 128 and bmm.skip_dma_token


# -- traced as ModelBuilder traces, on torch_xla's CPU device, TP=1 ---------------------------------------------------

def _fill_prefix_torch_branch(cache, prefix_cache):
    """NxDI's fill_prefix in device mode calls torch_neuronx's binary-only xla_hlo_call; its CPU-mode branch is the
    same update in torch (test_xla_trace.py's torch_fill_prefix fixture says more)."""
    from neuronx_distributed_inference.modules.kvcache import utils

    previous = os.environ.get("NXD_CPU_MODE")
    os.environ["NXD_CPU_MODE"] = "1"
    try:
        return utils.fill_prefix(cache, prefix_cache)
    finally:
        os.environ["NXD_CPU_MODE"] = previous if previous is not None else "0"


def _trace(rank_slices, submodel, batch, seq_len):
    """(TraceReport, NxdCalls, ShardOnBlockEntry) of one submodel traced at TP=1 on the one-rank slice."""
    from neuronx_distributed.modules.moe import blockwise
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed_inference.modules.kvcache import kv_cache_manager

    o = backend.CpuOptions(model=str(rank_slices[("fp8", 1)]), dtype="bfloat16")
    p = xla_trace.prepare(xla_trace.TraceOptions(o, submodel, seq_len=seq_len, batch=batch))
    experts = {m: _layer_of(name) for name, m in p.model.named_modules() if isinstance(m, ExpertMLPsV2)}
    kernel = ShardOnBlockEntry(NxdCalls(), experts)
    handles = [m.register_forward_pre_hook(kernel.hook) for m in experts]
    handles += kernel.spy.watch(p.model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache_manager, "fill_prefix", _fill_prefix_torch_branch)
        mp.setattr(blockwise, "_bwmm_shard_on_block_nki_call", kernel)
        with kernel.spy:
            report = xla_trace.run(p)
    for h in handles:
        h.remove()
    return report, kernel.spy, kernel


def _layer_of(module_name: str) -> int:
    parts = module_name.split(".")
    return int(parts[parts.index("layers") + 1])


class _Traces(dict):
    """The prefill (1024 tokens, batch 1) and decode (batch 1 and 4) submodels traced as ModelBuilder traces them,
    each on first use."""

    SUBMODELS = {"context": ("context", 1, PREFILL_TOKENS), "token1": ("token", 1, 256), "token4": ("token", 4, 256)}

    def __init__(self, rank_slices):
        super().__init__()
        self.rank_slices = rank_slices

    def __missing__(self, key):
        self[key] = _trace(self.rank_slices, *self.SUBMODELS[key])
        return self[key]


@pytest.fixture(scope="module")
def traces(rank_slices):
    return _Traces(rank_slices)


@pytest.fixture(scope="module")
def prefill_calls(traces):
    """The traced prefill's bwmm_shard_on_block calls on the host, one per MoE layer: (grid, layer, kwargs); the
    first whole, the others with their large tensors as meta tensors (shape and dtype; see as_meta)."""
    calls = [split_call(c) for c in traces["context"][2].cpu_calls()]
    return [calls[0]] + [(g, layer, as_meta(kw)) for g, layer, kw in calls[1:]]


@pytest.fixture(scope="module")
def moe_cfg(rank_slices):
    return KimiK2Config.from_file(rank_slices[("fp8", 1)])


def test_the_prefill_reaches_the_shard_on_block_kernel_with_its_arguments(traces, prefill_calls, moe_cfg):
    report, spy, kernel = traces["context"]
    assert report.stopped is None and report.clean, report.format()
    print(f"\nprefill graph at real per-rank shapes: {report.hlo_instructions} HLO instructions")
    # NxD's own choice, in device mode: the blockwise path, the kernel eligible, the shard-on-block entry
    assert spy.returned["can_use_blockwise_matmul_nki"] is True
    order = [c for c in spy.calls if c in ("ExpertMLPsV2.forward_blockwise", "BlockwiseMatmulNKIFunc.forward",
                                           "_call_bwmm_shard_on_block_kernel")]
    assert order == ["ExpertMLPsV2.forward_blockwise", "BlockwiseMatmulNKIFunc.forward",
                     "_call_bwmm_shard_on_block_kernel"]
    never = {"_call_shard_hidden_kernel", "_call_shard_on_intermediate_kernel",
             "ExpertMLPsV2.torch_blockwise_matmul_inference", "ExpertMLPsV2.forward_all_experts",
             "ExpertMLPsV2.forward_selective_loading"}
    assert never & set(spy.calls) == set()
    assert "blockwise_scale_dequantize" in spy.calls  # NxD dequantizes the FP8 experts before the kernel
    # One call per MoE layer, each passing the kernel's own checks (traced for both programs of the LNC=2 grid) and
    # what Kimi's prefill needs: T = 1024, N = ceil((1024 x 8 - 383) / 128) + 383 = 445 blocks of 128, block maps
    # placing each routed (token, expert) pair once.
    blocks = moe_paths.blockwise_blocks(moe_cfg, PREFILL_TOKENS, 1, 128)
    assert blocks == 445 and [layer for _, layer, _ in prefill_calls] == [1, 2]
    for grid, _, kw in prefill_calls:
        assert grid == 2  # LNC=2: one kernel instance per physical core
        assert shard_on_block_problems(kw, moe_cfg, PREFILL_TOKENS, blocks) == []


# The tolerance of nki-library's reference against the model's float32 math on the same call: NxD hands the kernel
# bf16 experts (dequantized from FP8, rounded: 2^-9 relative) and bf16 affinities, and the reference rounds each
# block's output to bf16 before adding it up (moe_cte_torch.py), against float32 weights in the core. Measured at
# these shapes: ~5e-3 max, ~4e-3 RMS, relative; a wrong layout, scale or expert is O(1).
MOE_TOLERANCE = {"max_rel": 2e-2, "rms_rel": 1e-2}


def test_the_prefill_kernel_computes_the_models_moe_for_the_whole_call(rank_slices, prefill_calls, moe_cfg):
    """The first MoE layer's call, all 1024 tokens and 445 blocks: nki-library's reference of bwmm_shard_on_block on
    exactly NxD's arguments (its layouts, skip mode, padding rows, block maps, affinities) equals the core's MoE (the
    noaux_tc router, top-8 of 384 experts, normalised and scaled by 2.827, then each token through its SwiGLU
    experts) on the same hidden states, within MOE_TOLERANCE."""
    grid, layer, kw = prefill_calls[0]
    moe = core_routed_experts(rank_slices[("fp8", 1)], layer)
    x = kw["hidden_states"].float()
    with torch.no_grad():
        weights, ids = moe.gate(x)
        want = moe(x)
    # the affinities NxD hands the kernel are the router's: the same experts, the same weights (bf16)
    routed = torch.zeros(x.shape[0], moe_cfg.n_routed_experts).scatter(1, ids, weights)
    given = kw["expert_affinities_masked"].view(x.shape[0], -1).float()
    assert torch.equal(given != 0, routed != 0)
    assert (given - routed).abs().max() <= 2 ** -8 * routed.abs().max()
    got = reference_output(kw, moe_cfg, grid)
    assert got.shape == (PREFILL_TOKENS, 2, moe_cfg.hidden_size) and not got[:, 1].any()  # the second core's half
    diff = moe_difference(got[:, 0], want)
    print(f"\nnki-library reference vs the core's MoE, layer {layer}, {PREFILL_TOKENS} tokens: {diff}")
    assert diff["max_rel"] < MOE_TOLERANCE["max_rel"] and diff["rms_rel"] < MOE_TOLERANCE["rms_rel"], diff


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_at_real_shapes_takes_selective_loading_in_one_clean_graph(traces, batch):
    """batch x top-8 < 384 experts: selective loading, at batch 1 and 4; the graph is one compile with no host sync,
    and computes what NxDI computes eagerly (bf16: argmax flips only in near ties, as test_xla_trace.py says)."""
    report, spy, kernel = traces[f"token{batch}"]
    assert report.stopped is None and report.clean, report.format()
    print(f"\ndecode graph at real per-rank shapes, batch {batch}: {report.hlo_instructions} HLO instructions")
    assert report.max_rel_diff_vs_eager < 2e-2, report.rel_diff_vs_eager
    for m in report.argmax_mismatches:
        assert m["eager_margin"] <= 2 * report.max_abs_logit_diff, report.format()
    assert "ExpertMLPsV2.forward_selective_loading" in spy.calls and not kernel.calls
    assert {"ExpertMLPsV2.forward_all_experts", "ExpertMLPsV2.forward_blockwise"} & set(spy.calls) == set()


# -- NxD's CPU mode at TP=2 over gloo ---------------------------------------------------------------------------------

def _rows(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


# (source, batch, row length): one prefill call of batch x length = 1024 tokens, then 3 decode steps
CASES = [("fp8", 1, PREFILL_TOKENS), ("fp8", 4, PREFILL_TOKENS // 4), ("int4", 1, PREFILL_TOKENS)]


@pytest.mark.parametrize("source,batch,length", CASES, ids=[f"{s}-batch{b}" for s, b, _ in CASES])
def test_tp2_at_real_shapes_equals_the_core_runner(rank_slices, traces, source, batch, length):
    ckpt = rank_slices[(source, 2)]
    cfg = KimiK2Config.from_file(ckpt)
    rows = _rows(batch, length, cfg.vocab_size)
    prefill = length - 3
    o = backend.CpuOptions(model=str(ckpt), tp=2)
    assert backend.prefill_mode(cfg, o, batch * length) == "shard-on-block"  # the trn2 NeuronConfig, not a CPU one
    got, report, calls, returned = backend.run(backend.prepare(o, length, batch), logits_and_calls, rows, prefill)
    want = CpuRunner(ckpt, dtype=torch.float32).logits(rows, prefill)
    assert rel_err(got, want) < 1e-4
    assert "context_encoding_model: blockwise (NxD's torch loop here; on trn2 nkilib's bwmm_shard_on_block" in report
    assert "token_generation_model: selective" in report
    # The functions NxD ran are the traced (trn2) ones but for one substitution: on a CPU device NxD's kernel check
    # says no and its torch loop runs where the kernel entry is.
    assert returned["can_use_blockwise_matmul_nki"] is False
    cpu_only = {"ExpertMLPsV2.torch_blockwise_matmul_inference"}
    device_only = {"BlockwiseMatmulNKIFunc.forward", "_call_bwmm_shard_on_block_kernel", "get_data",
                   "_call_bwmm_shard_on_block_kernel.<locals>.<lambda>", "torch_to_nki_dtype",
                   "check_kernel_availability", "check_blockwise_mm_kernel_compatibility",
                   "get_kernel_activation_func_id"}
    traced = set(traces["context"][1].calls) | set(traces[f"token{batch}"][1].calls)
    assert set(calls) - cpu_only == traced - device_only, (sorted(set(calls) - traced), sorted(traced - set(calls)))


def test_the_sampler_trn2_runs_picks_the_argmax_of_the_gathered_logits_at_tp2(rank_slices):
    """On-device greedy sampling with the trn2 settings at TP=2: lm_head keeps the vocabulary sharded (1280 columns
    per rank of the two-rank slice, 2560 being a TP=64 rank's), NxDI's Sampler calls NxD's distributed argmax,
    whose gathers run over gloo here; the sampled token is the argmax of the logits NxDI gathers for output_logits."""
    ckpt = rank_slices[("fp8", 2)]
    rows = _rows(2, 16, KimiK2Config.from_file(ckpt).vocab_size)
    steps = 2
    o = backend.prepare(backend.CpuOptions(model=str(ckpt), tp=2), 16 + steps, 2)
    got, gathered_in_lm_head, sampler = backend.run(o, device_sampler_greedy, rows, steps)
    assert gathered_in_lm_head is False and sampler == "Sampler"
    assert len(got) == steps + 1
    for tokens, logits in got:
        assert tokens.tolist() == logits.argmax(-1).tolist()
