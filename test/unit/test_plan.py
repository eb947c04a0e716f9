"""Fit planner: known facts about what fits on a trn2.48xlarge, and byte counts checked by hand from the config."""

import json
from pathlib import Path

import pytest

from kimi_k2_neuron.cli import main
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.plan import GiB, plan

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


CONTRIB = dict(kv_slots=2, router_dtype="bf16")


def _row(p, prefix):
    (row,) = [r for r in p.weights if r.kind.startswith(prefix)]
    return row.bytes


def _hand_params(c):
    """Parameter count written out tensor by tensor, as the HF checkpoint stores them."""
    h, heads, n_moe = c.hidden_size, c.num_attention_heads, c.num_hidden_layers - c.first_k_dense_replace
    attn = (h * c.q_lora_rank + c.q_lora_rank                       # q_a_proj, q_a_layernorm
            + c.q_lora_rank * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)  # q_b_proj
            + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank        # kv_a_proj_with_mqa, kv_a_layernorm
            + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)      # kv_b_proj
            + heads * c.v_head_dim * h + 2 * h)                     # o_proj, input/post-attention norms
    expert = 3 * h * c.moe_intermediate_size
    moe = (c.n_routed_experts + c.n_shared_experts) * expert + c.n_routed_experts * (h + 1)  # + gate and its bias
    dense = 3 * h * c.intermediate_size
    return c.num_hidden_layers * attn + n_moe * moe + c.first_k_dense_replace * dense + 2 * c.vocab_size * h + h


# --- known facts -----------------------------------------------------------------------------------------------

def test_kimi_bf16_experts_do_not_fit_at_tp64(kimi):
    p = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=1, experts="bf16")
    assert not p.fits
    experts_gb = _row(p, "routed experts") / 1e9
    assert 31 < experts_gb < 33  # nxdi_contracts §6: "BF16 experts (≈ 32 GB per rank) do not fit"


def test_kimi_fp8_fits_at_tp64_seq1024(kimi):
    for fmt in ("fp8-blockwise", "fp8-per-channel"):
        p = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=1, experts=fmt)
        assert p.fits and p.headroom_bytes > 3 * GiB, fmt
        assert 15.5 < _row(p, "routed experts (") / 1e9 < 16.2  # nxdi_contracts §6: ≈ 15.9 GB per rank


# The two DeepSeek-V3 facts bracket the runtime's reservation (plan.RUNTIME_RESERVED_BYTES), so they hold by
# calibration: these tests keep the bracket and the constants consistent. The Kimi facts above are independent.
def test_dsv3_bf16_fits_at_seq512(dsv3):
    assert plan(dsv3, tp=64, ep=1, lnc=2, seq_len=512, batch=1, experts="bf16", **CONTRIB).fits


def test_dsv3_bf16_does_not_fit_at_seq1024(dsv3):
    assert not plan(dsv3, tp=64, ep=1, lnc=2, seq_len=1024, batch=1, experts="bf16", **CONTRIB).fits


def test_dsv3_bf16_is_marginal_and_the_reservation_is_inside_its_bracket(dsv3):
    p512, p1024 = (plan(dsv3, tp=64, ep=1, lnc=2, seq_len=s, batch=1, experts="bf16", **CONTRIB) for s in (512, 1024))
    assert p1024.headroom_bytes < 0 < p512.headroom_bytes < 0.1 * GiB
    # Per-rank weights with the contrib's bf16 router match its ~21.4 GB (GiB) per-rank checkpoint files.
    assert abs(p512.weight_bytes / GiB - 21.4) < 0.1
    # Its own explanation, "CTE scratchpad (512MB) + TKG (23.1GB)", is this planner's seq-1024 total.
    assert abs(p1024.total_bytes / GiB - (23.1 + 0.5)) < 0.05
    # This port needs 0.16 GiB more at seq 512 (its fp32 router outweighs the latent-only cache): it does not fit.
    assert not plan(dsv3, tp=64, ep=1, lnc=2, seq_len=512, batch=1, experts="bf16").fits


def test_dsv3_needs_tp64_lnc2(dsv3):
    assert not plan(dsv3, tp=32, ep=1, lnc=2, seq_len=512, batch=1, experts="bf16", **CONTRIB).fits  # ~40 GB/rank
    assert not plan(dsv3, tp=64, ep=1, lnc=1, seq_len=512, batch=1, experts="bf16", **CONTRIB).fits  # 12 GiB/core


# --- byte counts by hand -----------------------------------------------------------------------------------------

def test_total_params_match_hand_count(kimi, dsv3):
    for cfg, published in ((kimi, 1.0264e12), (dsv3, 671e9)):  # kimi_k2_family §7; DeepSeek-V3 paper
        params = _hand_params(cfg)
        assert abs(params / published - 1) < 2e-3
        # At TP=1 everything is on one core: bf16 is 2 bytes a parameter, the fp32 router 2 more.
        p = plan(cfg, tp=1, ep=1, lnc=2, seq_len=1, batch=1, experts="bf16")
        assert p.weight_bytes == 2 * params + 2 * _row(p, "router") // 4


