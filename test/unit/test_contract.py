"""kimi_k2_neuron.neuron.contract, what Kimi-K2 requires of NxDI, without NxD/NxDI: the SDK check, a RunSpec ->
NeuronConfig kwargs (one way), the spec saved on the config and read back through the rules, the NeuronConfig fields
checked on every construction, compiler arguments, the modules NxD may quantize; and its evidence, NXDI_CONTRACT.md,
cited by name. What needs NxD/NxDI itself (the real NeuronConfig, loading, the model) is test/nxdi_cpu's; what stands
in for it here says "emulated". The rules are test_rules.py's, the loader test_loader.py's."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, scheme_for
from kimi_k2_neuron.model.model import KimiK2ForCausalLM
from kimi_k2_neuron.neuron import contract, rules, sdk
from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY, RunSpec, Sampling
from kimi_k2_neuron.placement import Layout

from specs import REPO, chunk, group, kimi_cfg, per_channel, tiny_cfg


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


def test_the_sequence_sharded_cache_is_nxdis_flash_decoding():
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, layout=group(64)))
    assert kw["flash_decoding_enabled"] is True
    assert "flash_decoding_enabled" not in contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64))


def emulated_nc(spec: RunSpec, **over) -> SimpleNamespace:
    """The NeuronConfig neuron_config_kwargs writes for `spec`, emulated (nested dicts as attributes, NxDI's defaults
    of what _field_problems reads); the real one is test/nxdi_cpu/test_run_spec.py's and test_kv_shard.py's."""
    kw = contract.neuron_config_kwargs(kimi_cfg(), spec)
    fields = {k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in kw.items()}
    fields["blockwise_matmul_config"].parallelize_token_to_block_mapping = True
    defaults = dict(moe_ep_degree=1, attention_dtype=None, async_mode=False, flash_decoding_enabled=False,
                    max_length=spec.seq_len, context_encoding_buckets=None, token_generation_buckets=None)
    return SimpleNamespace(**{**defaults, **fields, **over})


def enforce(spec: RunSpec, **over) -> None:
    """enforce_neuron_config as add_derived_config runs it, on emulated NeuronConfigs: `over` edits the one checked
    (as a hand-edited neuron_config.json would)."""
    derived = contract.neuron_config_kwargs(kimi_cfg(), spec)
    contract.enforce_neuron_config(emulated_nc(spec, **over), spec, emulated_nc(spec), derived)


FD = per_channel(tp=8, seq_len=1024, max_context_length=512, layout=group(4), moe_prefill="torch")


@pytest.mark.parametrize("nc_over,needle", [
    (dict(flash_decoding_enabled=False), "flash_decoding_enabled=False (the run spec kimi_k2_run_spec implies True)"),
    (dict(max_length=1022), "max_length=1022 (not a multiple of kimi_k2_run_spec.layout.kv_group=4)"),
    (dict(max_context_length=502), "max_context_length=502 (the run spec kimi_k2_run_spec implies 512)"),
    (dict(token_generation_buckets=[512, 1022]), "token_generation_buckets[1]=1022 (not a multiple"),
    (dict(tp_degree=12), "tp_degree=12 (the run spec kimi_k2_run_spec implies 8)"),
    (dict(capacity_factor=1.0), "capacity_factor=1.0 (drops prefill tokens"),
    (dict(is_block_kv_layout=True), "is_block_kv_layout=True (the run spec kimi_k2_run_spec implies False)"),
])
def test_a_reloaded_flash_decoding_config_is_checked_again_emulated(nc_over, needle, one_line_error):
    """Each NeuronConfig field the spec derives, compared with what it holds, and the fields no spec sets (emulated;
    the real NeuronConfig: test/nxdi_cpu/test_run_spec.py)."""
    one_line_error(lambda: enforce(FD, **nc_over), "unsupported NeuronConfig", needle)
    enforce(FD)  # accepted


class Config:
    """An InferenceConfig's attributes (emulated; hashable and weakly referenced, as the real one is)."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_a_reloaded_spec_meets_the_rules_once_named_by_its_field(one_line_error):
    """adopt_run_spec: a build's RunSpec is taken as it is (the rules ran before its NeuronConfig was derived); a
    reload's JSON is read back and put through rules.check, once, its refusal naming the saved field."""
    calls = []

    def counted(cfg, spec):
        calls.append(spec)
        return real(cfg, spec)

    real, cfg, spec = rules.check, kimi_cfg(), per_channel(tp=64, batch=4)
    try:
        rules.check = counted
        built = Config(**{RUN_SPEC_KEY: spec})
        assert contract.adopt_run_spec(built, cfg) is spec and calls == []
        assert getattr(built, RUN_SPEC_KEY) == json.loads(json.dumps(spec.to_json()))  # saved as JSON
        reloaded = Config(**{RUN_SPEC_KEY: json.loads(json.dumps(getattr(built, RUN_SPEC_KEY)))})
        assert contract.adopt_run_spec(reloaded, cfg) == spec and calls == [spec]
        assert contract.run_spec(reloaded) == spec
    finally:
        rules.check = real
    bad = Config(**{RUN_SPEC_KEY: {**spec.to_json(), "tp": 3}})
    one_line_error(lambda: contract.adopt_run_spec(bad, cfg), "neuron_config.json field kimi_k2_run_spec (as the "
                   "flags would ask): --tp 3: config.json field num_attention_heads=64 is not divisible by 3")
    one_line_error(lambda: contract.adopt_run_spec(Config(), cfg), "neuron_config.json: no field "
                   "kimi_k2_run_spec: not compiled by this version of kimi-k2-neuron")


