"""Fit planner: known facts about what fits on a trn2.48xlarge, and byte counts checked by hand from the config."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kimi_k2_neuron.cli import main
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.record import expert_scheme
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, ExpertScheme, converted_scheme
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.neuron.fit import plan
from kimi_k2_neuron.neuron.hbm import GiB, MiB
from kimi_k2_neuron.neuron.layout_search import best_layout, max_batch, max_seq_len
from kimi_k2_neuron.neuron.plan_report import format_plan
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.neuron.timing import Port

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
KIMI = CONFIGS / "kimi-k2-instruct-0905.json"
DSV3 = CONFIGS / "deepseek-v3.json"


@pytest.fixture(scope="module")
def kimi():
    return KimiK2Config.from_file(KIMI)


@pytest.fixture(scope="module")
def dsv3():
    # The AWS DeepSeek-V3 contrib runs on NxDI's stock KVCacheManager with a bf16 router, so its facts are checked
    # with kv_slots=2 and router_dtype="bf16" (CONTRIB below).
    return KimiK2Config.from_file(DSV3)


CONTRIB = dict(port=Port(kv_slots=2, router_dtype="bf16"))
MODELLED = ("kv_slots", "router_dtype")  # plan()'s model of other ports (timing.Port), beside the spec


def spec(**fields) -> RunSpec:
    return RunSpec(**fields)


def planned(cfg, args: dict):
    """plan() of one dict of the spec's fields and plan()'s other keywords."""
    return plan(cfg, spec(**{k: v for k, v in args.items() if k not in MODELLED}),
                Port(**{k: args[k] for k in MODELLED if k in args}))


# What `convert` writes from an FP8 (or BF16) source (formats/scheme.py), and unquantized experts.
BLOCKWISE, PER_CHANNEL = ExpertScheme("fp8-blockwise", (32, 32)), ExpertScheme("fp8-per-channel", None)


def _scheme(cfg, experts):
    """The expert scheme `convert --experts EXPERTS` writes from this config's source format."""
    return converted_scheme(cfg, experts)


def _row(p, prefix):
    (row,) = [r for r in (*p.weights, *p.allowance) if r.kind.startswith(prefix)]
    return row.bytes


# --- known facts -----------------------------------------------------------------------------------------------

def test_kimi_bf16_experts_do_not_fit_at_tp64(kimi):
    p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BF16_EXPERTS))
    assert not p.fits
    experts_gb = _row(p, "routed experts") / 1e9
    assert 31 < experts_gb < 33  # nxdi_contracts §6: "BF16 experts (≈ 32 GB per rank) do not fit"


def test_kimi_fp8_fits_at_tp64_seq1024(kimi):
    for fmt in ("fp8-blockwise", "fp8-per-channel"):
        p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=_scheme(kimi, fmt)))
        assert p.fits and p.headroom_bytes > 2.5 * GiB, fmt  # 2.92 GiB per-channel, 3.48 blockwise (README)
        assert 15.5 < _row(p, "routed experts (") / 1e9 < 16.2  # nxdi_contracts §6: ≈ 15.9 GB per rank


# The two DeepSeek-V3 facts bracket the runtime's reservation (plan.RUNTIME_RESERVED_BYTES), so they hold by
# calibration: these tests keep the bracket and the constants consistent. The Kimi facts above are independent.
def test_dsv3_bf16_fits_at_seq512(dsv3):
    assert plan(dsv3, spec(tp=64, ep=1, lnc=2, seq_len=512, batch=1, scheme=BF16_EXPERTS), **CONTRIB).fits


def test_dsv3_bf16_does_not_fit_at_seq1024(dsv3):
    assert not plan(dsv3, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BF16_EXPERTS), **CONTRIB).fits


def test_dsv3_bf16_is_marginal_and_the_reservation_is_inside_its_bracket(dsv3):
    p512, p1024 = (plan(dsv3, spec(tp=64, ep=1, lnc=2, seq_len=s, batch=1, scheme=BF16_EXPERTS), **CONTRIB) for s in (512, 1024))
    assert p1024.headroom_bytes < 0 < p512.headroom_bytes < 0.1 * GiB
    # Per-rank weights with the contrib's bf16 router match its ~21.4 GB (GiB) per-rank checkpoint files.
    assert abs(p512.weight_bytes / GiB - 21.4) < 0.1
    # Its own explanation, "CTE scratchpad (512MB) + TKG (23.1GB)", is this planner's seq-1024 total.
    assert abs(p1024.total_bytes / GiB - (23.1 + 0.5)) < 0.05
    # This port needs 0.16 GiB more at seq 512 (its fp32 router outweighs the latent-only cache): it does not fit.
    assert not plan(dsv3, spec(tp=64, ep=1, lnc=2, seq_len=512, batch=1, scheme=BF16_EXPERTS)).fits


def test_dsv3_needs_tp64_lnc2(dsv3):
    assert not plan(dsv3, spec(tp=32, ep=1, lnc=2, seq_len=512, batch=1, scheme=BF16_EXPERTS), **CONTRIB).fits  # ~40 GB/rank
    # 12 GiB/core; at LNC=1 NxD has no prefill kernel, its torch loop runs
    assert not plan(dsv3, spec(tp=64, ep=1, lnc=1, seq_len=512, batch=1, scheme=BF16_EXPERTS, moe_prefill="torch"), **CONTRIB).fits


# --- byte counts by hand -----------------------------------------------------------------------------------------

# Parameters counted by hand, tensor by tensor as the HF checkpoint stores them (hidden 7168, q_lora 1536, kv_lora 512,
# rope 64, nope 128, v 128, 61 layers, experts of 2048 plus one shared, dense MLP 18432):
# Kimi-K2 (64 heads, 384 experts, vocab 163840, 1 dense layer):
#   attention per layer: q_a 7168*1536 + q_a_layernorm 1536 + q_b 1536*64*192 + kv_a 7168*576 + kv_a_layernorm 512
#     + kv_b 512*64*256 + o 64*128*7168 + input/post-attention norms 2*7168 = 101,138,432
#   MoE layer: 385 experts * 3*7168*2048 + router 384*(7168 + 1) = 16,958,226,816; dense layer: 3*7168*18432
#   = 396,361,728
#   61 * 101,138,432 + 60 * 16,958,226,816 + 396,361,728 + embed and lm_head 2*163840*7168 + norm 7168
#   = 1,026,408,232,448; the fp32 router: 60 * 384 * 7169 = 165,173,760 parameters
# DeepSeek-V3 (128 heads, 256 experts, vocab 129280, 3 dense layers):
#   attention 187,121,664 per layer (q_b 1536*128*192, kv_b 512*128*256, o 128*128*7168, the rest as above);
#   MoE layer 257 * 3*7168*2048 + 256*7169 = 11,320,164,608
#   61 * 187,121,664 + 58 * 11,320,164,608 + 3 * 396,361,728 + 2*129280*7168 + 7168 = 671,026,419,200;
#   router 58 * 256 * 7169 = 106,445,312
KIMI_PARAMS, KIMI_ROUTER = 1_026_408_232_448, 165_173_760
DSV3_PARAMS, DSV3_ROUTER = 671_026_419_200, 106_445_312


