"""The Neuron shell on CPU: what can be checked without the SDK, against the core's numbers.

kimi_k2_neuron.neuron raises ImportError without the SDK, so its SDK-free files (contract.py, loader.py) are loaded
through an alias package over the same folder that does not run the package __init__. The NxDI prefill/decode flow
is emulated step by step from NxDI's source (cited at each step) around the shell's own attention block, and
compared with the core's CPU runner.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kimi_k2_neuron.checkpoint.tiny import dense_weights, tiny_config_dict
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.convert import layout
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.model.model import KimiK2ForCausalLM
from kimi_k2_neuron.model.moe import MoE
from kimi_k2_neuron.runtime.runner import CpuRunner

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test/data/configs"
SCRIPTS = ("compile_and_save.py", "run_inference.py", "bench_tpot.py")


def _sdk_free(name: str):
    pkg = types.ModuleType("_kimi_neuron_sdk_free")
    pkg.__path__ = [str(REPO / "src/kimi_k2_neuron/neuron")]
    sys.modules.setdefault(pkg.__name__, pkg)
    return importlib.import_module(f"_kimi_neuron_sdk_free.{name}")


contract = _sdk_free("contract")
loader = _sdk_free("loader")
keys = _sdk_free("keys")
layers = _sdk_free("layers")


def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


def kimi_cfg() -> KimiK2Config:
    return KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")


PER_CHANNEL = {"quantized": True, "quantization_dtype": "f8e4m3",
               "quantization_type": "expert_wise_per_channel_symmetric", "quantization_per_channel_axis": 2,
               "valid_moe_tp_degrees": [1, 2, 4, 8, 16, 32, 64]}


# -- the package without the SDK, and the scripts' --help ---------------------------------------------------------

def test_import_without_sdk_names_the_missing_packages():
    if not contract.missing_neuron_packages() == [p for _, p in contract.NEURON_PACKAGES]:
        pytest.skip("some Neuron packages are importable here")
    r = subprocess.run([sys.executable, "-c", "import kimi_k2_neuron.neuron"], capture_output=True, text=True)
    assert r.returncode != 0 and "ImportError" in r.stderr
    for pip_name in ("neuronx-distributed-inference", "neuronx-distributed", "torch-neuronx"):
        assert pip_name in r.stderr
    ok = subprocess.run([sys.executable, "-c", "import kimi_k2_neuron"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_works_without_sdk(script):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def _compile(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), *args], capture_output=True,
                          text=True)


def test_compile_checks_the_fit_before_anything_else(tmp_path):
    """The real Kimi config with a converted-checkpoint record and no tensors: the planner refuses TP=8."""
    raw = json.loads((CONFIGS / "kimi-k2-instruct-0905.json").read_text())
    rec = {"layout_version": layout.LAYOUT_VERSION, "experts": "fp8-per-channel", "nxd": PER_CHANNEL}
    (tmp_path / "config.json").write_text(json.dumps({**raw, layout.CONVERSION_KEY: rec}))
    r = _compile("--model", str(tmp_path), "--out", str(tmp_path / "c"), "--tp", "8")
    assert r.returncode == 2 and "does not fit" in r.stderr and "pass --force" in r.stderr, r.stderr


def test_compile_plans_a_converted_checkpoint_with_its_recorded_block(tmp_path):
    """K2-Thinking converted to fp8-blockwise keeps one scale per INT4 group ([32, 1]); its converted config.json
    has no quantization_config any more, so only the record says so, and the fit check must use it."""
    from kimi_k2_neuron.plan import plan

    raw = json.loads((CONFIGS / "kimi-k2-thinking.json").read_text())
    raw.pop("quantization_config")
    nxd = layout.scheme_for("fp8-blockwise", "int4", 32).nxd(raw["moe_intermediate_size"])
    rec = {"layout_version": layout.LAYOUT_VERSION, "experts": "fp8-blockwise", "nxd": nxd}
    (tmp_path / "config.json").write_text(json.dumps({**raw, layout.CONVERSION_KEY: rec}))
    r = _compile("--model", str(tmp_path), "--out", str(tmp_path / "c"), "--tp", "64")
    want = plan(KimiK2Config.from_file(tmp_path), 64, 1, 2, 1024, 1, "fp8-blockwise", kv_slots=1, block=(32, 1))
    assert want.summary() in r.stdout, r.stdout + r.stderr


def test_compile_without_the_sdk_stops_with_a_one_line_error(tiny_dirs, tmp_path):
    if not contract.missing_neuron_packages():
        pytest.skip("the Neuron SDK is importable here")
    r = _compile("--model", str(tiny_dirs["fp8"]), "--out", str(tmp_path / "c"), "--tp", "2")
    assert r.returncode == 2 and "(fits)" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("error: kimi_k2_neuron.neuron needs the AWS Neuron SDK"), r.stderr


# -- InferenceConfig derivation and the NeuronConfig ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["kimi-k2-instruct.json", "kimi-k2-instruct-0905.json", "kimi-k2-thinking.json"])
def test_derived_fields_are_idempotent_under_the_json_round_trip(name, tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / name).read_text())
    attrs = contract.hf_attributes(tmp_path)
    first = {**attrs, **contract.derived_fields(attrs)}
    # InferenceConfig.save -> load: to_dict/json, then the constructor runs add_derived_config again
    reloaded = json.loads(json.dumps(first))
    again = {**reloaded, **contract.derived_fields(reloaded)}
    assert again == first
    cfg = KimiK2Config.from_file(tmp_path)
    assert first["head_dim"] == cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576
    assert first["num_local_experts"] == cfg.n_routed_experts
    # HF fields are untouched, so the core config re-parsed from the reloaded attributes is the same model
    # (intermediate_size is still the dense MLP's; num_key_value_heads keeps the HF value).
    core = KimiK2Config.from_dict({k: v for k, v in again.items() if k != "quantization_config"})
    assert (core.intermediate_size, core.moe_intermediate_size) == (cfg.intermediate_size, cfg.moe_intermediate_size)
    assert again["num_key_value_heads"] == json.loads((CONFIGS / name).read_text())["num_key_value_heads"]
    assert core == KimiK2Config.from_dict({**json.loads((CONFIGS / name).read_text()), "quantization_config": None})


def test_config_attributes_make_the_pretrained_config_the_generation_adapter_builds(tmp_path):
    """HuggingFaceGenerationAdapter turns the InferenceConfig's attributes into a transformers PretrainedConfig
    (hf_adapter.py:91-107); use_return_dict, a read-only property there, must not be among them."""
    (tmp_path / "config.json").write_text((CONFIGS / "kimi-k2-instruct-0905.json").read_text())
    attrs = contract.hf_attributes(tmp_path)
    attrs.update(contract.derived_fields(attrs))
    assert "use_return_dict" not in attrs
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("NxDI 0.9.0 pins transformers 4.57; transformers 5 standardizes rope parameters differently")
    transformers.PretrainedConfig(**attrs, fused_spec_config=None, metadata=None, dtype=torch.bfloat16)


def _reloaded_moe_neuron_config(**over):
    """What MoENeuronConfig holds after a reload from neuron_config.json: normalize_top_k_affinities back at its
    default True (config.py:822 reads only disable_normalize_top_k_affinities), router_config a RouterConfig."""
    base = dict(normalize_top_k_affinities=True, capacity_factor=None, glu_mlp=True, glu_type="glu",
                cast_type="as-declared", router_config=SimpleNamespace(act_fn="softmax", dtype=torch.float32),
                sequence_parallel_enabled=False, padding_side="right", moe_fused_nki_kernel_enabled=None,
                attention_dp_degree=1)
    return SimpleNamespace(**{**base, **over})


def test_enforce_neuron_config_restores_our_settings_and_is_idempotent():
    nc = _reloaded_moe_neuron_config()
    contract.enforce_neuron_config(nc)
    after = dict(vars(nc), router_config=vars(nc.router_config).copy())
    contract.enforce_neuron_config(nc)
    assert dict(vars(nc), router_config=vars(nc.router_config)) == after
    assert nc.normalize_top_k_affinities is False and nc.cast_type == "as-declared"
    assert (nc.router_config.act_fn, nc.router_config.dtype) == ("sigmoid", torch.float32)


@pytest.mark.parametrize("over,needle", [
    ({"capacity_factor": 1.0}, "capacity_factor=1.0 (drops prefill tokens"),
    ({"sequence_parallel_enabled": True}, "sequence_parallel_enabled=True"),
    ({"moe_fused_nki_kernel_enabled": True}, "selection-only bias"),
    ({"padding_side": "left"}, "padding_side='left'"),
    ({"qkv_kernel_fuse_residual_add": True}, "returns no residual"),
    ({"torch_dtype": torch.bfloat16, "attention_dtype": torch.float32}, "attention_dtype=torch.float32 != torch_dtype"),
])
def test_enforce_neuron_config_refuses_what_is_not_implemented(over, needle):
    with pytest.raises(KimiInputError, match="unsupported NeuronConfig") as e:
        contract.enforce_neuron_config(_reloaded_moe_neuron_config(**over))
    assert needle in str(e.value)


def test_neuron_config_kwargs_compile_the_real_batch_and_a_dropless_moe():
    kw = contract.neuron_config_kwargs(kimi_cfg(), contract.ServeOptions(
        tp=64, batch=4, seq_len=2048, max_context_length=1024, checkpoint="/c", quant_record=PER_CHANNEL))
    # batch > 1 must reach both graphs: NeuronConfig defaults these four from batch_size only (config.py:161-167)
    assert [kw[k] for k in ("batch_size", "ctx_batch_size", "tkg_batch_size", "max_batch_size",
                            "kv_cache_batch_size")] == [4] * 5
    assert kw["capacity_factor"] is None and kw["disable_normalize_top_k_affinities"] is True
    assert kw["cast_type"] == "as-declared" and kw["router_config"] == {"act_fn": "sigmoid", "dtype": "float32"}
    assert kw["quantization_type"] == "expert_wise_per_channel_symmetric" and kw["quantization_dtype"] == "f8e4m3"
    assert "quantization_per_channel_axis" not in kw and "valid_moe_tp_degrees" not in kw  # not NeuronConfig fields
    assert kw["on_device_sampling_config"]["global_topk"] == 256 and kw["save_sharded_checkpoint"] is True
    assert (kw["seq_len"], kw["max_context_length"]) == (2048, 1024)
    assert kw["blockwise_matmul_config"] == {"logical_nc_config": 2}
    all_experts = contract.neuron_config_kwargs(kimi_cfg(), contract.ServeOptions(
        tp=64, lnc=1, checkpoint="/c", quant_record=PER_CHANNEL, moe_prefill="all-experts"))
    assert all_experts["blockwise_matmul_config"] == {"logical_nc_config": 1, "block_size": 2**30}
    assert contract.fp8_env(kw["quantized"], kw["quantization_dtype"]) == {"XLA_HANDLE_SPECIAL_SCALAR": "1",
                                                                           "UNSAFE_FP8FNCAST": "1"}


def test_logits_output_and_collective_flags():
    kw = contract.neuron_config_kwargs(kimi_cfg(), contract.ServeOptions(
        tp=64, checkpoint="/c", quant_record=PER_CHANNEL, on_device_sampling=False, output_logits=True))
    # without on-device sampling the lm_head already gathers the vocab; output_logits would gather it again
    assert kw["output_logits"] is False and kw["disable_numeric_cc_token"] is True


@pytest.mark.parametrize("over,needle", [
    (dict(moe_tp_degree=8), "moe_tp_degree=8 x moe_ep_degree=16 != tp_degree=64"),
    (dict(moe_ep_degree=8, moe_tp_degree=8), "moe_ep_degree=8 at tp_degree=64"),
    (dict(blockwise_matmul_config=SimpleNamespace(parallelize_token_to_block_mapping=False, block_size=512)),
     "no spmd_rank"),
    (dict(blockwise_matmul_config=SimpleNamespace(parallelize_token_to_block_mapping=True, block_size=2**30)),
     "all-experts prefill with EP"),
    (dict(moe_tp_degree=None), "moe_tp_degree=None x moe_ep_degree=16"),
    (dict(tkg_batch_size=8), "with batch 8: NxD decodes EP only on all experts"),
])
def test_enforce_neuron_config_rechecks_moe_ep(over, needle):
    ep = dict(tp_degree=64, logical_nc_config=2, moe_ep_degree=16, moe_tp_degree=4, tkg_batch_size=48)
    contract.enforce_neuron_config(_reloaded_moe_neuron_config(**ep), 384, 8)
    with pytest.raises(KimiInputError, match="unsupported NeuronConfig") as e:
        contract.enforce_neuron_config(_reloaded_moe_neuron_config(**{**ep, **over}), 384, 8)
    assert needle in str(e.value)


def test_a_one_token_prompt_is_not_batched_with_longer_ones():
    contract.check_prompt_lengths([1, 1])
    contract.check_prompt_lengths([3, 2, 7])
    with pytest.raises(KimiInputError, match="one-token prompt cannot share a batch"):
        contract.check_prompt_lengths([5, 1])


@pytest.mark.parametrize("start,size,env,want", [
    (0, 64, {}, [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (48, 8), (56, 8)]),
    (0, 2, {}, [(0, 2)]),
    (16, 20, {}, [(16, 8), (24, 8), (32, 4)]),
    (0, 64, {"NXD_LAYOUT_TRANSFORMATION_OPTIONS": "on_cpu_and_serialize"}, [(0, 64)]),
])
def test_presharding_passes_cover_every_rank_once(start, size, env, want):
    assert contract.rank_passes(start, size, env) == want


def test_enforce_neuron_config_refuses_a_decode_batch_below_the_cache_batch():
    with pytest.raises(KimiInputError, match="tkg_batch_size=1 < kv_cache_batch_size=2"):
        contract.enforce_neuron_config(_reloaded_moe_neuron_config(tkg_batch_size=1, kv_cache_batch_size=2))


def test_blockwise_takes_the_block_layout_from_the_converted_checkpoint():
    cfg = kimi_cfg()
    rec = layout.scheme_for("fp8-blockwise", "fp8").nxd(cfg.moe_intermediate_size)
    kw = contract.neuron_config_kwargs(cfg, contract.ServeOptions(tp=64, experts="fp8-blockwise", checkpoint="/c",
                                                                  quant_record=rec))
    assert kw["quantization_block_axis"] == [1, 2] and kw["quantization_block_size"] == list(rec[
        "quantization_block_size"])
    assert kw["quantization_scale_dtype"] == "f32"


@pytest.mark.parametrize("opts,needle", [
    (dict(tp=3), "num_attention_heads=64 is not divisible by 3"),
    (dict(tp=64, ep=4, batch=1), "needs batch >= 48"),
    (dict(tp=64, ep=2, batch=48), "--ep 2 at --tp 64 --lnc 2: not an expert layout"),
    (dict(tp=64, ep=8, batch=48), "use --ep in [1, 4, 16, 64]"),
    (dict(tp=64, ep=16, batch=48, moe_prefill="all-experts"), "no EP variant"),
    (dict(tp=64, ep=16, batch=48, seq_len=1, max_context_length=1), "at least 512 token-expert pairs"),
    (dict(tp=64, quant_record=None), "needs a converted checkpoint"),
    (dict(tp=64, experts="fp8-blockwise"), "holds expert_wise_per_channel_symmetric"),
    (dict(tp=64, quant_record={**PER_CHANNEL, "valid_moe_tp_degrees": [1, 2]}), "shard only [1, 2] ways"),
    (dict(tp=64, seq_len=512, max_context_length=1024), "--max-context-length 1024"),
    (dict(tp=64, ep=3, batch=48), "--ep 3: must divide --tp 64"),
    (dict(tp=64, ep=4, batch=48, quant_record={**PER_CHANNEL, "valid_moe_tp_degrees": [1, 2, 4, 8]}),
     "experts split 16 ways (tp / ep)"),
    (dict(tp=64, ep=16, batch=48, extra={"ep_degree": 2}), None),
])
def test_neuron_config_kwargs_refuse_bad_configurations(opts, needle):
    o = {"checkpoint": "/c", "quant_record": PER_CHANNEL, **opts}
    if needle is None:  # NxD's global ep_degree passes through `extra`; the config check refuses it
        kw = contract.neuron_config_kwargs(kimi_cfg(), contract.ServeOptions(**o))
        with pytest.raises(KimiInputError, match="ep_degree=2 \\(global EP counts the shared expert"):
            contract.enforce_neuron_config(_reloaded_moe_neuron_config(ep_degree=kw["ep_degree"]))
        return
    with pytest.raises(KimiInputError) as e:
        contract.neuron_config_kwargs(kimi_cfg(), contract.ServeOptions(**o))
    assert needle in str(e.value)


def _refusal(fn) -> str | None:
    try:
        fn()
    except KimiInputError as e:
        return str(e)
    return None


@pytest.mark.parametrize("experts", ["fp8-per-channel", "fp8-blockwise"])
def test_the_fit_planner_refuses_exactly_what_the_shell_refuses(experts):
    """compile_and_save plans first and the shell checks later: both must refuse the same TP / EP / prefill / scale
    layouts with the same message (both call plan.check_compile_options and plan.check_moe_tp)."""
    from itertools import product

    from kimi_k2_neuron.plan import plan

    cfg = kimi_cfg()
    nxd = layout.scheme_for(experts, "fp8").nxd(cfg.moe_intermediate_size)
    records = (nxd, {**nxd, "valid_moe_tp_degrees": [1, 2, 4]})
    refused = 0
    for tp, ep, batch, (seq, ctx), mode, rec in product(
            (3, 16, 32, 48, 64), (1, 2, 4, 16), (1, 48), ((1024, None), (1024, 1), (1, None)),
            ("kernel", "torch", "all-experts"), records):
        shell = _refusal(lambda: contract.check_serve_options(cfg, contract.ServeOptions(
            tp=tp, ep=ep, batch=batch, seq_len=seq, max_context_length=ctx, moe_prefill=mode, experts=experts,
            checkpoint="/c", quant_record=rec)))
        planner = _refusal(lambda: plan(cfg, tp, ep, 2, seq, batch, experts, context_len=ctx, moe_prefill=mode,
                                        record={"experts": experts, "nxd": rec}))
        assert planner == shell, (tp, ep, batch, seq, ctx, mode, rec["valid_moe_tp_degrees"])
        refused += shell is not None
    assert 0 < refused < 5 * 4 * 2 * 3 * 3 * 2


def _compile_script(monkeypatch):
    """scripts/compile_and_save.py as a module; it sets the FP8 environment on import, undone after the test."""
    from kimi_k2_neuron.launch import FP8_ENV

    for name in FP8_ENV:
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("_compile_and_save", REPO / "scripts/compile_and_save.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_kernel_compile_recommends_all_experts_prefill_not_torch(capsys, monkeypatch):
    script = _compile_script(monkeypatch)

    def fails(*args, **kwargs):
        raise RuntimeError("neuronx-cc: compilation failed")

    assert script._compile(fails, "/c", "/out", SimpleNamespace(moe_prefill="kernel"), "summary") is False
    err = capsys.readouterr().err
    assert "RuntimeError: neuronx-cc: compilation failed" in err  # NxDI's traceback first
    last = err.splitlines()[-1]
    assert last.startswith("error: compiling with --moe-prefill kernel failed (traceback above); ")
    assert "use --moe-prefill all-experts" in last and "not --moe-prefill torch" in last
    with pytest.raises(RuntimeError):  # another --moe-prefill: nothing to suggest, the error as it is
        script._compile(fails, "/c", "/out", SimpleNamespace(moe_prefill="all-experts"), "summary")
    assert script._compile(lambda *a, **k: None, "/c", "/out", SimpleNamespace(moe_prefill="kernel"), "s") is True
    assert "use --moe-prefill all-experts" in " ".join(script.build_parser().format_help().split())


def test_ep_is_moe_internal_expert_parallelism():
    """--ep splits the routed experts inside the TP ranks (NxDI moe_ep_degree x moe_tp_degree = tp_degree), so
    attention and the shared expert stay TP-sharded over every rank and MoE's single reduction counts each once."""
    o = contract.ServeOptions(tp=64, ep=16, batch=48, checkpoint="/c", quant_record=PER_CHANNEL)
    kw = contract.neuron_config_kwargs(kimi_cfg(), o)
    assert (kw["tp_degree"], kw["moe_ep_degree"], kw["moe_tp_degree"]) == (64, 16, 4) and "ep_degree" not in kw
    one = contract.neuron_config_kwargs(kimi_cfg(), contract.ServeOptions(tp=64, checkpoint="/c",
                                                                        quant_record=PER_CHANNEL))
    assert "moe_ep_degree" not in one and "moe_tp_degree" not in one  # EP=1 keeps NxDI's defaults