def test_expert_scale_shapes_at_tp64(kimi):
    c, n_moe = kimi, kimi.num_hidden_layers - kimi.first_k_dense_replace
    e, h, i_local = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size // 64
    # [128, 32] blocks (nxdi_contracts §3.6): local gate_up scale [E,56,2], local down scale [E,1,224], fp32.
    b128 = plan(c, tp=64, ep=1, lnc=2, seq_len=1, batch=1, experts="fp8-blockwise", block=(128, 32))
    assert _row(b128, "routed expert scales") == n_moe * e * (56 * 2 + 1 * 224) * 4
    # What the converter writes for an FP8 source, [32, 32]: gate_up [E, 7168/32, 64/32], down [E, 32/32, 7168/32].
    blockwise = plan(c, tp=64, ep=1, lnc=2, seq_len=1, batch=1, experts="fp8-blockwise")
    assert _row(blockwise, "routed expert scales") == n_moe * e * (224 * 2 + 1 * 224) * 4
    # ... and for an INT4 source, [32, 1] (one scale per INT4 group): gate_up [E, 224, 64], down [E, 1, 7168].
    thinking = KimiK2Config.from_file(KIMI.parent / "kimi-k2-thinking.json")
    int4 = plan(thinking, tp=64, ep=1, lnc=2, seq_len=1, batch=1, experts="fp8-blockwise")
    assert _row(int4, "routed expert scales") == n_moe * e * (224 * 64 + 1 * 7168) * 4
    per_channel = plan(c, tp=64, ep=1, lnc=2, seq_len=1, batch=1, experts="fp8-per-channel")
    assert _row(per_channel, "routed expert scales") == n_moe * e * (2 * i_local + h) * 4  # [E,1,2I/tp] + [E,1,H]
    # --ep splits experts inside the 64 ranks: E/16 experts, each 64/16 = 4 ways; the same expert bytes per rank.
    ep16 = plan(c, tp=64, ep=16, lnc=2, seq_len=1, batch=48, experts="fp8-per-channel")
    assert _row(ep16, "routed experts (") == n_moe * (e // 16) * 3 * h * (c.moe_intermediate_size // 4)
    assert _row(ep16, "routed experts (") == _row(per_channel, "routed experts (")


def test_kv_cache_and_slots(kimi):
    p = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=1, experts="fp8-blockwise", kv_slots=2)
    assert p.kv_cache.bytes == 61 * 2 * 1024 * 576 * 2  # nxdi_contracts §1.4: 144 MB at B=1, S=1K
    one = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=4, experts="fp8-blockwise")
    assert one.kv_cache.bytes == p.kv_cache.bytes * 4 // 2  # our latent-only cache is the default


def test_roofline(kimi):
    p1 = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=1, experts="fp8-blockwise")
    assert p1.active_experts_per_layer == pytest.approx(kimi.num_experts_per_tok)
    assert p1.hbm_bytes_per_s == pytest.approx(2.9e12 / 4)
    assert p1.tpot_lower_bound_s == pytest.approx(p1.bytes_per_token / p1.hbm_bytes_per_s)
    p32 = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=32, experts="fp8-blockwise")
    assert 8 < p32.active_experts_per_layer < kimi.n_routed_experts  # selective loading: the experts hit
    assert p32.bytes_per_token > p1.bytes_per_token
    # batch * top_k >= E: NxD runs every expert (expert_mlps_v2.py:1473-1478); with EP > 1 it always does
    p48 = plan(kimi, tp=64, ep=1, lnc=2, seq_len=1024, batch=48, experts="fp8-blockwise")
    ep4 = plan(kimi, tp=64, ep=4, lnc=2, seq_len=1024, batch=48, experts="fp8-blockwise")
    assert p48.active_experts_per_layer == kimi.n_routed_experts and ep4.active_experts_per_layer == 384 // 4
    # Lower bound: at least the expert bytes it is expected to touch, never more than everything on the core.
    assert p1.bytes_per_token < p1.weight_bytes + p1.kv_cache.bytes


@pytest.mark.parametrize("kw,needle", [
    (dict(tp=128), "--tp 128"), (dict(tp=16, ep=32), "--ep 32: must divide --tp 16"),
    (dict(tp=64, ep=8, batch=48), "--ep 8 at --tp 64 --lnc 2: not an expert layout"),
    (dict(tp=64, ep=4, batch=47), "needs batch >= 48"), (dict(lnc=3), "--lnc"),
    (dict(seq_len=0), "--seq-len"), (dict(batch=0), "--batch"), (dict(experts="int4"), "--experts"),
    (dict(kv_slots=3), "--kv-slots"), (dict(tp=1, ep=5), "--ep 5"),
])
def test_bad_arguments(kimi, kw, needle):
    args = dict(tp=64, ep=1, lnc=2, seq_len=1024, batch=1, experts="bf16") | kw
    with pytest.raises(KimiInputError, match=needle):
        plan(kimi, **args)


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


def test_a_converted_checkpoint_is_planned_with_the_block_it_records(tiny_dirs, tmp_path):
    """A converted config.json drops the source's quantization_config, so the INT4 source's [32, 1] scales are
    known only from the conversion record; the CLI and compile_and_save both read it (plan.recorded_block)."""
    from kimi_k2_neuron.convert.converter import convert
    from kimi_k2_neuron.convert.layout import read_record
    from kimi_k2_neuron.plan import recorded_block

    dst = tmp_path / "int4-blockwise"
    convert(tiny_dirs["int4"], dst, "fp8-blockwise", progress=False)
    rec = read_record(dst)
    assert recorded_block(rec, "fp8-blockwise") == (32, 1)
    assert recorded_block(rec, "fp8-per-channel") is None and recorded_block(None, "fp8-blockwise") is None
    converted_cfg = KimiK2Config.from_file(dst)
    assert converted_cfg.quant is None  # what default_block would see: it would assume [32, 32]
    with_record = plan(converted_cfg, tp=2, ep=1, lnc=2, seq_len=8, batch=1, experts="fp8-blockwise",
                       block=recorded_block(rec, "fp8-blockwise"))
    source = plan(KimiK2Config.from_file(tiny_dirs["int4"]), tp=2, ep=1, lnc=2, seq_len=8, batch=1,
                  experts="fp8-blockwise")
    assert _row(with_record, "routed expert scales") == _row(source, "routed expert scales")
