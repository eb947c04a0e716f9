"""Both NxDI submodels trace to one clean XLA graph on torch_xla's CPU device, in NxD's device mode
(kimi_k2_neuron.nxdi_cpu.xla_trace, `kimi-k2-neuron trace-cpu`), and the graph computes what NxDI computes eagerly.

The reference is independent of the trace: the same submodel call run eagerly in NxD's CPU mode (torch ops on CPU
tensors); the traced graph is executed by XLA's CPU compiler. MoE paths covered: all-experts prefill and
selective-loading decode, NxD's torch code on the XLA device (not the NKI kernels a trn2 build may use).
"""

import json
import os
import subprocess
import sys

import pytest

from nxdi_support import cpu_options, stand_in_device_ops

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.nxdi_cpu import backend, xla_trace

# torch_xla reads its debug settings once, at its first graph execution in the process; enable the sync log at
# collection, before any test here (or elsewhere in the session) can execute a graph.
xla_trace.sync_log()

SCHEMES = ["fp8-blockwise", "fp8-per-channel"]
BF16_TOLERANCE = 2e-2  # max |traced - eager| / max |eager|


@pytest.fixture
def torch_fill_prefix(monkeypatch):
    """Test-only swap, for the trace's duration. In device mode NxDI's fill_prefix (kvcache/utils.py:70-84) writes
    the prefill's KV through torch_neuronx's xla_hlo_call (a DynamicUpdateSlice), which is binary-only: the nxdi-cpu
    venv's import shim raises there, a real Neuron SDK has it. Its CPU-mode branch (utils.py:71-73,
    `cache[:s] = prefix`) is the same update in plain torch and traces on torch_xla, so NxDI's own function is
    called in CPU mode for that one call. KVCacheManager imported the name (kv_cache_manager.py:17), so the name in
    kv_cache_manager is the one replaced; the product still calls NxDI's."""
    from neuronx_distributed_inference.modules.kvcache import kv_cache_manager, utils

    def fill_prefix_torch_branch(cache, prefix_cache):
        with backend.nxd_cpu_mode(True):
            return utils.fill_prefix(cache, prefix_cache)

    monkeypatch.setattr(kv_cache_manager, "fill_prefix", fill_prefix_torch_branch)


def _options(converted, scheme, submodel, batch, dtype="bfloat16"):
    return xla_trace.TraceOptions(cpu_options(model=str(converted[("fp8", scheme)]), dtype=dtype), submodel,
                                  seq_len=16, batch=batch)


