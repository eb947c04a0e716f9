"""--shard-attn-a and --shard-router in the Neuron shell, through the real NxD/NxDI in NxD's CPU mode (gloo ranks).

- --shard-attn-a: q_a_proj | kv_a_proj_with_mqa as one NxD ColumnParallelLinear(gather_output=True); the state dict
  fuses the two bf16 weights (only the routed experts are quantized, so there is no scale to fuse) and NxD's sharder
  gives rank r rows [r n / tp, (r + 1) n / tp) of the fused [q_lora_rank + latent, hidden].
- --shard-router: the float32 router weight as a gathered ColumnParallelLinear in NxDRouter, E / tp experts' rows per
  rank; the gathered float32 logits feed the same selection on every rank.
- Each and both: the logits at TP=2 and TP=4 equal the replicated TP=1 run's (float32, 1e-4 of max |logit|), and
  the expert indices NxD's MoE hands ExpertMLPsV2 (recorded by forward pre-hooks on the real module, nothing
  patched) are identical on every rank and equal, per token, to the replicated run's. Each rank's slices are read
  from the model's state dict after NxD's get_sharded_checkpoint, and from the files NxD's ModelBuilder pre-shards
  (what compile() writes for trn2), which the ranks then load.
- The options: an InferenceConfig attribute through NxDI's save/load; uneven splits refused in one line; the dry run
  of compile_and_save.py prints them beside the NeuronConfig.
Tiny shapes (hidden 192, q_lora_rank 160, latent 96 + 16, 8 experts): 272 / tp fused rows, 8 / tp router rows. At
Kimi-K2's (hidden 7168, q_lora_rank 1536, latent 512 + 64, 384 experts) and TP=64 that is 2112 / 64 = 33 and
384 / 64 = 6 rows of 7168 per rank (derived from config.json, not run here).
Collectives are gloo's in NxD's CPU mode, not Neuron's; TP=4 uses fp8-per-channel experts (blockwise [32, 32] expert
scales of the tiny model shard only 1 or 2 ways).
"""

import json
import subprocess
import sys

import pytest
import torch
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
from nxdi_support import REPO, cpu_options, rel_err
from safetensors.torch import load_file

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.neuron import KimiK2InferenceConfig, contract
from kimi_k2_neuron.neuron.loader import mmap_checkpoint
from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY, RunSpec
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.ranks import run_ranks
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict

ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100]]
PREFILL = 4
SCHEME = "fp8-per-channel"
OPTIONS = {"attn-a": Layout(shard_attn_a=True), "router": Layout(shard_router=True),
           "both": Layout(shard_attn_a=True, shard_router=True)}

pytestmark = pytest.mark.fp8_selective_cpu


# -- one run at tp ranks, every rank's record kept ---------------------------------------------------------------------

def _record(rank: int, o: backend.CpuOptions, out_dir: str) -> None:
    """A rank: its logits, the fused / router weights each submodel holds, and each ExpertMLPsV2 call's indices."""
    torch.set_num_threads(1)
    app = backend.build(o, seq_len=max(map(len, ROWS)), batch=len(ROWS))
    calls, weights = [], {}
    for wrapper in app.models:
        state = wrapper.model.state_dict()
        weights[wrapper.tag] = {k: v.clone() for k, v in state.items() if _is_layout_key(k)}
        for module in wrapper.model.modules():
            if isinstance(module, ExpertMLPsV2):
                module.register_forward_pre_hook(
                    lambda _m, _a, kw, tag=wrapper.tag: calls.append((tag, kw["expert_index"].clone())),
                    with_kwargs=True)
    logits = backend.teacher_forced_logits(app, ROWS, PREFILL)
    torch.save({"logits": logits, "weights": weights, "calls": calls}, f"{out_dir}/rank{rank}.pt")


def _is_layout_key(key: str) -> bool:
    return (".self_attn." in key and any(f".{n}." in key for n in (*layout.ATTENTION_A, layout.FUSED_ATTENTION_A))
            or ".mlp.router." in key and key.endswith("weight"))


def _run(o: backend.CpuOptions, out_dir) -> list[dict]:
    o = backend.prepare(o, max(map(len, ROWS)), len(ROWS))
    out_dir.mkdir(exist_ok=True)
    run_ranks(_record, o.tp, (o, str(out_dir)))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(o.tp)]