def test_total_params_match_hand_count(kimi, dsv3):
    assert abs(KIMI_PARAMS / 1.0264e12 - 1) < 2e-3 and abs(DSV3_PARAMS / 671e9 - 1) < 2e-3  # as published
    # At TP=1 everything is on one core: bf16 is 2 bytes a parameter, the fp32 router 2 more:
    # 2 * 1,026,408,232,448 + 2 * 165,173,760 = 2,053,146,812,416; 2 * 671,026,419,200 + 2 * 106,445,312
    # = 1,342,265,729,024.
    for cfg, weight_bytes in ((kimi, 2_053_146_812_416), (dsv3, 1_342_265_729_024)):
        assert plan(cfg, spec(tp=1, ep=1, lnc=2, seq_len=1, batch=1, scheme=BF16_EXPERTS)).weight_bytes == weight_bytes
    assert (2 * KIMI_PARAMS + 2 * KIMI_ROUTER, 2 * DSV3_PARAMS + 2 * DSV3_ROUTER) == (2_053_146_812_416,
                                                                                    1_342_265_729_024)


def test_expert_scale_shapes_at_tp64(kimi):
    c = kimi  # 60 MoE layers of 384 experts; per rank gate_up [7168, 64], down [32, 7168]
    # [128, 32] blocks: a rank's 2048 / 64 = 32 down rows hold no whole 128-row block, which NxD would collapse to one
    # scale per rank; refused (such scales shard for expert TP <= 16 only)
    with pytest.raises(KimiInputError, match=r"shard only \[1, 2, 4, 8, 16\] ways"):
        plan(c, spec(tp=64, ep=1, lnc=2, seq_len=1, batch=1, scheme=ExpertScheme("fp8-blockwise", (128, 32))))
    # What the converter writes for an FP8 source, [32, 32]: gate_up [E, 7168/32, 64/32], down [E, 32/32, 7168/32]:
    # 60 * 384 * (224*2 + 1*224) * 4 = 61,931,520.
    blockwise = plan(c, spec(tp=64, ep=1, lnc=2, seq_len=1, batch=1, scheme=BLOCKWISE))
    assert _row(blockwise, "routed expert scales") == 61_931_520
    # ... and for an INT4 source, [32, 1] (one scale per INT4 group): gate_up [E, 224, 64], down [E, 1, 7168]:
    # 60 * 384 * (224*64 + 1*7168) * 4 = 1,981,808,640.
    thinking = KimiK2Config.from_file(KIMI.parent / "kimi-k2-thinking.json")
    int4 = plan(thinking, spec(tp=64, ep=1, lnc=2, seq_len=1, batch=1, scheme=_scheme(thinking, "fp8-blockwise")))
    assert _row(int4, "routed expert scales") == 1_981_808_640
    # Per channel: [E, 1, 2I/tp] + [E, 1, H] = 60 * 384 * (2*32 + 7168) * 4 = 666,501,120.
    per_channel = plan(c, spec(tp=64, ep=1, lnc=2, seq_len=1, batch=1, scheme=PER_CHANNEL))
    assert _row(per_channel, "routed expert scales") == 666_501_120
    # --ep splits experts inside the 64 ranks: E/16 experts, each 64/16 = 4 ways; the same expert bytes per rank:
    # 60 MoE layers x 24 experts x 3 x 7168 x 512 fp8 bytes = 15,854,469,120. (seq_len 16: 48 x 16 = 768 tokens,
    # whole 128-token tiles for the shard-on-block kernel.)
    ep16 = plan(c, spec(tp=64, ep=16, lnc=2, seq_len=16, batch=48, scheme=PER_CHANNEL))
    assert _row(ep16, "routed experts (") == 15_854_469_120
    assert _row(ep16, "routed experts (") == _row(per_channel, "routed experts (")


def test_kv_cache_and_slots(kimi):
    p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE), Port(kv_slots=2))
    # 61 layers x 2 slots x 1024 tokens x 576 x 2 bytes = 143,917,056 (nxdi_contracts §1.4: 144 MB at B=1, S=1K)
    assert p.kv_cache.bytes == 143_917_056
    one = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=4, scheme=BLOCKWISE))
    assert one.kv_cache.bytes == p.kv_cache.bytes * 4 // 2  # our latent-only cache is the default


def test_roofline(kimi):
    p1 = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE))
    assert p1.experts_read_per_layer == kimi.num_experts_per_tok
    assert p1.hbm_bytes_per_s == pytest.approx(2.9e12 / 4)
    # Bytes one decode step reads on a core, by hand: every non-expert weight, 61 layers of attention replicated
    # (q_a + kv_a) 61*7168*(1536+576)*2 = 1,846,935,552 and TP-split (q_b + kv_b + o)
    # 61*(18,874,368 + 8,388,608 + 58,720,256)/64*2 = 163,905,536, norms (61*(2*7168+1536+512) + 7168)*2 = 2,013,184,
    # lm_head 163840/64*7168*2 = 36,700,160, the dense MLP 3*7168*18432/64*2 = 12,386,304, the shared experts
    # 60*3*7168*2048/64*2 = 82,575,360, the fp32 router 60*384*7169*4 = 660,695,040 (2,805,211,136 in all); one
    # embedding row 7168/64*2 = 224; 8 of the 384 local experts with their scales, (60*384*3*7168*32 + 61,931,520)*8/384
    # = 331,591,680; the latent cache 61*1024*576*2 = 71,958,528: 3,208,761,568 bytes, / 725 GB/s = 4.426 ms.
    assert p1.bytes_per_token == 3_208_761_568
    assert p1.tpot_lower_bound_s == pytest.approx(3_208_761_568 / 725e9)
    p32 = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=32, scheme=BLOCKWISE))
    # selective loading: each token's top-k, a repeat read again (NxD's loop over the tokens)
    assert p32.experts_read_per_layer == 32 * 8 < kimi.n_routed_experts
    assert p32.bytes_per_token > p1.bytes_per_token
    # batch * top_k >= E: NxD runs every expert (expert_mlps_v2.py:1473-1478); with EP > 1 it always does
    p48 = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=48, scheme=BLOCKWISE))
    ep4 = plan(kimi, spec(tp=64, ep=4, lnc=2, seq_len=1024, batch=48, scheme=BLOCKWISE))
    assert p48.experts_read_per_layer == kimi.n_routed_experts and ep4.experts_read_per_layer == 384 // 4
    # Lower bound: at least the expert bytes it is expected to touch, never more than everything on the core.
    assert p1.bytes_per_token < p1.weight_bytes + p1.kv_cache.bytes


