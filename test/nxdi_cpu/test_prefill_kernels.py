"""The prefill kernels' work at Kimi-K2's per-rank shapes as neuron/kernels.py counts it (for the planner's time model)
against the kernels' own loops, traced by nki_kernels at the arguments NxD passes them; and the trn2 kernel-check
script's CPU dry mode (scripts/check_kernels.py --dry-run: nki-library's references, the MoE one computed from the
arguments NxD's own kernel wrapper passes, against the model's math).

Kimi-K2 at TP=64: 1024 prefill tokens x top-8 = 8,192 routed rows per MoE layer; EP=1 gives each rank all 384 experts
of 32 columns (shard-on-block), EP=16 or 64 gives it 24 experts of 512 or 6 of 2,048 columns (shard-on-intermediate,
which needs a multiple of 256 columns: moe_paths)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from nki_kernels import counting, kernel_problems
from nxdi_support import REPO

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron import kernels, moe_paths

REAL = KimiK2Config.from_file(REPO / "test/data/configs/kimi-k2-instruct-0905.json")
TP, TOKENS = 64, 1024


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _enums():
    from nkilib.core.moe.moe_cte.moe_cte_utils import BlockShardStrategy, SkipMode
    from nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

    return SkipMode, BlockShardStrategy, ActFnType, ExpertAffinityScaleMode


def test_shard_on_block_computes_every_block_nxd_counts():
    """bwmm_shard_on_block traced at the EP=1 call (as test_real_shapes records it): each of NxD's 445 blocks loads its
    expert's gate/up weights once (load_gate_up_proj_weights, the per-block step), PING_PONG over the two cores."""
    skip, strategy, act, scale = _enums()
    work = kernels.prefill_work(REAL, "shard-on-block", TOKENS, TP)
    e, i, h, b = REAL.n_routed_experts, moe_paths.local_intermediate(REAL, TP, 1), REAL.hidden_size, work.block_size
    kw = dict(hidden_states=_meta(TOKENS, h), expert_affinities_masked=_meta(TOKENS * e, 1),
              gate_up_proj_weight=_meta(e, h, 2, i), down_proj_weight=_meta(e, i, h), block_size=b,
              token_position_to_id=_meta(work.blocks * b, dtype=torch.int32),
              block_to_expert=_meta(work.blocks, dtype=torch.int32), skip_dma=skip(True, False),
              is_tensor_update_accumulating=True, expert_affinities_scaling_mode=scale.POST_SCALE,
              block_sharding_strategy=strategy.PING_PONG, compute_dtype="bfloat16", activation_function=act.SiLU)
    with counting("bwmm_shard_on_block", "load_gate_up_proj_weights") as per_core:
        assert kernel_problems("bwmm_shard_on_block", kw, grid=2) == []
    assert work.blocks == 445 and sum(per_core) == work.blocks and max(per_core) == work.blocks_per_core == 223
    assert work.padded_rows == 56960 and work.routed_rows == 8192 and work.columns_per_core == 32


def _balanced_routing(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Token t's experts (t * top_k + j) mod E: every expert gets tokens x top_k / E rows, give or take one."""
    return (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None]) % experts


def _nonpadded_blocks(ep: int, block: int, blocks: int) -> int:
    """NxD's own count of the blocks holding a row, on EP rank 0, for the balanced routing: its token-to-block mapping
    (ExpertMLPsV2.get_blockwise_expert_and_token_mapping, EP's local mask) and sum(get_block_conditions)."""
    from types import SimpleNamespace

    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    e_local = REAL.n_routed_experts // ep
    ids = _balanced_routing(TOKENS, REAL.num_experts_per_tok, REAL.n_routed_experts)
    mask = torch.zeros(TOKENS, REAL.n_routed_experts, dtype=torch.long).scatter(1, ids, 1)[:, :e_local]
    _, rows = ExpertMLPsV2.get_blockwise_expert_and_token_mapping(
        total_tokens=TOKENS, num_blocks=blocks, expert_mask=mask, expert_index=ids, block_size=block, device="cpu",
        enable_spmd_rank=False, spmd_rank=None, tensor_parallel_group=SimpleNamespace(size=lambda: 1),
        optimized_block_to_token_mapping=False)
    return int(ExpertMLPsV2.get_block_conditions(block, blocks, rows).sum())


