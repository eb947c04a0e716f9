"""The time model (neuron/timing.py) against the published trn2 ports it is fitted on and checked against: each fitted
constant refit from its source's measurement, the ports it was not fitted on predicted within 25 %, and the tables of
docs/planner.md as the planner computes them. Estimates throughout: nothing here ran on trn2."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kimi_k2_neuron.cli import main
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron.fit import plan
from kimi_k2_neuron.neuron.layout_search import published_spec
from kimi_k2_neuron.neuron.timing import PUBLISHED, PUBLISHED_BY_NAME, TRN2

from specs import doc_table

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test" / "data" / "configs"
PLANNER_DOC = (REPO / "docs" / "planner.md").read_text()
# The DeepSeek-V3 contrib's vLLM sync ITLs at compiled batch 1, 2, 4 and 8 (its README, "vLLM Serving + GuideLLM Sweep",
# seq 512): the source of the per-token cost and of vLLM's per-step cost
DSV3_VLLM_ITL_S = {1: 22.2e-3, 2: 30.5e-3, 4: 37.1e-3, 8: 47.6e-3}


def _published(name: str, **fields):
    pub = PUBLISHED_BY_NAME[name]
    cfg = KimiK2Config.from_file(CONFIGS / pub.config)
    spec, port = published_spec(cfg, name)
    return cfg, pub, plan(cfg, replace(spec, **fields), port)


def _moe_layers(cfg) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_the_per_layer_cost_is_the_deepseek_v3_contrib_s_tpot_less_its_bytes_collectives_and_compute():
    cfg, pub, p = _published("deepseek-v3-contrib")
    d = p.decode
    refit = (pub.tpot_ms * 1e-3 - d.bytes_s - d.collectives_s - d.flops_s) / cfg.num_hidden_layers
    assert refit == pytest.approx(TRN2.layer_s, abs=0.5e-6)


def _itl_fit():
    """Least squares on all four published ITLs: ITL(b) - the modelled step without the per-token loop = vLLM's
    per-step cost + (b - 1) x MoE layers x the per-token cost -> (per-step, per-token, {batch: residual s})."""
    cfg = KimiK2Config.from_file(CONFIGS / "deepseek-v3.json")
    x, y = [], []
    for b, itl in DSV3_VLLM_ITL_S.items():
        d = _published("deepseek-v3-contrib", batch=b)[2].decode
        x.append((b - 1) * _moe_layers(cfg))
        y.append(itl - (d.total_s - d.batch_s))
    n, sx, sy = len(x), sum(x), sum(y)
    sxx, sxy = sum(v * v for v in x), sum(u * v for u, v in zip(x, y))
    token = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    step = (sy - token * sx) / n
    return step, token, {b: step + token * xi - yi for b, xi, yi in zip(DSV3_VLLM_ITL_S, x, y)}


def test_the_per_token_cost_and_vllm_s_step_are_the_least_squares_fit_of_all_four_itls():
    """The contrib's ITLs rise 8.3, 6.6 and 10.5 ms from batch 1 to 2, 4 and 8: concave, so no line through them is
    exact; the fit's residuals are docs/planner.md's ("the per-token cost")."""
    step, token, residuals = _itl_fit()
    assert token == pytest.approx(TRN2.token_moe_s, abs=0.05e-6)
    assert step == pytest.approx(TRN2.vllm_step_s, abs=0.005e-3)
    rows = {int(_number(r[0])): r for r in _table("| compiled batch | published ITL |")}
    assert sorted(rows) == sorted(DSV3_VLLM_ITL_S)
    for b, r in rows.items():
        _, p = _published("deepseek-v3-contrib", batch=b)[1:]
        modelled = p.decode.total_s + TRN2.vllm_step_s
        assert _number(r[1]) == DSV3_VLLM_ITL_S[b] * 1e3 and r[2] == f"{modelled * 1e3:.1f} ms"
        assert _number(r[3]) == pytest.approx(round(residuals[b] / DSV3_VLLM_ITL_S[b] * 100, 1), abs=0.051)
    assert max(abs(v) / DSV3_VLLM_ITL_S[b] for b, v in residuals.items()) < 0.13


def test_the_prefill_factor_is_the_contrib_s_ttft_over_its_counted_prefill():
    _, pub, p = _published("deepseek-v3-contrib")
    t = p.prefill
    on_core = (t.bytes_s + t.flops_s + t.fixed_s) / TRN2.prefill_factor  # what the factor scales
    refit = (pub.ttft_ms * 1e-3 - t.collectives_s) / on_core
    assert refit == pytest.approx(TRN2.prefill_factor, abs=0.005)
    assert p.ttft_s == p.prefill.total_s  # one 512-token bucket: no chunks


@pytest.mark.parametrize("name", [p.name for p in PUBLISHED if p.name != "deepseek-v3-contrib"])
def test_the_ports_not_fitted_on_are_predicted_within_25_percent(name):
    _, pub, p = _published(name)
    assert abs(p.decode.total_s * 1e3 / pub.tpot_ms - 1) <= 0.25


def _table(heading: str) -> list[list[str]]:
    return doc_table(PLANNER_DOC, heading)


def _number(cell: str) -> float:
    return float(re.sub(r"[^\d.+-]", "", cell.replace(",", "")))


def test_the_docs_table_of_published_ports_is_what_the_planner_computes():
    rows = _table("**Against the published ports**")
    assert [r[0] for r in rows] == [p.name for p in PUBLISHED]
    for name, config, tpot, modelled, error, ttft, modelled_ttft, ttft_error in rows:
        _, pub, p = _published(name)
        assert config == pub.config and _number(tpot) == pub.tpot_ms and _number(ttft) == round(pub.ttft_ms)
        assert modelled == f"{p.decode.total_s * 1e3:.2f} ms"
        assert _number(error) == pytest.approx(round((p.decode.total_s * 1e3 / pub.tpot_ms - 1) * 100, 1), abs=0.051)
        assert _number(modelled_ttft) == round(p.ttft_s * 1e3)
        assert _number(ttft_error) == round((p.ttft_s * 1e3 / pub.ttft_ms - 1) * 100)


def test_the_docs_constants_are_the_model_s():
    rows = {r[0]: r[1] for r in _table("| constant | value | source |")}
    assert rows["per-layer cost"] == f"{TRN2.layer_s * 1e6:.0f} us"
    assert rows["per-token MoE cost"] == f"{TRN2.token_moe_s * 1e6:.1f} us"
    assert rows["prefill factor"] == f"{TRN2.prefill_factor:.2f}"
    assert rows["collective latency"] == f"{TRN2.alpha_s * 1e6:.0f} us"
    assert rows["HBM bandwidth per logical core"] == f"{TRN2.hbm_bytes_per_s / 1e9:.0f} GB/s"


def _plan_json(capsys, *args) -> dict:
    assert main(["plan", "--config", str(CONFIGS / "kimi-k2-instruct-0905.json"), "--tp", "64", *args,
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_the_docs_table_of_layouts_by_time_is_what_plan_best_chooses(capsys):
    rows = _table("**The layout by time**")
    assert len(rows) == 4
    for shape, chosen, tpot, ttft, headroom, replicated in rows:
        seq_len, batch = (str(int(_number(x))) for x in shape.split(" x "))
        best = _plan_json(capsys, "--seq-len", seq_len, "--batch", batch, "--best")
        assert set(chosen.strip("`").split(" --")) <= set(" ".join(best["best_flags"]).split(" --")), shape
        assert tpot == f"{best['tpot_ms']:.2f} ms" and _number(ttft) == pytest.approx(best["ttft_ms"] / 1e3, abs=0.51)
        assert headroom == f"{best['headroom_gib']:.2f} GiB"
        if replicated == "does not fit":
            assert main(["plan", "--config", str(CONFIGS / "kimi-k2-instruct-0905.json"), "--tp", "64", "--seq-len",
                         seq_len, "--batch", batch]) == 1
            capsys.readouterr()
        else:
            assert replicated == f"{_plan_json(capsys, '--seq-len', seq_len, '--batch', batch)['tpot_ms']:.2f} ms"


def test_modelled_tpot_is_above_the_byte_roofline_and_every_component_is_reported(capsys):
    """Kimi-K2-Instruct-0905 at 8,192 x 1 (the layout that fits): the step is mostly per-step overhead, not bytes (the published ports run
    4-5x above their byte bound)."""
    d = _plan_json(capsys, "--seq-len", "8192", "--shard-attn-a")
    assert d["tpot_ms"] > 3 * d["tpot_lower_bound_ms"]
    decode = d["decode"]
    parts = ("bytes_ms", "collectives_ms", "fixed_ms", "batch_ms", "flops_ms")
    assert decode["total_ms"] == pytest.approx(sum(decode[k] for k in parts))
    assert decode["bytes_ms"] == pytest.approx(d["tpot_lower_bound_ms"])
    # 61 o_proj, 60 MoE and 1 dense-MLP all-reduces, the embedding's all-gather, the sampler's 2, 61 q_a|kv_a gathers
    assert decode["collective_count"] == sum(c["count"] for c in decode["collectives"]) == 125 + 61


@pytest.mark.parametrize("name, other", [("deepseek-v3-contrib", "kimi-k2-instruct-0905.json"),
                                         ("kimi-k2.5-community", "deepseek-v3.json")])
def test_a_port_is_planned_only_with_the_config_of_the_model_it_serves(name, other, capsys, one_line_error):
    """Each published port's shape is its own config.json's (test/data/configs), and another model's is refused:
    its times would be set against numbers that port never ran."""
    pub = PUBLISHED_BY_NAME[name]
    own = KimiK2Config.from_file(CONFIGS / pub.config)
    assert (own.hidden_size, own.num_hidden_layers, own.n_routed_experts, own.num_attention_heads) == pub.shape
    rc = main(["plan", "--config", str(CONFIGS / other), "--port", name])
    one_line_error.exit(rc, capsys.readouterr().err, f"--port {name}: the config given", "is not the model that "
                        "port serves", pub.config)


def test_returning_the_logits_beside_the_devices_tokens_costs_one_all_gather_a_step():
    """output_logits with on-device sampling (what vLLM serves, for the steps a grammar masks on the host:
    neuron/vllm_worker.py): the step's logits gathered across the TP group, B x vocab fp32 each step, one collective
    at the model's latency and link rate; nothing else of the step changes."""
    cfg = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    spec, port = published_spec(cfg, "kimi-k2.5-community")
    spec = replace(spec, sampling=replace(spec.sampling, on_device=True), batch=4, continuous_batching=True)
    base, logits = (plan(cfg, replace(spec, output_logits=o)).decode for o in (False, True))
    added = [c for c in logits.collectives if c not in base.collectives]
    assert [(c.count, c.group, c.bytes) for c in added] == [(1, 64, 4 * cfg.vocab_size * 4)]
    assert logits.total_s - base.total_s == pytest.approx(TRN2.alpha_s + 4 * cfg.vocab_size * 4 / TRN2.beta_bytes_per_s)



