"""EAGLE3 drafts (checkpoint/draft.py, tiny/draft_checkpoint.py) and what the shell's SDK-free parts make of --draft:
`make-tiny --draft-for --draft-layout L` writes the public layouts (TorchSpec's LlamaForCausalLMEagle3 and its
Kimi-K2.5 config; SpecForge's reduced-vocabulary drafts with d2t/t2d; TorchSpec's MLA Eagle3DeepseekV2ForCausalLM
with EAGLE3.1's fc_norm; restated as data: the oracle), --draft reads them as it would a real draft, and every draft
that cannot run is one `error:` line before any work; the run spec's rules, the NeuronConfig fields, vLLM's request
and the planner."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k2_neuron import cli
from kimi_k2_neuron.checkpoint.draft import DRAFT_IDS, aux_conventions, aux_layer_ids, neuron_tensors, read_draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron import contract, rules, vllm_request
from kimi_k2_neuron.neuron.spec import DraftSpec, RunSpec, Sampling
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft

H, V, HEADS, HEAD_DIM, I = 192, 512, 4, 48, 384  # the tiny target's hidden and vocabulary; the draft's attention, MLP
# TorchSpec's LlamaForCausalLMEagle3 modules (torchspec/models/draft/llama3_eagle.py), at the tiny sizes
PUBLIC_LAYOUT = {
    "embed_tokens.weight": [V, H], "fc.weight": [H, 3 * H],
    "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
    "midlayer.post_attention_layernorm.weight": [H],
    "midlayer.self_attn.q_proj.weight": [HEADS * HEAD_DIM, 2 * H],
    "midlayer.self_attn.k_proj.weight": [HEADS * HEAD_DIM, 2 * H],
    "midlayer.self_attn.v_proj.weight": [HEADS * HEAD_DIM, 2 * H],
    "midlayer.self_attn.o_proj.weight": [H, HEADS * HEAD_DIM],
    "midlayer.mlp.gate_proj.weight": [I, H], "midlayer.mlp.up_proj.weight": [I, H],
    "midlayer.mlp.down_proj.weight": [H, I], "norm.weight": [H], "lm_head.weight": [V, H]}
VD = V // 4  # the eagle3-d2t draft's vocabulary
# SpecForge's reduced-vocabulary draft: the lm_head's draft_vocab_size rows, d2t offsets and the t2d mask beside
REDUCED_LAYOUT = {**PUBLIC_LAYOUT, "lm_head.weight": [VD, H], "d2t": [VD], "t2d": [V]}
# TorchSpec's Eagle3DeepseekV2ForCausalLM (torchspec/models/draft/deepseek_eagle.py) with EAGLE3.1's fc_norm.0-2
# (TorchSpec PR 97, vLLM PR 42764's names), at the tiny target's MLA ranks: q 160, kv 96, rope 16, nope 32, v 32
QL, KVR, ROPE, NOPE, VH = 160, 96, 16, 32, 32
MLA_LAYOUT = {**{k: v for k, v in PUBLIC_LAYOUT.items() if ".self_attn." not in k},
              **{f"fc_norm.{i}.weight": [H] for i in range(3)},
              "midlayer.self_attn.q_a_proj.weight": [QL, 2 * H], "midlayer.self_attn.q_a_layernorm.weight": [QL],
              "midlayer.self_attn.q_b_proj.weight": [HEADS * (NOPE + ROPE), QL],
              "midlayer.self_attn.kv_a_proj_with_mqa.weight": [KVR + ROPE, 2 * H],
              "midlayer.self_attn.kv_a_layernorm.weight": [KVR],
              "midlayer.self_attn.kv_b_proj.weight": [HEADS * (NOPE + VH), KVR],
              "midlayer.self_attn.o_proj.weight": [H, HEADS * VH]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny(root / "target", shards=2, config_overrides={"num_hidden_layers": 7})
    return target, make_tiny_draft(root / "draft", target)


@pytest.fixture(scope="module")
def drafts(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {"eagle3": pair[1], **{layout: make_tiny_draft(root / layout, pair[0], seed=3, layout=layout)
                                  for layout in ("eagle3-d2t", "eagle3.1-mla")}}


@pytest.fixture
def draft_copy(pair, tmp_path):
    return Path(shutil.copytree(pair[1], tmp_path / "draft"))


def copy_of(drafts, layout, tmp_path) -> Path:
    return Path(shutil.copytree(drafts[layout], tmp_path / layout))


def run_cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- the tiny draft ------------------------------------------------------------------------------------------------

def test_make_tiny_draft_for_writes_the_public_llama_eagle3_layout(pair, tmp_path, capsys):
    target, _ = pair
    rc, out, _ = run_cli(["make-tiny", tmp_path / "d", "--draft-for", target, "--seed", "5"], capsys)
    assert rc == 0 and "EAGLE3 draft" in out
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert {k: list(t.shape) for k, t in tensors.items()} == PUBLIC_LAYOUT
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    # the frozen target embedding, as trained drafts carry it
    embed = load_file(next(target.glob("model-0000*.safetensors")))["model.embed_tokens.weight"]
    assert torch.equal(tensors["embed_tokens.weight"], embed.to(torch.bfloat16))
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    want = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "head_dim": HEAD_DIM, "intermediate_size": I, "vocab_size": V, "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": [2, 3, 4]}
    assert {k: config[k] for k in want} == want


def test_make_tiny_draft_layout_writes_the_reduced_vocabulary_and_the_mla_layouts(pair, tmp_path, capsys):
    """eagle3-d2t: SpecForge's (AQ-MedAI/Kimi-K2-Instruct-eagle3's config: draft_vocab_size, eagle_config nested;
    d2t int64 offsets, t2d a bool mask of the same ids); eagle3.1-mla: TorchSpec's MLA draft with fc_norm/norm_output
    (lightseekorg/kimi-k2.6-eagle3.1-mla's card), aux ids in the output convention (its card's "layers 1, 29, 57")."""
    target, _ = pair
    for layout, want_layout in (("eagle3-d2t", REDUCED_LAYOUT), ("eagle3.1-mla", MLA_LAYOUT)):
        rc, out, _ = run_cli(["make-tiny", tmp_path / layout, "--draft-for", target, "--draft-layout", layout],
                             capsys)
        assert rc == 0 and f"({layout})" in out
        tensors = load_file(tmp_path / layout / "model.safetensors")
        assert {k: list(t.shape) for k, t in tensors.items()} == want_layout
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
        if layout == "eagle3-d2t":
            assert (config["architectures"], config["draft_vocab_size"]) == (["LlamaForCausalLMEagle3"], VD)
            d2t, t2d = tensors["d2t"], tensors["t2d"]
            assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
            ids = torch.arange(VD) + d2t  # vLLM's reading (llama_eagle3.py compute_logits)
            assert torch.equal(t2d.nonzero().view(-1), ids) and int(t2d.sum()) == VD
        else:
            assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
            assert (config["fc_norm"], config["norm_output"], config["kv_lora_rank"], config["draft_vocab_size"]) == (
                True, True, KVR, V)
    rc, _, err = run_cli(["make-tiny", tmp_path / "x", "--draft-layout", "eagle3-d2t"], capsys)
    assert rc == 2 and "--draft-layout eagle3-d2t: only with --draft-for" in err


def test_make_tiny_layers_and_a_draft_for_a_three_layer_target(tiny, tmp_path, capsys, one_line_error):
    rc, _, _ = run_cli(["make-tiny", tmp_path / "t", "--layers", "7"], capsys)
    assert rc == 0 and KimiK2Config.from_file(tmp_path / "t").num_hidden_layers == 7
    rc, _, err = run_cli(["make-tiny", tmp_path / "d", "--draft-for", tiny["fp8"]], capsys)
    one_line_error.exit(rc, err, "num_hidden_layers=3", "make-tiny --layers 7")
    rc, _, err = run_cli(["make-tiny", tmp_path / "d", "--draft-for", tmp_path / "t", "--quant", "int4"], capsys)
    one_line_error.exit(rc, err, "--quant: not with --draft-for")
    assert not (tmp_path / "d").exists()


def test_aux_layer_ids_name_nxdis_capture_in_both_conventions():
    """NxDI appends the outputs of layers 1, N//2 - 1, N - 4 (model_base.py:1403-1406): SpecForge's DeepSeek-V3
    config declares them so, [1, 29, 57] (SGLang adds 1 and captures the next layer's input); vLLM's ids are the
    inputs of the next layers, [2, 30, 58] (llama.py:596-603), as TorchSpec's and SpecForge's Kimi configs declare."""
    assert aux_conventions(61) == {"output": (1, 29, 57), "input": (2, 30, 58)}
    for n in (7, 61):
        assert aux_layer_ids(n) == tuple(i + 1 for i in aux_conventions(n)["output"])


# -- reading a draft ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["top", "eagle_config"])
@pytest.mark.parametrize("ids, convention", [([1, 2, 3], "output"), ([2, 3, 4], "input")])
def test_both_aux_id_conventions_are_read_as_nxdis_capture(ids, convention, where, pair, draft_copy):
    """A 7-layer target: [1, 2, 3] is [1, 29, 57] scaled (the outputs of layers 1, N//2 - 1, N - 4), [2, 3, 4] is
    [2, 30, 58] scaled; declared at the top (TorchSpec) or under eagle_config (SpecForge)."""
    c = json.loads((draft_copy / "config.json").read_text())
    c.pop("eagle_aux_hidden_state_layer_ids")
    c.update({"eagle_aux_hidden_state_layer_ids": ids} if where == "top" else
             {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}})
    (draft_copy / "config.json").write_text(json.dumps(c))
    assert read_draft(draft_copy, KimiK2Config.from_file(pair[0])).aux_convention == convention


def test_a_reduced_vocabulary_and_the_mla_layout_are_read(pair, drafts):
    """The d2t draft: its lm_head's rows, the map to target ids as int32 for the graph (target id = draft id + d2t,
    vLLM's reading); the MLA draft: its tensors under the shell's names, its layer as a one-layer dense core config."""
    target, _ = pair
    cfg = KimiK2Config.from_file(target)
    d = read_draft(drafts["eagle3-d2t"], cfg)
    assert (d.kind, d.lm_head_rows, d.mapped, d.aux_convention) == ("eagle3", VD, True, "output")
    raw = load_file(drafts["eagle3-d2t"] / "model.safetensors")
    ids = neuron_tensors(d, target)[DRAFT_IDS]
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), torch.arange(VD) + raw["d2t"])
    m = read_draft(drafts["eagle3.1-mla"], cfg)
    assert (m.kind, m.fc_norm, m.norm_output, m.mapped, m.mla.latent_dim) == ("eagle3-mla", True, True, False,
                                                                              KVR + ROPE)
    names = neuron_tensors(m, target)
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in names and "fc_norm.2.weight" in names
    core = m.core_config()
    assert (core.num_hidden_layers, core.is_moe_layer(0), core.hidden_size, core.rope_scaling) == (
        1, False, H, cfg.rope_scaling)


def test_the_names_nxdi_loads_and_the_targets_embedding_for_a_draft_without_one(pair, draft_copy):
    target, draft = pair
    d = read_draft(draft, KimiK2Config.from_file(target))
    assert d.stored["layers.0.self_attn.q_proj.weight"] == "midlayer.self_attn.q_proj.weight" and d.has_embedding
    tensors = load_file(draft_copy / "model.safetensors")
    embed = tensors.pop("embed_tokens.weight")
    # NxDI's own names, under a model. prefix, an identity d2t/t2d: the same draft
    renamed = {"model." + k.replace("midlayer.", "layers.0."): t for k, t in tensors.items()}
    renamed.update(d2t=torch.zeros(V, dtype=torch.int64), t2d=torch.ones(V, dtype=torch.bool))
    save_file(renamed, draft_copy / "model.safetensors")
    got = read_draft(draft_copy, KimiK2Config.from_file(target))
    assert not got.has_embedding and set(got.stored) == set(d.stored) - {"embed_tokens.weight"}
    loaded = neuron_tensors(got, target)
    assert torch.equal(loaded["embed_tokens.weight"].to(torch.bfloat16), embed)  # the target's
    assert torch.equal(loaded["layers.0.mlp.up_proj.weight"], tensors["midlayer.mlp.up_proj.weight"])


def _config(**fields):
    def edit(d: Path):
        c = json.loads((d / "config.json").read_text())
        c.update(fields)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _tensors(fn):
    def edit(d: Path):
        t = load_file(d / "model.safetensors")
        fn(t)
        save_file(t, d / "model.safetensors")
    return edit


BAD_DRAFTS = [
    ("mla fields", _config(architectures=["Eagle3DeepseekV2ForCausalLM"]), "field q_lora_rank=None"),
    ("not eagle3", _config(architectures=["LlamaForCausalLM"]), "expected one of ['LlamaForCausalLMEagle3'"),
    ("hidden", _config(hidden_size=2 * H), f"hidden_size={2 * H}, expected the target's hidden_size {H}"),
    ("target hidden", _config(target_hidden_size=2 * H), f"target_hidden_size={2 * H}"),
    ("vocab", _config(vocab_size=V // 2), f"vocab_size={V // 2}, expected the target's {V}"),
    ("pruned vocab", _config(draft_vocab_size=32), "lm_head.weight has shape [512, 192], expected [32, 192]"),
    ("big vocab", _config(draft_vocab_size=2 * V), f"draft_vocab_size={2 * V}, expected at most vocab_size {V}"),
    ("layers", _config(num_hidden_layers=2), "num_hidden_layers=2, expected 1"),
    ("aux ids", _config(eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
     "eagle_aux_hidden_state_layer_ids=[1, 3, 5], expected [1, 2, 3] (the outputs of those layers) or [2, 3, 4]"),
    ("no aux", _config(eagle_config={"use_aux_hidden_state": False}), "use_aux_hidden_state=false"),
    ("eagle3.1 llama", _config(fc_norm=True), "fc_norm/norm_output (EAGLE3.1) with the Llama layout"),
    ("rope", _config(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling="),
    ("nan", _tensors(lambda t: t["fc.weight"].view(-1).__setitem__(7, float("nan"))), "fc.weight: contains NaN"),
    ("d2t range", _tensors(lambda t: t.update(d2t=torch.arange(V))), "maps draft id 256 to target id 512, outside"),
    ("t2d alone", _tensors(lambda t: t.update(t2d=torch.ones(V, dtype=torch.bool))), "tensor t2d without d2t"),
    ("eagle3.1", _tensors(lambda t: t.update({"fc_norm.0.weight": torch.ones(H)})), "an EAGLE3.1 draft's"),
    ("missing", _tensors(lambda t: t.pop("midlayer.hidden_norm.weight")), "missing: layers.0.hidden_norm.weight"),
    ("shape", _tensors(lambda t: t.update({"fc.weight": torch.zeros(H, 2 * H)})), "fc.weight has shape [192, 384]"),
    ("dtype", _tensors(lambda t: t.update({"norm.weight": torch.zeros(H, dtype=torch.int32)})), "expected bf16"),
]


@pytest.mark.parametrize("name, damage, words", BAD_DRAFTS, ids=[b[0] for b in BAD_DRAFTS])
def test_a_draft_nxdi_cannot_run_is_one_line(name, damage, words, pair, draft_copy, one_line_error):
    damage(draft_copy)
    one_line_error(lambda: read_draft(draft_copy, KimiK2Config.from_file(pair[0])), words)


def _d2t(fn):
    return _tensors(lambda t: t.update(d2t=fn(t["d2t"])))


BAD_MAPS = [
    ("float", _d2t(lambda d: d.float()), "tensor d2t is torch.float32 [128], expected integer [128]"),
    ("short", _d2t(lambda d: d[:-1]), "tensor d2t is torch.int64 [127], expected integer [128]"),
    ("negative", _d2t(lambda d: d - 10 ** 6), "maps draft id 0 to target id"),
    ("duplicate", _d2t(lambda d: torch.cat([d[:1] + 1, d[1:]])), "maps draft ids 0 and 1 to one target id"),
    ("t2d", _tensors(lambda t: t.update(t2d=~t["t2d"])), "tensor t2d does not mark the 128 target ids"),
    ("missing", _tensors(lambda t: t.pop("d2t")), "draft_vocab_size=128 < vocab_size=512 without a d2t tensor"),
    ("rows", _tensors(lambda t: t.update({"lm_head.weight": torch.zeros(V, H)})), "lm_head.weight has shape [512"),
]


@pytest.mark.parametrize("name, damage, words", BAD_MAPS, ids=[b[0] for b in BAD_MAPS])
def test_a_bad_vocabulary_map_is_one_line(name, damage, words, pair, drafts, tmp_path, one_line_error):
    d = copy_of(drafts, "eagle3-d2t", tmp_path)
    damage(d)
    one_line_error(lambda: read_draft(d, KimiK2Config.from_file(pair[0])), words)


BAD_MLA = [
    ("no fc_norm", _config(fc_norm=False), "tensor fc_norm.0.weight is not part of the eagle3-mla layout"),
    ("fc_norm missing", _tensors(lambda t: t.pop("fc_norm.1.weight")), "missing: fc_norm.1.weight"),
    ("q lora", _config(q_lora_rank=None), "field q_lora_rank=None"),
    ("rope", _config(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.type='linear', expected 'yarn'"),
    ("kv_a", _tensors(lambda t: t.update({"midlayer.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(KVR + ROPE, H)})),
     "kv_a_proj_with_mqa.weight has shape [112, 192], expected [112, 384]"),
]


@pytest.mark.parametrize("name, damage, words", BAD_MLA, ids=[b[0] for b in BAD_MLA])
def test_a_bad_mla_draft_is_one_line(name, damage, words, pair, drafts, tmp_path, one_line_error):
    d = copy_of(drafts, "eagle3.1-mla", tmp_path)
    damage(d)
    one_line_error(lambda: read_draft(d, KimiK2Config.from_file(pair[0])), words)


@pytest.mark.parametrize("cmd", ["generate", "plan"])
def test_the_commands_refuse_a_bad_draft_before_any_work(cmd, pair, draft_copy, tmp_path, capsys, one_line_error,
                                                         monkeypatch):
    """generate --backend nxdi-cpu refuses it before NxD is imported (here it is not even installed), plan before
    planning."""
    _tensors(lambda t: t["lm_head.weight"].view(-1).__setitem__(0, float("inf")))(draft_copy)
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path / "cache"))
    argv = {"generate": ["generate", "--backend", "nxdi-cpu", "--tp", "2", "--model", pair[0], "--prompt", "hi"],
            "plan": ["plan", "--model", pair[0], "--tp", "2", "--seq-len", "64"]}[cmd]
    if cmd == "plan":
        _config(vocab_size=V // 2)(draft_copy)  # plan reads headers only (no values): a config fault
    rc, out, err = run_cli([*argv, "--draft", draft_copy, "--speculation-length", "4"], capsys)
    one_line_error.exit(rc, err, f"--draft {draft_copy}" if cmd == "generate" else "vocab_size=256")
    assert out == "" and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("argv, words", [
    (["--speculation-length", "4"], "--speculation-length 4: needs --draft"),
    (["--draft", "{draft}", "--speculation-length", "9"], "--speculation-length 9: expected 2..8"),
    (["--draft", "{draft}", "--speculation-length", "1"], "--speculation-length: expected an integer >= 2"),
    (["--draft", "{draft}", "--prefill-chunk", "16"], "--prefill-chunk 16: not with --draft"),
    (["--draft", "{draft}", "--backend", "core", "--tp", "1"], "only with --backend nxdi-cpu (speculative decoding is "
     "NxDI's fused"),
    (["--draft", "{draft}", "--temperature", "0.7"], "--temperature with --draft"),
], ids=["no draft", "k 9", "k 1", "chunk", "core backend", "sampling on cpu"])
def test_generate_refuses_what_speculation_cannot_run(argv, words, pair, tmp_path, capsys, one_line_error,
                                                      monkeypatch):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path / "cache"))
    base = ["generate", "--model", pair[0], "--prompt", "hi"]
    backend = [] if "--backend" in argv else ["--backend", "nxdi-cpu", "--tp", "2"]
    rc, out, err = run_cli([*base, *backend, *(a.format(draft=pair[1]) for a in argv)], capsys)
    one_line_error.exit(rc, err, words)


# -- the spec's rules, the NeuronConfig, vLLM's request -------------------------------------------------------------

def _spec(pair, **fields) -> tuple[KimiK2Config, RunSpec]:
    target, draft = pair
    draft = fields.pop("draft", draft)
    cfg = KimiK2Config.from_file(target)
    d = DraftSpec(path=str(draft), speculation_length=fields.pop("k", 4), checkpoint=read_draft(draft, cfg))
    from kimi_k2_neuron.formats.record import expert_scheme

    return cfg, RunSpec(tp=fields.pop("tp", 2), lnc=None, seq_len=64, scheme=expert_scheme(cfg, None, None),
                        moe_prefill="torch", draft=d, **fields)


@pytest.mark.parametrize("fields, words", [
    ({"ep": 2, "batch": 8}, "--ep 2: not with --draft"),
    ({"tp": 4, "heads": 6}, "num_attention_heads=6 does not split --tp 4 ways"),
    ({"k": 0}, "--speculation-length 0: expected 2..8"),
    ({"sampling": Sampling(on_device=False)}, "--no-on-device-sampling: not with --draft"),
], ids=["ep", "draft heads", "k", "host sampling"])
def test_rules_refuse_what_nxdis_fused_speculation_cannot_run(fields, words, pair, draft_copy, one_line_error):
    heads = fields.pop("heads", None)
    if heads:  # 6 heads of 32: the same q/k/v/o shapes as the tiny draft's 4 of 48
        _config(num_attention_heads=heads, num_key_value_heads=heads, head_dim=H // heads)(draft_copy)
        fields["draft"] = draft_copy
    cfg, spec = _spec(pair, **fields)
    one_line_error(lambda: rules.check_shapes(cfg, spec), words)


def test_a_draft_on_a_three_layer_target_is_refused(tiny, pair, one_line_error):
    cfg = KimiK2Config.from_file(tiny["fp8"])
    spec = RunSpec(tp=2, lnc=None, seq_len=64, draft=DraftSpec(path=str(pair[1])))
    one_line_error(lambda: rules.check_shapes(cfg, spec), "the target has 3 layers", ">= 7")


def test_the_neuron_config_of_a_draft_run(pair):
    """NxDI's fused EAGLE3 flags (config.py:243-256), KV tiling off for the latent cache (config.py:400-411)."""
    cfg, spec = _spec(pair, k=5, checkpoint="/converted")
    kw = contract.neuron_config_kwargs(cfg, spec)
    assert {k: kw[k] for k in ("enable_fused_speculation", "enable_eagle_speculation", "is_eagle3",
                               "speculation_length", "disable_kv_cache_tiling")} == {
        "enable_fused_speculation": True, "enable_eagle_speculation": True, "is_eagle3": True,
        "speculation_length": 5, "disable_kv_cache_tiling": True}
    plain = contract.neuron_config_kwargs(cfg, RunSpec(**{**spec.__dict__, "draft": None}))
    assert "speculation_length" not in plain and "enable_fused_speculation" not in plain


class _Request:
    """What vllm-neuron's _get_default_neuron_config sets for --speculative-config (loader.py:785-791)."""

    def __init__(self, method="eagle", k=4, **fields):
        self.tp_degree, self.batch_size, self.max_batch_size, self.seq_len = 1, 2, 2, 64
        self.max_context_length, self.torch_dtype, self.ctx_batch_size = 64, torch.bfloat16, 1
        self.is_continuous_batching, self.on_device_sampling_config = True, None
        self.enable_fused_speculation, self.speculation_length = True, k
        self.enable_eagle_speculation = method == "eagle"
        self.__dict__.update(fields)


def test_vllms_speculative_config_as_the_request_spec(pair, one_line_error):
    assert vllm_request.draft(_Request(k=3)) == DraftSpec(path=None, speculation_length=3)
    one_line_error(lambda: vllm_request.draft(_Request(method="draft_model")),
                   "--speculative-config: Kimi-K2 speculates with an EAGLE3 draft only", '"method": "eagle"')
    cfg, spec = _spec(pair, tp=1, batch=2)
    compiled = RunSpec(**{**spec.__dict__, "continuous_batching": True})  # as compile_and_save --for-vllm saves it
    assert vllm_request.compiled_mismatches(spec, compiled) == []
    asked_5 = RunSpec(**{**spec.__dict__, "draft": DraftSpec(path=None, speculation_length=5)})
    assert vllm_request.compiled_mismatches(asked_5, compiled) == [
        "--speculative-config num_speculative_tokens 5, compiled for 4 (NxDI's speculation_length)"]
    plain = RunSpec(**{**spec.__dict__, "draft": None})
    assert "num_speculative_tokens none, compiled for 4" in vllm_request.compiled_mismatches(plain, compiled)[0]



def test_compile_for_vllm_refuses_an_mla_draft_vllm_cannot_take(pair, drafts, tmp_path, one_line_error):
    """vLLM 0.13's registry has no Eagle3DeepseekV2ForCausalLM: the command compile_and_save.py would print is refused
    there at start-up, so the compile is refused first, in one line, before the SDK is needed."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts/compile_and_save.py"),
                        "--model", str(pair[0]), "--out", str(tmp_path / "c"), "--tp", "2", "--seq-len", "64",
                        "--moe-prefill", "torch", "--for-vllm", "--draft", str(drafts["eagle3.1-mla"]), "--dry-run"],
                       capture_output=True, text=True, env={**os.environ, "KIMI_K2_NEURON_CACHE": str(tmp_path)})
    one_line_error.exit(r.returncode, r.stderr, "an MLA EAGLE3 draft", "vLLM 0.13", "without --for-vllm")


# -- the planner ----------------------------------------------------------------------------------------------------

def test_plan_with_a_draft_prints_its_hbm_and_the_effective_tpot(pair, capsys):
    target, draft = pair
    rc, out, _ = run_cli(["plan", "--model", target, "--tp", "2", "--seq-len", "64", "--moe-prefill", "torch",
                          "--draft", draft, "--speculation-length", "4"], capsys)
    assert rc == 0
    section = out.split("speculative decoding, an estimate")[1]
    assert "EAGLE3 draft weights" in section and "EAGLE3 draft KV cache" in section
    assert "effective TPOT at accept length 2.3:" in section and "effective TPOT at accept length 3.2:" in section
    rc, out, _ = run_cli(["plan", "--model", target, "--tp", "2", "--seq-len", "64", "--moe-prefill", "torch",
                          "--draft", draft, "--json"], capsys)
    spec = json.loads(out)["speculation"]
    assert spec["speculation_length"] == 4 and set(spec["effective_tpot_ms"]) == {"2.3", "3.2"}


@pytest.mark.parametrize("layout", ["eagle3", "eagle3.1-mla"])
def test_plan_prints_no_accept_length_a_step_cannot_emit(layout, pair, drafts, capsys):
    """--speculation-length 2: a step emits at most 2 tokens a row, so the published accept lengths (3 drafts a step)
    are scaled down by their per-draft acceptance rate (1 + a + a^2 + a^3 = L -> 1 + a), none above 2."""
    from kimi_k2_neuron.neuron.fit import accept_lengths

    target, _ = pair
    rc, out, _ = run_cli(["plan", "--model", target, "--tp", "2", "--seq-len", "64", "--moe-prefill", "torch",
                          "--draft", drafts[layout], "--speculation-length", "2", "--json"], capsys)
    lengths = [float(a) for a in json.loads(out)["speculation"]["effective_tpot_ms"]]
    assert lengths and all(1 < a <= 2 for a in lengths)
    # the published lengths at K = 4; every scaled one at most K, growing with K, by less than 1 a step
    for family in ("eagle3", "eagle3-mla", "eagle3.1-mla"):
        by_k = {k: accept_lengths(family, k) for k in range(2, 9)}
        assert all(1 < a <= k for k, ls in by_k.items() for a in ls)
        assert all(0 < b - a < 1 for k in range(2, 8) for a, b in zip(by_k[k], by_k[k + 1]))
    assert accept_lengths("eagle3", 4) == (2.3, 3.2)
    rc, text, _ = run_cli(["plan", "--model", target, "--tp", "2", "--seq-len", "64", "--moe-prefill", "torch",
                           "--draft", drafts[layout], "--speculation-length", "2"], capsys)
    printed = [float(line.split("accept length ")[1].split(":")[0]) for line in text.splitlines()
               if "effective TPOT at accept length" in line]
    assert printed == lengths


def _k25_draft():
    """TorchSpec's Kimi-K2.5 EAGLE3 draft config (configs/draft_models/kimi_k25_eagle3.json), as facts."""
    from kimi_k2_neuron.checkpoint.draft import Eagle3Draft

    return Eagle3Draft(path="/data/kimi-k2.5-eagle3", hidden_size=7168, intermediate_size=12288,
                       num_attention_heads=64, num_key_value_heads=64, head_dim=128, vocab_size=163840,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=262144)


def test_the_draft_at_kimis_shapes_in_the_plan():
    """TP 64: the draft's weights are the public layout's tensors (its table at the real sizes) split 64 ways but the
    norms; its MHA cache one KV head a rank; the verify's MoE selective at batch 1 x 4 tokens, all-experts (and
    counted) at 16 x 4 = 64 tokens >= n_routed_experts / top_k = 48."""
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron.fit import plan

    cfg = KimiK2Config.from_file(Path(__file__).parents[1] / "data/configs/kimi-k2-instruct-0905.json")
    d = _k25_draft()
    h, v, q, i = 7168, 163840, 64 * 128, 12288
    layout = {"embed": (v, h), "fc": (h, 3 * h), "q": (q, 2 * h), "k": (q, 2 * h), "v": (q, 2 * h), "o": (h, q),
              "gate": (i, h), "up": (i, h), "down": (h, i), "lm_head": (v, h)}
    split = sum(a * b for a, b in layout.values()) * 2 // 64
    norms = 4 * h * 2
    for batch, path in ((1, "selective"), (16, "all-experts")):
        spec = RunSpec(tp=64, seq_len=1024, batch=batch, scheme=expert_scheme(cfg, None, None),
                       draft=DraftSpec(path=d.path, speculation_length=4, checkpoint=d))
        s = plan(cfg, spec).speculation
        rows = {r.kind.split(" (")[0]: r.bytes for r in s.rows}
        assert rows["EAGLE3 draft weights"] == split + norms
        assert rows["EAGLE3 draft KV cache"] == batch * 1024 * 2 * 1 * 128 * 2
        assert s.verify_path == path and ("verify MoE temporaries" in rows) == (path == "all-experts")
        assert s.step_s == s.verify.total_s + s.draft_s and s.tpot_s(2.0) == s.step_s / 2


def test_speculative_md_quotes_the_planners_figures(capsys, monkeypatch):
    """docs/speculative.md's table at Kimi-K2-Instruct, TP 64, seq_len 1024 is what the planner computes now, row by
    row as printed there: SpecForge's Kimi-K2 Llama draft (configs/kimi-k2-eagle3.json: 64 heads, intermediate 18432,
    a 32000-token head) at K 4 batch 1 and 4, K 2 batch 1, and an EAGLE3.1 MLA draft of the target's attention shape
    with the full head; the doc's Python snippet, which says how to recompute them, runs and prints the same."""
    from kimi_k2_neuron.checkpoint.draft import Eagle3Draft, MlaDims
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron.fit import plan
    from kimi_k2_neuron.neuron.hbm import GiB

    root = Path(__file__).parents[2]
    doc = (root / "docs" / "speculative.md").read_text()
    cfg = KimiK2Config.from_file(root / "test/data/configs/kimi-k2-instruct-0905.json")
    shape = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=128, vocab_size=163840,
                 intermediate_size=18432, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=131072)
    aq = Eagle3Draft(path="aq", draft_vocab_size=32000, mapped=True, **shape)
    mla = Eagle3Draft(path="mla", kind="eagle3-mla", fc_norm=True, norm_output=True,
                      mla=MlaDims(1536, 512, 128, 64, 128), **shape)
    cases = (("AQ-MedAI K2 (Llama, 32000-token head)", aq, 4, 1), ("AQ-MedAI K2", aq, 4, 4), ("AQ-MedAI K2", aq, 2, 1),
             ("EAGLE3.1 MLA of K2.6's shape (full head)", mla, 4, 1))
    steps = []
    for name, d, k, batch in cases:
        spec = RunSpec(tp=64, seq_len=1024, batch=batch, scheme=expert_scheme(cfg, None, None))
        plain = plan(cfg, spec).decode.total_s * 1e3
        s = plan(cfg, RunSpec(**{**spec.__dict__, "draft": DraftSpec(d.path, k, d)})).speculation
        tpot = ", ".join(f"{ms:.2f} ms at {a}" for a, ms in s.effective_tpot_ms().items())
        row = (f"| {name} | {k} | {batch} | {plain:.2f} ms | {s.step_s * 1e3:.2f} ms (verify "
               f"{s.verify.total_s * 1e3:.2f} + draft {s.draft_s * 1e3:.2f}) | {tpot} | "
               f"{sum(r.bytes for r in s.rows) / GiB:.3f} GiB |")
        assert row in doc
        steps.append(s.step_s * 1e3)
    monkeypatch.chdir(root)
    exec(doc.split("```python\n")[1].split("```")[0], {})
    printed = [float(line.split()[4]) for line in capsys.readouterr().out.splitlines()]
    assert printed == pytest.approx(steps)