def _neuron_parallel_linears(cfg: KimiK2Config) -> tuple[list[str], list[str]]:
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
def test_modules_to_not_convert_covers_every_non_expert_parallel_linear_and_no_expert(cfg):
    skip = contract.modules_to_not_convert(cfg)
    plain, experts = _neuron_parallel_linears(cfg)
    converted = lambda path: not any(key in path for key in skip)  # noqa: E731 (quantize.py:122-123)
    assert [p for p in plain if converted(p)] == []
    assert [p for p in experts if not converted(p)] == []


def test_compiler_args():
    cte = contract.compiler_args("context_encoding_model", 2)
    tkg = contract.compiler_args("token_generation_model", 1)
    assert "--lnc=2" in cte and "--lnc=1" in tkg  # our string replaces NxDI's, which carried --lnc
    assert " -O1 " in cte and " -O2 " in tkg and "--auto-cast=none" in cte
    assert "tiling-factor=2" in cte and "tiling-factor=1" in tkg
    # NxDI appends these itself (model_wrapper.py:148-162); repeating them would pass the option twice
    assert "hlo2tensorizer" not in cte and "fp8e4m3" not in cte


# -- the router in NxD's contract -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_affinities_at_the_chosen_experts_equal_the_core_router(n_group, topk_group, dtype):
    cfg = tiny_cfg(n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group)
    g = torch.Generator().manual_seed(0)
    router = layers.NxDRouter(cfg)
    router.weight.data.copy_(torch.randn(32, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5)
    router.e_score_correction_bias.data.copy_(0.3 * torch.randn(32, generator=g))
    x = torch.randn(2, 5, cfg.hidden_size, generator=g).to(dtype)  # [B, S, H] as MoE passes it
    logits, aff, ids = router(x)
    core_w, core_ids = super(layers.NxDRouter, router).forward(x.reshape(-1, cfg.hidden_size))
    assert torch.equal(ids, core_ids) and aff.shape == (10, 32) and aff.dtype == dtype
    torch.testing.assert_close(aff.gather(1, ids), core_w.to(dtype))
    off = torch.ones_like(aff, dtype=torch.bool).scatter(1, ids, False)
    assert (aff[off] == 0).all()
    torch.testing.assert_close(logits, x.reshape(-1, cfg.hidden_size).float() @ router.weight.T)
    # ExpertMLPsV2 masks to the chosen experts and, with normalize_top_k_affinities False, changes nothing
    # (expert_mlps_v2.py:283-319): rows still sum to routed_scaling_factor.
    mask = torch.zeros_like(aff, dtype=torch.float64).scatter(1, ids, 1.0)
    torch.testing.assert_close(aff.masked_fill(mask == 0, 0), aff)
    torch.testing.assert_close(aff.float().sum(1), torch.full((10,), cfg.routed_scaling_factor),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)


def _fused(moe: MoE):
    """The converted layout of a core MoE's experts: gate_up [E, H, 2I] (gate columns, then up), down [E, I, H]."""
    gu = torch.stack([torch.cat([e.gate_proj.weight.T, e.up_proj.weight.T], dim=1) for e in moe.experts])
    dn = torch.stack([e.down_proj.weight.T for e in moe.experts])
    return gu, dn


def test_nxd_moe_combine_with_our_router_equals_the_core_moe(tiny_dirs):
    """ExpertMLPsV2's inference paths on the fused layout (Experts: x @ gate_up[e], silu(gate) * up, @ down[e];
    selective loading sums over the token's ids, all-experts over every expert with masked affinities,
    expert_mlps_v2.py:366-392, 595-625), plus the shared expert added before the reduction (model.py:305-361)."""
    runner = CpuRunner(tiny_dirs["bf16"])
    cfg, layer = runner.cfg, next(l for i, l in enumerate(runner.model.model.layers) if runner.cfg.is_moe_layer(i))
    moe = layer.mlp
    router = layers.NxDRouter(cfg)
    router.load_state_dict(moe.gate.state_dict())
    gu, dn = _fused(moe)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    _, aff, ids = router(x)

    def expert(e, h):
        g, u = (h @ gu[e]).chunk(2, dim=-1)
        return (F.silu(g) * u) @ dn[e]

    selective = torch.stack([sum(expert(int(e), x[t]) * aff[t, e] for e in ids[t]) for t in range(len(x))])
    masked = aff.masked_fill(torch.zeros_like(aff, dtype=torch.bool).scatter(1, ids, True).logical_not(), 0)
    all_experts = sum(expert(e, x) * masked[:, e:e + 1] for e in range(cfg.n_routed_experts))
    shared = moe.shared_experts(x)
    want = moe(x)
    torch.testing.assert_close(selective + shared, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(all_experts + shared, want, rtol=1e-5, atol=1e-5)


# -- decode masks and NxDI's prefill/decode flow ----------------------------------------------------------------

def test_decode_masks_are_the_cached_prefix_plus_the_current_token():
    prior_mask = layers.prior_mask_for_positions(torch.tensor([2, 5]), 6)
    prior, active = layers.decode_masks(prior_mask, 1)
    assert prior.tolist() == [[[[1, 1, 0, 0, 0, 0]]], [[[1, 1, 1, 1, 1, 0]]]] and active.tolist() == [[[[1]]]] * 2
    # the same as the core's rule for a token at position p: it sees cache slots 0..p (mla.py forward)
    for b, p in enumerate([2, 5]):
        core_visible = torch.arange(6) <= p
        core_visible[p] = False  # slot p is not written yet on Neuron: the token itself is the active segment
        assert torch.equal(prior[b, 0, 0], core_visible)


def test_split_attention_equals_attention_over_the_concatenated_cache(tiny_dirs):
    """attend_split (prior cache in place + active entries) == attend(absorbed) over their concatenation."""
    attn = CpuRunner(tiny_dirs["bf16"]).model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    b, t, s = 2, 7, 2
    q_nope = torch.randn(b, attn.n_heads, s, attn.nope, generator=g)
    q_pe = torch.randn(b, attn.n_heads, s, attn.rope, generator=g)
    prior, active = (torch.randn(b, n, attn.rank + attn.rope, generator=g) for n in (t, s))
    prior_mask = torch.rand(b, 1, s, t, generator=g) > 0.3
    active_mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    want = attn.attend(q_nope, q_pe, torch.cat([prior, active], 1), torch.cat([prior_mask, active_mask], -1), True)
    got = attn.attend_split(q_nope, q_pe, prior, prior_mask, active, active_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _nxdi_flow(runner: CpuRunner, prompts, steps, seq_len, bucket, off_by_one=False):
    """NeuronBaseModel.get_model_output emulated around layers.attention_block and the core's layers: prefill of a
    right-padded bucket, then decode steps with the rows at different positions. Returns per-row logits."""
    model, cfg = runner.model, runner.cfg
    b = len(prompts)
    # Host inputs as HuggingFaceGenerationAdapter makes them: pads right, their position_ids 1 (hf_adapter.py:283-295)
    ids = torch.zeros(b, bucket, dtype=torch.long)
    pos = torch.ones(b, bucket, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)], pos[r, : len(p)] = torch.tensor(p), torch.arange(len(p))
    k_cache = [torch.zeros(b, 1, seq_len, cfg.latent_dim) for _ in model.model.layers]  # zeros, as spmd.py:112-117
    v_cache = [torch.zeros(b, 1, seq_len, 1) for _ in model.model.layers]

    def run_layers(h, rope, mask, past):
        new = []
        for i, layer in enumerate(model.model.layers):
            h, kv = layers.attention_block(layer.self_attn, layer.input_layernorm, h, rope,
                                             None if past is None else [k_cache[i], v_cache[i]], mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            new.append(kv)
        return model.lm_head(model.model.norm(h)).float(), new

    # prefill: causal [B, 1, S, S] mask ignoring padding (model_base.py:197-215); cache filled from 0 (fill_prefix)
    causal = torch.ones(bucket, bucket, dtype=torch.bool).tril()[None, None].expand(b, 1, bucket, bucket)
    logits, new = run_layers(model.model.embed_tokens(ids), model.rotary(pos), causal, None)
    for i, (k, v) in enumerate(new):
        assert k.shape == (b, 1, bucket, cfg.latent_dim) and v.shape == (b, 1, bucket, 1)
        k_cache[i][:, :, :bucket], v_cache[i][:, :, :bucket] = k, v
    out = [[row] for row in logits[torch.arange(b), pos.argmax(dim=1)]]  # last real token (model_base.py:970-976)
    cur = torch.tensor([len(p) for p in prompts])
    for step in range(steps.shape[1]):
        prior = layers.prior_mask_for_positions(cur + (1 if off_by_one else 0), seq_len)
        logits, new = run_layers(model.model.embed_tokens(steps[:, step:step + 1]), model.rotary(cur[:, None]), prior,
                             past=True)
        for i, (k, v) in enumerate(new):  # scatter at position_ids along dim 2 (kv_cache_manager.py:571-585)
            k_cache[i].scatter_(2, cur.view(b, 1, 1, 1).expand_as(k), k)
            v_cache[i].scatter_(2, cur.view(b, 1, 1, 1).expand_as(v), v)
        for r in range(b):
            out[r].append(logits[r, 0])
        cur = cur + 1
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_nxdi_prefill_and_batched_decode_equal_the_core(tiny_dirs, fmt):
    runner = CpuRunner(tiny_dirs[fmt])
    prompts = [[5, 17, 300, 42, 256, 9, 77], [400, 3, 3]]  # rows end at different positions
    steps = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])
    got = _nxdi_flow(runner, prompts, steps, seq_len=16, bucket=8)
    for r, p in enumerate(prompts):
        want = runner.logits([p + steps[r].tolist()], prefill_len=len(p))[0, len(p) - 1:]
        assert (got[r] - want).abs().max() / want.abs().max() < 1e-5, f"row {r}"


def test_a_mask_that_covers_the_current_slot_is_caught(tiny_dirs):
    """The KIMI contrib's test harness mask ones(pos + 1) attends to the stale slot at pos (nxdi_contracts §5.5.2)."""
    runner = CpuRunner(tiny_dirs["bf16"])
    prompts, steps = [[5, 17, 300], [400, 3, 3]], torch.tensor([[11, 12], [21, 22]])
    right = _nxdi_flow(runner, prompts, steps, seq_len=8, bucket=6)
    wrong = _nxdi_flow(runner, prompts, steps, seq_len=8, bucket=6, off_by_one=True)
    assert all((a[1:] - b[1:]).abs().max() > 1e-3 for a, b in zip(right, wrong))


# -- checkpoint keys and the loader ---------------------------------------------------------------------------------

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
    assert keys.expected_keys(cfg, "bf16") == mapped
    fp8 = keys.expected_keys(cfg, "fp8-per-channel")
    assert fp8 - mapped == {k[: -len("weight")] + "scale" for k in mapped if ".expert_mlps." in k}


def test_converted_layout_keys_map_onto_the_model():
    cfg = tiny_cfg()
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert keys.neuron_key(layout.gate_up_key(L)) == f"layers.{L}.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
    assert keys.neuron_key(layout.scale_key(layout.down_key(L))) == \
        f"layers.{L}.mlp.expert_mlps.mlp_op.down_proj.scale"
    router = layout.router_keys(L)
    assert {keys.neuron_key(v) for v in router.values()} == {f"layers.{L}.mlp.router.weight",
                                                                 f"layers.{L}.mlp.router.e_score_correction_bias"}
    assert keys.neuron_key("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") == \
        "layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert keys.neuron_key(f"model.layers.{L}.mlp.shared_experts.down_proj.weight") == \
        f"layers.{L}.mlp.shared_experts.down_proj.weight"
    assert keys.neuron_key("lm_head.weight") == "lm_head.weight"
    assert keys.neuron_key("model.layers.2.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(KimiInputError, match="must be converted"):
        keys.neuron_key(layout.expert_name(L, 3, "up_proj"))
    with pytest.raises(KimiInputError, match="no place"):
        keys.neuron_key("model.layers.1.self_attn.q_a_proj.weight_scale_inv")


def _converted_tensors(cfg: KimiK2Config) -> dict[str, torch.Tensor]:
    """A converted-layout state dict (per-channel scheme) built by hand from the tiny dense weights."""
    dense = dense_weights(cfg, seed=0)
    out = {}
    for name, t in dense.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith(".mlp.gate.weight"):
            out[name.replace(".mlp.gate.", ".mlp.router.linear_router.")] = t.float()
        elif name.endswith("e_score_correction_bias"):
            out[name.replace(".mlp.gate.", ".mlp.router.")] = t.float()
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
    state = keys.to_neuron_state_dict(tensors, cfg, nc)
    assert set(state) == keys.expected_keys(cfg, "fp8-per-channel") | {"rank_util.rank"}
    assert state["rank_util.rank"].tolist() == [0, 1]
    router = next(k for k in state if k.endswith("mlp.router.weight"))
    assert state[router].dtype == torch.float32
    missing = dict(tensors)
    del missing[layout.scale_key(layout.gate_up_key(1))]
    with pytest.raises(KimiInputError, match="1 tensor\\(s\\) missing"):
        keys.to_neuron_state_dict(missing, cfg, nc)
    with pytest.raises(KimiInputError, match="no place for"):
        keys.to_neuron_state_dict(tensors, cfg, SimpleNamespace(quantized=False, tp_degree=2))
    wrong = dict(tensors, **{layout.gate_up_key(1): tensors[layout.gate_up_key(1)].to(torch.bfloat16)})
    with pytest.raises(KimiInputError, match="expected torch.float8_e4m3fn"):
        keys.to_neuron_state_dict(wrong, cfg, nc)
    bad_shape = dict(tensors, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(KimiInputError, match="model.norm.weight|norm.weight has shape"):
        keys.to_neuron_state_dict(bad_shape, cfg, nc)
    scale = layout.scale_key(layout.down_key(1))
    bad_scale = dict(tensors, **{scale: tensors[scale][:, :, :-1]})  # per-channel [E, 1, H] is one column short
    with pytest.raises(KimiInputError, match="down_proj.scale has shape"):
        keys.to_neuron_state_dict(bad_scale, cfg, nc)


def test_mmap_checkpoint_reads_what_safetensors_reads(tmp_path):
    tensors = _converted_tensors(tiny_cfg())
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: tensors[n].contiguous() for n in part}, str(tmp_path / f"s{i}.safetensors"))
    index = {"weight_map": {n: f"s{0 if j < half else 1}.safetensors" for j, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = loader.mmap_checkpoint(tmp_path)
    want = {**load_file(str(tmp_path / "s0.safetensors")), **load_file(str(tmp_path / "s1.safetensors"))}
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))


# -- with the real converter --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tiny_dirs, tmp_path_factory):
    from kimi_k2_neuron.convert import convert

    root = tmp_path_factory.mktemp("converted")
    for scheme in ("fp8-per-channel", "fp8-blockwise"):
        convert(tiny_dirs["fp8"], root / scheme, scheme, progress=False)
    return {scheme: root / scheme for scheme in ("fp8-per-channel", "fp8-blockwise")}


def _shell_config(ckpt: Path, tp: int):
    """What KimiK2InferenceConfig exposes to the loader: core_config() and the NeuronConfig's fields, here as they
    come out of contract.neuron_config_kwargs for this checkpoint's record."""
    cfg = KimiK2Config.from_file(ckpt)
    rec = layout.read_record(ckpt)
    kw = contract.neuron_config_kwargs(cfg, contract.ServeOptions(tp=tp, experts=rec["experts"], checkpoint=str(ckpt),
                                                                  quant_record=rec["nxd"]))
    return SimpleNamespace(core_config=lambda: cfg, neuron_config=SimpleNamespace(**kw))


# The tiny experts (I = 64) shard blockwise [32, 32] scales for TP 1 and 2 (layout.ExpertScheme.nxd).
@pytest.mark.parametrize("scheme,tp", [("fp8-per-channel", 2), ("fp8-blockwise", 2)])
def test_loader_reads_the_converters_output_into_the_neuron_model_keys(converted, tiny_dirs, scheme, tp):
    ckpt = converted[scheme]
    shell = _shell_config(ckpt, tp)
    state = loader.load_neuron_state_dict(ckpt, shell)
    cfg = shell.core_config()
    assert set(state) == keys.expected_keys(cfg, scheme) | {"rank_util.rank"}
    # The fused experts dequantize (NxD's way: blocks inferred from shapes) to the core's expert weights, gate
    # columns before up columns, [in, out] (what ExpertMLPsV2's Experts multiplies by).
    core = CpuRunner(tiny_dirs["fp8"]).model
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    want_gu, want_dn = _fused(core.model.layers[L].mlp)
    p = f"layers.{L}.mlp.expert_mlps.mlp_op."
    for name, want in (("gate_up_proj", want_gu), ("down_proj", want_dn)):
        codes, scale = state[p + name + ".weight"], state[p + name + ".scale"]
        got = torch.stack([layout.dequantize_nxd(codes[e], scale[e]) for e in range(cfg.n_routed_experts)])
        assert (got - want).abs().max() / want.abs().max() < 0.05  # FP8 re-rounding (per-channel) or exact blocks
    torch.testing.assert_close(state[f"layers.{L}.mlp.router.weight"], core.model.layers[L].mlp.gate.weight)


def test_loader_refuses_a_checkpoint_converted_for_another_scheme(converted):
    shell = _shell_config(converted["fp8-per-channel"], 2)
    with pytest.raises(KimiInputError, match="converted with experts=fp8-blockwise"):
        loader.load_neuron_state_dict(converted["fp8-blockwise"], shell)


def test_a_raw_checkpoint_is_converted_once_into_a_sibling_folder(tiny_dirs, tmp_path):
    import shutil

    raw = tmp_path / "kimi"
    shutil.copytree(tiny_dirs["fp8"], raw)
    dst = loader.ensure_converted(raw, "fp8-per-channel", workers=1)
    assert dst == loader.converted_dir_for(raw, "fp8-per-channel") == tmp_path / "kimi-neuron-fp8-per-channel"
    assert layout.read_record(dst)["experts"] == "fp8-per-channel"
    stamp = (dst / "config.json").stat().st_mtime_ns
    assert loader.ensure_converted(raw, "fp8-per-channel") == dst and (dst / "config.json").stat().st_mtime_ns == stamp
    assert loader.ensure_converted(dst, "fp8-per-channel") == dst  # already converted: used as is