# --- what the MoE allocates while it runs (NxD's code; hbm.moe_temporaries) -----------------------------------------
# Kimi at TP=64, EP=1: 384 local experts, each gate_up [7168, 64] + down [32, 7168] = 3 x 7168 x 32 = 688,128
# elements; all 384: 264,241,152 elements, 528,482,304 bytes in bf16, 1,056,964,608 in fp32.

@pytest.mark.parametrize("experts", ["fp8-blockwise", "fp8-per-channel"])
def test_the_prefill_kernel_gets_every_local_expert_dequantized_for_both_fp8_schemes(kimi, experts):
    """Both schemes' scales are 3-D, so BlockwiseMatmulNKIFunc dequantizes all local experts before the kernel
    (NxD blockwise.py:955-967): a bf16 copy counted, its fp32 product reported as assumed fused."""
    p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=_scheme(kimi, experts)))
    assert p.prefill_path == "shard-on-block" and p.prefill_blocks == 445  # ceil((1024 x 8 - 383) / 128) + 383
    assert _row(p, "prefill MoE temporaries") == 528_482_304
    assert p.unfused_fp32_bytes == 1_056_964_608
    # activations 0.5 GiB (calibrated, 1024 tokens) + 0.492 GiB of temporaries: two 512 MiB pages
    assert _row(p, "prefill activations") + _row(p, "prefill MoE temporaries") + _row(p, "prefill scratchpad") == GiB
    bf16 = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BF16_EXPERTS))
    assert _row(bf16, "prefill MoE temporaries") == 0 and bf16.unfused_fp32_bytes == 0  # used as they are


def test_all_experts_prefill_holds_every_expert_output(kimi):
    """forward_all_experts (expert_mlps_v2.py:366-391): every token through every local expert, so besides the bf16
    expert copies the [384, 1024, 64] gate_up, [384, 1024, 32] GLU and [384, 1024, 7168] down outputs, bf16:
    384 x 1024 x (64 + 32 + 7168) x 2 = 5,712,642,048 bytes."""
    p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, moe_prefill="all-experts"))
    assert p.prefill_path == "all-experts" and p.prefill_blocks is None
    assert _row(p, "prefill MoE temporaries") == 528_482_304 + 5_712_642_048
    assert p.unfused_fp32_bytes == 1_056_964_608  # blockwise: weight x scale in fp32 (dequantize.py:121)
    assert not p.fits  # ~5.3 GiB more than the shard-on-block kernel at seq 1024
    # per-channel scales its outputs instead (dequantize.py:37-39): 384 x 1024 x (64 + 7168) x 4 = 11,374,952,448
    pc = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=PER_CHANNEL, moe_prefill="all-experts"))
    assert _row(pc, "prefill MoE temporaries") == 528_482_304 + 5_712_642_048
    assert pc.unfused_fp32_bytes == 11_374_952_448


def test_torch_prefill_runs_one_block_of_one_expert_at_a_time(kimi):
    """The torch loop (expert_mlps_v2.py:1350-1405): one expert gathered and dequantized, 3 x 7168 x 32 x 2 =
    1,376,256 bytes, and one 512-token block's outputs, 512 x (96 + 7168) x 2 = 7,438,336."""
    p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, moe_prefill="torch"))
    assert p.prefill_path == "torch" and p.prefill_blocks == 399
    assert _row(p, "prefill MoE temporaries") == 8_814_592
    assert "399 blocks per MoE layer unrolled into the graph" in format_plan(p)


@pytest.mark.parametrize("seq_len,lnc,mode,path", [
    (47, 2, "shard-on-block", "selective"),    # 47 x 8 = 376 < 384 experts
    (128, 2, "shard-on-block", "shard-on-block"),  # 1024 pairs >= 384: blockwise, NxD's shard-on-block kernel
    (48, 2, "torch", "all-experts"),   # 384 <= 48 x 8 < 512, the torch path's block
    (63, 2, "torch", "all-experts"),   # 504 < 512
    (64, 2, "torch", "torch"),
    (64, 1, "torch", "torch"),         # no kernel at LNC=1: the torch loop is the only blockwise path there
    (4096, 2, "all-experts", "all-experts"),  # block 2**30
])
def test_which_prefill_path_nxd_takes(kimi, seq_len, lnc, mode, path):
    tp = 64 if lnc == 2 else 32  # 128 logical cores at LNC=1, but 64 heads: TP 32 is the largest that divides
    p = plan(kimi, spec(tp=tp, ep=1, lnc=lnc, seq_len=seq_len, batch=1, scheme=PER_CHANNEL, moe_prefill=mode))
    assert p.prefill_path == path


@pytest.mark.parametrize("kw,needle", [
    # the kernel's final reduction reads 128-row tiles of its [T, 2, H] output
    (dict(seq_len=100), "a prefill of 100 tokens (batch x --max-context-length) must be a multiple of 128"),
    (dict(lnc=1, tp=32), "nkilib has its MoE prefill kernels for LNC=2 only"),
    # 2048 / 64 = 32 columns per rank, 16 per physical core; the kernel's tiles are 128 rows
    (dict(moe_prefill="shard-on-intermediate"), "a multiple of 128 (16 here)"),
])
def test_kernel_prefill_modes_are_refused_where_their_kernel_cannot_run(kimi, kw, needle):
    args = dict(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE) | kw
    with pytest.raises(KimiInputError) as e:
        planned(kimi, args)
    assert needle in str(e.value)
    # the tile rule is on the whole prefill call: 3 rows x 1000 tokens = 3000 is refused, 3 x 1024 = 24 tiles is not
    assert planned(kimi, args | dict(seq_len=1024, batch=3, lnc=2, tp=64,
                                     moe_prefill="shard-on-block")).prefill_path == "shard-on-block"


def test_shard_on_intermediate_where_each_core_gets_128_columns(kimi):
    """--ep 16 at --tp 64: experts split 4 ways, 512 columns per rank, 256 per physical core; block 256."""
    p = plan(kimi, spec(tp=64, ep=16, lnc=2, seq_len=128, batch=48, scheme=PER_CHANNEL, moe_prefill="shard-on-intermediate"))
    assert p.prefill_path == "shard-on-intermediate"
    # 48 x 128 x 8 = 49,152 pairs, 24 local experts: ceil((49,152 - 23) / 256) + 23 = 192 + 23
    assert p.prefill_blocks == 215


def test_all_experts_decode_temporaries(kimi):
    """All-experts decode at batch 48 runs every local expert (expert_mlps_v2.py:366-392). EP=1: 528,482,304
    + 384 x 48 x 7264 x 2 = 796,262,400 bytes. EP=16: 24 experts of I/4 = 512, the same 528,482,304 bytes of
    copies + 24 x 48 x (3 x 512 + 7168) x 2 = 548,536,320. Selective loading allocates none."""
    p = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=128, batch=48, scheme=BLOCKWISE, moe_decode="all-experts"))
    assert p.decode_path == "all-experts" and _row(p, "decode MoE temporaries") == 796_262_400
    ep16 = plan(kimi, spec(tp=64, ep=16, lnc=2, seq_len=128, batch=48, scheme=BLOCKWISE))
    assert _row(ep16, "decode MoE temporaries") == 548_536_320
    assert ep16.prefill_blocks == 407  # 48 x 128 tokens x 8 = 49,152 pairs: ceil((49,152 - 23) / 128) + 23
    selective = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=128, batch=48, scheme=BLOCKWISE, moe_decode="selective"))
    assert selective.decode_path == "selective"
    assert not [r for r in selective.allowance if r.kind.startswith("decode MoE temporaries")]