@pytest.fixture(scope="module")
def replicated(converted, tmp_path_factory):
    return _run(cpu_options(model=str(converted[("fp8", SCHEME)])), tmp_path_factory.mktemp("tp1"))[0]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_sharded_weights_give_the_replicated_logits_slices_and_experts(converted, replicated, tmp_path, tp, option):
    ckpt = converted[("fp8", SCHEME)]
    o = cpu_options(model=str(ckpt), tp=tp, layout=OPTIONS[option])
    ranks = _run(o, tmp_path / "ranks")
    cfg = KimiK2Config.from_file(ckpt)
    want = replicated["logits"]
    for got in ranks:
        for r, row in enumerate(ROWS):
            assert rel_err(got["logits"][r, :len(row)], want[r, :len(row)]) < 1e-4, f"row {r}"

    # Each rank's slices: tiny 272 / tp fused rows and 8 / tp router rows of 192 (Kimi-K2 at TP=64: 33 and 6 of
    # 7168), the rows NxD's sharder gives rank r of the fused / router checkpoint tensors.
    tensors = mmap_checkpoint(ckpt)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for rank, got in enumerate(ranks):
        for tag, weights in got["weights"].items():
            if o.spec.layout.shard_attn_a:
                assert not any(f".{n}." in k for k in weights for n in layout.ATTENTION_A)
                rows = (cfg.q_lora_rank + cfg.latent_dim) // tp
                for i in range(cfg.num_hidden_layers):
                    w = weights[layout.fused_attention_a_key(i)]
                    assert w.shape == (rows, cfg.hidden_size) == ((160 + 112) // tp, 192), tag
                    full = torch.cat([tensors[f"model.{k}"] for k in layout.attention_a_keys(i)])
                    assert torch.equal(w, full[rank * rows:(rank + 1) * rows].to(w.dtype)), (tag, i)
            else:
                assert all(weights[k].shape[0] == full for k, full in
                           zip(layout.attention_a_keys(0), (cfg.q_lora_rank, cfg.latent_dim)))
            for i in moe_layers:
                key = layout.router_weight_key(i, linear=o.spec.layout.shard_router)
                w = weights[key]
                other = layout.router_weight_key(i, not o.spec.layout.shard_router)
                assert w.dtype == torch.float32 and other not in weights
                full = tensors[f"model.layers.{i}.mlp.gate.weight"]
                if o.spec.layout.shard_router:
                    rows = cfg.n_routed_experts // tp
                    assert w.shape == (rows, cfg.hidden_size) == (8 // tp, 192)
                    assert torch.equal(w, full[rank * rows:(rank + 1) * rows]), (tag, i)
                else:
                    assert torch.equal(w, full)

    # The experts NxD's MoE handed ExpertMLPsV2, call by call: the same on every rank, and per token the replicated
    # run's (sorted: a selection, not an order).
    calls = [got["calls"] for got in ranks]
    assert len(calls[0]) == len(replicated["calls"]) > 0
    for other in calls[1:]:
        assert [t for t, _ in other] == [t for t, _ in calls[0]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(other, calls[0]))
    for (tag, ids), (tag1, ids1) in zip(calls[0], replicated["calls"]):
        assert tag == tag1 and torch.equal(ids.sort(-1).values, ids1.sort(-1).values), tag


def test_in_bfloat16_the_router_linear_stays_float32(converted, replicated):
    """As on trn2 (bf16 at TP=1 here: gloo has no bf16): the gathered router linear keeps its float32 weight
    (cast_type "as-declared") and takes the bf16 hidden state cast up; the fused q_a|kv_a layer is bf16. A sanity
    bound against the float32 run, not parity (a near-tie routing decision may flip in bf16, as test_backend's)."""
    o = cpu_options(model=str(converted[("fp8", SCHEME)]), dtype="bfloat16", layout=OPTIONS["both"])
    app = backend.build(o, seq_len=max(map(len, ROWS)), batch=len(ROWS))
    for wrapper in app.models:
        state = wrapper.model.state_dict()
        routers = [v for k, v in state.items() if k.endswith(f".{layout.ROUTER_LINEAR}.weight")]
        fused = [v for k, v in state.items() if f".{layout.FUSED_ATTENTION_A}." in k]
        assert routers and all(v.dtype == torch.float32 for v in routers), wrapper.tag
        assert fused and all(v.dtype == torch.bfloat16 for v in fused), wrapper.tag
    got = backend.teacher_forced_logits(app, ROWS, PREFILL)
    for r, row in enumerate(ROWS):
        ours, want = got[r, :len(row)], replicated["logits"][r, :len(row)]
        assert (ours - want).abs().median() / want.abs().max() < 2e-2
        assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


# -- the options in the config, and their refusals ---------------------------------------------------------------------

def _tiny_options(cfg, tp, **lay):
    """The tiny model as the CPU harness serves it (NxD's torch MoE loop, NxDI's LNC)."""
    return RunSpec(tp=tp, lnc=None, scheme=ConversionRecord.of(cfg).scheme, seq_len=16, checkpoint="/c",
                   moe_prefill="torch", layout=Layout(**lay))


def test_the_options_survive_nxdis_save_and_load(converted, tmp_path):
    """An InferenceConfig attribute (NxDI drops NeuronConfig fields it does not know), saved to neuron_config.json and
    set again on load, where the model reads it."""
    cfg = KimiK2Config.from_file(converted[("fp8", SCHEME)])
    opts = _tiny_options(cfg, 2, shard_attn_a=True, shard_router=True)
    config = KimiK2InferenceConfig.for_serving(cfg, opts)
    config.save(str(tmp_path))
    saved = json.loads((tmp_path / "neuron_config.json").read_text())
    assert saved[RUN_SPEC_KEY]["layout"] == {"kv_group": 1, "prefill_chunk": None, "shard_attn_a": True,
                                             "shard_router": True, "chunk_group": None}
    again = KimiK2InferenceConfig.load(str(tmp_path))
    assert contract.run_spec(again) == opts
    assert "mlp.router" in again.neuron_config.modules_to_not_convert  # its linear stays float32, unquantized
    default = KimiK2InferenceConfig.for_serving(cfg, _tiny_options(cfg, 2))
    assert contract.run_spec(default).layout == Layout()
    assert "mlp.router" not in default.neuron_config.modules_to_not_convert


def _one_line(fn, message):
    with pytest.raises(KimiInputError) as e:
        fn()
    assert str(e.value) == message and "\n" not in str(e.value)


def test_uneven_splits_are_refused_in_one_line(converted, tmp_path):
    """An uneven split would make NxD pad the layer (ColumnParallelLinear(pad=...)), which neither the fused split nor
    the planner models; refused before NxD builds anything, and again on a reload."""
    import dataclasses

    cfg = KimiK2Config.from_file(converted[("fp8", SCHEME)])

    def serving(c, tp, **lay):
        return lambda: KimiK2InferenceConfig.for_serving(c, _tiny_options(cfg, tp, **lay))

    _one_line(serving(dataclasses.replace(cfg, q_lora_rank=162), 4, shard_attn_a=True),
              "--shard-attn-a --tp 4: config.json field q_lora_rank=162 is not divisible by 4")
    _one_line(serving(dataclasses.replace(cfg, n_routed_experts=6), 4, shard_router=True),
              "--shard-router --tp 4: config.json field n_routed_experts=6 is not divisible by 4")
    config = KimiK2InferenceConfig.for_serving(cfg, _tiny_options(cfg, 2))
    config.save(str(tmp_path))
    saved = json.loads((tmp_path / "neuron_config.json").read_text())
    saved[RUN_SPEC_KEY]["layout"] = {"shard_heads": True}
    (tmp_path / "neuron_config.json").write_text(json.dumps(saved))
    _one_line(lambda: KimiK2InferenceConfig.load(str(tmp_path)),
              f"neuron_config.json field {RUN_SPEC_KEY}.layout: expected an object with fields among ['chunk_group', "
              f"'kv_group', 'prefill_chunk', 'shard_attn_a', 'shard_router'], got {{'shard_heads': True}}")
    saved[RUN_SPEC_KEY]["layout"] = {"shard_router": True}  # keeps its router linear out of quantization
    (tmp_path / "neuron_config.json").write_text(json.dumps(saved))
    with pytest.raises(KimiInputError, match=r"modules_to_not_convert=.*\(the run spec kimi_k2_run_spec implies"):
        KimiK2InferenceConfig.load(str(tmp_path))  # its NeuronConfig was derived from another spec


@pytest.mark.parametrize("layout,flags", [(dict(shard_router=True), "--shard-router"),
                                          (dict(kv_group=2), "--kv-shard sequence --kv-group 2")])
def test_vllm_neuron_is_not_served_artifacts_compiled_with_the_options(converted, tmp_path, layout, flags):
    """vllm-neuron builds the model from its own request, which carries no layout, and drives the prefills itself:
    artifacts compiled with one would load into a replicated model; refused before it loads them
    (compile_and_save.py --for-vllm refuses the flags)."""
    from kimi_k2_neuron.neuron.inference_config import _check_compiled

    cfg = KimiK2Config.from_file(converted[("fp8", SCHEME)])
    KimiK2InferenceConfig.for_serving(cfg, _tiny_options(cfg, 2, **layout)).save(str(tmp_path))
    request = RunSpec(tp=2, batch=1, seq_len=16, max_context_length=16)
    with pytest.raises(KimiInputError, match="a layout vllm-neuron's request cannot carry") as e:
        _check_compiled(str(tmp_path), request, KimiK2InferenceConfig.for_serving(cfg, _tiny_options(cfg, 2)))
    assert "\n" not in str(e.value) and f"compiled with {flags}, a layout" in str(e.value)


def test_compile_dry_run_prints_the_neuron_config_with_the_options(tmp_path):
    """Kimi-K2-Instruct-0905 at TP=64: the saved weight layout beside the NeuronConfig, the router's linear kept out of
    quantization, the plan with the split rows; and an uneven split refused in one line, exit 2."""
    model = tmp_path / "k2"
    model.mkdir()
    (model / "config.json").write_text((REPO / "test/data/configs/kimi-k2-instruct-0905.json").read_text())
    script = [sys.executable, str(REPO / "scripts/compile_and_save.py"), "--model", str(model), "--out",
              str(tmp_path / "out"), "--dry-run"]
    r = subprocess.run(script + ["--tp", "64", "--shard-attn-a", "--shard-router"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got[RUN_SPEC_KEY]["layout"] == {"kv_group": 1, "prefill_chunk": None, "shard_attn_a": True,
                                           "shard_router": True, "chunk_group": None}
    assert got["neuron_config"]["tp_degree"] == 64 and "mlp.router" in got["neuron_config"]["modules_to_not_convert"]
    plain = subprocess.run(script + ["--tp", "64", "--kv-shard", "none"], capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    base = json.loads(plain.stdout)
    assert not base[RUN_SPEC_KEY]["layout"]["shard_attn_a"] and not base[RUN_SPEC_KEY]["layout"]["shard_router"]
    assert got["plan"]["layout"] == got[RUN_SPEC_KEY]["layout"] and got["plan"]["fits"]
    kinds = {w["kind"] for w in got["plan"]["weights"]}
    assert "attention q_a+kv_a (TP, gathered)" in kinds and "attention q_a+kv_a (TP, gathered)" not in {
        w["kind"] for w in base["plan"]["weights"]}

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps({**tiny_config_dict("fp8"), "n_routed_experts": 6}))
    bad = subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), "--model", str(tiny), "--out",
                          str(tmp_path / "out2"), "--dry-run", "--tp", "4", "--shard-router"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "error: --shard-router --tp 4: config.json field n_routed_experts=6 is not divisible by 4"), bad.stderr[-2000:]


# -- NxD's pre-sharding (what compile() writes for trn2) ------------------------------------------------------------

# ModelBuilder refuses a torch_neuronx without __version__ (model_builder.py:461); as test_backend.py's PRESHARD.
PRESHARD = """
import sys, torch_neuronx
if not hasattr(torch_neuronx, "__version__"):
    torch_neuronx.__version__ = "2 (nxdi-cpu import shim)"
from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY, RunSpec
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.nxdi_cpu import backend
layout = Layout(shard_attn_a=True, shard_router=True)
backend.preshard(backend.CpuOptions(model=sys.argv[1], spec=RunSpec(tp=int(sys.argv[2]), lnc=None, moe_prefill=None,
                                                                    layout=layout)),
                 sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
"""


def test_presharded_ranks_hold_their_slices_and_give_the_replicated_logits(converted, replicated, tmp_path):
    """NxD's ModelBuilder shard_checkpoint writes each rank's rows of the fused and router tensors into its file; each
    rank then loads its own file strictly, at TP=2 with both options."""
    tp, ckpt = 2, converted[("fp8", SCHEME)]
    r = subprocess.run([sys.executable, "-c", PRESHARD, str(ckpt), str(tp), str(tmp_path), str(max(map(len, ROWS))),
                        str(len(ROWS))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg, tensors = KimiK2Config.from_file(ckpt), mmap_checkpoint(ckpt)
    moe = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    for rank in range(tp):
        ranked = load_file(str(tmp_path / "weights" / f"tp{rank}_sharded_checkpoint.safetensors"))
        assert not any(f".{n}." in k for k in ranked for n in layout.ATTENTION_A)
        fused = ranked[layout.fused_attention_a_key(moe)]
        full = torch.cat([tensors[f"model.{k}"] for k in layout.attention_a_keys(moe)])
        assert fused.shape == (136, 192) and torch.equal(fused, full[rank * 136:(rank + 1) * 136].to(fused.dtype))
        router = ranked[layout.router_weight_key(moe, linear=True)]
        assert router.shape == (4, 192) and router.dtype == torch.float32
        assert torch.equal(router, tensors[f"model.layers.{moe}.mlp.gate.weight"][rank * 4:(rank + 1) * 4])
    o = cpu_options(model=str(ckpt), tp=tp, layout=OPTIONS["both"], presharded=str(tmp_path / "weights"))
    got, _ = backend.logits(o, ROWS, PREFILL)
    for r, row in enumerate(ROWS):
        assert rel_err(got[r, :len(row)], replicated["logits"][r, :len(row)]) < 1e-4, f"row {r}"
