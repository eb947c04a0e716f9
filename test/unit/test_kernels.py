"""neuron/kernels.py: the kernels the recommended trn2 configuration's graphs call, on or off with a reason each, and
the prefill work it counts for the planner. The counts are checked against the kernels' own loops in the nxdi-cpu tier
(test/nxdi_cpu/test_prefill_kernels.py); here, what the report says and that every reason rests on a contract entry."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.neuron import kernels
from kimi_k2_neuron.neuron.spec import RunSpec, Sampling

REPO = Path(__file__).resolve().parents[2]
REAL = KimiK2Config.from_file(REPO / "test/data/configs/kimi-k2-instruct-0905.json")
BLOCKWISE = ExpertScheme("fp8-blockwise", (32, 32))
CONTRACT = (REPO / "src/kimi_k2_neuron/neuron/NXDI_CONTRACT.md").read_text()


def _report(on_device_sampling=True, **kw):
    spec = RunSpec(tp=64, lnc=2, seq_len=1024, batch=1, scheme=BLOCKWISE, moe_prefill="shard-on-block",
                   sampling=Sampling(on_device=on_device_sampling))
    return {r["kernel"]: r for r in kernels.report(REAL, dataclasses.replace(spec, **kw))}


def test_the_recommended_configuration_runs_shard_on_block_and_the_sampler_kernels_only():
    r = _report()
    on = sorted(k for k, v in r.items() if v["on"])
    assert on == ["bwmm_shard_on_block", "cumsum", "topk (rotational)"]
    why = r["bwmm_shard_on_block"]["why"]
    assert "445 blocks of 128 rows" in why and "7.0x the 8192 routed rows" in why and "1.32 GB" in why
    assert r["bwmm_shard_on_block"]["submodel"] == "context_encoding"
    for name in ("moe_block_tkg (NxD MoEFusedTKG)", "router_topk", "mlp (mlp_tkg)",
                 "attention_block_tkg / attention_tkg", "cascaded_max",
                 "blockwise_mm_baseline_shard_intermediate_hybrid"):
        assert not r[name]["on"] and r[name]["why"]


def test_every_off_reason_rests_on_a_contract_entry():
    entries = set(re.findall(r"^### ([a-z0-9-]+)$", CONTRACT, re.MULTILINE))
    for name, row in _report().items():
        cited = re.findall(r"NXDI_CONTRACT\.md: ([a-z0-9-]+)", row["why"])
        if name.startswith("bwmm") or name.startswith("blockwise_mm"):
            continue  # the numbers, and the mode's own description
        assert cited and set(cited) <= entries, (name, row["why"])


def test_without_on_device_sampling_the_sampler_kernels_are_not_listed():
    assert not {"topk (rotational)", "cumsum", "cascaded_max"} & set(_report(on_device_sampling=False))


def test_a_small_prefill_names_the_path_it_takes_instead_of_the_kernel():
    r = _report(seq_len=32)  # 32 x 8 < 384 experts: selective loading
    assert not r["bwmm_shard_on_block"]["on"] and "selective" in r["bwmm_shard_on_block"]["why"]


def test_prefill_work_per_mode():
    sob = kernels.prefill_work(REAL, "shard-on-block", 2048, 64)
    assert (sob.blocks, sob.blocks_per_core, sob.routed_rows) == (509, 255, 16384)  # ceil((16384-383)/128)+383
    soi = kernels.prefill_work(REAL, "shard-on-intermediate", 1024, 64, 16)
    assert (soi.blocks, soi.columns_per_core, soi.block_size) == (24, 256, 256)
    assert kernels.prefill_work(REAL, "shard-on-intermediate", 1024, 64, 16, "worst").blocks == 55
    torch_loop = kernels.prefill_work(REAL, "torch", 1024, 64)
    assert torch_loop.blocks == torch_loop.blocks_per_core == 399 and torch_loop.kernel is None
    assert kernels.prefill_work(REAL, "all-experts", 1024, 64).padded_rows == 384 * 1024
    with pytest.raises(ValueError, match="routing"):
        kernels.prefill_work(REAL, "shard-on-block", 1024, 64, routing="typical")


def test_dequantize_traffic_counts_what_nxd_moves_per_moe_layer():
    t = kernels.dequantize_traffic(REAL, BLOCKWISE, 64)
    assert t.elements == 384 * 3 * 7168 * 32
    assert (t.fp8_read, t.bf16_written, t.bf16_read) == (t.elements, 2 * t.elements, 2 * t.elements)
    per_channel = kernels.dequantize_traffic(REAL, ExpertScheme("fp8-per-channel", None), 64)
    assert per_channel.scale_read == 4 * 384 * (2 * 32 + 7168)  # one fp32 scale per output column
    assert kernels.dequantize_traffic(REAL, ExpertScheme("bf16", None), 64) is None
