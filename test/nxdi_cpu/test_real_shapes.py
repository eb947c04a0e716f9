"""The recommended trn2 configuration at Kimi-K2's real per-rank shapes, through the real NxD/NxDI on CPU.

Which branch NxD takes depends on the shapes, and tiny configs are below every kernel's, so these tests use
checkpoints whose tensors are one TP=64 rank's exactly (testing/rank_slice.py: hidden 7168, one head, q_lora 1536,
latent 512 + 64, 384 experts of 32 columns, vocab 2560; one dense and two MoE layers; random weights stored as
Kimi-K2-Instruct-0905's FP8 and Kimi-K2-Thinking's INT4 are, converted to fp8-blockwise), with the real buckets: a
1024-token prefill and decode at batch 1 and 4.

- In NxD's device mode, on torch_xla's CPU device (what ModelBuilder traces), the prefill reaches nkilib's
  shard-on-block kernel entry. The kernel cannot run here (it needs a NeuronCore): a test stand-in records each
  call and computes NxD's torch path for one block, so the rest of the graph traces at real shapes. The recorded
  arguments then pass the kernel's own checks (its Python traced by nki_kernels: every assert and static bound),
  what Kimi needs of them and the block maps' values, and 20 mutations of them each fail; nki-library's torch
  reference on the first MoE layer's whole call equals the core's MoE, and 6 mutations of layout, scale, activation
  or expert leave that tolerance. Decode takes selective loading at batch 1 and 4 and traces clean.
- In NxD's CPU mode at TP=2 over gloo (a two-rank checkpoint, so each rank holds the TP=64 slice), the logits equal
  the core runner's, and NxD's functions are the traced ones but for the one documented CPU substitution: NxD runs
  its torch loop where trn2 runs the kernel.
- The sampler trn2 runs: on-device sampling over vocab-sharded logits at TP=2, NxD's distributed top-k over gloo,
  its nkilib kernels (top-k, cumsum) stopped at their entries, checked by their own code and stood in for by
  nki-library's references, picks the argmax of the gathered logits.

What still awaits trn2: the kernels on the device (scripts/check_kernels.py), neuronx-cc accepting the graphs (and
its instruction limits), HBM.
"""

from __future__ import annotations

import pytest
import torch
from nxdi_support import REPO, cpu_options, rel_err
import nki_kernels
from real_shapes import (NxdCalls, ShardOnBlockEntry, as_meta, core_routed_experts, device_sampler_greedy,
                         logits_and_calls, moe_difference, reference_output, shard_on_block_problems, split_call,
                         token_subset)

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.neuron import kernels, moe_paths
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
    app = backend.application(cpu_options(model=str(rank_slices[("fp8", 1)])), seq_len=PREFILL_TOKENS, batch=1)
    bmm = app.neuron_config.blockwise_matmul_config
    assert moe_paths.mode_of(bmm) == "shard-on-block"
    assert bmm.use_shard_on_block_dynamic_while is True and not bmm.use_shard_on_intermediate_dynamic_while
    assert bmm.block_sharding_strategy.name == "PING_PONG" and bmm.block_size == 128 and bmm.skip_dma_token


# -- traced as ModelBuilder traces, on torch_xla's CPU device, TP=1 ---------------------------------------------------

def _fill_prefix_torch_branch(cache, prefix_cache):
    """NxDI's fill_prefix in device mode calls torch_neuronx's binary-only xla_hlo_call; its CPU-mode branch is the
    same update in torch (test_xla_trace.py's torch_fill_prefix fixture says more)."""
    from neuronx_distributed_inference.modules.kvcache import utils

    with backend.nxd_cpu_mode(True):
        return utils.fill_prefix(cache, prefix_cache)


def _trace(rank_slices, submodel, batch, seq_len):
    """(TraceReport, NxdCalls, ShardOnBlockEntry) of one submodel traced at TP=1 on the one-rank slice."""
    from neuronx_distributed.modules.moe import blockwise
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
    from neuronx_distributed_inference.modules.kvcache import kv_cache_manager

    o = cpu_options(model=str(rank_slices[("fp8", 1)]), dtype="bfloat16")
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


