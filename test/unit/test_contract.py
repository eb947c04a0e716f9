"""kimi_k2_neuron.neuron.contract, what Kimi-K2 requires of NxDI, without NxD/NxDI: the SDK check, serving options ->
NeuronConfig kwargs and what they refuse (the same as the fit planner), compiler arguments, the modules NxD may
quantize, and the checkpoint's strict state dict; and its evidence, NXDI_CONTRACT.md, cited by name. What needs NxD/NxDI
itself (the real NeuronConfig, loading, the model) is test/nxdi_cpu's; what stands in for it here says "emulated"."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, ExpertScheme, scheme_for
from kimi_k2_neuron.model.model import KimiK2ForCausalLM
from kimi_k2_neuron.neuron import contract, loader, rules, sdk
from kimi_k2_neuron.neuron import vllm_request as vllm_request_
from kimi_k2_neuron.neuron.spec import RunSpec, Sampling
from kimi_k2_neuron.parallel import Layout
from kimi_k2_neuron.tiny.checkpoint import dense_weights, tiny_config_dict

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test/data/configs"


def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


def kimi_cfg() -> KimiK2Config:
    return KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")


PER_CHANNEL = ExpertScheme("fp8-per-channel", None)


def group(g: int) -> "Layout":
    return Layout(kv_group=g)


def per_channel(**opts) -> RunSpec:
    """A run of a converted fp8-per-channel checkpoint."""
    return RunSpec(**{"scheme": PER_CHANNEL, "checkpoint": "/c", **opts})


# -- the Neuron SDK ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sdk_import", ["import kimi_k2_neuron.neuron.modeling",
                                        "from kimi_k2_neuron.neuron import NeuronKimiK2ForCausalLM",
                                        "import kimi_k2_neuron.nxdi_cpu.backend",
                                        "import kimi_k2_neuron.neuron.serving"])
def test_import_without_sdk_names_the_missing_packages(sdk_import):
    if not sdk.missing_neuron_packages() == [p for _, p in sdk.NEURON_PACKAGES]:
        pytest.skip("some Neuron packages are importable here")
    r = subprocess.run([sys.executable, "-c", sdk_import], capture_output=True, text=True)
    assert r.returncode != 0 and "ImportError" in r.stderr
    for pip_name in ("neuronx-distributed-inference", "neuronx-distributed", "torch-neuronx"):
        assert pip_name in r.stderr
    assert "docs/nxdi_on_cpu.md" in r.stderr
    pure = ("import kimi_k2_neuron, kimi_k2_neuron.neuron.contract, kimi_k2_neuron.neuron.loader, "
            "kimi_k2_neuron.neuron.fit, kimi_k2_neuron.neuron.vllm_request")
    ok = subprocess.run([sys.executable, "-c", pure], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


# -- serving options -> MoENeuronConfig --------------------------------------------------------------------------------

def test_neuron_config_kwargs_compile_the_real_batch_and_a_dropless_moe():
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, batch=4, seq_len=2048, max_context_length=1024))
    # batch > 1 must reach both graphs: NeuronConfig defaults these four from batch_size only (config.py:161-167)
    assert [kw[k] for k in ("batch_size", "ctx_batch_size", "tkg_batch_size", "max_batch_size",
                            "kv_cache_batch_size")] == [4] * 5
    assert kw["capacity_factor"] is None and kw["disable_normalize_top_k_affinities"] is True
    assert kw["cast_type"] == "as-declared" and kw["router_config"] == {"act_fn": "sigmoid", "dtype": "float32"}
    assert kw["quantization_type"] == "expert_wise_per_channel_symmetric" and kw["quantization_dtype"] == "f8e4m3"
    assert "quantization_per_channel_axis" not in kw and "valid_moe_tp_degrees" not in kw  # not NeuronConfig fields
    assert kw["on_device_sampling_config"]["global_topk"] == 256 and kw["save_sharded_checkpoint"] is True
    assert (kw["seq_len"], kw["max_context_length"]) == (2048, 1024)
    # the recommended prefill: NxD's shard-on-block kernel, PING_PONG as the kernel asserts, its LNC given (NxD's
    # kernel LNC defaults to the platform's); test/nxdi_cpu checks NxD parses these keys into its config
    bmm = kw["blockwise_matmul_config"]
    assert bmm["logical_nc_config"] == 2 and bmm["use_shard_on_block_dynamic_while"] is True
    assert bmm["block_sharding_strategy"] == "PING_PONG" and bmm["block_size"] in (128, 256, 512, 1024)
    all_experts = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, lnc=1, moe_prefill="all-experts"))
    assert all_experts["blockwise_matmul_config"] == {"logical_nc_config": 1, "block_size": 2**30}
    assert contract.fp8_env(kw["quantized"], kw["quantization_dtype"]) == {"XLA_HANDLE_SPECIAL_SCALAR": "1",
                                                                           "UNSAFE_FP8FNCAST": "1"}


def test_logits_output_and_collective_flags():
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, sampling=Sampling(on_device=False),
                                                                output_logits=True))
    # without on-device sampling the lm_head already gathers the vocab; output_logits would gather it again
    assert kw["output_logits"] is False and kw["disable_numeric_cc_token"] is True


def test_blockwise_takes_the_block_layout_from_the_converted_checkpoint():
    cfg = kimi_cfg()
    for source, block in (("fp8", [32, 32]), ("int4", [32, 1])):
        scheme = scheme_for("fp8-blockwise", source, 32)
        kw = contract.neuron_config_kwargs(cfg, RunSpec(tp=64, scheme=scheme, checkpoint="/c"))
        assert kw["quantization_block_axis"] == [1, 2] and kw["quantization_block_size"] == block
        assert kw["quantization_scale_dtype"] == "f32"
        assert "valid_moe_tp_degrees" not in kw  # the scheme's, not a NeuronConfig field


def test_ep_is_moe_internal_expert_parallelism():
    """--ep splits the routed experts inside the TP ranks (NxDI moe_ep_degree x moe_tp_degree = tp_degree), so
    attention and the shared expert stay TP-sharded over every rank and MoE's single reduction counts each once."""
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, ep=16, batch=48))
    assert (kw["tp_degree"], kw["moe_ep_degree"], kw["moe_tp_degree"]) == (64, 16, 4) and "ep_degree" not in kw
    one = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64))
    assert "moe_ep_degree" not in one and "moe_tp_degree" not in one  # EP=1 keeps NxDI's defaults