def test_glm_5_2_all_experts_prefill_fits_only_if_its_fp32_products_are_fused(dsv3):
    """Known fact: NxDI's GLM-5.2 contrib (DeepSeek-V3 architecture, 78 layers, hidden 6144, 256 FP8 experts of
    2048, bf16 router, stock KV cache) runs a 2048-token all-experts prefill at TP=64 LNC=2. The planner's model of
    it fits, and the fp32 product of its per-tensor output scaling (dequantize.py:37-39), had it been materialized,
    is more than ten times the headroom: 256 x 2048 x (64 + 6144) x 4 bytes = 12.125 GiB. So the planner's rule
    (such products are fused, not counted) agrees with that run. Per-tensor scales are ~0 bytes; [32, 32]
    blockwise stands in for them (its scales are 0.04 GiB)."""
    glm = dataclasses.replace(dsv3, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                              first_k_dense_replace=3, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                              qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, vocab_size=154880)
    p = plan(glm, spec(tp=64, ep=1, lnc=2, seq_len=2048, batch=1, scheme=ExpertScheme("fp8-blockwise", (32, 32)), moe_prefill="all-experts"), **CONTRIB)
    assert p.fits and 10 * p.headroom_bytes < 12.125 * GiB


def test_the_fallback_advice_is_what_the_planner_says_fits(kimi):
    """If the shard-on-block kernel fails to compile, the advice is the other modes the planner fits: at the
    recommended configuration the torch loop at 1024 tokens, and all-experts only with a smaller prefill bucket
    (at 1024 its [384, 1024, 7264] outputs do not fit)."""
    from kimi_k2_neuron.neuron.layout_search import fallback_advice, prefill_fallbacks

    plans = prefill_fallbacks(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, moe_prefill="shard-on-block"))
    assert {p.moe_prefill for p in plans} == {"torch", "all-experts"}  # shard-on-intermediate is refused at EP=1
    for p in plans:
        again = plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, max_context_length=p.context_len, moe_prefill=p.moe_prefill))
        assert again.fits
    (all_experts,) = [p for p in plans if p.moe_prefill == "all-experts"]
    assert all_experts.context_len < 1024
    assert not plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, max_context_length=all_experts.context_len + 1, moe_prefill="all-experts")).fits
    text = fallback_advice(plans, "shard-on-block")
    assert "--moe-prefill torch:" in text and f"--max-context-length {all_experts.context_len}" in text


# --- the largest seq_len that fits ---------------------------------------------------------------------------------

def test_max_seq_len_is_the_last_that_fits(kimi):
    """The shard-on-block kernel takes prefills of whole 128-token tiles, so the seq_lens it can compile step by
    128 / gcd(batch, 128): the next one does not fit, and the ones between are refused, not planned."""
    for batch, ep, step in ((1, 1, 128), (4, 1, 32), (48, 16, 8)):
        p = max_seq_len(kimi, spec(tp=64, ep=ep, lnc=2, batch=batch, scheme=BLOCKWISE))
        assert p.fits and p.batch == batch and p.seq_len * batch % 128 == 0
        assert not plan(kimi, spec(tp=64, ep=ep, lnc=2, seq_len=p.seq_len + step, batch=batch, scheme=BLOCKWISE)).fits
        with pytest.raises(KimiInputError, match="must be a multiple of 128"):
            plan(kimi, spec(tp=64, ep=ep, lnc=2, seq_len=p.seq_len + 1, batch=batch, scheme=BLOCKWISE))
    torch_path = max_seq_len(kimi, spec(tp=64, ep=1, lnc=2, batch=1, scheme=BLOCKWISE, moe_prefill="torch"))
    assert not plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=torch_path.seq_len + 1, batch=1, scheme=BLOCKWISE, moe_prefill="torch")).fits


def test_max_seq_len_searches_each_prefill_path_apart(kimi):
    """What a plan allocates can drop where the prefill path changes: at batch 1 and seq 63 the torch mode's
    all-experts path holds every local expert dequantized, 528,482,304 bytes, and [384, 63, 7264] outputs, 384 x 63
    x 7264 x 2 = 351,461,376, where its blockwise loop at 64 holds one expert and one 512-token block, 8,814,592.
    So the bisection runs per path: batch 1 switches at 48 (48 x 8 = 384 experts) and, for torch, 64 (512, its
    block); shard-on-block (block 128) is blockwise from 48 tokens on, in steps of 128."""
    from kimi_k2_neuron.neuron.layout_search import _constant_path_ranges

    at63, at64 = (plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=s, batch=1, scheme=BLOCKWISE, moe_prefill="torch"))
                  for s in (63, 64))
    assert _row(at63, "prefill MoE temporaries") - _row(at64, "prefill MoE temporaries") == \
        528_482_304 + 351_461_376 - 8_814_592
    assert _constant_path_ranges(kimi, 1, 1, None, "torch") == [(1, 47, 1), (48, 63, 1), (64, 262144, 1)]
    assert _constant_path_ranges(kimi, 1, 1, None, "all-experts") == [(1, 47, 1), (48, 262144, 1)]
    assert _constant_path_ranges(kimi, 1, 1, None, "shard-on-block") == [(1, 15, 1), (16, 47, 1),
                                                                         (128, 262144, 128)]
    # EP: from one block up (48 x 8 = 384 pairs >= 128), in steps of 128 / gcd(48, 128) = 8
    assert _constant_path_ranges(kimi, 48, 16, None, "shard-on-block") == [(8, 262144, 8)]
    assert _constant_path_ranges(kimi, 1, 1, 1024, "shard-on-block") == [(1024, 262144, 1)]  # KV only grows


def test_max_seq_len_with_a_fixed_prefill_is_kv_bound(kimi):
    """With a 1024-token prefill bucket only the KV cache grows: 61 layers x 576 x 2 bytes = 70,272 bytes a token."""
    p = max_seq_len(kimi, spec(tp=64, ep=1, lnc=2, batch=1, scheme=BLOCKWISE, max_context_length=1024))
    assert p.fits and p.context_len == 1024 and p.headroom_bytes < 70_272
    assert p.kv_cache.bytes == p.seq_len * 70_272