@pytest.fixture(scope="module")
def core_moe(rank_slices, prefill_calls):
    """The core's routed experts of the first traced call's MoE layer (real_shapes.core_routed_experts)."""
    return core_routed_experts(rank_slices[("fp8", 1)], prefill_calls[0][1])


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
    # what the planner counts NxD dequantizing per MoE layer and call is these two bf16 tensors (kernels.py)
    traffic = kernels.dequantize_traffic(moe_cfg, ConversionRecord.of(moe_cfg).scheme, 1)
    dequantized = [prefill_calls[0][2][k] for k in ("gate_up_proj_weight", "down_proj_weight")]
    assert traffic.bf16_written == sum(t.numel() * t.element_size() for t in dequantized)


# The tolerance of nki-library's reference against the model's float32 math on the same call: NxD hands the kernel
# bf16 experts (dequantized from FP8, rounded: 2^-9 relative) and bf16 affinities, and the reference rounds each
# block's output to bf16 before adding it up (moe_cte_torch.py), against float32 weights in the core. Measured at
# these shapes: ~5e-3 max, ~4e-3 RMS, relative; a wrong layout, scale or expert is O(1).
MOE_TOLERANCE = {"max_rel": 2e-2, "rms_rel": 1e-2}


def test_the_prefill_kernel_computes_the_models_moe_for_the_whole_call(prefill_calls, moe_cfg, core_moe):
    """The first MoE layer's call, all 1024 tokens and 445 blocks: nki-library's reference of bwmm_shard_on_block on
    exactly NxD's arguments (its layouts, skip mode, padding rows, block maps, affinities) equals the core's MoE (the
    noaux_tc router, top-8 of 384 experts, normalised and scaled by 2.827, then each token through its SwiGLU
    experts) on the same hidden states, within MOE_TOLERANCE."""
    grid, layer, kw = prefill_calls[0]
    moe = core_moe
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


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _nki_enum(name: str, member: str):
    """A member of nki-library's own enum (d2ad3a5), for values the shim's copy lacks (PRE_SCALE_DELAYED)."""
    return getattr(nki_kernels.module("core.utils.common_types"), name)[member]


def _shim(name: str):
    """The classes NxD passes the kernel, from the nkilib it imports (the shim here, the SDK's on trn2)."""
    from nkilib.core.moe.moe_cte import moe_cte_utils
    from nkilib.core.utils import common_types

    return getattr(moe_cte_utils, name, None) or getattr(common_types, name)


def _tokens(kw: dict, tokens: int, cfg) -> dict:
    """The call for a prefill of `tokens` rows, consistent in every other way (NxD's block count for them)."""
    blocks = moe_paths.blockwise_blocks(cfg, tokens, 1, kw["block_size"])
    return {**kw, "hidden_states": _meta(tokens, cfg.hidden_size),
            "expert_affinities_masked": _meta(tokens * cfg.n_routed_experts, 1),
            "token_position_to_id": _meta(blocks * kw["block_size"], dtype=torch.int32),
            "block_to_expert": _meta(blocks, dtype=torch.int32)}


def _set_value(name: str, value):
    """Sets the first routed row's (or the last block's) entry of `name` to value(cfg)."""
    def mutate(kw, cfg):
        t = kw[name].clone()
        t[(t >= 0).nonzero()[0, 0] if name == "token_position_to_id" else -1] = value(cfg)
        return {**kw, name: t}
    return mutate