def _emulated_neuron_parallel_linears(cfg: KimiK2Config) -> tuple[list[str], list[str]]:
    """(non-expert, expert) module paths of the layers NxD's convert() may quantize, from the core model's tree:
    the core's column/row/embedding/lm_head layers are the ones the Neuron build makes NxD parallel layers; routed
    experts become expert_mlps.mlp_op.{gate_up,down}_proj."""
    from kimi_k2_neuron import parallel

    with torch.device("meta"):
        core = KimiK2ForCausalLM(cfg)
    kinds = (parallel.ColumnParallelLinear, parallel.RowParallelLinear, parallel.ParallelEmbedding)
    plain, experts = set(), set()
    for name, mod in core.named_modules():
        if not isinstance(mod, kinds) or isinstance(mod, parallel.ReplicatedLinear):
            continue
        name = name.removeprefix("model.")
        if ".mlp.experts." in name:
            layer = name.split(".mlp.")[0]
            experts |= {f"{layer}.mlp.expert_mlps.mlp_op.gate_up_proj", f"{layer}.mlp.expert_mlps.mlp_op.down_proj"}
        else:
            plain.add(name)
    return sorted(plain), sorted(experts)


@pytest.mark.parametrize("cfg", [tiny_cfg(), tiny_cfg(num_hidden_layers=12, first_k_dense_replace=2), kimi_cfg()],
                         ids=["tiny", "12 layers, 2 dense", "kimi-k2"])
def test_modules_to_not_convert_covers_every_non_expert_parallel_linear_and_no_expert_emulated(cfg):
    """On the core's module tree as a stand-in for NxD's (at Kimi's real size, which cannot be built here);
    test/nxdi_cpu/test_modeling.py checks the real NxD conversion on the tiny model."""
    skip = contract.modules_to_not_convert(cfg)
    plain, experts = _emulated_neuron_parallel_linears(cfg)
    converted = lambda path: not any(key in path for key in skip)  # noqa: E731 (quantize.py:122-123)
    assert [p for p in plain if converted(p)] == []
    assert [p for p in experts if not converted(p)] == []


# -- what it refuses ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts,needle", [
    (dict(tp=3), "num_attention_heads=64 is not divisible by 3"),
    (dict(tp=64, ep=4, batch=1), "needs batch >= 48"),
    (dict(tp=64, ep=2, batch=48), "--ep 2 at --tp 64 --lnc 2: not an expert layout"),
    (dict(tp=64, ep=8, batch=48), "use --ep in [1, 4, 16, 64]"),
    (dict(tp=64, ep=16, batch=48, moe_prefill="all-experts"), "no EP variant; use --moe-prefill shard-on-block with "
     "at least 128 tokens per prefill call or --moe-prefill torch with at least 64 tokens per prefill call"),
    # 48 x 8 = 384 token-expert pairs: below the torch path's block of 512, so NxD's all-experts path
    (dict(tp=64, ep=16, batch=48, seq_len=1, max_context_length=1, moe_prefill="torch"),
     "takes NxD's all-experts path, which has no EP variant"),
    # 47 x 8 < 384 experts: selective loading
    (dict(tp=64, ep=16, batch=47, seq_len=1, max_context_length=1), "--ep 16 with --batch 47"),
    # shard-on-block at Kimi's shapes: the kernel's output tiles are 128 rows
    (dict(tp=64, seq_len=1000), "a prefill of 1000 tokens (batch x --max-context-length) must be a multiple of 128"),
    (dict(tp=64, lnc=1), "--moe-prefill shard-on-block with --lnc 1: nkilib has its MoE prefill kernels for LNC=2"),
    # 2048 / 64 = 32 expert columns per rank, 16 per physical core: below the kernel's 128-row tiles
    (dict(tp=64, moe_prefill="shard-on-intermediate"), "(16 here)"),
    (dict(tp=64, ep=4, batch=48, moe_prefill="shard-on-intermediate"), "(64 here)"),  # 2048 / 16 / 2
    (dict(tp=64, moe_prefill="kernel"), "--moe-prefill 'kernel': expected one of shard-on-block"),
    (dict(tp=64, checkpoint=None), "needs a converted checkpoint"),
    # [128, 32] blocks: a rank's 32 down-projection rows at TP 64 hold no whole 128-row block
    (dict(tp=64, scheme=ExpertScheme("fp8-blockwise", (128, 32))), "shard only [1, 2, 4, 8, 16] ways"),
    (dict(tp=64, seq_len=512, max_context_length=1024), "--max-context-length 1024"),
    (dict(tp=64, ep=3, batch=48), "--ep 3: must divide --tp 64"),
    (dict(tp=64, ep=4, batch=48, scheme=ExpertScheme("fp8-blockwise", (256, 32))), "experts split 16 ways (tp / ep)"),
    (dict(tp=64, layout=group(3)), "--kv-group 3: must divide --tp 64"),
    (dict(tp=64, layout=group(64), seq_len=1056, max_context_length=1024), "--seq-len 1056: with --kv-shard sequence"),
    (dict(tp=64, layout=group(64), max_context_length=1000, moe_prefill="torch"),
     "--max-context-length 1000: with --kv-shard"),
])
def test_neuron_config_kwargs_refuse_bad_configurations(opts, needle):
    with pytest.raises(KimiInputError) as e:
        contract.neuron_config_kwargs(kimi_cfg(), per_channel(**opts))
    assert needle in str(e.value)


