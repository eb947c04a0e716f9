"""The Neuron shell's pure parts on CPU, without NxD/NxDI: serving options, NeuronConfig kwargs, key mapping, the
memory-mapped loader. Everything that needs NxD/NxDI itself (the model, its router and decoder layer, its config
round trip, loading, prefill and decode, TP, pre-sharding) is tested against the real libraries in test/nxdi_cpu;
what is left here that stands in for them says "emulated" in its name.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k2_neuron.testing.tiny_checkpoint import dense_weights, tiny_config_dict
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.record import CONVERSION_KEY, LAYOUT_VERSION, ConversionRecord
from kimi_k2_neuron.formats.scheme import scheme_for
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.model.model import KimiK2ForCausalLM
from kimi_k2_neuron.neuron import contract, loader
from kimi_k2_neuron.runtime.runner import CpuRunner

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test/data/configs"
SCRIPTS = ("compile_and_save.py", "run_inference.py", "bench_tpot.py")



def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


def kimi_cfg() -> KimiK2Config:
    return KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")


PER_CHANNEL = {"quantized": True, "quantization_dtype": "f8e4m3",
               "quantization_type": "expert_wise_per_channel_symmetric", "quantization_per_channel_axis": 2,
               "valid_moe_tp_degrees": [1, 2, 4, 8, 16, 32, 64]}


def per_channel(**opts) -> "contract.ServeOptions":
    """Serving options for a converted fp8-per-channel checkpoint (fp8-blockwise is ServeOptions' default)."""
    return contract.ServeOptions(**{"experts": "fp8-per-channel", "checkpoint": "/c", "quant_record": PER_CHANNEL,
                                    **opts})


# -- the package without the SDK, and the scripts' --help ---------------------------------------------------------

@pytest.mark.parametrize("sdk_import", ["import kimi_k2_neuron.neuron.modeling",
                                        "from kimi_k2_neuron.neuron import NeuronKimiK2ForCausalLM",
                                        "import kimi_k2_neuron.neuron.cpu", "import kimi_k2_neuron.neuron.serving"])
def test_import_without_sdk_names_the_missing_packages(sdk_import):
    if not contract.missing_neuron_packages() == [p for _, p in contract.NEURON_PACKAGES]:
        pytest.skip("some Neuron packages are importable here")
    r = subprocess.run([sys.executable, "-c", sdk_import], capture_output=True, text=True)
    assert r.returncode != 0 and "ImportError" in r.stderr
    for pip_name in ("neuronx-distributed-inference", "neuronx-distributed", "torch-neuronx"):
        assert pip_name in r.stderr
    assert "README section 'The NxDI model on CPU'" in r.stderr
    pure = "import kimi_k2_neuron, kimi_k2_neuron.neuron.contract, kimi_k2_neuron.neuron.loader"
    ok = subprocess.run([sys.executable, "-c", pure], capture_output=True, text=True)
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
    rec = {"layout_version": LAYOUT_VERSION, "experts": "fp8-per-channel", "nxd": PER_CHANNEL}
    (tmp_path / "config.json").write_text(json.dumps({**raw, CONVERSION_KEY: rec}))
    r = _compile("--model", str(tmp_path), "--out", str(tmp_path / "c"), "--tp", "8")
    assert r.returncode == 2 and "does not fit" in r.stderr and "pass --force" in r.stderr, r.stderr


def test_compile_plans_a_converted_checkpoint_with_its_recorded_block(tmp_path):
    """K2-Thinking converted to fp8-blockwise keeps one scale per INT4 group ([32, 1]); its converted config.json
    has no quantization_config any more, so only the record says so, and the fit check must use it."""
    from kimi_k2_neuron.plan import plan

    raw = json.loads((CONFIGS / "kimi-k2-thinking.json").read_text())
    raw.pop("quantization_config")
    nxd = scheme_for("fp8-blockwise", "int4", 32).nxd(raw["moe_intermediate_size"])
    rec = {"layout_version": LAYOUT_VERSION, "experts": "fp8-blockwise", "nxd": nxd}
    (tmp_path / "config.json").write_text(json.dumps({**raw, CONVERSION_KEY: rec}))
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
    assert kw["blockwise_matmul_config"] == {"logical_nc_config": 2}
    all_experts = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, lnc=1, moe_prefill="all-experts"))
    assert all_experts["blockwise_matmul_config"] == {"logical_nc_config": 1, "block_size": 2**30}
    assert contract.fp8_env(kw["quantized"], kw["quantization_dtype"]) == {"XLA_HANDLE_SPECIAL_SCALAR": "1",
                                                                           "UNSAFE_FP8FNCAST": "1"}