# Each argument NxD could get wrong, and what must catch it: the kernel's own assert ("kernel"), its static bounds
# ("bounds"), Kimi's intent (SHARD_ON_BLOCK_INTENT, "intent"), or the block maps' values ("values").
MUTATIONS = {
    "expert_affinities_scaling_mode=PRE_SCALE_DELAYED": ("kernel", lambda kw, cfg: {
        **kw, "expert_affinities_scaling_mode": _nki_enum("ExpertAffinityScaleMode", "PRE_SCALE_DELAYED")}),
    "expert_affinities_scaling_mode=PRE_SCALE": ("intent", lambda kw, cfg: {
        **kw, "expert_affinities_scaling_mode": _shim("ExpertAffinityScaleMode").PRE_SCALE}),
    "compute_dtype=float32": ("intent", lambda kw, cfg: {**kw, "compute_dtype": "float32"}),
    "compute_dtype=torch.bfloat16 (not an NKI dtype)": ("kernel", lambda kw, cfg: {
        **kw, "compute_dtype": torch.bfloat16}),
    "skip_dma.skip_weight": ("intent", lambda kw, cfg: {**kw, "skip_dma": _shim("SkipMode")(True, True)}),
    "skip_dma.skip_token off": ("intent", lambda kw, cfg: {**kw, "skip_dma": _shim("SkipMode")(False, False)}),
    "n_block_per_iter=2": ("intent", lambda kw, cfg: {**kw, "n_block_per_iter": 2}),
    "T % 128 != 0 (1000 tokens)": ("bounds", lambda kw, cfg: _tokens(kw, 1000, cfg)),
    "block_sharding_strategy=HI_LO": ("kernel", lambda kw, cfg: {
        **kw, "block_sharding_strategy": _shim("BlockShardStrategy").HI_LO}),
    "gate_up_proj_weight 3-D [E, H, 2I]": ("kernel", lambda kw, cfg: {
        **kw, "gate_up_proj_weight": _meta(cfg.n_routed_experts, cfg.hidden_size, 2 * cfg.moe_intermediate_size)}),
    "I % 16 != 0 (24 columns)": ("kernel", lambda kw, cfg: {
        **kw, "gate_up_proj_weight": _meta(cfg.n_routed_experts, cfg.hidden_size, 2, 24),
        "down_proj_weight": _meta(cfg.n_routed_experts, 24, cfg.hidden_size)}),
    "is_tensor_update_accumulating=False": ("intent", lambda kw, cfg: {**kw, "is_tensor_update_accumulating": False}),
    "activation_function=GELU": ("intent", lambda kw, cfg: {**kw, "activation_function": _shim("ActFnType").GELU}),
    "block_size=256": ("intent", lambda kw, cfg: {**kw, "block_size": 256}),
    "FP8 scales passed": ("intent", lambda kw, cfg: {
        **kw, "gate_up_proj_scale": _meta(cfg.n_routed_experts, 1, 2 * cfg.moe_intermediate_size, dtype=torch.float32),
        "down_proj_scale": _meta(cfg.n_routed_experts, 1, cfg.hidden_size, dtype=torch.float32)}),
    "hidden_states float32": ("intent", lambda kw, cfg: {
        **kw, "hidden_states": _meta(PREFILL_TOKENS, cfg.hidden_size, dtype=torch.float32)}),
    "hidden_states with a padding row": ("intent", lambda kw, cfg: {
        **kw, "hidden_states": _meta(PREFILL_TOKENS + 1, cfg.hidden_size)}),
    "block_to_expert names expert E": ("values", _set_value("block_to_expert", lambda cfg: cfg.n_routed_experts)),
    "token_position_to_id names token T": ("values", _set_value("token_position_to_id", lambda cfg: PREFILL_TOKENS)),
    "a routed row dropped (-1)": ("values", _set_value("token_position_to_id", lambda cfg: -1)),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_wrong_argument_fails_the_check(prefill_calls, moe_cfg, name):
    """The second MoE layer's call (its tensors as shapes, its block maps and affinities with their values), one
    argument changed: the check names it, from the kernel's own code where the kernel asserts it."""
    caught_by, mutate = MUTATIONS[name]
    grid, _, kw = prefill_calls[-1]
    kw = mutate(kw, moe_cfg)
    tokens = kw["hidden_states"].shape[0] if caught_by == "bounds" else PREFILL_TOKENS
    blocks = moe_paths.blockwise_blocks(moe_cfg, tokens, 1, 128)
    problems = shard_on_block_problems(kw, moe_cfg, tokens, blocks, grid)
    assert problems, name
    if caught_by in ("kernel", "bounds"):  # by nki-library's own code, cited by file:line
        assert any("moe_cte/bwmm_shard_on_block.py:" in p for p in problems), problems
    print(f"\n{name}: {problems[0]}")


# What the whole-call comparison catches that no assert does, each on the same 4 tokens' share of the real call (their
# ~32 blocks: the reference costs ~0.1 s a block): the mutated reference leaves MOE_TOLERANCE, the true one stays in.
NUMERIC_MUTATIONS = {
    "gate and up halves swapped": lambda kw, cfg: {**kw, "gate_up_proj_weight": kw["gate_up_proj_weight"].flip(2)},
    "PRE_SCALE (affinity on the input)": lambda kw, cfg: {
        **kw, "expert_affinities_scaling_mode": _shim("ExpertAffinityScaleMode").PRE_SCALE},
    "affinities without the 2.827 routed scale": lambda kw, cfg: {
        **kw, "expert_affinities_masked": (kw["expert_affinities_masked"].float() / cfg.routed_scaling_factor
                                           ).to(torch.bfloat16)},
    "GELU for SiLU": lambda kw, cfg: {**kw, "activation_function": _shim("ActFnType").GELU},
    "affinities as [E, T]": lambda kw, cfg: {
        **kw, "expert_affinities_masked": kw["expert_affinities_masked"].view(-1, cfg.n_routed_experts).t()
        .reshape(-1, 1)},
    "each block one expert off": lambda kw, cfg: {
        **kw, "block_to_expert": ((kw["block_to_expert"] + 1) % cfg.n_routed_experts).to(torch.int32)},
}


def test_a_wrong_layout_scale_or_expert_fails_the_comparison(prefill_calls, moe_cfg, core_moe):
    grid, _, kw = prefill_calls[0]
    sub = token_subset(kw, [0, 1, 511, 1023])
    with torch.no_grad():
        want = core_moe(sub["hidden_states"].float())
    assert len(sub["block_to_expert"]) <= 4 * moe_cfg.num_experts_per_tok
    diff = moe_difference(reference_output(sub, moe_cfg, grid)[:, 0], want)
    assert diff["max_rel"] < MOE_TOLERANCE["max_rel"], diff  # the true call's share passes
    for name, mutate in NUMERIC_MUTATIONS.items():
        diff = moe_difference(reference_output(mutate(sub, moe_cfg), moe_cfg, grid)[:, 0], want)
        print(f"\n{name}: {diff}")
        assert diff["max_rel"] > 5 * MOE_TOLERANCE["max_rel"], (name, diff)


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


def test_tp2_all_experts_decode_at_real_shapes_equals_the_core_runner(rank_slices):
    """--moe-decode all-experts (what the planner's model picks at batch 35-42 where NxD's threshold takes selective
    loading: docs/planner.md): the shell's KimiExpertMLPs calls NxD's forward_all_experts at token generation, every
    one of a rank's 384 experts of 32 columns for the 4 tokens of a step, whose [384, 4, 7168] output is summed at
    the zero affinities too; the logits equal the core runner's as the selective path's do."""
    ckpt = rank_slices[("fp8", 2)]
    cfg = KimiK2Config.from_file(ckpt)
    batch, length = 4, 128
    rows = _rows(batch, length, cfg.vocab_size)
    prefill = length - 3
    o = cpu_options(model=str(ckpt), tp=2, moe_decode="all-experts")
    got, report, calls, _ = backend.run(backend.prepare(o, length, batch), logits_and_calls, rows, prefill)
    want = CpuRunner(ckpt, dtype=torch.float32).logits(rows, prefill)
    assert rel_err(got, want) < 1e-4
    assert "token_generation_model: all-experts" in report
    assert "ExpertMLPsV2.forward_all_experts" in calls and "ExpertMLPsV2.forward_selective_loading" not in calls


@pytest.mark.parametrize("source,batch,length", CASES, ids=[f"{s}-batch{b}" for s, b, _ in CASES])
def test_tp2_at_real_shapes_equals_the_core_runner(rank_slices, traces, source, batch, length):
    ckpt = rank_slices[(source, 2)]
    cfg = KimiK2Config.from_file(ckpt)
    rows = _rows(batch, length, cfg.vocab_size)
    prefill = length - 3
    o = cpu_options(model=str(ckpt), tp=2)
    # the trn2 NeuronConfig's mode, not a CPU one
    assert backend.request_spec(o, length, batch).prefill_mode(cfg) == "shard-on-block"
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
    """On-device greedy sampling with the trn2 settings at TP=2: lm_head keeps the vocabulary sharded (2,560 columns
    per rank of the two-rank slice, as a TP=64 rank's), and NxDI's dynamic Sampler takes its multinomial
    path for every request (sampling.py:461-464): NxD's distributed top-k of global_topk 256 (nkilib's rotated top-k
    on each shard, the gathers over gloo here, then a sorted top-k of the gathered candidates), then nkilib's cumsum
    (top-p, then the draw). Those kernels are stopped at their entries (real_shapes.SamplerKernels): their own checks
    pass on NxD's arguments and nki-library's references stand in for them; the sampled token is the argmax of the
    logits NxDI gathers for output_logits. The cascaded-max kernel (NxD's distributed argmax) is never reached: only
    a static greedy sampler calls it (sampling.py:466)."""
    ckpt = rank_slices[("fp8", 2)]
    vocab = KimiK2Config.from_file(ckpt).vocab_size
    rows = _rows(2, 16, vocab)
    steps = 2
    o = backend.prepare(cpu_options(model=str(ckpt), tp=2), 16 + steps, 2)
    got, gathered_in_lm_head, sampler, kernels = backend.run(o, device_sampler_greedy, rows, steps)
    assert gathered_in_lm_head is False and sampler == "Sampler"
    assert len(got) == steps + 1
    for tokens, logits in got:
        assert tokens.tolist() == logits.argmax(-1).tolist()
    # per sampling call (a prefill, then each step): the shard's top-256, the gathered top-256, two cumsums
    shard = vocab // 2
    assert shard == 163840 // TP_REAL  # a TP=64 rank's shard exactly
    want = [("topk", (2, shard), 256, False), ("topk", (2, 2 * 256), 256, True), ("cumsum", (2, 256), None, None),
            ("cumsum", (2, 256), None, None)] * (steps + 1)
    assert [(c["kernel"], c["shape"], c.get("k"), c.get("sorted_flag")) for c in kernels] == want
    assert {c["dtype"] for c in kernels} == {"float32"}  # NxDI samples float32 logits (model_base.py:988)
    assert all(c["grid"] == 2 for c in kernels if c["kernel"] == "topk")  # LNC=2
    assert [c["problems"] for c in kernels] == [[]] * len(kernels)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_the_sampler_kernels_pass_their_own_checks_at_tp64_shapes(batch):
    """What NxD passes the sampler's kernels on one TP=64 rank of Kimi-K2 (vocab 163,840: 2,560 per rank; global_topk
    256; float32 logits), at the batches the README's configurations compile (1, 4 for vLLM, 16 for long context):
    each kernel's own checks pass, traced for its grid. The shapes are the TP=2 run's (test above) with 64 ranks
    gathering 64 x 256 candidates."""
    real = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    k, f32 = 256, torch.float32
    calls = {"shard top-k": ("topk", {"k": k, "sorted_flag": False}, 2, (batch, real.vocab_size // TP_REAL)),
             "gathered top-k": ("topk", {"k": k, "sorted_flag": True}, 2, (batch, TP_REAL * k)),
             "cumsum": ("cumsum", {"axis": 1}, None, (batch, k))}
    for what, (kernel, kw, grid, shape) in calls.items():
        x = torch.empty(shape, dtype=f32, device="meta")
        args = ((), {**kw, "x": x}) if kernel == "cumsum" else ((x,), kw)
        assert nki_kernels.kernel_problems(kernel, args[1], grid=grid, args=args[0]) == [], what