def test_the_sequence_sharded_cache_is_nxdis_flash_decoding():
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, layout=group(64)))
    assert kw["flash_decoding_enabled"] is True
    assert "flash_decoding_enabled" not in contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64))


def emulated_nc(spec: RunSpec, **over) -> SimpleNamespace:
    """The NeuronConfig neuron_config_kwargs writes for `spec`, emulated (nested dicts as attributes, NxDI's
    max_length and buckets); the real one is test/nxdi_cpu/test_kv_shard.py's and test_modeling.py's."""
    kw = contract.neuron_config_kwargs(kimi_cfg(), spec)
    fields = {k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in kw.items()}
    fields.setdefault("moe_ep_degree", 1)
    fields |= dict(max_length=spec.seq_len, context_encoding_buckets=None, token_generation_buckets=None)
    return SimpleNamespace(**{**fields, **over})


FD = per_channel(tp=8, seq_len=1024, max_context_length=512, layout=group(4), moe_prefill="torch")


@pytest.mark.parametrize("nc_over,layout,needle", [
    (dict(flash_decoding_enabled=False), group(4), "flash_decoding_enabled=False with kimi_k2_layout.kv_group=4"),
    ({}, group(3), "max_length=1024 (not a multiple of kimi_k2_layout.kv_group=3)"),
    (dict(max_length=1022), group(4), "max_length=1022 (not a multiple of kimi_k2_layout.kv_group=4)"),
    (dict(max_context_length=502), group(4), "max_context_length=502: with --kv-shard sequence must be a multiple"),
    (dict(token_generation_buckets=[512, 1022]), group(4), "token_generation_buckets[1]=1022 (not a multiple"),
    (dict(tp_degree=12, max_length=1020), Layout(kv_group=3), "tp_degree=12: config.json field num_attention_heads=64"),
])
def test_a_reloaded_flash_decoding_config_is_checked_again_emulated(nc_over, layout, needle):
    """enforce_neuron_config on a NeuronConfig's fields (emulated; the real one: test/nxdi_cpu/test_kv_shard.py)."""
    with pytest.raises(KimiInputError, match="unsupported NeuronConfig") as e:
        contract.enforce_neuron_config(emulated_nc(FD, **nc_over), kimi_cfg(), layout)
    assert needle in str(e.value) and "\n" not in str(e.value)
    contract.enforce_neuron_config(emulated_nc(FD), kimi_cfg(), group(4))  # accepted
    # flash decoding at a group of one rank: NxDI's graph as trace-cpu traces it
    contract.enforce_neuron_config(emulated_nc(FD), kimi_cfg(), Layout())


@pytest.mark.parametrize("tokens", [1, 16, 47])
def test_the_ep_refusals_advice_is_accepted_and_is_the_least(tokens):
    """A prefill too short for a blockwise path with EP is refused with, per suggested mode, a token count; each is
    accepted by the same check, and one token fewer is not (the selective path below 384 / 8 = 48 tokens, the
    all-experts path below a block / 8, the kernel's whole 128-row tiles)."""
    from kimi_k2_neuron.neuron import moe_paths

    cfg = kimi_cfg()
    with pytest.raises(KimiInputError) as e:
        moe_paths.check_prefill_mode(cfg, "shard-on-block", 64, 4, 2, tokens)
    advice = re.findall(r"--moe-prefill (\S+) with at least (\d+) tokens", str(e.value))
    assert [m for m, _ in advice] == ["shard-on-block", "torch"]
    for mode_name, n in advice:
        moe_paths.check_prefill_mode(cfg, mode_name, 64, 4, 2, int(n))
        with pytest.raises(KimiInputError):
            moe_paths.check_prefill_mode(cfg, mode_name, 64, 4, 2, int(n) - 1)


# -- a serving framework's request (vllm-neuron) -----------------------------------------------------------------------