@pytest.mark.parametrize("kw,needle", [
    (dict(tp=128), "--tp 128"), (dict(tp=16, ep=32), "--ep 32: must divide --tp 16"),
    (dict(tp=64, ep=8, batch=48), "--ep 8 at --tp 64 --lnc 2: not an expert layout"),
    (dict(tp=64, ep=4, batch=47, moe_decode="selective"), "--moe-decode selective with --ep 4"), (dict(lnc=3), "--lnc"),
    (dict(seq_len=0), "--seq-len"), (dict(batch=0), "--batch"),
    (dict(kv_slots=3), "--kv-slots"), (dict(tp=1, ep=5), "--ep 5"),
])
def test_bad_arguments(kimi, kw, needle):
    args = dict(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BF16_EXPERTS) | kw
    with pytest.raises(KimiInputError, match=needle):
        planned(kimi, args)


# --- CLI -----------------------------------------------------------------------------------------------------

def _cli(*extra):
    return main(["plan", "--tp", "64", "--seq-len", "1024", *extra])


def test_cli_exit_codes(capsys, tmp_path):
    assert _cli("--config", str(KIMI), "--experts", "fp8-blockwise") == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "lower bound" in out
    assert _cli("--config", str(KIMI), "--experts", "bf16") == 1
    assert "fits: NO" in capsys.readouterr().out
    assert main(["plan", "--config", str(KIMI), "--tp", "128", "--seq-len", "8", "--experts", "bf16"]) == 2
    assert "--tp 128" in capsys.readouterr().err
    assert _cli("--model", str(tmp_path), "--experts", "bf16") == 2  # no config.json there
    (tmp_path / "config.json").write_text(KIMI.read_text())
    assert _cli("--model", str(tmp_path), "--experts", "fp8-per-channel") == 0


def test_cli_json(capsys):
    assert _cli("--config", str(DSV3), "--experts", "bf16", "--batch", "2", "--json") in (0, 1)
    d = json.loads(capsys.readouterr().out)
    assert d["tp"] == 64 and d["batch"] == 2 and isinstance(d["fits"], bool)
    assert d["total_bytes"] == sum(r["bytes"] for r in d["weights"] + d["allowance"]) + d["kv_cache"]["bytes"]
    assert d["tpot_lower_bound_ms"] > 0 and d["assumptions"]


def test_a_converted_checkpoint_is_planned_with_the_block_it_records(tiny, tmp_path):
    """A converted config.json drops the source's quantization_config, so the INT4 source's [32, 1] scales are
    known only from the conversion record; the CLI and compile_and_save both plan with it (formats.record)."""
    from kimi_k2_neuron.convert import convert
    from kimi_k2_neuron.formats.record import ConversionRecord

    dst = tmp_path / "int4-blockwise"
    convert(tiny["int4"], dst, "fp8-blockwise", progress=False)
    rec = ConversionRecord.read(dst)
    assert rec.scheme.block == (32, 1)
    converted_cfg = KimiK2Config.from_file(dst)
    assert converted_cfg.quant is None  # the config alone would say a BF16 source, converted to [32, 32]
    # torch: the tiny model's hidden size is below the prefill kernels'
    raw = KimiK2Config.from_file(tiny["int4"])
    with_record = plan(converted_cfg, spec(tp=2, ep=1, lnc=2, seq_len=8, batch=1, moe_prefill="torch", scheme=expert_scheme(converted_cfg, ConversionRecord.of(converted_cfg), None)))
    source = plan(raw, spec(tp=2, ep=1, lnc=2, seq_len=8, batch=1, scheme=expert_scheme(raw, None, "fp8-blockwise"), moe_prefill="torch"))
    assert _row(with_record, "routed expert scales") == _row(source, "routed expert scales")


@pytest.mark.parametrize("tp", ["3", "48"])
def test_cli_refuses_a_tp_that_does_not_divide_the_model(capsys, tp):
    """TP 3 or 48 used to print fractional sizes; compile_and_save refuses them (64 heads), and so does the planner."""
    assert main(["plan", "--config", str(KIMI), "--tp", tp, "--seq-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --tp {tp}: config.json field num_attention_heads=64 is not divisible by {tp}\n"


def _converted(tmp_path, experts, nxd):
    """The real Kimi config.json with a conversion record and no tensors (the planner reads only config.json)."""
    from kimi_k2_neuron.formats.record import CONVERSION_KEY, LAYOUT_VERSION

    rec = {"layout_version": LAYOUT_VERSION, "experts": experts, "nxd": nxd}
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(KIMI.read_text()), CONVERSION_KEY: rec}))
    return str(tmp_path)


def test_cli_takes_the_experts_a_converted_checkpoint_holds(capsys, tmp_path):
    from kimi_k2_neuron.formats.scheme import scheme_for

    model = _converted(tmp_path, "fp8-per-channel", scheme_for("fp8-per-channel", "fp8").nxd(2048))
    assert _cli("--model", model, "--json") == 0  # --experts defaults to the record's
    assert json.loads(capsys.readouterr().out)["experts"] == "fp8-per-channel"
    assert _cli("--config", str(Path(model) / "config.json"), "--json") == 0  # its config.json alone: the same
    assert json.loads(capsys.readouterr().out)["experts"] == "fp8-per-channel"
    assert _cli("--model", model, "--experts", "fp8-blockwise") == 2
    assert capsys.readouterr().err == ("error: --experts fp8-blockwise: the converted checkpoint holds "
                                       "fp8-per-channel experts; pass --experts fp8-per-channel or leave it out\n")


def test_fp8_blockwise_is_the_default_for_a_raw_checkpoint(capsys):
    """The recommended expert format (exact from FP8 and INT4 sources) is what plan and compile_and_save.py (through
    formats.record.experts_for) take when none is given and no converted checkpoint records one."""
    from kimi_k2_neuron.formats.record import experts_for

    assert _cli("--config", str(KIMI), "--json") == 0
    assert json.loads(capsys.readouterr().out)["experts"] == "fp8-blockwise" == experts_for(None, None)


def test_cli_refuses_a_tp_the_recorded_scales_do_not_shard_for(capsys, tmp_path):
    """[32, 32] blockwise scales shard for expert TP t when 2048 / t is a multiple of 32, t <= 64; a converted
    checkpoint recording [128, 32] blocks (a coarser layout) shards for t <= 16 only, and TP 64 is refused, as the
    Neuron shell does."""
    nxd = ExpertScheme("fp8-blockwise", (128, 32)).nxd(2048)
    assert _cli("--model", _converted(tmp_path, "fp8-blockwise", nxd)) == 2
    assert "experts split 64 ways (tp / ep), but fp8-blockwise expert scales of block (128, 32) shard only " \
           "[1, 2, 4, 8, 16] ways" in capsys.readouterr().err