# -- a serving framework's request (vllm-neuron) -----------------------------------------------------------------------


def test_a_prefill_chunk_makes_the_cte_one_row_of_the_chunk():
    """--prefill-chunk N: the CTE bucket is N, one row a call, written into its seq_id's line; decode keeps batch B."""
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, batch=4, seq_len=4096, layout=chunk(1024)))
    assert (kw["max_context_length"], kw["ctx_batch_size"], kw["is_continuous_batching"]) == (1024, 1, True)
    assert (kw["seq_len"], kw["tkg_batch_size"], kw["kv_cache_batch_size"]) == (4096, 4, 4)


@pytest.mark.parametrize("over,needle", [
    (dict(async_mode=True), "async_mode=True (NxDI's async path does not call _get_model_outputs"),
    (dict(max_context_length=512), "max_context_length=512 (the run spec kimi_k2_run_spec implies 256)"),
    (dict(seq_len=1000), "seq_len=1000 (the run spec kimi_k2_run_spec implies 1024)"),
    (dict(is_continuous_batching=False), "is_continuous_batching=False (the run spec kimi_k2_run_spec implies True)"),
    (dict(ctx_batch_size=2), "ctx_batch_size=2 (the run spec kimi_k2_run_spec implies 1)"),
])
def test_a_reloaded_neuron_config_the_chunk_driver_cannot_run_is_refused(over, needle, one_line_error):
    """What add_derived_config re-checks on every construction, on NeuronConfig-like fields (emulated)."""
    chunked = per_channel(tp=8, seq_len=1024, layout=chunk(256), moe_prefill="torch")
    one_line_error(lambda: enforce(chunked, **over), "unsupported NeuronConfig", needle)


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


# -- the checkpoint in the model's state dict --------------------------------------------------------------------------


def test_the_router_linear_is_kept_out_of_quantization_with_shard_router():
    """NxD's quantize.convert would swap the router's ColumnParallelLinear for a quantized one (quantize.py:122-123);
    the entry matches no expert path."""
    cfg = kimi_cfg()
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    router, experts = f"layers.{L}.mlp.router.{layout.ROUTER_LINEAR}", f"layers.{L}.mlp.expert_mlps.mlp_op.gate_up_proj"
    both = Layout(shard_attn_a=True, shard_router=True)
    for options, kept in ((Layout(), False), (both, True)):
        skip = contract.modules_to_not_convert(cfg, options)
        assert any(key in router for key in skip) is kept
        assert not any(key in experts for key in skip)
    kw = contract.neuron_config_kwargs(cfg, per_channel(tp=64, layout=both))
    assert kw["modules_to_not_convert"] == contract.modules_to_not_convert(cfg, both)


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