def test_vllm_md_quotes_the_planners_cost_of_the_logits():
    """docs/vllm.md's "Cost per step" figures are what the planner computes now: TP=64, LNC=2, an 8,192-token cache,
    the default experts, each batch's TPOT without and with output_logits and the difference, as printed there."""
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron.spec import RunSpec

    doc = re.sub(r"\s*\n\s*", " ", (REPO / "docs" / "vllm.md").read_text())
    cfg = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    quoted = []
    for batch in (1, 4, 8, 32):
        spec = RunSpec(tp=64, lnc=2, seq_len=8192, batch=batch, scheme=expert_scheme(cfg, None, None))
        base, logits = (plan(cfg, replace(spec, output_logits=o)).decode.total_s for o in (False, True))
        quoted.append(f"{base * 1e3:.3f} -> {logits * 1e3:.3f} ms at {'batch ' * (batch == 1)}{batch} "
                      f"(+{(logits - base) * 1e6:.1f} us)")
    assert [q for q in quoted if q not in doc] == []

def _plan_dict(seq_len: int, batch: int, path: str) -> dict:
    """The plan's JSON of Kimi-K2-Instruct-0905 at fp8-blockwise, TP=64, the replicated cache, on this decode path
    (fitting or not)."""
    from kimi_k2_neuron.formats.scheme import scheme_for
    from kimi_k2_neuron.neuron.spec import RunSpec

    cfg = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    return plan(cfg, RunSpec(tp=64, seq_len=seq_len, batch=batch, scheme=scheme_for("fp8-blockwise", "fp8"),
                             checkpoint="-", moe_decode=path)).to_dict()


