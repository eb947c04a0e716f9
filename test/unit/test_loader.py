"""The shell's loader without NxD/NxDI (neuron/loader.py): a safetensors checkpoint memory-mapped tensor by tensor, a
raw one refused; the converted checkpoint as the model's state dict, strict both ways, fitted to the layout; the
pre-sharding passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS
from kimi_k2_neuron.model.model import KimiK2ForCausalLM
from kimi_k2_neuron.neuron import loader
from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY, RunSpec
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.tiny.checkpoint import dense_weights

from specs import PER_CHANNEL, tiny_cfg


def test_mmap_checkpoint_reads_what_safetensors_reads(tiny):
    """A 3-shard checkpoint with an index and FP8, float32 and bf16 tensors (the tiny FP8 one)."""
    d = tiny["fp8"]
    got = loader.mmap_checkpoint(d)
    want = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))


def test_a_raw_checkpoint_is_refused_with_the_command_that_converts_it(tiny, one_line_error):
    """The shell never converts: the entry points do, once, up front (kimi_k2_neuron.convert.once). A raw
    checkpoint's per-expert tensors have no place in the Neuron model."""
    nc = SimpleNamespace(quantized=True, quantization_type="blockwise_symmetric", quantization_block_size=[32, 32],
                         tp_degree=1)
    config = SimpleNamespace(neuron_config=nc, core_config=lambda: KimiK2Config.from_file(tiny["fp8"]),
                             **{RUN_SPEC_KEY: RunSpec().to_json()})
    one_line_error(lambda: loader.load_neuron_state_dict(tiny["fp8"], config), str(tiny["fp8"]),
                   "per-expert HF tensors", "kimi-k2-neuron convert SRC DST --experts fp8-blockwise")


@pytest.mark.parametrize("start,size,env,want", [
    (0, 64, {}, [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (48, 8), (56, 8)]),
    (0, 2, {}, [(0, 2)]),
    (16, 20, {}, [(16, 8), (24, 8), (32, 4)]),
    (0, 64, {"NXD_LAYOUT_TRANSFORMATION_OPTIONS": "on_cpu_and_serialize"}, [(0, 64)]),
])
def test_presharding_passes_cover_every_rank_once(start, size, env, want):
    assert loader.rank_passes(start, size, env) == want


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