def vllm_request(**over) -> SimpleNamespace:
    """The NeuronConfig fields vllm-neuron 0.2.0 sets from vLLM's flags (emulated; the real one, built by the plugin
    itself, is test/nxdi_cpu/test_vllm_serving.py's), for --tensor-parallel-size 64 --max-num-seqs 4
    --max-model-len 2048."""
    fields = dict(tp_degree=64, batch_size=4, ctx_batch_size=1, seq_len=2048, max_context_length=2048,
                  torch_dtype=torch.bfloat16, logical_nc_config=2, moe_ep_degree=1, is_continuous_batching=True,
                  on_device_sampling_config=SimpleNamespace(dynamic=True, global_topk=256), is_prefix_caching=False,
                  is_block_kv_layout=False, is_chunked_prefill=False, on_cpu=False, quantized=False)
    return SimpleNamespace(**{**fields, **over})


def per_channel_record():
    from kimi_k2_neuron.formats.record import LAYOUT_VERSION, ConversionRecord

    nxd = PER_CHANNEL.nxd(kimi_cfg().moe_intermediate_size)
    return ConversionRecord.from_json({"layout_version": LAYOUT_VERSION, "experts": "fp8-per-channel", "nxd": nxd},
                                      "config.json")


def test_a_vllm_request_compiles_the_contracts_model_at_the_requests_shape():
    r = vllm_request_.spec_of_request(kimi_cfg(), vllm_request(), per_channel_record(), "/c")
    kw = contract.neuron_config_kwargs(kimi_cfg(), r)
    # the request's shape, NxDI's continuous batching as vllm-neuron runs it
    assert (kw["tp_degree"], kw["batch_size"], kw["seq_len"], kw["max_context_length"]) == (64, 4, 2048, 2048)
    assert kw["is_continuous_batching"] is True and kw["ctx_batch_size"] == 1
    assert kw["tkg_batch_size"] == kw["kv_cache_batch_size"] == 4 and kw["logical_nc_config"] == 2
    # the checkpoint's experts and the contract's model, none of which the request knows
    assert kw["quantized"] is True and kw["quantization_type"] == "expert_wise_per_channel_symmetric"
    assert kw["quantized_checkpoints_path"] == "/c" and kw["cast_type"] == "as-declared"
    assert kw["router_config"] == {"act_fn": "sigmoid", "dtype": "float32"} and kw["capacity_factor"] is None
    assert kw["on_device_sampling_config"]["dynamic"] is True and kw["save_sharded_checkpoint"] is True
    assert kw["blockwise_matmul_config"]["use_shard_on_block_dynamic_while"] is True  # the trn2 default mode


@pytest.mark.parametrize("over,record,needle", [
    (dict(is_prefix_caching=True, is_block_kv_layout=True, pa_block_size=32, pa_num_blocks=65), True,
     "give --num-gpu-blocks-override, at least --max-num-seqs x --max-model-len / --block-size = 256"),
    (dict(is_chunked_prefill=True, is_block_kv_layout=True, batch_size=1), True,
     "unset DISABLE_NEURON_CUSTOM_SCHEDULER"),
    (dict(torch_dtype=torch.float16), True, "--dtype float16: Kimi-K2 runs in bfloat16"),
    (dict(), False, "/c: a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron convert /c DST"),
    (dict(ctx_batch_size=4), True, "continuous batching with a prefill batch of 4"),
    (dict(tp_degree=3), True, "num_attention_heads=64 is not divisible by 3"),
    # the prefill kernel's 128-token tiles at Kimi's shapes: refused in vLLM's words, not a silent torch loop
    (dict(seq_len=1000, max_context_length=1000), True, "--max-model-len 1000: NxD's prefill kernel at these shapes "
     "computes whole 128-token tiles; use a multiple of 128 (1024 or 896)"),
])
def test_what_a_vllm_request_cannot_get_is_refused_in_one_line(over, record, needle, one_line_error):
    one_line_error(lambda: contract.neuron_config_kwargs(kimi_cfg(), vllm_request_.spec_of_request(
        kimi_cfg(), vllm_request(**over), per_channel_record() if record else None, "/c")), needle)


def test_prefill_rules_count_one_sequence_under_continuous_batching():
    """The kernel's 128-row tiles: 2 x 576 tokens would pass, but each prefill call holds one sequence of 576."""
    contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, batch=2, seq_len=576))
    with pytest.raises(KimiInputError, match="a prefill of 576 tokens"):
        contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, batch=2, seq_len=576, continuous_batching=True))


def chunk(n: int) -> "Layout":
    return Layout(prefill_chunk=n)


def test_a_prefill_chunk_makes_the_cte_one_row_of_the_chunk():
    """--prefill-chunk N: the CTE bucket is N, one row a call, written into its seq_id's line; decode keeps batch B."""
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, batch=4, seq_len=4096, layout=chunk(1024)))
    assert (kw["max_context_length"], kw["ctx_batch_size"], kw["is_continuous_batching"]) == (1024, 1, True)
    assert (kw["seq_len"], kw["tkg_batch_size"], kw["kv_cache_batch_size"]) == (4096, 4, 4)


