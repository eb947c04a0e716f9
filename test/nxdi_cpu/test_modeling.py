"""modeling.py through the real NxD/NxDI, in NxDI's order: KimiK2InferenceConfig through NxDI's own save/load (the
derived fields and our NeuronConfig settings survive the round trip, what this port does not implement is refused
again on reload), the model's pieces that answer NxD/NxDI's contracts (the router NxD's MoE calls, the masks of a
decode step), and NeuronKimiK2ForCausalLM.to_cpu, which builds each submodel as the device path builds it and loads
it strictly (the whole model's logits: test_backend.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from neuronx_distributed.quantization.quantization_layers import (QuantizedExpertFusedColumnParallel,
                                                                  QuantizedExpertFusedRowParallel)
from neuronx_distributed_inference.models.config import MoENeuronConfig
from nxdi_support import REPO, cpu_options

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS
from kimi_k2_neuron.neuron import KimiK2InferenceConfig, contract, modeling, moe_paths
from kimi_k2_neuron.neuron.loader import expected_keys, unloaded_parameters
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.neuron.base import decode_masks
from kimi_k2_neuron.neuron.modeling import NxDRouter
from kimi_k2_neuron.nxdi_cpu import backend, cpu_mode
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict


# -- the config: KimiK2InferenceConfig through NxDI's save and load ----------------------------------------------------

CONFIGS = ["kimi-k2-instruct.json", "kimi-k2-instruct-0905.json", "kimi-k2-thinking.json"]


def _config(tmp_path, name, **opts):
    opts = {"tp": 64, **opts}
    src = tmp_path / "ckpt"
    src.mkdir(exist_ok=True)
    shutil.copy(REPO / "test/data/configs" / name, src / "config.json")
    cfg = KimiK2Config.from_file(src)
    return cfg, KimiK2InferenceConfig.for_serving(cfg, RunSpec(scheme=BF16_EXPERTS, **opts))


def test_bench_tpot_reports_the_planners_model_of_the_config_it_loads(tmp_path):
    """scripts/bench_tpot.py reads the compiled folder's config back (NxDI's save and load) into the spec the planner
    models: the modelled TPOT it reports beside its measurement is the one `plan` prints for the same run."""
    import importlib.util

    from kimi_k2_neuron.neuron.fit import plan

    spec = RunSpec(tp=64, seq_len=2048, batch=4, scheme=BF16_EXPERTS, layout=Layout(shard_attn_a=True))
    cfg, config = _config(tmp_path, "kimi-k2-instruct-0905.json", seq_len=2048, batch=4,
                          layout=Layout(shard_attn_a=True))
    config.save(str(tmp_path / "compiled"))
    loaded = KimiK2InferenceConfig.load(str(tmp_path / "compiled"))
    bench_spec = importlib.util.spec_from_file_location("bench_tpot", REPO / "scripts" / "bench_tpot.py")
    bench = importlib.util.module_from_spec(bench_spec)
    bench_spec.loader.exec_module(bench)
    got = bench.modelled_times(loaded)
    want = plan(cfg, spec)
    assert got["tpot_ms"] == pytest.approx(want.decode.total_s * 1e3, rel=1e-9)
    assert got["ttft_longest_prompt_ms"] == pytest.approx(want.ttft_s * 1e3, rel=1e-9)
    # 125: the layers' and the sampler's two top-k all-gathers (sampler-collectives); 61: the q_a|kv_a gathers
    assert got["decode"]["collective_count"] == want.decode.collective_count == 125 + 61


@pytest.mark.parametrize("name", CONFIGS)
def test_config_survives_nxdis_save_and_load(tmp_path, name):
    cfg, config = _config(tmp_path, name)
    config.save(str(tmp_path / "compiled"))
    again = KimiK2InferenceConfig.load(str(tmp_path / "compiled"))
    assert (again.head_dim, again.num_local_experts) == (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.n_routed_experts)
    assert again.head_dim == 576 and again.intermediate_size == cfg.intermediate_size
    assert again.num_key_value_heads == json.loads((tmp_path / "ckpt/config.json").read_text())["num_key_value_heads"]
    assert again.core_config() == config.core_config() == KimiK2Config.from_dict(
        {**json.loads((tmp_path / "ckpt/config.json").read_text()), "quantization_config": None})
    nc = again.neuron_config
    # MoENeuronConfig reads only disable_normalize_top_k_affinities back (config.py:822); add_derived_config restores
    assert nc.normalize_top_k_affinities is False and nc.cast_type == "as-declared" and nc.capacity_factor is None
    assert (nc.router_config.act_fn, nc.router_config.dtype) == ("sigmoid", torch.float32)
    assert nc.tkg_batch_size == nc.ctx_batch_size == nc.max_batch_size == 1
    # the prefill mode survives too: NxDI writes NxD's strategy enum as a dict, which would reach the kernel as one
    bmm = nc.blockwise_matmul_config
    saved = json.loads((tmp_path / "compiled/neuron_config.json").read_text())["neuron_config"]
    assert isinstance(saved["blockwise_matmul_config"]["block_sharding_strategy"], dict)
    assert type(bmm.block_sharding_strategy).__name__ == "BlockShardStrategy"
    assert bmm.block_sharding_strategy.name == "PING_PONG"
    assert moe_paths.mode_of(bmm) == "shard-on-block" and bmm.use_shard_on_block_dynamic_while


def test_a_config_with_no_kernel_flag_is_refused(tmp_path):
    """With neither kernel flag at LNC=2, NxD 2.29 calls _call_shard_hidden_kernel, which only raises: a NeuronConfig
    that says so (here through `extra`) is refused when it is built, not at the first trace."""
    with pytest.raises(ValueError, match="none of --moe-prefill shard-on-block"):
        _config(tmp_path, "kimi-k2-instruct-0905.json", extra={"blockwise_matmul_config": {"logical_nc_config": 2}})


def test_a_reloaded_config_is_checked_again(tmp_path):
    """A neuron_config.json edited by hand (here: capacity_factor) is refused when NxDI reloads it."""
    _, config = _config(tmp_path, "kimi-k2-instruct-0905.json")
    config.save(str(tmp_path / "compiled"))
    path = tmp_path / "compiled" / "neuron_config.json"
    saved = json.loads(path.read_text())
    saved["neuron_config"]["capacity_factor"] = 1.0
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="capacity_factor=1.0 \\(drops prefill tokens"):
        KimiK2InferenceConfig.load(str(tmp_path / "compiled"))


# Settings this port does not implement, set on a real MoENeuronConfig through RunSpec.extra (the reload path is
# test_a_reloaded_config_is_checked_again's).
REFUSED = [
    ({"capacity_factor": 1.0}, "capacity_factor=1.0 (drops prefill tokens"),
    ({"sequence_parallel_enabled": True}, "sequence_parallel_enabled=True"),
    ({"moe_fused_nki_kernel_enabled": True}, "selection-only bias"),
    ({"padding_side": "left"}, "padding_side='left'"),
    ({"qkv_kernel_fuse_residual_add": True}, "returns no residual"),
    ({"attention_dtype": "float32"}, "attention_dtype=torch.float32 != torch_dtype"),
    ({"tkg_batch_size": 1, "kv_cache_batch_size": 2, "max_batch_size": 2}, "tkg_batch_size=1 < kv_cache_batch_size=2"),
    ({"ep_degree": 2}, "global EP counts the shared expert"),
]


@pytest.mark.parametrize("over,needle", REFUSED, ids=[next(iter(o)) for o, _ in REFUSED])
def test_settings_not_implemented_are_refused_on_a_real_neuron_config(tmp_path, over, needle):
    with pytest.raises(ValueError, match="unsupported NeuronConfig") as e:
        _config(tmp_path, "kimi-k2-instruct-0905.json", extra=over)
    assert needle in str(e.value)


EP = dict(tp=64, ep=16, batch=48, seq_len=128)
EP_REFUSED = [
    ({"moe_tp_degree": 8}, "moe_tp_degree=8 (the run spec kimi_k2_run_spec implies 4)"),
    ({"moe_ep_degree": 8, "moe_tp_degree": 8}, "moe_ep_degree=8 (the run spec kimi_k2_run_spec implies 16)"),
    ({"blockwise_matmul_config": {"logical_nc_config": 2, "parallelize_token_to_block_mapping": False}},
     "no spmd_rank"),
    ({"blockwise_matmul_config": {"logical_nc_config": 2, "block_size": 2**30}},
     "blockwise_matmul_config={'logical_nc_config': 2, 'block_size': 1073741824} (the run spec kimi_k2_run_spec "
     "implies {'logical_nc_config': 2, 'use_shard_on_block_dynamic_while': True"),
    ({"tkg_batch_size": 8}, "tkg_batch_size=8 < kv_cache_batch_size=48"),
    ({k: 8 for k in ("batch_size", "ctx_batch_size", "tkg_batch_size", "max_batch_size", "kv_cache_batch_size")},
     "max_batch_size=8 (the run spec kimi_k2_run_spec implies 48)"),
]


@pytest.mark.parametrize("over,needle", EP_REFUSED, ids=[str(o) for o, _ in EP_REFUSED])
def test_moe_expert_parallelism_is_rechecked_on_a_real_neuron_config(tmp_path, over, needle):
    _config(tmp_path, "kimi-k2-instruct-0905.json", **EP)  # accepted as --ep 16 sets it
    with pytest.raises(ValueError, match="unsupported NeuronConfig") as e:
        _config(tmp_path, "kimi-k2-instruct-0905.json", **EP, extra=over)
    assert needle in str(e.value)


@pytest.mark.parametrize("scratchpad,chunk", [(None, None), (1024, None), (None, 8)])
def test_compiler_args_are_nxdis_own_plus_flags_nxdis_own_models_use(converted, scratchpad, chunk):
    """Each submodel's string, as compile_and_save builds the application, against what NxDI's ModelWrapper computes
    for the same config by itself (model_wrapper.py:85-162): all of NxDI's kept (prefill's
    --modular-flow-mac-threshold=10, a scratchpad page size reaching the compiler); and every flag added is one that
    NxDI's own MoE models pass neuronx-cc, spelled as they spell it (their source, read here). The chunk submodel
    (--prefill-chunk) compiles with the context-encoding string as it is; every submodel has each option once."""
    from neuronx_distributed_inference.models.model_wrapper import ModelWrapper

    import neuronx_distributed_inference
    from kimi_k2_neuron.neuron import NeuronKimiK2ForCausalLM

    ckpt = converted[("fp8", "fp8-blockwise")]
    cfg = KimiK2Config.from_file(ckpt)
    opts = RunSpec(tp=1, seq_len=32, scheme=ConversionRecord.of(cfg).scheme, checkpoint=str(ckpt), moe_prefill="torch",
                   layout=Layout(prefill_chunk=chunk),
                   extra={} if scratchpad is None else {"scratchpad_page_size": scratchpad})
    app = NeuronKimiK2ForCausalLM(str(ckpt), KimiK2InferenceConfig.for_serving(cfg, opts))
    assert [w.tag for w in app.models][2:] == (["chunked_prefill_model"] if chunk else [])
    for w in app.models:  # each option once: no second --internal-hlo2tensorizer-options, -O, --lnc
        opts_given = [o.split("=")[0].split(" ")[0] for o in w.compiler_args.split(" --") if o.strip()]
        assert len(opts_given) == len(set(opts_given)), (w.tag, w.compiler_args)
    models = Path(neuronx_distributed_inference.__file__).parent / "models"
    nxdi_moe_models = [(models / m).read_text() for m in ("mixtral/modeling_mixtral.py", "dbrx/modeling_dbrx.py",
                                                          "qwen3_moe/modeling_qwen3_moe.py")]
    for w in app.models:
        if w.tag == "chunked_prefill_model":
            assert w.compiler_args == app.context_encoding_model.compiler_args
            continue
        nxdi = ModelWrapper(config=w.config, model_cls=w.model_cls, tag=w.tag, compiler_args=None).compiler_args
        assert w.compiler_args.startswith(nxdi.strip() + " ")
        added = w.compiler_args[len(nxdi.strip()):].split(" --")
        assert [f for f in added if f.strip() and not any("--" + f.strip() in src for src in nxdi_moe_models)] == []
        assert ("--modular-flow-mac-threshold=10" in nxdi) == (w.tag == "context_encoding_model")
        assert ("--hbm-scratchpad-page-size=1024" in nxdi) == bool(scratchpad)
        assert (" -O1 " if w.tag == "context_encoding_model" else " -O2 ") in nxdi and "--lnc=2" in nxdi


# -- the model ---------------------------------------------------------------------------------------------------------

def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


# -- the router in NxD's contract -----------------------------------------------------------------------------------

def _transformers_gate(cfg: KimiK2Config, weight, bias):
    """transformers' DeepseekV3TopkRouter (the noaux_tc gate, written independently of this port) with these
    weights: (indices, weights) of each token's experts, whatever transformers version this venv pins."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gate = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=cfg.hidden_size, n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor))
    gate.weight.data.copy_(weight)
    gate.e_score_correction_bias.copy_(bias)

    def route(x):
        out = gate(x)
        return out[-2:]  # (indices, weights); transformers 5 puts the router logits first

    return route


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_affinities_at_the_chosen_experts_equal_transformers_gate(n_group, topk_group, dtype):
    cfg = tiny_cfg(n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group)
    g = torch.Generator().manual_seed(0)
    router = NxDRouter(cfg)
    router.weight.data.copy_(torch.randn(32, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5)
    router.e_score_correction_bias.data.copy_(0.3 * torch.randn(32, generator=g))
    x = torch.randn(2, 5, cfg.hidden_size, generator=g).to(dtype)  # [B, S, H] as MoE passes it
    logits, aff, ids = router(x)
    hf_ids, hf_w = _transformers_gate(cfg, router.weight.data, router.e_score_correction_bias.data)(x)
    assert [set(r) for r in ids.tolist()] == [set(r) for r in hf_ids.tolist()]
    assert aff.shape == (10, 32) and aff.dtype == dtype
    want = torch.zeros(10, 32).scatter(1, hf_ids, hf_w.float())  # the gate's weights at its experts, 0 elsewhere
    torch.testing.assert_close(aff.float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    torch.testing.assert_close(logits, x.reshape(-1, cfg.hidden_size).float() @ router.weight.T)
    # ExpertMLPsV2 masks to the chosen experts and, with normalize_top_k_affinities False, changes nothing
    # (expert_mlps_v2.py:283-319): rows still sum to routed_scaling_factor.
    torch.testing.assert_close(aff.float().sum(1), torch.full((10,), cfg.routed_scaling_factor),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)


# -- decode masks and NxDI's prefill/decode flow ----------------------------------------------------------------

def prior_mask_for_positions(positions: torch.Tensor, cache_len: int) -> torch.Tensor:
    """The mask NxDI builds for rows decoding at `positions` [B]: [B, 1, 1, cache_len], True on [0, pos) (what
    hf_adapter's attention mask becomes in _create_simple_attn_mask)."""
    return (torch.arange(cache_len)[None, :] < positions[:, None])[:, None, None, :]


def test_decode_masks_are_the_cached_prefix_plus_the_current_token():
    prior_mask = prior_mask_for_positions(torch.tensor([2, 5]), 6)
    prior, active = decode_masks(prior_mask, 1)
    assert prior.tolist() == [[[[1, 1, 0, 0, 0, 0]]], [[[1, 1, 1, 1, 1, 0]]]] and active.tolist() == [[[[1]]]] * 2
    # the same as the core's rule for a token at position p: it sees cache slots 0..p (mla.py forward)
    for b, p in enumerate([2, 5]):
        core_visible = torch.arange(6) <= p
        core_visible[p] = False  # slot p is not written yet on Neuron: the token itself is the active segment
        assert torch.equal(prior[b, 0, 0], core_visible)


def test_the_planners_sharded_cache_slots_are_nxdis_get_cache_size():
    """RunSpec.cache_slots (the planner's KV row) against NxDI's flash-decoding cache size per rank (NXDI_CONTRACT.md:
    fd-cache-size), the cache manager's call; NxDI refuses what check_layout refuses, a length G does not divide."""
    from neuronx_distributed_inference.modules.flashdecode.utils import get_cache_size

    for seq_len, group in ((262144, 64), (131072, 64), (1024, 64), (262144, 16), (4096, 8), (16, 2)):
        assert RunSpec(seq_len=seq_len, layout=Layout(kv_group=group)).cache_slots == get_cache_size(seq_len, group)
    assert RunSpec(seq_len=1000).cache_slots == 1000  # replicated: every position on every rank
    with pytest.raises(Exception):
        get_cache_size(1000, 64)


# -- the application: to_cpu builds as the device path does, and loads strictly ----------------------------------------

@pytest.fixture(scope="module")
def bf16_app(converted):
    """bfloat16 at TP=1, the device dtype: NxDI's own to_cpu would cast the float32 router to bf16 here."""
    return backend.build(cpu_options(model=str(converted[("fp8", "fp8-blockwise")]), dtype="bfloat16"), 16, 2)


def _moe_layer(model):
    return next(layer.mlp for layer in model.layers if layer.is_moe)


def test_parameters_keep_their_declared_dtypes(bf16_app):
    for wrapper in bf16_app.models:
        model = wrapper.model
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        router = {n: d for n, d in dtypes.items() if ".mlp.router." in n}
        assert router and set(router.values()) == {torch.float32}, router
        assert dtypes["layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
        assert dtypes["embed_tokens.weight"] == torch.bfloat16


def test_fp8_experts_are_nxd_quantized_layers_with_their_scales(bf16_app):
    """NxDI's to_cpu skips quantize.convert, so FP8 codes would load into plain bf16 expert layers and the scales be
    dropped; built as on device they are NxD's quantized expert layers holding float8 codes and float32 scales."""
    op = _moe_layer(bf16_app.context_encoding_model.model).expert_mlps.mlp_op
    assert isinstance(op.gate_up_proj, QuantizedExpertFusedColumnParallel)
    assert isinstance(op.down_proj, QuantizedExpertFusedRowParallel)
    for proj in (op.gate_up_proj, op.down_proj):
        assert proj.weight.dtype == torch.float8_e4m3fn and proj.scale.dtype == torch.float32
        assert proj.scale.abs().sum() > 0  # loaded, not left at its allocation


def test_each_submodel_is_built_with_its_own_config(bf16_app):
    """As enable_context_encoding / enable_token_generation configure them (model_base.py:3107-3141)."""
    cte, tkg = bf16_app.context_encoding_model.model, bf16_app.token_generation_model.model
    assert cte is not tkg
    assert _moe_layer(cte).expert_mlps.is_prefill is True
    assert _moe_layer(tkg).expert_mlps.is_prefill is False


def test_loading_is_strict_both_ways(bf16_app):
    model = bf16_app.token_generation_model.model
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("kv_mgr.past_key_values.")}
    assert unloaded_parameters(model, [], state) == []
    # kv_mgr.global_rank.rank is a second name of rank_util.rank: loaded with it, not missing
    assert unloaded_parameters(model, ["kv_mgr.global_rank.rank"], state) == []
    gone = "layers.1.mlp.router.e_score_correction_bias"
    without = {k: v for k, v in state.items() if k != gone}
    assert unloaded_parameters(model, [gone], without) == [gone]
    with pytest.raises(KimiInputError, match="1 tensor\\(s\\) the model has no place for: layers.1.mlp.stray"):
        cpu_mode._check_no_unexpected(model, {**state, "layers.1.mlp.stray": torch.zeros(1)}, "ckpt")


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_our_reading_of_the_converted_experts_is_nxds(converted, scheme):
    """quant.nxd_fp8.dequantize_nxd (the core runner's reading of a converted checkpoint) against NxD's quantized
    expert layers themselves: an identity input through the loaded layer gives its dequantized weight [E, in, out]."""
    from kimi_k2_neuron.quant.nxd_fp8 import dequantize_nxd

    app = backend.build(cpu_options(model=str(converted[("fp8", scheme)])), 8, 1)
    op = _moe_layer(app.token_generation_model.model).expert_mlps.mlp_op
    for proj in (op.gate_up_proj, op.down_proj):
        e, n_in = proj.weight.shape[0], proj.weight.shape[1]
        with torch.no_grad():
            nxd = proj(torch.eye(n_in).expand(e, 1, n_in, n_in).contiguous())[:, 0]
        ours = torch.stack([dequantize_nxd(proj.weight[i], proj.scale[i]) for i in range(e)])
        torch.testing.assert_close(ours, nxd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_the_loader_delivers_exactly_the_models_tensors(converted, scheme):
    """checkpoint_loader_fn on a real KimiK2InferenceConfig at TP=2: every key the model's state dict has for weights,
    the float32 router as the core reads it."""
    from kimi_k2_neuron.neuron import contract
    from kimi_k2_neuron.runtime.runner import CpuRunner

    app = backend.application(cpu_options(model=str(converted[("fp8", scheme)]), tp=2), 8, 1)
    state = app.checkpoint_loader_fn()
    cfg = app.config.core_config()
    assert set(state) == expected_keys(cfg, ConversionRecord.of(cfg).scheme) | {"rank_util.rank"}
    core = CpuRunner(converted[("fp8", scheme)]).model
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert state[f"layers.{layer}.mlp.router.weight"].dtype == torch.float32
    torch.testing.assert_close(state[f"layers.{layer}.mlp.router.weight"], core.model.layers[layer].mlp.gate.weight)


def test_nxdis_default_state_dict_path_gives_the_loaders_tensors(converted):
    """NxDI's default get_state_dict (through convert_hf_to_neuron_state_dict; NXDI_CONTRACT.md: state-dict-prefix)
    and checkpoint_loader_fn give the same state dict, with q_a | kv_a fused and the router under its linear."""
    from kimi_k2_neuron.formats import layout

    path = str(converted[("fp8", "fp8-blockwise")])
    o = cpu_options(model=path, tp=2, layout=Layout(shard_attn_a=True, shard_router=True))
    app = backend.application(o, 8, 1)
    want = app.checkpoint_loader_fn()
    got = type(app).get_state_dict(path, app.config)
    cfg = app.config.core_config()
    moe = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert layout.fused_attention_a_key(0) in got and layout.router_weight_key(moe, linear=True) in got
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_the_loader_refuses_a_checkpoint_converted_for_another_scheme(converted):
    """Its scales have another shape than the NeuronConfig's scheme gives them: named, with both shapes."""
    app = backend.application(cpu_options(model=str(converted[("fp8", "fp8-per-channel")])), 8, 1)
    app.neuron_config.quantized_checkpoints_path = str(converted[("fp8", "fp8-blockwise")])
    with pytest.raises(KimiInputError, match=r"_proj.scale has shape \[.*\], expected \["):
        app.checkpoint_loader_fn()


def test_nxd_converts_exactly_the_routed_experts(bf16_app):
    """NxD's quantize.convert with contract.modules_to_not_convert: quantized layers are the routed experts only."""
    from neuronx_distributed.quantization.quantization_layers import BaseQuantizeParallelLinear

    for wrapper in bf16_app.models:
        quantized = {n for n, m in wrapper.model.named_modules() if isinstance(m, BaseQuantizeParallelLinear)}
        moe = [i for i, layer in enumerate(wrapper.model.layers) if layer.is_moe]
        projections = ("gate_up_proj", "down_proj")
        assert quantized == {f"layers.{i}.mlp.expert_mlps.mlp_op.{p}" for i in moe for p in projections}


# -- the KV group's collectives (the sequence-sharded cache's seam) through NxD's CPU-mode collectives ----------------

def _kv_seam_rank(rank: int, tp: int, g: int, out_dir: str) -> None:
    """One of `tp` NxD CPU-mode ranks with NxD's KV groups of `g` adjacent ranks: the seam's collectives and
    MLAttention.attend_sharded through NxDParallelContext, and through the core's ParallelContext (plain gloo
    groups) on the same inputs."""
    import os

    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.layers import SPMDRank
    from neuronx_distributed.trace.trace import get_sharded_checkpoint
    from safetensors.torch import save_file

    from kimi_k2_neuron.model.mla import MLAttention
    from kimi_k2_neuron.parallel import ParallelContext

    os.environ["NXD_CPU_MODE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, skip_collective_init=True)
    parallel_state.initialize_kv_group(g, sequential_ranks_in_group=True)
    groups = [dist.new_group(list(range(s, s + g))) for s in range(0, tp, g)]
    core = ParallelContext(tp, rank, Layout(kv_group=g), groups[rank // g])
    # the model's SPMDRank, its rank_util.rank (contract.to_neuron_state_dict) sharded as NxDI's to_cpu() shards it
    rank_util = SPMDRank(world_size=tp)
    state = {"rank": torch.arange(tp, dtype=torch.int32)}
    get_sharded_checkpoint(state, rank_util, rank, tp)
    rank_util.load_state_dict(state)
    nxd = modeling.NxDParallelContext(tp_size=tp, layout=Layout(kv_group=g), rank_util=rank_util)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(2, 3, 5, 7, generator=gen), torch.randn(2, 3 * g, 5, 9, generator=gen)
    out = {"kv_rank": torch.cat([nxd.kv_rank(), torch.tensor([core.kv_rank()])])}
    for name, ctx in (("nxd", nxd), ("core", core)):
        out |= {f"{name}.gather": ctx.gather_kv_heads(x), f"{name}.max": ctx.max_over_kv_group(x),
                f"{name}.reduce_scatter": ctx.reduce_scatter_kv_heads(y)}
    cfg = KimiK2Config.from_dict(tiny_config_dict("bf16"))
    attn = MLAttention(cfg, torch.float32, core)  # this rank's heads (and their slice of o_proj), uninitialized
    weights = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=weights)
    q_nope = torch.randn(2, attn.n_heads, 3, attn.nope, generator=gen)
    q_pe = torch.randn(2, attn.n_heads, 3, attn.rope, generator=gen)
    keys = torch.randn(2, 6, attn.rank + attn.rope, generator=gen)
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool) if rank == 0 else torch.rand(2, 1, 3, 6, generator=gen) > 0.4
    for name, ctx in (("nxd", nxd), ("core", core)):
        attn.ctx = ctx
        out[f"{name}.attend"] = attn.attend_sharded(q_nope, q_pe, [keys], [mask])
    save_file({k: v.contiguous() for k, v in out.items()}, f"{out_dir}/rank{rank}.safetensors")
    dist.destroy_process_group()


@pytest.mark.parametrize("g", [4, 2])
def test_the_kv_group_seam_through_nxds_collectives_is_the_cores(tmp_path, g):
    """NxDParallelContext's KV-group collectives (NxD's _gather_along_dim, _reduce with max and
    _reduce_scatter_along_dim over the group initialize_kv_group makes; NXDI_CONTRACT.md: kv-collectives) at TP=4,
    one group of 4 and two groups of 2, give the core seam's results (its sharded attention is checked against
    transformers in test/unit/test_tp.py), its kv_rank from an SPMDRank loaded as the model's is the core's rank in
    its group, and attend_sharded through either seam gives the same output. The model uses it with --kv-shard
    sequence (test_kv_shard.py, test_chunk_submodel.py)."""
    from safetensors.torch import load_file

    from kimi_k2_neuron.runtime.ranks import run_ranks

    run_ranks(_kv_seam_rank, 4, args=(4, g, str(tmp_path)))
    for r in range(4):
        got = load_file(tmp_path / f"rank{r}.safetensors")
        assert got["kv_rank"].tolist() == [r % g, r % g]
        for op in ("gather", "max", "reduce_scatter", "attend"):
            torch.testing.assert_close(got[f"nxd.{op}"], got[f"core.{op}"], rtol=1e-6, atol=1e-6)
        assert got["nxd.gather"].shape == (2, 3 * g, 5, 7) and got["nxd.reduce_scatter"].shape == (2, 3, 5, 9)


def test_the_chunk_groups_on_device_are_one_group_per_mesh_as_nxd_makes_its_own():
    """NxDParallelContext's chunk groups outside NxD's CPU mode, under ModelBuilder's mock_distributed as tracing runs
    the forward (NXDI_CONTRACT.md: chunk-groups): one group per mesh, whose replica groups (what NxD's comm
    collectives read) are the whole mesh. At TP=64, G=64 and the chunk group of 16: the consecutive 16s NxD lays out
    for a KV group of 16, and the 4 ranks strided by 16 of its 3-stage top-k; each made once. In NxD's CPU mode the
    same groups are gloo's (test_chunk_submodel.py's chunk group 2 runs through them)."""
    from neuronx_distributed.parallel_layers import comm
    from neuronx_distributed.parallel_layers.parallel_state import arrange_kv_groups
    from neuronx_distributed.trace.mock_torchdist import mock_distributed
    from neuronx_distributed.utils.utils import hardware

    with backend.nxd_cpu_mode(False), mock_distributed(world_size=64):
        torch.distributed.init_process_group("xla", rank=0, world_size=64)
        ctx = modeling.NxDParallelContext(tp_size=64, layout=Layout(kv_group=64, prefill_chunk=1024))
        merge, pool = ctx._mesh(16, 0), ctx._mesh(16, 1)
        assert comm._get_group_mesh(merge) == arrange_kv_groups(1, 64, 16, True, hardware.TRN2)
        assert comm._get_group_mesh(pool) == [list(range(i, 64, 16)) for i in range(16)]
        assert (merge.size(), pool.size()) == (16, 4) and ctx._mesh(16, 0) is merge