def test_logits_output_and_collective_flags():
    kw = contract.neuron_config_kwargs(kimi_cfg(), per_channel(tp=64, on_device_sampling=False, output_logits=True))
    # without on-device sampling the lm_head already gathers the vocab; output_logits would gather it again
    assert kw["output_logits"] is False and kw["disable_numeric_cc_token"] is True


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


def test_serve_options_default_to_the_recommended_expert_format():
    assert contract.ServeOptions(tp=64).experts == "fp8-blockwise"  # as plan.experts_for (test_plan.py)


def test_blockwise_takes_the_block_layout_from_the_converted_checkpoint():
    cfg = kimi_cfg()
    rec = scheme_for("fp8-blockwise", "fp8").nxd(cfg.moe_intermediate_size)
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
])
def test_neuron_config_kwargs_refuse_bad_configurations(opts, needle):
    with pytest.raises(KimiInputError) as e:
        contract.neuron_config_kwargs(kimi_cfg(), per_channel(**opts))
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
    nxd = scheme_for(experts, "fp8").nxd(cfg.moe_intermediate_size)
    records = (nxd, {**nxd, "valid_moe_tp_degrees": [1, 2, 4]})
    refused = 0
    for tp, ep, batch, (seq, ctx), mode, rec in product(
            (3, 16, 32, 48, 64), (1, 2, 4, 16), (1, 48), ((1024, None), (1024, 1), (1, None)),
            ("kernel", "torch", "all-experts"), records):
        shell = _refusal(lambda: contract.check_serve_options(cfg, contract.ServeOptions(
            tp=tp, ep=ep, batch=batch, seq_len=seq, max_context_length=ctx, moe_prefill=mode, experts=experts,
            checkpoint="/c", quant_record=rec)))
        record = ConversionRecord.from_json({"layout_version": LAYOUT_VERSION, "experts": experts, "nxd": rec}, "t")
        planner = _refusal(lambda: plan(cfg, tp, ep, 2, seq, batch, experts, context_len=ctx, moe_prefill=mode,
                                        record=record))
        assert planner == shell, (tp, ep, batch, seq, ctx, mode, rec["valid_moe_tp_degrees"])
        refused += shell is not None
    assert 0 < refused < 5 * 4 * 2 * 3 * 3 * 2