@pytest.mark.parametrize("over,needle", [
    (dict(seq_len=4096, layout=chunk(1000)), "--prefill-chunk 1000: must divide --seq-len 4096"),
    (dict(seq_len=4096, layout=chunk(1024), max_context_length=2048),
     "--max-context-length 2048: with --prefill-chunk 1024 the prefill bucket is the chunk"),
    # shard-on-block, the default mode at these shapes: the kernel's 128-row output tiles, counted per chunk call
    (dict(seq_len=1536, layout=chunk(192)), "a prefill of 192 tokens"),
])
def test_what_a_prefill_chunk_cannot_run_is_refused_in_one_line(over, needle, one_line_error):
    one_line_error(lambda: contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, **over)), needle)


@pytest.mark.parametrize("over,needle", [
    (dict(async_mode=True), "async_mode=True"),
    (dict(max_context_length=512), "max_context_length=512: with kimi_k2_layout.prefill_chunk=256"),
    (dict(seq_len=1000, max_length=1000), "kimi_k2_layout.prefill_chunk=256: must divide seq_len=1000"),
    (dict(is_continuous_batching=False), "is_continuous_batching=False"),
    (dict(ctx_batch_size=2), "ctx_batch_size=2"),
])
def test_a_reloaded_neuron_config_the_chunk_driver_cannot_run_is_refused(over, needle, one_line_error):
    """What add_derived_config re-checks on every construction, on NeuronConfig-like fields (emulated)."""
    chunked = per_channel(tp=8, seq_len=1024, layout=chunk(256), moe_prefill="torch")
    one_line_error(lambda: contract.enforce_neuron_config(emulated_nc(chunked, **over), kimi_cfg(), chunk(256)),
                   "unsupported NeuronConfig", needle)
    contract.enforce_neuron_config(emulated_nc(chunked, **over), kimi_cfg(), Layout()) if over in (
        dict(is_continuous_batching=False), dict(async_mode=True)) else None  # no chunk: neither is needed


COMPILED = dict(tp_degree=64, max_batch_size=4, seq_len=1024, max_context_length=1024, is_continuous_batching=True,
                ctx_batch_size=1, on_device_sampling_config=SimpleNamespace(dynamic=True))


@pytest.mark.parametrize("request_over,compiled_over,needle", [
    (dict(batch_size=2, seq_len=512, max_context_length=512), {}, None),  # less than compiled: NxDI pads
    (dict(batch_size=4, seq_len=1024, max_context_length=1024), {}, None),
    (dict(batch_size=8, seq_len=1024, max_context_length=1024), {}, "--max-num-seqs 8 > the compiled batch 4"),
    (dict(seq_len=2048, max_context_length=2048), {}, "--max-model-len 2048 > the compiled seq_len 1024"),
    (dict(seq_len=1024, max_context_length=1024), dict(max_context_length=256),
     "prompts that long need a prefill of 1024 tokens, compiled for 256"),
    (dict(tp_degree=32, seq_len=1024, max_context_length=1024), {}, "--tensor-parallel-size 32, compiled for TP 64"),
    (dict(seq_len=1024, max_context_length=1024), dict(is_continuous_batching=False, ctx_batch_size=4),
     "runs NxDI's continuous batching, compiled without it"),
    (dict(seq_len=1024, max_context_length=1024), dict(on_device_sampling_config=SimpleNamespace(dynamic=False)),
     "static on-device sampling"),
])
def test_precompiled_artifacts_serve_a_request_up_to_their_compiled_shape(request_over, compiled_over, needle):
    r = vllm_request_.spec_of_request(kimi_cfg(), vllm_request(**request_over), per_channel_record(), "/c")
    bad = vllm_request_.compiled_mismatches(r, SimpleNamespace(**{**COMPILED, **compiled_over}))
    assert bad == [] if needle is None else (len(bad) == 1 and needle in bad[0]), bad


# -- compiler arguments, generation, pre-sharding ----------------------------------------------------------------------

def test_compiler_args_add_kimis_to_nxdis_without_contradicting_them():
    """The mechanism, on a string of NxDI's form: NxDI's flags kept as they are, each of Kimi's added once, none
    that contradicts a flag NxDI set. test/nxdi_cpu/test_modeling.py checks the result against what NxDI's own
    ModelWrapper computes, and that NxDI's own models use each of Kimi's flags."""
    nxdi_cte = ("--auto-cast=none --model-type=transformer --tensorizer-options='--cc-pipeline-tiling-factor=2' "
                "--lnc=2 -O1 --internal-hlo2tensorizer-options=' --modular-flow-mac-threshold=10 --verify-hlo=true'")
    got = contract.compiler_args(nxdi_cte)
    assert got.startswith(nxdi_cte + " ")
    added = got[len(nxdi_cte):]
    assert all(added.count(flag) == 1 for flag in contract.KIMI_COMPILER_ARGS)
    assert len(added.split()) == sum(len(f.split()) for f in contract.KIMI_COMPILER_ARGS)
    assert contract.compiler_args(got) == got  # idempotent
    # NxDI's long-context mode turns fp32 accumulation off and picks its own DGE levels: neither is overridden
    long_ctx = nxdi_cte + " --disable-mixed-precision-accumulation --internal-enable-dge-levels spill_reload"
    extra = contract.compiler_args(long_ctx)[len(long_ctx):]
    assert "--enable-mixed-precision-accumulation" not in extra and "--internal-enable-dge-levels" not in extra
    assert "--enable-saturate-infinity" in extra