def test_cli_max_seq_len(capsys):
    args = ["plan", "--config", str(KIMI), "--tp", "64", "--experts", "fp8-blockwise", "--max-seq-len"]
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_seq_len"] == d["seq_len"] and d["fits"] and d["context_len"] == d["seq_len"]
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    # batch 1 on the shard-on-block kernel: seq_lens in whole 128-token tiles
    assert first.startswith(f"max seq_len: {d['seq_len']} (the next the shard-on-block kernel takes, "
                            f"{d['seq_len'] + 128}, does not fit;")
    fixed = [*args, "--max-context-length", "1024"]  # the prefill fixed: any seq_len compiles
    assert main([*fixed, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["max_seq_len"]
    assert main(fixed) == 0
    assert capsys.readouterr().out.startswith(f"max seq_len: {found} ({found + 1} does not fit;")
    assert main(["plan", "--config", str(KIMI), "--tp", "64", "--experts", "bf16", "--max-seq-len", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["max_seq_len"] is None  # 29.5 GiB of bf16 experts fit nowhere
    # argparse: one or the other (main turns argparse's exit into its return code)
    assert main(["plan", "--config", str(KIMI), "--tp", "64", "--seq-len", "8", "--max-seq-len"]) == 2


@pytest.mark.parametrize("flags, words", [
    (["--batch", "0"], "--batch: expected an integer >= 1, got '0'"),
    (["--max-context-length", "0"], "--max-context-length: expected an integer >= 1, got '0'"),
    (["--seq-len", "262145"], "--seq-len 262145: exceeds config.json field max_position_embeddings=262144"),
], ids=["batch 0", "context 0", "seq-len past the model's positions"])
def test_cli_refuses_bad_counts_before_planning(flags, words, capsys, one_line_error):
    search = [] if "--seq-len" in flags else ["--max-seq-len"]
    rc = main(["plan", "--config", str(KIMI), "--tp", "64", *flags, *search])
    one_line_error.exit(rc, capsys.readouterr().err, words)


# --- the long-context layout (issue 17): sequence-sharded cache, chunked prefill, sharded q_a/kv_a and router -----
# Kimi-K2: 61 layers (60 MoE), 64 heads, latent 512 + 64 = 576, q_lora_rank 1536, 384 experts, hidden 7168.
# NxDI's flash-decoding cache holds get_cache_size(S, G) = S / G + 128 slots per rank (NXDI_CONTRACT.md:
# fd-cache-size).

SEQ = Layout(kv_group=64, prefill_chunk=1024)
SHARDED = dataclasses.replace(SEQ, shard_attn_a=True, shard_router=True)
UNCHUNKED, UNCHUNKED_SHARDED = (dataclasses.replace(x, prefill_chunk=None) for x in (SEQ, SHARDED))
LATENT_TOKEN = 61 * 576 * 2  # 70,272 bytes of latent per token, all layers (68.6 KiB)


def _at(kimi, seq_len, batch, layout=Layout(), **kw):
    return plan(kimi, spec(tp=64, ep=1, lnc=2, seq_len=seq_len, batch=batch, scheme=BLOCKWISE, layout=layout, **kw))


def test_the_replicated_cache_row_is_todays(kimi):
    """The default layout is the README's: 7,168 tokens fit at batch 1 and 1,792 at batch 4 (whole 128-token tiles
    of the one-shot prefill), each the KV bound of 68.6 KiB per token on every rank."""
    for batch, want in ((1, 7168), (4, 1792)):
        p = max_seq_len(kimi, spec(tp=64, ep=1, lnc=2, batch=batch, scheme=BLOCKWISE))
        assert p.seq_len == want and p.fits and p.kv_cache.bytes == batch * want * LATENT_TOKEN
        assert p.cache_slots_per_rank == want and p.collectives == ()


def test_the_sequence_sharded_cache_is_a_64th_plus_nxdis_reserve(kimi):
    """At 262,144 x 8: 4,096 positions per rank plus the 128-slot reserve = 4,224 slots (2.212 GiB), the replicated
    cache's 1/64 plus 61 x 8 x 128 reserve slots; G=16 holds 16,512."""
    rep, seq = _at(kimi, 262144, 8, Layout(prefill_chunk=1024)), _at(kimi, 262144, 8, SEQ)
    assert rep.kv_cache.bytes == 8 * 262144 * LATENT_TOKEN
    assert seq.cache_slots_per_rank == 4224
    assert seq.kv_cache.bytes == rep.kv_cache.bytes // 64 + 8 * 128 * LATENT_TOKEN == 2_374_631_424
    g16 = _at(kimi, 262144, 8, dataclasses.replace(SEQ, kv_group=16))
    assert g16.cache_slots_per_rank == 16512 and g16.kv_cache.bytes == 8 * 16512 * LATENT_TOKEN
    assert "4224 slots/rank of G=64" in seq.kv_cache.kind


def test_sharding_q_a_kv_a_and_the_router_leaves_a_64th_of_them(kimi):
    """q_a [1536, 7168] + kv_a [576, 7168] bf16 in 61 layers and the router [384, 7168] fp32 in 60 split 64 ways;
    the router's bias [384] stays whole. Per rank 2.30 GiB less, and each decode step reads that much less."""
    # (at 1,024 tokens one prefill call: a chunk as wide as the cache is refused)
    whole, split = _at(kimi, 1024, 1, UNCHUNKED), _at(kimi, 1024, 1, UNCHUNKED_SHARDED)
    attn_a, router = 61 * (1536 + 576) * 7168 * 2, 60 * 384 * 7168 * 4
    assert _row(whole, "attention q_a+kv_a (replicated)") == attn_a
    assert _row(split, "attention q_a+kv_a (TP, gathered)") == attn_a // 64
    assert _row(whole, "router + bias (replicated)") == router + 60 * 384 * 4
    assert _row(split, "router (TP, gathered) + bias (replicated)") == router // 64 + 60 * 384 * 4
    saved = attn_a + router - attn_a // 64 - router // 64
    assert whole.weight_bytes - split.weight_bytes == saved and saved / GiB == pytest.approx(2.30, abs=0.005)
    assert whole.bytes_per_token - split.bytes_per_token == saved


def test_the_sharded_cache_reads_its_slots_per_decode_step(kimi):
    """The roofline reads the rank's slots: at 1,024 x 1, 144 slots (16 + 128) instead of 1,024; 3.209 GB -> 3.147
    GB, and 0.679 GB with q_a/kv_a and the router split as well."""
    rep, seq, split = _at(kimi, 1024, 1), _at(kimi, 1024, 1, UNCHUNKED), _at(kimi, 1024, 1, UNCHUNKED_SHARDED)
    assert rep.bytes_per_token - seq.bytes_per_token == (1024 - 144) * 576 * 2 * 61
    assert round(seq.bytes_per_token / 1e9, 3) == 3.147 and round(split.bytes_per_token / 1e9, 3) == 0.679


def test_decode_collectives_added_per_step(kimi):
    """The sharded cache adds three collectives per layer over the KV group (64 heads' absorbed queries of 576 bf16
    gathered; 64 fp32 maxima all-reduced; 64 x (512 + 1) fp32 partials reduce-scattered); the fused q_a|kv_a output
    (2,112 bf16) one all-gather per layer; the router's 384 fp32 logits one per MoE layer."""
    assert _at(kimi, 1024, 1).collectives == ()
    split = _at(kimi, 262144, 8, SHARDED)
    got = {c.what.split(" (")[0]: (c.count, c.group, c.bytes) for c in split.collectives}  # batch 8
    assert got == {"absorbed Q all-gather": (61, 64, 8 * 64 * 576 * 2), "softmax max all-reduce": (61, 64, 8 * 64 * 4),
                   "[context | sum] reduce-scatter": (61, 64, 8 * 64 * 513 * 4),
                   "q_a|kv_a output all-gather": (61, 64, 8 * 2112 * 2), "router logits all-gather": (60, 64, 8 * 384 * 4)}
    assert sum(c.count for c in split.collectives) == 183 + 61 + 60
    # among the step's own: 61 o_proj, 1 dense and 60 MoE all-reduces, the embedding's all-gather, the sampler's 2
    assert split.decode.collective_count == 125 + 183 + 61 + 60
    assert set(split.collectives) < set(split.decode.collectives)
    g16 = _at(kimi, 262144, 8, dataclasses.replace(SEQ, kv_group=16))  # 1 head per rank, 16 gathered
    assert (g16.collectives[0].group, g16.collectives[0].bytes) == (16, 8 * 16 * 576 * 2)


def test_a_chunked_prefill_costs_one_chunk_whatever_the_batch(kimi):
    """The chunk graph runs one row of N tokens: its calibrated activations (512 MiB per 1,024 tokens), MoE and
    attention temporaries are the same at batch 1 and 16 (what the attention row holds is tested against what
    attend_chunk builds: test_chunk_merge.py); one-shot, the activations are batch x context."""
    one, many = _at(kimi, 262144, 1, SEQ), _at(kimi, 262144, 16, SEQ)
    assert [r for r in one.allowance] == [r for r in many.allowance]
    assert _row(one, "prefill activations") == 512 * MiB
    assert _row(_at(kimi, 1024, 4), "prefill activations") == 4 * 512 * MiB


def test_the_goals_fit_with_the_sequence_sharded_cache(kimi):
    """Issue 17's goals at fp8-blockwise, TP=64, LNC=2: 262,144 tokens at batch 8 and 131,072 at batch 16 fit
    with --kv-shard sequence --prefill-chunk 1024 (1.1 GiB of headroom), with over 3 GiB when q_a/kv_a and the
    router are split too; the replicated cache fits neither."""
    for seq_len, batch in ((262144, 8), (131072, 16)):
        assert not _at(kimi, seq_len, batch, Layout(prefill_chunk=1024)).fits
        p, s = _at(kimi, seq_len, batch, SEQ), _at(kimi, seq_len, batch, SHARDED)
        assert p.fits and 1.0 < p.headroom_bytes / GiB < 1.2
        assert s.fits and s.headroom_bytes - p.headroom_bytes == p.weight_bytes - s.weight_bytes
        assert s.headroom_bytes / GiB > 3.1


@pytest.mark.parametrize("layout, seq_len, want", [
    (SEQ, 262144, 11), (SEQ, 131072, 24), (SHARDED, 262144, 20), (SHARDED, 131072, 40),
    (Layout(), 1024, None),
], ids=["seq 256K", "seq 128K", "sharded 256K", "sharded 128K", "replicated 1K"])
def test_max_batch_is_the_last_that_fits(kimi, layout, seq_len, want):
    p = max_batch(kimi, spec(tp=64, ep=1, lnc=2, seq_len=seq_len, scheme=BLOCKWISE, layout=layout))
    assert p.fits and (want is None or p.batch == want)
    assert not _at(kimi, seq_len, p.batch + 1, layout).fits
    if want is None and layout == Layout():  # one-shot prefill of batch x 1024 tokens: any batch tiles
        assert p.batch > 1


def test_max_batch_when_none_fits(kimi):
    p = max_batch(kimi, spec(tp=64, ep=1, lnc=2, seq_len=262144, scheme=BLOCKWISE, layout=Layout(prefill_chunk=1024)))
    assert p.batch == 1 and not p.fits


def test_max_seq_len_steps_by_the_group_and_the_chunk(kimi):
    """The sharded cache at batch 16 holds 196,608 tokens (192 chunks of 1,024); the replicated cache with chunked
    prefill 53,248 at batch 1 (its chunk attention in the shell's 128-query tiles). Each is the last multiple of the
    chunk that fits."""
    for layout, batch, want in ((SEQ, 16, 196608), (Layout(prefill_chunk=1024), 1, 53248), (SEQ, 8, 262144)):
        p = max_seq_len(kimi, spec(tp=64, ep=1, lnc=2, batch=batch, scheme=BLOCKWISE, layout=layout))
        assert p.seq_len == want and p.fits and p.seq_len % 1024 == 0
        if want < kimi.max_position_embeddings:
            assert not _at(kimi, want + 1024, batch, layout).fits


@pytest.mark.parametrize("layout, kw, needle", [
    (Layout(kv_group=48), {}, "--kv-group 48: must divide --tp 64"),
    (Layout(kv_group=64), dict(seq_len=1000), "--seq-len 1000: with --kv-shard sequence must be a multiple"),
    (Layout(prefill_chunk=768), {}, "--prefill-chunk 768: must divide --seq-len 1024"),
    (Layout(kv_group=64, prefill_chunk=32), {}, "--prefill-chunk 32: must be a multiple of --kv-group"),
    (Layout(prefill_chunk=512), dict(max_context_length=1024), "--max-context-length 1024: with --prefill-chunk 512"),
    (Layout(prefill_chunk=1000), dict(seq_len=2000), "a prefill of 1000 tokens"),
    (Layout(kv_group=64), dict(kv_slots=2), "--kv-slots 2: the sequence-sharded cache"),
    (Layout(kv_group=0), {}, "--kv-group"),
    (Layout(shard_router=True), dict(tp=256, lnc=1), "--tp 256"),
], ids=["group not dividing tp", "seq not a multiple of G", "chunk not dividing seq", "chunk not a multiple of G",
        "bucket not the chunk", "chunk not in kernel tiles", "stock cache", "group 0", "tp past the cores"])
def test_layouts_nxdi_cannot_run_are_refused(kimi, one_line_error, layout, kw, needle):
    args = dict(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, layout=layout) | kw
    one_line_error(lambda: planned(kimi, args), needle)


def test_cli_plans_the_long_context_layout(capsys):
    args = ["plan", "--config", str(KIMI), "--tp", "64", "--experts", "fp8-blockwise", "--kv-shard", "sequence",
            "--prefill-chunk", "1024", "--shard-attn-a", "--shard-router"]
    assert main([*args, "--seq-len", "262144", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    for needle in ("layout: KV cache sequence-sharded over G=64 ranks (4224 slots per sequence per rank); prefill "
                   "chunks of 1024 tokens, one row per call; split across ranks: q_a/kv_a, router",
                   "attention q_a+kv_a (TP, gathered)", "router (TP, gathered) + bias (replicated)",
                   "prefill chunk attention (16 heads, 128-query tiles, 4 caches pooled)", "prefill 1 x 1024 tokens",
                   "its attention moves 38.5 MB per layer and rank",
                   "collectives per decode step", "router logits all-gather (TP), fp32", " 429 collectives "):
        assert needle in out, needle
    assert main([*args, "--seq-len", "131072", "--max-batch", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_batch"] == d["batch"] == 40 and d["layout"]["kv_group"] == 64 and d["cache_slots_per_rank"] == 2176
    assert [c["count"] for c in d["collectives"]] == [61, 61, 61, 61, 60]
    assert d["collectives"][0]["bytes"] == 73_728 * 40
    assert d["decode"]["collective_count"] == 125 + 304 and d["tpot_ms"] > d["tpot_lower_bound_ms"]
    assert main([*args, "--seq-len", "131072", "--max-batch"]) == 0
    assert capsys.readouterr().out.startswith("max batch at seq_len 131072: 40; the plan at it:")
    assert main([*args, "--max-seq-len", "--batch", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_seq_len"] == 262144


@pytest.mark.parametrize("flags, words", [
    (["--seq-len", "1024", "--kv-group", "8"], "--kv-group 8: only with --kv-shard sequence"),
    (["--seq-len", "1024", "--batch", "2", "--max-batch"], "--max-batch: searches the batch at --seq-len"),
    (["--max-seq-len", "--max-batch"], "--max-batch: searches the batch at --seq-len"),
    (["--seq-len", "1000", "--kv-shard", "sequence"], "--seq-len 1000: with --kv-shard sequence must be a multiple "
                                                      "of --kv-group 64"),
    (["--seq-len", "1024", "--prefill-chunk", "0"], "--prefill-chunk: expected an integer >= 1, got '0'"),
])
def test_cli_refuses_bad_layouts_in_one_line(flags, words, capsys, one_line_error):
    rc = main(["plan", "--config", str(KIMI), "--tp", "64", *flags])
    one_line_error.exit(rc, capsys.readouterr().err, words)


def test_the_sample_in_docs_planner_md_is_the_commands_output(capsys, monkeypatch):
    """docs/planner.md shows `plan`'s output for the recommended configuration: it must be what the command prints."""
    repo = Path(__file__).parents[2]
    command = "kimi-k2-neuron plan --config test/data/configs/kimi-k2-instruct-0905.json --tp 64 --seq-len 1024"
    doc = (repo / "docs" / "planner.md").read_text()
    shown = doc.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(repo)
    assert main(command.split()[1:]) == 0
    assert capsys.readouterr().out == shown


def test_max_batch_with_ep_decodes_on_all_experts(capsys):
    """--ep 4 decodes on all experts at any batch (the shell calls forward_all_experts_EP: nxd_moe.KimiExpertMLPs,
    where NxD's own forward would take selective loading below batch 48 and raise): --max-batch searches from batch
    1, and the batch it finds fits while one more row does not (the long-context layout, 1024-token chunks)."""
    cfg = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    layout = Layout(kv_group=64, prefill_chunk=1024, shard_attn_a=True, shard_router=True)
    found = max_batch(cfg, spec(tp=64, ep=4, lnc=2, seq_len=4096, scheme=BLOCKWISE, layout=layout))
    assert found.fits and found.batch >= 48
    assert not plan(cfg, spec(tp=64, ep=4, lnc=2, seq_len=4096, batch=found.batch + 1, scheme=BLOCKWISE, layout=layout)).fits


def test_the_readme_quotes_the_planners_figures(kimi):
    """Every planner figure the README's trn2 story quotes is what the planner computes now (each as printed there):
    the converted model (`plan --tp 1`), a rank's file at TP 64 (replicated and --shard-attn-a), the recommended
    configuration's HBM and TPOT, the long-context layout `plan --best` chooses, and the disk totals they add up to
    with the download sizes (958.5 and 554 GiB, from the releases' file lists, not the planner)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    flat = re.sub(r"\s*\n#?\s*", " ", readme)
    thinking = KimiK2Config.from_file(CONFIGS / "kimi-k2-thinking.json")
    tb = lambda gib: gib * GiB / 1e12  # noqa: E731

    def at(cfg, **fields):
        return plan(cfg, spec(**{"tp": 64, "seq_len": 1024, "scheme": _scheme(cfg, "fp8-blockwise"),
                                 "checkpoint": "/c", **fields}))

    whole = {c: at(c, tp=1, seq_len=16, moe_prefill="torch").weight_bytes / GiB for c in (kimi, thinking)}
    rank = {(c, a): at(c, layout=Layout(shard_attn_a=a)) for c in (kimi, thinking) for a in (False, True)}
    best = rank[(kimi, True)]
    chosen, _ = best_layout(kimi, spec(tp=64, seq_len=131072, batch=16, scheme=_scheme(kimi, "fp8-blockwise"),
                                       checkpoint="/c"))
    assert chosen.layout == Layout(kv_group=64, prefill_chunk=4096, shard_attn_a=True)
    short_chunks = at(kimi, seq_len=131072, batch=16, layout=Layout(kv_group=64, prefill_chunk=1024, shard_attn_a=True))
    download = {kimi: 958.5, thinking: 554}
    disk = {c: (round(tb(download[c]), 2), round(tb(whole[c]), 2), round(tb(64 * rank[(c, True)].weight_bytes / GiB), 2))
            for c in (kimi, thinking)}
    quoted = [
        f"{whole[kimi]:.1f} GiB", f"{whole[thinking]:.1f} GiB", f"{disk[kimi][1]:.2f} TB", f"{disk[thinking][1]:.2f} TB",
        f"{rank[(kimi, True)].weight_bytes / GiB:.2f} GiB", f"{rank[(kimi, False)].weight_bytes / GiB:.2f} GiB",
        f"{rank[(thinking, True)].weight_bytes / GiB:.2f} GiB", f"{disk[kimi][2]:.2f} TB", f"{disk[thinking][2]:.2f} TB",
        f"{sum(disk[kimi]):.2f} TB for -Instruct", f"{sum(disk[thinking]):.2f} TB for -Thinking",
        f"leaves {disk[kimi][1] + disk[kimi][2]:.2f} or {disk[thinking][1] + disk[thinking][2]:.2f} TB",
        f"{best.total_bytes / GiB:.2f} of {best.usable_bytes / GiB:.2f} usable GiB",
        f"{best.decode.total_s * 1e3:.1f} ms modelled TPOT against {rank[(kimi, False)].decode.total_s * 1e3:.1f}",
        f"a modelled TPOT of {best.decode.total_s * 1e3:.1f} ms",
        f"{chosen.decode.total_s * 1e3:.0f} ms modelled TPOT, {chosen.ttft_s:.0f} s for a whole 131,072-token prompt, "
        f"{chosen.headroom_bytes / GiB:.2f} GiB headroom (--prefill-chunk 1024: "
        f"{short_chunks.headroom_bytes / GiB:.2f} GiB, {short_chunks.ttft_s:.0f} s)"]
    assert [q for q in quoted if q not in flat] == []
