"""EAGLE3 drafts (checkpoint/draft.py, tiny/draft_checkpoint.py) and what the shell's SDK-free parts make of --draft:
`make-tiny --draft-for` writes the public Llama EAGLE3 layout (TorchSpec's LlamaForCausalLMEagle3 and its Kimi-K2.5
config, restated as data: the oracle), --draft reads it as it would a real draft, and every draft NxDI cannot run is
one `error:` line before any work; the run spec's rules, the NeuronConfig fields and vLLM's request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k2_neuron import cli
from kimi_k2_neuron.checkpoint.draft import aux_layer_ids, neuron_tensors, read_draft
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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny(root / "target", shards=2, config_overrides={"num_hidden_layers": 7})
    return target, make_tiny_draft(root / "draft", target)


@pytest.fixture
def draft_copy(pair, tmp_path):
    return Path(shutil.copytree(pair[1], tmp_path / "draft"))


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


def test_make_tiny_layers_and_a_draft_for_a_three_layer_target(tiny, tmp_path, capsys, one_line_error):
    rc, _, _ = run_cli(["make-tiny", tmp_path / "t", "--layers", "7"], capsys)
    assert rc == 0 and KimiK2Config.from_file(tmp_path / "t").num_hidden_layers == 7
    rc, _, err = run_cli(["make-tiny", tmp_path / "d", "--draft-for", tiny["fp8"]], capsys)
    one_line_error.exit(rc, err, "num_hidden_layers=3", "make-tiny --layers 7")
    rc, _, err = run_cli(["make-tiny", tmp_path / "d", "--draft-for", tmp_path / "t", "--quant", "int4"], capsys)
    one_line_error.exit(rc, err, "--quant: not with --draft-for")
    assert not (tmp_path / "d").exists()


def test_aux_layer_ids_are_vllms_inputs_of_nxdis_captured_outputs():
    """NxDI appends the outputs of layers 1, N//2 - 1, N - 4 (model_base.py:1403-1406); vLLM's default aux ids are
    (2, N//2, N - 3), the inputs of the next layers (vLLM llama.py:596-603)."""
    for n in (7, 61):
        assert aux_layer_ids(n) == tuple(i + 1 for i in (1, n // 2 - 1, n - 4))
    assert aux_layer_ids(61) == (2, 30, 58)


# -- reading a draft ---------------------------------------------------------------------------------------------

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
    ("mla", _config(architectures=["Eagle3DeepseekV2ForCausalLM"]), "an MLA EAGLE3 draft"),
    ("not eagle3", _config(architectures=["LlamaForCausalLM"]), "expected ['LlamaForCausalLMEagle3']"),
    ("hidden", _config(hidden_size=2 * H), f"hidden_size={2 * H}, expected the target's hidden_size {H}"),
    ("target hidden", _config(target_hidden_size=2 * H), f"target_hidden_size={2 * H}"),
    ("vocab", _config(vocab_size=V // 2), f"vocab_size={V // 2}, expected the target's {V}"),
    ("pruned vocab", _config(draft_vocab_size=32), "draft_vocab_size=32"),
    ("layers", _config(num_hidden_layers=2), "num_hidden_layers=2, expected 1"),
    ("aux ids", _config(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), "eagle_aux_hidden_state_layer_ids=[1, 3, 5]"),
    ("rope", _config(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling="),
    ("nan", _tensors(lambda t: t["fc.weight"].view(-1).__setitem__(7, float("nan"))), "fc.weight: contains NaN"),
    ("d2t", _tensors(lambda t: t.update(d2t=torch.arange(V))), "tensor d2t maps a pruned draft vocabulary"),
    ("eagle3.1", _tensors(lambda t: t.update({"fc_norm.weight": torch.ones(H)})), "an EAGLE3.1 draft's"),
    ("missing", _tensors(lambda t: t.pop("midlayer.hidden_norm.weight")), "missing: layers.0.hidden_norm.weight"),
    ("shape", _tensors(lambda t: t.update({"fc.weight": torch.zeros(H, 2 * H)})), "fc.weight has shape [192, 384]"),
    ("dtype", _tensors(lambda t: t.update({"norm.weight": torch.zeros(H, dtype=torch.int32)})), "expected bf16"),
]


@pytest.mark.parametrize("name, damage, words", BAD_DRAFTS, ids=[b[0] for b in BAD_DRAFTS])
def test_a_draft_nxdi_cannot_run_is_one_line(name, damage, words, pair, draft_copy, one_line_error):
    damage(draft_copy)
    one_line_error(lambda: read_draft(draft_copy, KimiK2Config.from_file(pair[0])), words)


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