def _assert_one_clean_graph(r):
    assert r.stopped is None, r.stopped
    assert (r.compiles, r.executes, r.host_syncs, r.syncs, r.aten_fallbacks) == (1, 1, 0, [], []), r.format()
    assert r.clean
    assert r.hlo_instructions > 1000  # the whole 3-layer forward, not a fragment (1736-1991 seen)
    assert set(r.rel_diff_vs_eager) == {"logits"} | {f"cache.{i}.{s}" for i in range(3) for s in "kv"}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("submodel", ["context", "token"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_submodel_traces_to_one_clean_graph_matching_eager_bf16(converted, torch_fill_prefix, scheme, submodel,
                                                                  batch):
    r = xla_trace.trace(_options(converted, scheme, submodel, batch))
    _assert_one_clean_graph(r)
    assert r.max_rel_diff_vs_eager < BF16_TOLERANCE, r.rel_diff_vs_eager
    # bf16 rounding (eager op by op vs XLA's fused graph) can only flip an argmax whose eager top-2 margin is within
    # twice the largest logit difference; seen once: per-channel context batch 2, row 1 (margin 0.016, diff 0.043).
    # float32 below compares argmax exactly.
    for m in r.argmax_mismatches:
        assert m["eager_margin"] <= 2 * r.max_abs_logit_diff, r.format()


@pytest.mark.parametrize("submodel", ["context", "token"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_float32_trace_equals_eager_exactly_enough_for_equal_argmax(converted, torch_fill_prefix, scheme, submodel):
    """float32 also traces at TP=1: with bf16 rounding out of the way the graph agrees with eager to ~1e-6."""
    r = xla_trace.trace(_options(converted, scheme, submodel, 2, dtype="float32"))
    _assert_one_clean_graph(r)
    assert r.max_rel_diff_vs_eager < 1e-5, r.rel_diff_vs_eager
    assert r.argmax_equal, r.format()


def test_a_host_sync_in_a_layer_is_caught_and_its_frame_named(converted, torch_fill_prefix):
    """The check cannot pass vacuously: a `.item()` injected by a forward hook on decoder layer 1 (test code; the
    product has none) cuts the graph in two, and torch_xla's debug output names the hook's frame."""
    p = xla_trace.prepare(_options(converted, "fp8-blockwise", "token", 1))

    def read_back_mid_forward(_module, _args, output):
        output[0].sum().item()

    p.model.layers[1].register_forward_hook(read_back_mid_forward)
    r = xla_trace.run(p)
    assert not r.clean and r.host_syncs == 1 and r.compiles == 2 and r.executes == 2
    assert "aten::_local_scalar_dense" in r.aten_fallbacks
    assert "access tensor value" in r.syncs[0].cause
    assert r.syncs[0].frames[0].startswith(f"read_back_mid_forward ({__file__}:")
    assert "read_back_mid_forward" in r.format()


def test_without_the_swap_context_encoding_writes_through_the_tiers_dynamic_update_slice(converted):
    """NxDI's fill_prefix as on device, an xla_hlo_call DynamicUpdateSlice, computed by the tier's stand-in
    (scripts/nxdi_cpu_tier/device_ops.py): the same one clean graph, equal to eager."""
    stand_in_device_ops()
    r = xla_trace.trace(_options(converted, "fp8-blockwise", "context", 1, dtype="float32"))
    _assert_one_clean_graph(r)
    assert r.max_rel_diff_vs_eager < 1e-5, r.rel_diff_vs_eager


def test_cli_reports_json_and_exit_code(converted):
    cmd = [sys.executable, "-m", "kimi_k2_neuron.cli", "trace-cpu", "--model", str(converted[("fp8", SCHEMES[0])]),
           "--submodel", "token", "--batch", "2", "--json"]
    # a fresh process: not this one's gloo rendezvous port (to_cpu set it here) nor its torch_xla debug file
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE", "NXD_CPU_MODE")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)  # the report alone on stdout: NxD's and gloo's prints go to stderr
    assert got["clean"] and (got["compiles"], got["executes"], got["host_syncs"]) == (1, 1, 0)
    assert got["aten_fallbacks"] == [] and got["max_rel_diff_vs_eager"] < BF16_TOLERANCE


def test_tp_above_one_is_refused_with_the_reason(converted):
    o = xla_trace.TraceOptions(cpu_options(model=str(converted[("fp8", SCHEMES[0])]), tp=2), "token")
    with pytest.raises(KimiInputError, match="mocked torch.distributed"):
        xla_trace.trace(o)


def test_a_bf16_difference_past_rounding_names_the_first_output_past_it_and_the_float32_check():
    """Issue 41: trace-cpu on a 7-layer checkpoint reached 0.257 in bf16 where docs/nxdi_on_cpu.md said ~1e-2 (3
    layers). The figures are those measured (docs/nxdi_on_cpu.md): rounding until layer 4, then a step at cache.5
    (a router near tie flipped in layer 4: its float32 top-3/4 margin 7e-4); float32 1.4e-6 or less everywhere."""
    diffs = {"logits": 0.257, **{f"cache.{i}.{s}": 0.0 for i in range(7) for s in "kv"},
             "cache.1.k": 0.0043, "cache.2.k": 0.0072, "cache.3.k": 0.0071, "cache.4.k": 0.0079, "cache.5.k": 0.1716,
             "cache.6.k": 0.1767}

    def report(dtype, scale=1.0):
        return xla_trace.TraceReport(
            submodel="token", batch=1, seq_len=16, dtype=dtype, compiles=1, executes=1, host_syncs=0, syncs=[],
            aten_fallbacks=[], hlo_instructions=4252, max_rel_diff_vs_eager=0.257 * scale,
            rel_diff_vs_eager={k: v * scale for k, v in diffs.items()}, argmax_equal=True, argmax_mismatches=[],
            max_abs_logit_diff=0.1)

    text = report("bfloat16").format()
    assert "cache.5.k is the first output past it" in text and "--dtype float32 tells" in text, text
    assert "note:" not in report("bfloat16", 1e-2 / 0.257).format()  # rounding's own figure: no note
    assert "note:" not in report("float32").format()  # float32 has no rounding to excuse it