def test_the_all_experts_decode_at_batch_48_counts_every_local_expert_s_compute():
    """The issue's count: forward_all_experts runs all 384 local experts for all 48 tokens, 3 x 7,168 x 32 weights
    each at TP=64, in 60 MoE layers: ~1.5 TFLOP a step per rank, ~10 ms at the TensorEngine's peak; the instruction
    model charges more (each 128 x 128 weight tile takes max(48, 64) cycles), and never zero."""
    d = _plan_dict(1024, 48, "all-experts")
    assert d["decode_path"] == "all-experts"
    routed = [m for m in d["decode"]["compute"]["matmuls"] if m["what"].startswith("routed")]
    flops = sum(2 * m["count"] * m["k"] * m["m"] * m["n"] for m in routed)
    assert flops == 2 * 384 * 48 * 3 * 7168 * 32 * 60 and 1.5e12 < flops < 1.6e12
    assert d["decode"]["flops_ms"] > 0
    assert d["decode"]["compute"]["routed_experts_ms"] >= flops / TRN2.bf16_flops * 1e3 > 9
    assert d["decode"]["total_ms"] == pytest.approx(sum(d["decode"][k] for k in (
        "bytes_ms", "collectives_ms", "fixed_ms", "batch_ms", "flops_ms")))


def test_selective_loading_computes_batch_x_top_k_experts_and_loops_over_the_tokens():
    one, eight = _plan_dict(1024, 1, "selective")["decode"], _plan_dict(1024, 8, "selective")["decode"]
    assert eight["compute"]["routed_experts_ms"] == pytest.approx(8 * one["compute"]["routed_experts_ms"])
    assert eight["batch_ms"] == pytest.approx(7 * 60 * TRN2.token_moe_s * 1e3) and one["batch_ms"] == 0


def test_the_sampler_s_collectives_are_nxdi_s_rotated_top_k():
    """NxDI's default on trn2 (top_k_kernel_enabled): each rank's top-256 of its vocabulary shard, then two all-gathers
    over the 64 ranks, values (float32) and indices (int32), [batch, 64 x 256] each (NXDI_CONTRACT.md:
    sampler-collectives; test/nxdi_cpu/test_time_model.py counts what NxDI's sampler issues)."""
    from kimi_k2_neuron.neuron.timing import decode_collectives

    cfg = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")
    spec = replace(published_spec(cfg, "kimi-k2.5-community")[0], sampling=replace(
        published_spec(cfg, "kimi-k2.5-community")[0].sampling, on_device=True), batch=4)
    (topk,) = [c for c in decode_collectives(cfg, spec) if "top-k" in c.what]
    assert (topk.count, topk.group, topk.bytes) == (2, 64, 4 * 64 * 256 * 4)