def test_a_one_token_prompt_is_not_batched_with_longer_ones():
    rules.check_prompt_lengths([1, 1])
    rules.check_prompt_lengths([3, 2, 7])
    with pytest.raises(KimiInputError, match="one-token prompt cannot share a batch"):
        rules.check_prompt_lengths([5, 1])


@pytest.mark.parametrize("start,size,env,want", [
    (0, 64, {}, [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (48, 8), (56, 8)]),
    (0, 2, {}, [(0, 2)]),
    (16, 20, {}, [(16, 8), (24, 8), (32, 4)]),
    (0, 64, {"NXD_LAYOUT_TRANSFORMATION_OPTIONS": "on_cpu_and_serialize"}, [(0, 64)]),
])
def test_presharding_passes_cover_every_rank_once(start, size, env, want):
    assert loader.rank_passes(start, size, env) == want


# -- the checkpoint in the model's state dict --------------------------------------------------------------------------

def test_expected_keys_are_the_core_parameters_in_the_neuron_layout():
    cfg = tiny_cfg()
    with torch.device("meta"):
        core = KimiK2ForCausalLM(cfg)
    mapped = set()
    for name in core.state_dict():
        name = name.removeprefix("model.")
        if ".mlp.experts." in name:
            layer = name.split(".mlp.")[0]
            mapped |= {f"{layer}.mlp.expert_mlps.mlp_op.{p}_proj.weight" for p in ("gate_up", "down")}
        else:
            mapped.add(name.replace(".mlp.gate.", ".mlp.router."))
    assert loader.expected_keys(cfg, BF16_EXPERTS) == mapped
    fp8 = loader.expected_keys(cfg, PER_CHANNEL)
    assert fp8 - mapped == {k[: -len("weight")] + "scale" for k in mapped if ".expert_mlps." in k}


def test_converted_layout_keys_map_onto_the_model():
    cfg = tiny_cfg()
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert layout.module_key(layout.gate_up_key(L)) == f"layers.{L}.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
    assert layout.module_key(layout.scale_key(layout.down_key(L))) == \
        f"layers.{L}.mlp.expert_mlps.mlp_op.down_proj.scale"
    # the router is stored under its HF names; NxD's MoE holds it as `router`
    router = [f"model.layers.{L}.mlp.gate.weight", f"model.layers.{L}.mlp.gate.e_score_correction_bias"]
    assert [layout.module_key(k) for k in router] == [f"layers.{L}.mlp.router.weight",
                                                       f"layers.{L}.mlp.router.e_score_correction_bias"]
    assert layout.module_key("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") == \
        "layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert layout.module_key(f"model.layers.{L}.mlp.shared_experts.down_proj.weight") == \
        f"layers.{L}.mlp.shared_experts.down_proj.weight"
    assert layout.module_key("lm_head.weight") == "lm_head.weight"
    assert layout.is_ignored("model.layers.2.self_attn.rotary_emb.inv_freq")
    # the state dict takes what the format has a place for, sets aside the rotary buffers, and refuses the rest
    tensors, nc = _converted_tensors(cfg), SimpleNamespace(quantized=True, tp_degree=1,
                                                           quantization_type="expert_wise_per_channel_symmetric")
    inv_freq = {"model.layers.2.self_attn.rotary_emb.inv_freq": torch.zeros(1)}
    assert loader.to_neuron_state_dict({**tensors, **inv_freq}, cfg, nc).keys() == \
        loader.to_neuron_state_dict(tensors, cfg, nc).keys()
    with pytest.raises(KimiInputError, match="a raw checkpoint, to convert first"):
        loader.to_neuron_state_dict({**tensors, layout.expert_name(L, 3, "up_proj"): torch.zeros(1)}, cfg, nc)
    with pytest.raises(KimiInputError, match="no place"):
        loader.to_neuron_state_dict({**tensors, "model.layers.1.self_attn.q_a_proj.weight_scale_inv": torch.ones(1)},
                                      cfg, nc)


def _converted_tensors(cfg: KimiK2Config) -> dict[str, torch.Tensor]:
    """A converted-layout state dict (per-channel scheme) built by hand from the tiny dense weights."""
    dense = dense_weights(cfg, seed=0)
    out = {}
    for name, t in dense.items():
        if ".mlp.experts." in name:
            continue
        if ".mlp.gate." in name:  # the router, float32 under its HF names
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    for L in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(L):
            continue
        e = range(cfg.n_routed_experts)
        gu = torch.stack([torch.cat([dense[layout.expert_name(L, i, "gate_proj")].T,
                                     dense[layout.expert_name(L, i, "up_proj")].T], 1) for i in e])
        dn = torch.stack([dense[layout.expert_name(L, i, "down_proj")].T for i in e])
        for key, w in ((layout.gate_up_key(L), gu), (layout.down_key(L), dn)):
            scale = w.abs().amax(dim=1, keepdim=True) / 240.0
            out[key] = (w / scale).to(torch.float8_e4m3fn)
            out[layout.scale_key(key)] = scale.float()
    return out


