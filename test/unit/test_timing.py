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

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test" / "data" / "configs"
PLANNER_DOC = (REPO / "docs" / "planner.md").read_text()
# The DeepSeek-V3 contrib's vLLM sync ITLs at batch 1 and 8 (its README, seq 512), the source of the per-token cost
DSV3_VLLM_ITL_S = {1: 22.2e-3, 8: 47.6e-3}


def _published(name: str, **fields):
    pub = PUBLISHED_BY_NAME[name]
    cfg = KimiK2Config.from_file(CONFIGS / pub.config)
    spec, port = published_spec(cfg, name)
    return cfg, pub, plan(cfg, replace(spec, **fields), port)


def _moe_layers(cfg) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_the_per_layer_cost_is_the_deepseek_v3_contrib_s_tpot_less_its_bytes_and_collectives():
    cfg, pub, p = _published("deepseek-v3-contrib")
    refit = (pub.tpot_ms * 1e-3 - p.decode.bytes_s - p.decode.collectives_s) / cfg.num_hidden_layers
    assert refit == pytest.approx(TRN2.layer_s, abs=0.5e-6)


def test_the_per_token_moe_cost_is_the_contrib_s_batch_8_itl_beyond_its_bytes_and_collectives():
    """vLLM's own per-step cost is in both ITLs and cancels in their difference."""
    cfg, _, one = _published("deepseek-v3-contrib")
    _, _, eight = _published("deepseek-v3-contrib", batch=8)
    counted = (eight.decode.bytes_s + eight.decode.collectives_s) - (one.decode.bytes_s + one.decode.collectives_s)
    refit = (DSV3_VLLM_ITL_S[8] - DSV3_VLLM_ITL_S[1] - counted) / (7 * _moe_layers(cfg))
    assert refit == pytest.approx(TRN2.token_moe_s, abs=0.05e-6)
    assert eight.decode.batch_s == pytest.approx(7 * _moe_layers(cfg) * TRN2.token_moe_s)


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
    """The rows of the first markdown table after `heading` in docs/planner.md, cells stripped."""
    text = PLANNER_DOC[PLANNER_DOC.index(heading):]
    lines = []
    for line in text.splitlines():
        if line.startswith("|"):
            lines.append([c.strip() for c in line.strip("|").split("|")])
        elif lines:
            break
    return [r for r in lines[2:]]  # header and rule aside


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
    # 61 o_proj, 60 MoE and 1 dense-MLP all-reduces, the embedding's all-gather, the sampler's 6, 61 q_a|kv_a gathers
    assert decode["collective_count"] == sum(c["count"] for c in decode["collectives"]) == 129 + 61


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