@pytest.mark.parametrize("ep,routing", [(16, "balanced"), (16, "worst"), (64, "balanced"), (64, "worst")])
def test_shard_on_intermediate_computes_the_blocks_the_planner_counts(ep, routing):
    """blockwise_mm_baseline_shard_intermediate_hybrid traced at NxD's EP call: num_static_blocks from NxD's formula,
    then its dynamic loop up to the non-padded blocks NxD's conditions count (balanced: NxD's own mapping of a
    balanced routing; worst: every block). Each core computes every block over half the columns, and its own checks
    pass at Kimi's shapes."""
    skip, _, act, scale = _enums()
    work = kernels.prefill_work(REAL, "shard-on-intermediate", TOKENS, TP, ep, routing)
    e, i, h, b = REAL.n_routed_experts // ep, moe_paths.local_intermediate(REAL, TP, ep), REAL.hidden_size, 256
    blocks = moe_paths.blockwise_blocks(REAL, TOKENS, ep, b)
    static = math.ceil(math.ceil(TOKENS * REAL.num_experts_per_tok / ep) / b)  # NxD expert_mlps_v2.py:730-733
    nonpadded = blocks if routing == "worst" else _nonpadded_blocks(ep, b, blocks)
    # the mode sets no token skip: NxD adds the padding row (blockwise.py:950-954) and pads conditions with a 0
    kw = dict(conditions=_meta(blocks + 1, dtype=torch.float32), hidden_states=_meta(TOKENS + 1, h),
              expert_affinities_masked=_meta((TOKENS + 1) * e, 1), gate_up_proj_weight=_meta(e, h, 2, i),
              down_proj_weight=_meta(e, i, h), block_size=b, num_static_block=static,
              token_position_to_id=_meta(blocks * b, dtype=torch.int32),
              block_to_expert=_meta(blocks, dtype=torch.int32), skip_dma=skip(False, False),
              compute_dtype="bfloat16", is_tensor_update_accumulating=True,
              expert_affinities_scaling_mode=scale.POST_SCALE, activation_function=act.SiLU)
    with counting("blockwise_mm_baseline_shard_intermediate_hybrid", "compute_one_block") as per_core:
        assert kernel_problems("blockwise_mm_baseline_shard_intermediate_hybrid", kw, grid=2,
                               registers=[nonpadded]) == []
    assert per_core == [work.blocks_per_core] * 2 and work.blocks == max(static, nonpadded)
    assert work.columns_per_core == i // 2
    print(f"\nshard-on-intermediate EP={ep} ({routing}): {work.to_dict()}")


def test_the_kernel_check_script_dry_mode_holds_the_references_to_the_models_math(tmp_path):
    """scripts/check_kernels.py --dry-run at Kimi's per-rank shapes: nki-library's references of the three kernels
    (the MoE one on a random noaux_tc layer through NxD's own block mapping) against the core's MoE and torch's
    top-k and cumsum, within the script's tolerances; a trn2 host runs the same script without --dry-run."""
    report = tmp_path / "kernels.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts/check_kernels.py"), "--dry-run", "--batch", "4",
                        "--report", str(report)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    assert [x["kernel"] for x in results] == ["bwmm_shard_on_block", "topk", "topk", "cumsum"]
    assert all(x["ok"] and "device_vs_reference" not in x for x in results), results
    assert "4 of 4 within tolerance" in r.stdout
    assert results[0]["wrapper"] == "neuronx_distributed.modules.moe.blockwise._call_bwmm_shard_on_block_kernel"


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_kernels_script", REPO / "scripts/check_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_calls_the_moe_kernel_through_nxds_wrapper(tmp_path, monkeypatch):
    """The MoE case goes through NxD's blockwise._call_bwmm_shard_on_block_kernel (spied on here) with NxD's
    BlockwiseMatmulArgs, which calls its module's kernel object, import_nki_beta2's nki.jit(..., mode='torchxla') on a
    device: here, for that call only, nki-library's reference, which receives the keyword arguments NxD builds
    (the grid LNC_2, the int32 block maps, the compute dtype and activation NxD derives). A tiny config (TP 2, 128
    tokens) keeps it quick; the real shapes are the subprocess test's."""
    from neuronx_distributed.modules.moe import blockwise

    from kimi_k2_neuron.tiny.checkpoint import make_tiny

    ck = _script()
    calls, real, kernel = [], blockwise._call_bwmm_shard_on_block_kernel, blockwise._bwmm_shard_on_block_nki_call

    def spy(args):
        calls.append(args)
        return real(args)

    monkeypatch.setattr(blockwise, "_call_bwmm_shard_on_block_kernel", spy)
    config = make_tiny(tmp_path / "tiny", shards=1) / "config.json"
    report = tmp_path / "r.json"
    rc = ck.main(["--dry-run", "--config", str(config), "--tp", "2", "--tokens", "128", "--kernels",
                  "bwmm_shard_on_block", "--report", str(report)])
    assert rc == 0 and len(calls) == 1 and isinstance(calls[0], blockwise.BlockwiseMatmulArgs)
    assert calls[0].kernel_act_fn == blockwise.ActivationFunction.SiLU and calls[0].is_tensor_update_accumulating
    result = json.loads(report.read_text())["results"][0]
    assert result["ok"] and result["kernel_call"]["grid"] == "2"
    assert {"token_position_to_id", "block_to_expert", "compute_dtype", "activation_function", "skip_dma",
            "block_sharding_strategy"} <= set(result["kernel_call"]["arguments"])
    assert blockwise._bwmm_shard_on_block_nki_call is kernel  # the stand-in was for that call only


def test_a_case_that_raises_is_reported_and_the_others_still_run(monkeypatch, capsys):
    """One case's exception (a kernel assert on a device) is that case's FAILED line, in one line; the next cases
    run and the exit status is 1."""
    ck = _script()
    real = ck.run_case

    def flaky(case, refs, device):
        if case["case"].endswith("unsorted"):
            raise RuntimeError("kernel assert: tile too large\nin topk")
        return real(case, refs, device)

    monkeypatch.setattr(ck, "run_case", flaky)
    rc = ck.main(["--dry-run", "--kernels", "topk,cumsum", "--batch", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "topk 256 of [2, 2560] unsorted: FAILED: RuntimeError: kernel assert: tile too large in topk" in out
    assert "cumsum of [2, 256]: reference vs model" in out
    assert "2 of 3 within tolerance; not: topk 256 of [2, 2560] unsorted" in out