def test_to_neuron_state_dict_is_strict_both_ways():
    cfg = tiny_cfg()
    nc = SimpleNamespace(quantized=True, quantization_type="expert_wise_per_channel_symmetric", tp_degree=2)
    tensors = _converted_tensors(cfg)
    state = loader.to_neuron_state_dict(tensors, cfg, nc)
    assert set(state) == loader.expected_keys(cfg, PER_CHANNEL) | {"rank_util.rank"}
    assert state["rank_util.rank"].tolist() == [0, 1]
    router = next(k for k in state if k.endswith("mlp.router.weight"))
    assert state[router].dtype == torch.float32
    missing = dict(tensors)
    del missing[layout.scale_key(layout.gate_up_key(1))]
    with pytest.raises(KimiInputError, match="1 tensor\\(s\\) missing"):
        loader.to_neuron_state_dict(missing, cfg, nc)
    with pytest.raises(KimiInputError, match="no place for"):
        loader.to_neuron_state_dict(tensors, cfg, SimpleNamespace(quantized=False, tp_degree=2))
    wrong = dict(tensors, **{layout.gate_up_key(1): tensors[layout.gate_up_key(1)].to(torch.bfloat16)})
    with pytest.raises(KimiInputError, match="expected torch.float8_e4m3fn"):
        loader.to_neuron_state_dict(wrong, cfg, nc)
    bad_shape = dict(tensors, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(KimiInputError, match="model.norm.weight|norm.weight has shape"):
        loader.to_neuron_state_dict(bad_shape, cfg, nc)
    scale = layout.scale_key(layout.down_key(1))
    bad_scale = dict(tensors, **{scale: tensors[scale][:, :, :-1]})  # per-channel [E, 1, H] is one column short
    with pytest.raises(KimiInputError, match="down_proj.scale has shape"):
        loader.to_neuron_state_dict(bad_scale, cfg, nc)



BOTH = Layout(shard_attn_a=True, shard_router=True)


@pytest.mark.parametrize("options", [Layout(shard_attn_a=True), Layout(
    shard_router=True), BOTH], ids=["attn-a", "router", "both"])
def test_for_layout_gives_the_sharded_layers_their_tensors(options):
    """q_a_proj rows then kv_a_proj_with_mqa rows in the fused tensor (the order the core splits it in), the router
    weight unchanged under its linear; nothing else moves, and the keys and shapes are layout.neuron_tensors'."""
    cfg = tiny_cfg()
    nc = SimpleNamespace(quantized=True, quantization_type="expert_wise_per_channel_symmetric", tp_degree=2)
    tensors = _converted_tensors(cfg)
    plain = loader.to_neuron_state_dict(tensors, cfg, nc)
    state = loader.for_layout(dict(plain), cfg, options)
    assert set(state) == loader.expected_keys(cfg, PER_CHANNEL, options) | {"rank_util.rank"}
    want = layout.neuron_tensors(cfg, PER_CHANNEL, options.shard_attn_a, options.shard_router)
    assert all(tuple(state[k].shape) == shape for k, (_, shape) in want.items())
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    fused = state.get(f"layers.{L}.self_attn.q_kv_a_proj.weight")
    q_a, kv_a = (tensors[f"model.layers.{L}.self_attn.{n}.weight"] for n in ("q_a_proj", "kv_a_proj_with_mqa"))
    if options.shard_attn_a:
        assert fused.dtype == torch.bfloat16 and fused.shape == (cfg.q_lora_rank + cfg.latent_dim, cfg.hidden_size)
        assert torch.equal(fused[:cfg.q_lora_rank], q_a) and torch.equal(fused[cfg.q_lora_rank:], kv_a)
    else:
        assert fused is None and torch.equal(state[f"layers.{L}.self_attn.q_a_proj.weight"], q_a)
    router = state[f"layers.{L}.mlp.router.{'linear_router.' if options.shard_router else ''}weight"]
    assert router.dtype == torch.float32 and torch.equal(router, tensors[f"model.layers.{L}.mlp.gate.weight"])
    assert torch.equal(state[f"layers.{L}.mlp.router.e_score_correction_bias"],
                       tensors[f"model.layers.{L}.mlp.gate.e_score_correction_bias"])
    untouched = {k for k in plain if "q_a_proj" not in k and "kv_a_proj" not in k and "router.weight" not in k}
    assert all(state[k] is plain[k] for k in untouched)


def test_the_router_linear_is_kept_out_of_quantization_with_shard_router():
    """NxD's quantize.convert would swap the router's ColumnParallelLinear for a quantized one (quantize.py:122-123);
    the entry matches no expert path."""
    cfg = kimi_cfg()
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    router, experts = f"layers.{L}.mlp.router.{layout.ROUTER_LINEAR}", f"layers.{L}.mlp.expert_mlps.mlp_op.gate_up_proj"
    for options, kept in ((Layout(), False), (BOTH, True)):
        skip = contract.modules_to_not_convert(cfg, options)
        assert any(key in router for key in skip) is kept
        assert not any(key in experts for key in skip)
    kw = contract.neuron_config_kwargs(cfg, per_channel(tp=64, layout=BOTH))
    assert kw["modules_to_not_convert"] == contract.modules_to_not_convert(cfg, BOTH)


def test_the_layout_attribute_round_trips_and_refuses_what_it_cannot_read(one_line_error):
    import json

    attr = json.loads(json.dumps(contract.layout_attribute(BOTH)))  # as NxDI saves and loads it
    assert contract.layout_of(SimpleNamespace(**{contract.LAYOUT_KEY: attr})) == BOTH
    assert contract.layout_of(SimpleNamespace()) == Layout()
    one_line_error(lambda: contract.layout_of(SimpleNamespace(**{contract.LAYOUT_KEY: {"shard_heads": True}})),
                   f"neuron_config.json field {contract.LAYOUT_KEY}: expected an object with fields among")
    bad_group = {"kv_group": 4, "prefill_chunk": 8, "chunk_group": 3}
    one_line_error(lambda: contract.layout_of(SimpleNamespace(**{contract.LAYOUT_KEY: bad_group})),
                   f"neuron_config.json field {contract.LAYOUT_KEY}.chunk_group 3: must be an integer dividing the KV "
                   f"group 4")


@pytest.mark.parametrize("options,message", [
    (Layout(shard_router=True), "--shard-router --tp 4: config.json field n_routed_experts=6 is not "
                                                "divisible by 4"),
    (Layout(shard_attn_a=True), "--shard-attn-a --tp 4: config.json field q_lora_rank=162 is not "
                                                "divisible by 4"),
])
def test_the_shell_refuses_layouts_it_cannot_build_in_one_line(one_line_error, options, message):
    """Uneven splits (NxD would pad the layer)."""
    cfg = tiny_cfg(n_routed_experts=6, q_lora_rank=162)
    o = RunSpec(tp=4, lnc=None, seq_len=16, scheme=BF16_EXPERTS, moe_prefill="torch", layout=options)
    one_line_error(lambda: contract.neuron_config_kwargs(cfg, o), message)



def test_the_chunk_with_the_sharded_cache_is_built():
    """--prefill-chunk with --kv-shard sequence: a batch-1 context-encoding bucket of N written at the row's line, and
    NxDI's flash decoding (the chunk submodel then reads the sharded cache: chunked_prefill.chunk_masks)."""
    o = RunSpec(tp=4, lnc=None, seq_len=16, scheme=BF16_EXPERTS, moe_prefill="torch",
                              layout=Layout(kv_group=4, prefill_chunk=8))
    kwargs = contract.neuron_config_kwargs(tiny_cfg(), o)
    got = [kwargs[k] for k in ("max_context_length", "ctx_batch_size", "is_continuous_batching",
                               "flash_decoding_enabled")]
    assert got == [8, 1, True, True]

# -- the contract document ---------------------------------------------------------------------------------------------

# the shell's, and the CPU harness's (NxD's CPU mode, which nothing on trn2 runs); neither cites the other's entries
DOCS = {"NXDI_CONTRACT.md": REPO / "src/kimi_k2_neuron/neuron/NXDI_CONTRACT.md",
        "NXD_CPU_MODE.md": REPO / "src/kimi_k2_neuron/nxdi_cpu/NXD_CPU_MODE.md"}
CITING = sorted([*(REPO / "src/kimi_k2_neuron").rglob("*.py"), *(REPO / "scripts").glob("*.py")])  # any may rest on NxD


def _cited_names(text: str, doc: str = "NXDI_CONTRACT.md") -> set[str]:
    """Entry names cited as `DOC: a, b`, also across a line break of a comment or docstring."""
    flat = re.sub(r"\s*\n\s*(#\s*)?", " ", text)
    return {name for group in re.findall(re.escape(doc) + r": ([a-z0-9-]+(?:, [a-z0-9-]+)*)", flat)
            for name in group.split(", ")}


def _prose(path: Path) -> list[str]:
    """The comments and docstrings of a module."""
    tree = ast.parse(path.read_text())
    docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    with open(path, "rb") as f:
        comments = [t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
    return docs + comments


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_contract_entry_exists_and_every_entry_is_cited(doc):
    entries = set(re.findall(r"^### ([a-z0-9-]+)$", DOCS[doc].read_text(), re.MULTILINE))
    cited = set().union(*(_cited_names(p.read_text(), doc) for p in CITING))
    assert cited - entries == set(), f"cited but not in {doc}"
    assert entries - cited == set(), f"in {doc} but cited nowhere"


def test_the_shell_knows_nothing_of_nxds_cpu_mode():
    """What runs on trn2 does not switch, build for, or talk through NxD's CPU mode: the harness (nxdi_cpu/) does."""
    shell = sorted((REPO / "src/kimi_k2_neuron/neuron").glob("*"))
    said = [f"{p.name}:{i}" for p in shell if p.suffix in (".py", ".md")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"NXD_CPU_MODE|set_aot_mode|gloo", line)]
    assert said == []
    ranks = [p.name for p in shell if p.suffix == ".py" and re.search(r"runtime[. ]+(import )?ranks|\.ranks import",
                                                                        p.read_text())]
    assert ranks == []


def test_the_code_cites_nxdi_lines_only_through_the_contract_document():
    """file:line evidence lives in NXDI_CONTRACT.md; comments, docstrings and messages name its entries."""
    pinned = re.compile(r"\w\.py:\s?\d|\bl\.\d")
    for path in CITING:
        assert [line for line in path.read_text().splitlines() if pinned.search(line)] == [], path.name