def _compile_script(monkeypatch):
    """scripts/compile_and_save.py as a module; it sets the FP8 environment on import, undone after the test."""
    for name in contract.FP8_ENV:
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
    test/nxdi_cpu/test_to_cpu.py checks the real NxD conversion on the tiny model."""
    skip = contract.modules_to_not_convert(cfg)
    plain, experts = _emulated_neuron_parallel_linears(cfg)
    converted = lambda path: not any(key in path for key in skip)  # noqa: E731 (quantize.py:122-123)
    assert [p for p in plain if converted(p)] == []
    assert [p for p in experts if not converted(p)] == []


def test_compiler_args_add_kimis_to_nxdis_without_contradicting_them():
    nxdi_cte = ("--auto-cast=none --model-type=transformer --tensorizer-options='--cc-pipeline-tiling-factor=2' "
                "--lnc=2 -O1 --internal-hlo2tensorizer-options=' --modular-flow-mac-threshold=10 --verify-hlo=true'")
    got = contract.compiler_args(nxdi_cte)
    kimi = " --enable-saturate-infinity --enable-mixed-precision-accumulation --internal-enable-dge-levels " \
           "vector_dynamic_offsets"
    assert got == nxdi_cte + kimi
    long_ctx = nxdi_cte + " --disable-mixed-precision-accumulation --internal-enable-dge-levels spill_reload"
    assert contract.compiler_args(long_ctx) == long_ctx + " --enable-saturate-infinity"
    assert contract.compiler_args(got) == got  # idempotent


# -- MLA: the split attention the decoder layer uses for decode ------------------------------------------------

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
    assert contract.expected_keys(cfg, "bf16") == mapped
    fp8 = contract.expected_keys(cfg, "fp8-per-channel")
    assert fp8 - mapped == {k[: -len("weight")] + "scale" for k in mapped if ".expert_mlps." in k}


def test_converted_layout_keys_map_onto_the_model():
    cfg = tiny_cfg()
    L = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert layout.module_key(layout.gate_up_key(L)) == f"layers.{L}.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
    assert layout.module_key(layout.scale_key(layout.down_key(L))) == \
        f"layers.{L}.mlp.expert_mlps.mlp_op.down_proj.scale"
    router = layout.router_keys(L)
    assert {layout.module_key(v) for v in router.values()} == {f"layers.{L}.mlp.router.weight",
                                                                   f"layers.{L}.mlp.router.e_score_correction_bias"}
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
    assert contract.to_neuron_state_dict({**tensors, **inv_freq}, cfg, nc).keys() == \
        contract.to_neuron_state_dict(tensors, cfg, nc).keys()
    with pytest.raises(KimiInputError, match="must be converted"):
        contract.to_neuron_state_dict({**tensors, layout.expert_name(L, 3, "up_proj"): torch.zeros(1)}, cfg, nc)
    with pytest.raises(KimiInputError, match="no place"):
        contract.to_neuron_state_dict({**tensors, "model.layers.1.self_attn.q_a_proj.weight_scale_inv": torch.ones(1)},
                                      cfg, nc)


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
    state = contract.to_neuron_state_dict(tensors, cfg, nc)
    assert set(state) == contract.expected_keys(cfg, "fp8-per-channel") | {"rank_util.rank"}
    assert state["rank_util.rank"].tolist() == [0, 1]
    router = next(k for k in state if k.endswith("mlp.router.weight"))
    assert state[router].dtype == torch.float32
    missing = dict(tensors)
    del missing[layout.scale_key(layout.gate_up_key(1))]
    with pytest.raises(KimiInputError, match="1 tensor\\(s\\) missing"):
        contract.to_neuron_state_dict(missing, cfg, nc)
    with pytest.raises(KimiInputError, match="no place for"):
        contract.to_neuron_state_dict(tensors, cfg, SimpleNamespace(quantized=False, tp_degree=2))
    wrong = dict(tensors, **{layout.gate_up_key(1): tensors[layout.gate_up_key(1)].to(torch.bfloat16)})
    with pytest.raises(KimiInputError, match="expected torch.float8_e4m3fn"):
        contract.to_neuron_state_dict(wrong, cfg, nc)
    bad_shape = dict(tensors, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(KimiInputError, match="model.norm.weight|norm.weight has shape"):
        contract.to_neuron_state_dict(bad_shape, cfg, nc)
    scale = layout.scale_key(layout.down_key(1))
    bad_scale = dict(tensors, **{scale: tensors[scale][:, :, :-1]})  # per-channel [E, 1, H] is one column short
    with pytest.raises(KimiInputError, match="down_proj.scale has shape"):
        contract.to_neuron_state_dict(bad_scale, cfg, nc)


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


def test_a_raw_checkpoint_is_converted_once_into_a_sibling_folder(tiny_dirs, tmp_path):
    import shutil

    raw = tmp_path / "kimi"
    shutil.copytree(tiny_dirs["fp8"], raw)
    dst = loader.ensure_converted(raw, "fp8-per-channel", workers=1)
    assert dst == loader.converted_dir_for(raw, "fp8-per-channel") == tmp_path / "kimi-neuron-fp8-per-channel"
    assert ConversionRecord.read(dst).experts == "fp8-per-channel"
    stamp = (dst / "config.json").stat().st_mtime_ns
    assert loader.ensure_converted(raw, "fp8-per-channel") == dst and (dst / "config.json").stat().st_mtime_ns == stamp
    assert loader.ensure_converted(dst, "fp8-per-channel") == dst  # already converted: used as is


@pytest.mark.parametrize("cmd", [
    [sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--backend", "nxdi-cpu", "--input-ids", "1,2", "--out",
     "{tmp}/l.safetensors"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--input-ids", "1,2"],
    [sys.executable, str(REPO / "scripts/run_inference.py"), "--cpu", "--prompt", "hi"],
    [sys.executable, str(REPO / "scripts/bench_tpot.py"), "--cpu"],
], ids=["logits", "generate", "run_inference", "bench_tpot"])
def test_nxdi_cpu_without_nxd_is_one_line_naming_what_is_missing_and_the_setup(tiny_dirs, tmp_path, cmd):
    if not contract.missing_neuron_packages():
        pytest.skip("NxD/NxDI are importable here")
    cmd = [c.replace("{tmp}", str(tmp_path)) for c in cmd] + ["--model", str(tiny_dirs["fp8"])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "neuronx-distributed-inference" in err[0] and "README section 'The NxDI model on CPU'" in err[0]
