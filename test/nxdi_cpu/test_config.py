"""KimiK2InferenceConfig through NxDI's own save/load (InferenceConfig.save -> neuron_config.json -> load), on the real
Kimi-K2 configs: the derived fields and our NeuronConfig settings survive the round trip."""

import json
import shutil

import pytest
import torch
from neuronx_distributed_inference.models.config import MoENeuronConfig

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron import KimiK2InferenceConfig, contract
from nxdi_support import REPO

CONFIGS = ["kimi-k2-instruct.json", "kimi-k2-instruct-0905.json", "kimi-k2-thinking.json"]


def _config(tmp_path, name, **opts):
    opts = {"tp": 64, **opts}
    src = tmp_path / "ckpt"
    src.mkdir(exist_ok=True)
    shutil.copy(REPO / "test/data/configs" / name, src / "config.json")
    cfg = KimiK2Config.from_file(src)
    kw = contract.neuron_config_kwargs(cfg, contract.ServeOptions(experts="bf16", **opts))
    return cfg, KimiK2InferenceConfig.from_checkpoint(src, MoENeuronConfig(**kw))


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


# Settings this port does not implement, set on a real MoENeuronConfig through ServeOptions.extra (the reload path is
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
    ({"moe_tp_degree": 8}, "moe_tp_degree=8 x moe_ep_degree=16 != tp_degree=64"),
    ({"moe_ep_degree": 8, "moe_tp_degree": 8}, "moe_ep_degree=8 at tp_degree=64"),
    ({"blockwise_matmul_config": {"logical_nc_config": 2, "parallelize_token_to_block_mapping": False}},
     "no spmd_rank"),
    ({"blockwise_matmul_config": {"logical_nc_config": 2, "block_size": 2**30}}, "all-experts prefill with EP"),
    ({"tkg_batch_size": 8}, "with batch 8: NxD decodes EP only on all experts"),
]


@pytest.mark.parametrize("over,needle", EP_REFUSED, ids=[str(o) for o, _ in EP_REFUSED])
def test_moe_expert_parallelism_is_rechecked_on_a_real_neuron_config(tmp_path, over, needle):
    _config(tmp_path, "kimi-k2-instruct-0905.json", **EP)  # accepted as --ep 16 sets it
    with pytest.raises(ValueError, match="unsupported NeuronConfig") as e:
        _config(tmp_path, "kimi-k2-instruct-0905.json", **EP, extra=over)
    assert needle in str(e.value)


@pytest.mark.parametrize("scratchpad", [None, 1024])
def test_compiler_args_are_nxdis_own_plus_kimis(converted, scratchpad):
    """Each submodel's string, as compile_and_save builds the application, against what NxDI's ModelWrapper computes
    for the same config by itself (model_wrapper.py:85-162): all of NxDI's kept (prefill's
    --modular-flow-mac-threshold=10, a scratchpad page size reaching the compiler), Kimi's added."""
    from neuronx_distributed_inference.models.model_wrapper import ModelWrapper

    from kimi_k2_neuron.formats.record import ConversionRecord
    from kimi_k2_neuron.neuron import NeuronKimiK2ForCausalLM

    ckpt = converted[("fp8", "fp8-blockwise")]
    rec = ConversionRecord.read(ckpt)
    opts = contract.ServeOptions(tp=1, seq_len=16, experts=rec.experts, checkpoint=str(ckpt),
                                 quant_record=rec.nxd,
                                 extra={} if scratchpad is None else {"scratchpad_page_size": scratchpad})
    kw = contract.neuron_config_kwargs(KimiK2Config.from_file(ckpt), opts)
    app = NeuronKimiK2ForCausalLM(str(ckpt), KimiK2InferenceConfig.from_checkpoint(ckpt, MoENeuronConfig(**kw)))
    for w in app.models:
        nxdi = ModelWrapper(config=w.config, model_cls=w.model_cls, tag=w.tag, compiler_args=None).compiler_args
        assert w.compiler_args == nxdi.strip() + " " + " ".join(contract.KIMI_COMPILER_ARGS)
        assert ("--modular-flow-mac-threshold=10" in nxdi) == (w.tag == "context_encoding_model")
        assert ("--hbm-scratchpad-page-size=1024" in nxdi) == bool(scratchpad)
        assert (" -O1 " if w.tag == "context_encoding_model" else " -O2 ") in nxdi and "--lnc=2" in nxdi
