"""Speculative decoding with an EAGLE3 draft (issues 29, 38) through the real NxDI fused speculation in NxD's CPU mode:
NxDI's fused submodels (context encoding with the draft's prefill, one fused graph: draft steps, one target verify of
speculation_length tokens, NxDI's greedy acceptance), our NeuronKimiK2Model as the target (its 3-layer capture, the 4H
gather), the replicated and the sequence-sharded latent cache, our generation loop and the CLI; for each public draft
layout `make-tiny --draft-for --draft-layout` writes: eagle3 (NxDI's Llama draft, the target's vocabulary, aux ids in
vLLM's input convention), eagle3-d2t (the same with a quarter of the vocabulary, d2t mapped in the graph, aux ids in
the output convention: [1, 29, 57] scaled), eagle3.1-mla (the shell's MLA draft with fc_norm and norm_output). A tiny
7-layer FP8 target (three distinct captured layers), TP 2, float32: greedy equality is exact there.

Oracles: the tokens of the same model without a draft (NxDI's token-generation graph, a different graph), which the
rest of the tier checks against transformers; and test drafts whose proposals are known: the draft's lm_head output
replaced (a forward hook, test code) by logits peaking at the draft id of the token wanted, so the draft's own greedy
pick, its vocabulary map and NxDI's acceptance all run: the target's own next tokens (accepted whole where the draft's
vocabulary holds them), the same with every third replaced (an accept length strictly between 1 and K, as the
construction implies), tokens the target never picks (1 a step); the accept lengths each step shows are those greedy
speculation's rule gives for the construction (expected_steps). NxD's greedy speculation calls torch_neuronx's Argmax
custom op, device-only: stood in by torch.argmax in test code (device_ops/sitecustomize.py). Not here: the sampled
acceptance (test_speculation_sampling.py), neuronx-cc, trn2 accept lengths and latency.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
from nxdi_support import REPO, cpu_options, stand_in_device_ops, with_device_ops

from kimi_k2_neuron.checkpoint.draft import DRAFT_IDS, neuron_tensors, read_draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron.spec import GREEDY, DraftSpec, RunSpec
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.chat import prompt_ids
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from kimi_k2_neuron.tiny import DRAFT_LAYOUTS
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft

K = 4  # --speculation-length: the draft proposes 3, a step emits 1..4
NEW = 8
PROMPTS = ["Hello there, how are you today?", "Hi"]  # ragged rows in one batch
CACHES = {"replicated": Layout(), "sequence": Layout(kv_group=2)}
PROPOSALS = {"oracle": lambda q: False, "partial": lambda q: q % 3 == 0, "wrong": lambda q: True}  # q: replaced?

pytestmark = pytest.mark.fp8_selective_cpu  # the baseline decodes on NxD's FP8 selective-loading path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target and one tiny draft of each layout."""
    root = tmp_path_factory.mktemp("speculation")
    target = make_tiny(root / "target", quant="fp8", shards=2, seed=1, config_overrides={"num_hidden_layers": 7})
    return target, {layout: make_tiny_draft(root / layout, target, seed=2, layout=layout) for layout in DRAFT_LAYOUTS}


@pytest.fixture(scope="module")
def chat(models):
    """The prompts' token ids through the chat template, and the stop ids, as the CLI makes them."""
    tok = KimiTokenizer.from_dir(models[0])
    return prompt_ids(tok, PROMPTS), tok.stop_ids(list(KimiK2Config.from_file(models[0]).eos_token_ids))


def _generate_job(rank: int, o, rows, drafts: dict, presharded: str):
    """At each rank: the non-speculative tokens (replicated and sequence-sharded cache), and for each draft layout the
    fused model's, replicated and sequence-sharded, with the tiny draft and the three test proposals, and from NxD's
    pre-sharded files of the eagle3 layout's fused model; -> {key: (tokens, tokens each step emitted per row)}."""
    from kimi_k2_neuron.neuron.serving import Decoding, generate_ids

    plain = dataclasses.replace(o.spec, draft=None)
    out = {}
    for name, cache in CACHES.items():
        app = backend.build(dataclasses.replace(o, spec=dataclasses.replace(plain, layout=cache)), _seq_len(rows),
                            len(rows), GREEDY)
        # K more than the speculative runs ask: the oracle's truth for every position a step can propose
        out[("plain", name)] = (generate_ids(app, rows, set(), Decoding(NEW + K)), [])
    truth = [row + new for row, new in zip(rows, out[("plain", "replicated")][0])]
    for layout, (spec, vocab) in drafts.items():
        for name, cache in CACHES.items():
            o_draft = dataclasses.replace(o, spec=dataclasses.replace(o.spec, draft=spec, layout=cache))
            app = backend.build(o_draft, _seq_len(rows), len(rows), GREEDY)
            steps: list = []
            out[(layout, name, "tiny")] = (generate_ids(app, rows, set(), Decoding(NEW), accepted=steps), steps)
            if name != "replicated":
                continue
            fused = app.fused_spec_model.model
            out[(layout, "buffers")] = {
                "seq_len": app.neuron_config.seq_len,  # this rank's, as NxDI built them
                "draft_weights": sum(p.numel() for p in fused.draft_model.parameters() if p.is_floating_point())
                - sum(t.numel() for t in fused.draft_model.kv_mgr.past_key_values),
                "draft_kv": sum(t.numel() for t in fused.draft_model.kv_mgr.past_key_values),
                "buffer": fused.hidden_state_rolling_buffer.hidden_states.numel()}
            for proposal, replaced in PROPOSALS.items():
                proposer = Proposer(app, truth, replaced, vocab)
                steps = []
                out[(layout, proposal)] = (generate_ids(app, rows, set(), Decoding(NEW), accepted=steps), steps)
                proposer.remove()
    o_pre = dataclasses.replace(o, spec=dataclasses.replace(o.spec, draft=drafts["eagle3"][0]), presharded=presharded)
    out["presharded"] = (generate_ids(backend.build(o_pre, _seq_len(rows), len(rows), GREEDY), rows, set(),
                                      Decoding(NEW)), [])
    return out


def _seq_len(rows) -> int:
    """The plain runs' NEW + K tokens (nxdi_cpu.options.request_spec adds K more with a draft)."""
    return max(map(len, rows)) + NEW + K


class Proposer:
    """The fused graph's draft proposes truth[row][q] for the token at index q, where `replaced(q)` is false and the
    draft's vocabulary holds it, else a token of its vocabulary the target does not pick there: its lm_head's
    output, for the single-token draft calls, peaks at that token's draft id (this rank's slice of it where the head
    is vocab-sharded). Draft position d proposes index d + 2 (the draft runs one behind, NxDI model_base.py:2560)."""

    def __init__(self, app, truth, replaced, vocab: list[int]):
        from neuronx_distributed.parallel_layers import parallel_state

        self.truth, self.replaced, self.vocab = truth, replaced, vocab
        self.draft_id = {t: j for j, t in enumerate(vocab)}
        self.rank, self.tp = parallel_state.get_tensor_model_parallel_rank(), app.neuron_config.tp_degree
        draft = app.fused_spec_model.model.draft_model
        self.positions = None
        self.handles = [draft.register_forward_pre_hook(self._call), draft.lm_head.register_forward_hook(self._head)]

    def _call(self, _module, args):
        ids, positions = args[0], args[2]
        self.positions = positions.view(-1).tolist() if ids.shape[1] == 1 else None

    def _head(self, _module, _args, output):
        if self.positions is None:  # the draft's prefill, and its cache rewrite after the verify
            return output
        rows = len(self.positions)
        full = torch.zeros(rows, 1, len(self.vocab), dtype=output.dtype)
        for r, q in enumerate(self.positions):
            full[r, 0, self.want(r, q + 2)] = 100.0
        if output.shape[-1] == len(self.vocab):
            return full
        width = output.shape[-1]  # this rank's slice of the vocab-sharded head (NxD pads the last)
        full = torch.nn.functional.pad(full, (0, width * self.tp - len(self.vocab)))
        return full[..., self.rank * width:(self.rank + 1) * width]

    def want(self, r: int, q: int) -> int:
        """The draft id proposed for index q of row r."""
        target = self.truth[r][q] if q < len(self.truth[r]) else None
        if target is not None and not self.replaced(q) and target in self.draft_id:
            return self.draft_id[target]
        return next(j for j, t in enumerate(self.vocab) if t != target)

    def remove(self):
        for h in self.handles:
            h.remove()


def expected_steps(rows, truth, vocab: set, replaced) -> list[list[int]]:
    """Greedy speculation's rule for the construction: a step after the token at index p proposes p + 1 .. p + K - 1,
    keeps the proposals up to the first the draft gets wrong (replaced, or outside its vocabulary) and the target's
    next token: it emits that many + 1. Per step, the rows still under NEW tokens, in order (generate_fused's
    record)."""
    per_row = []
    for row, full in zip(rows, truth):
        p, emitted, steps = len(row), 1, []  # the prefill emits the token at index len(row)
        while emitted < NEW:
            a = 0
            while a < K - 1 and not replaced(p + 1 + a) and full[p + 1 + a] in vocab:
                a += 1
            steps.append(a + 1)
            p, emitted = p + a + 1, emitted + a + 1
        per_row.append(steps)
    return [[s[i] for s in per_row if i < len(s)] for i in range(max(map(len, per_row)))]


@pytest.fixture(scope="module")
def specs(models):
    return draft_specs(*models)


def draft_specs(target, drafts: dict) -> dict:
    """Each layout's DraftSpec and its vocabulary (the target id of each draft id), as read."""
    cfg = KimiK2Config.from_file(target)
    out = {}
    for layout, path in drafts.items():
        d = read_draft(path, cfg)
        ids = neuron_tensors(d, target).get(DRAFT_IDS)
        out[layout] = (DraftSpec(path=str(path), speculation_length=K, checkpoint=d),
                       list(range(d.lm_head_rows)) if ids is None else ids.tolist())
    return out


@pytest.fixture(scope="module")
def runs(models, chat, specs, tmp_path_factory):
    """One run of ranks for every in-process case (builds are the tier's cost); the eagle3 fused model's weights
    pre-sharded first, as compile_and_save's compile() does after its trace (backend.preshard: NxD's ModelBuilder)."""
    stand_in_device_ops()
    target, _ = models
    rows, _ = chat
    o = backend.prepare(cpu_options(target, tp=2, draft=specs["eagle3"][0]), _seq_len(rows), len(rows), GREEDY, rows)
    presharded = backend.preshard(o, tmp_path_factory.mktemp("presharded"), _seq_len(rows), len(rows))
    return {**backend.run(o, _generate_job, rows, specs, str(presharded)), "presharded_dir": presharded}


@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_each_layout_gives_the_plain_tokens_replicated_and_sequence_sharded(layout, runs):
    """The tiny (random) draft: NxDI accepts about nothing, so the tokens are the verify's, the target's own."""
    plain = [row[:NEW] for row in runs[("plain", "replicated")][0]]
    assert runs[("plain", "sequence")][0] == runs[("plain", "replicated")][0]
    for cache in CACHES:
        tokens, steps = runs[(layout, cache, "tiny")]
        assert tokens == plain and [len(t) for t in tokens] == [NEW, NEW]
        assert steps and all(1 <= n <= K for step in steps for n in step)


@pytest.mark.parametrize("proposal", PROPOSALS)
@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_known_proposals_are_accepted_as_the_construction_implies(layout, proposal, runs, chat, specs):
    """Every step's accept length is greedy speculation's for the proposals (expected_steps), and the tokens are the
    plain ones: the target's own next tokens are accepted whole where the draft's vocabulary holds them (K a step
    for the full vocabularies), every third replaced gives an accept length strictly between 1 and K, tokens the
    target never picks 1 a step. Through the d2t draft's vocabulary map: its draft ids become the target's."""
    rows, _ = chat
    truth = [row + new for row, new in zip(rows, runs[("plain", "replicated")][0])]
    tokens, steps = runs[(layout, proposal)]
    assert tokens == [row[:NEW] for row in runs[("plain", "replicated")][0]]
    vocab = set(specs[layout][1])
    assert steps == expected_steps(rows, truth, vocab, PROPOSALS[proposal])
    flat = [n for step in steps for n in step]
    mean = sum(flat) / len(flat)
    if proposal == "partial":
        assert 1 < mean < K, steps
    elif proposal == "wrong":
        assert set(flat) == {1}
    elif layout != "eagle3-d2t":  # the full vocabularies hold every token
        assert set(flat) == {K}, steps


@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_generate_with_a_draft_over_the_sequence_sharded_cache_prints_the_plain_tokens(layout, models, chat, runs,
                                                                                       env):
    """`kimi-k2-neuron generate --backend nxdi-cpu --tp 2 --kv-shard sequence --draft D --speculation-length 4`,
    in a user's environment (the Argmax stand-in aside), two chat prompts, each draft layout: the tokens of the same
    model without a draft, cut at the stop tokens as the CLI cuts them, and the accept length on stderr."""
    target, draft = models[0], models[1][layout]
    cmd = [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--tp", "2", "--model",
           str(target), "--kv-shard", "sequence", "--draft", str(draft), "--speculation-length", str(K), "--greedy",
           "--max-new-tokens", str(NEW), "--json", *(a for p in PROMPTS for a in ("--prompt", p))]
    r = subprocess.run(cmd, capture_output=True, text=True, env=with_device_ops(env), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)["tokens"]
    stops = chat[1]
    want = [_cut(row[:NEW], stops) for row in runs[("plain", "sequence")][0]]
    assert got == want
    line = next(line for line in r.stderr.splitlines() if line.startswith("speculation (--speculation-length 4)"))
    assert re.search(r"\d+ fused steps, accept length [1-4]\.\d\d tokens per step per row", line), line
    # the draft's 4 KV heads at TP 2 stay 2 a rank: NxDI's "not divisible" warning describes nothing (taken for MLA's)
    assert "KV heads" not in r.stderr


def test_nxdis_gqa_warning_is_dropped_only_where_it_describes_nothing():
    """NXDI_CONTRACT.md: draft-gqa-warning. NxDI's own functions say which head counts change."""
    import logging

    from neuronx_distributed_inference.modules.attention.gqa import (determine_sharding_strategy,
                                                                     get_shardable_head_counts)

    from kimi_k2_neuron.neuron.draft_config import NoOpGqaWarning

    def kept(tp, kv):
        message = f"TP degree ({tp}) and KV heads ({kv}) are not divisible. Overriding attention sharding strategy"
        return NoOpGqaWarning().filter(logging.LogRecord("Neuron", logging.WARNING, "", 0, message, None, None))

    for heads, kv, tp in ((4, 4, 2), (64, 8, 4), (64, 16, 8), (48, 6, 4), (40, 10, 4)):  # NxDI warns: tp % kv
        strategy = determine_sharding_strategy(tp, kv)
        changed = get_shardable_head_counts(tp, heads, kv, strategy)[1] != kv
        assert kept(tp, kv) == changed, (heads, kv, tp)


def test_generate_with_a_draft_at_tp_1_batch_1_prints_the_plain_tokens(models, env):
    """The other corner of the lossless claim (TP 2, batch 2 above; vLLM's test: TP 1, batch 2): `generate --tp 1`,
    one prompt, the replicated cache, with and without the draft."""
    target, draft = models[0], models[1]["eagle3"]
    cmd = [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--tp", "1", "--model",
           str(target), "--greedy", "--max-new-tokens", str(NEW), "--json", "--prompt", PROMPTS[0]]
    runs = [subprocess.run(cmd + flags, capture_output=True, text=True, env=with_device_ops(env), timeout=900)
            for flags in ([], ["--draft", str(draft), "--speculation-length", str(K)])]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    plain, fused = (json.loads(r.stdout)["tokens"] for r in runs)
    assert fused == plain and len(plain[0]) > 1
    assert "speculation (--speculation-length 4)" in runs[1].stderr


def test_a_draft_made_for_a_k26_target_generates_the_targets_greedy_tokens(tmp_path, env):
    """As a user follows the docs with a K2.6 target (its layout: text_config, language_model. tensors, INT4
    experts): `make-tiny T --layout k2.6 --layers 7`, `make-tiny D --draft-for T`, then `generate --backend nxdi-cpu
    --draft D` prints the tokens `generate --backend nxdi-cpu` prints without it (before: make-tiny --draft-for failed
    on every K2.5-layout target, its embedding under language_model.)."""
    cli = [sys.executable, "-m", "kimi_k2_neuron.cli"]
    target, draft = tmp_path / "k26", tmp_path / "draft"
    for argv in (["make-tiny", str(target), "--layout", "k2.6", "--layers", "7"],
                 ["make-tiny", str(draft), "--draft-for", str(target)]):
        r = subprocess.run(cli + argv, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    cmd = cli + ["generate", "--backend", "nxdi-cpu", "--model", str(target), "--greedy", "--max-new-tokens",
                 str(NEW), "--json", "--prompt", PROMPTS[0]]
    runs = [subprocess.run(cmd + flags, capture_output=True, text=True, env=with_device_ops(env), timeout=900)
            for flags in ([], ["--draft", str(draft), "--speculation-length", str(K)])]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    plain, fused = (json.loads(r.stdout)["tokens"] for r in runs)
    assert fused == plain and len(plain[0]) > 1
    assert "speculation (--speculation-length 4)" in runs[1].stderr


def _cut(row, stops):
    return next((row[:i + 1] for i, t in enumerate(row) if t in stops), row)


@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_the_planners_draft_rows_are_the_buffers_nxdi_builds(layout, models, runs):
    """plan's per-core rows for the draft (bf16 bytes) against the element counts of the draft's parameters, its KV
    cache (MHA heads, or the latent entry and V's 1-wide slot) and the hidden-state buffer in NxDI's fused model at
    TP 2 (float32 on CPU: compared in elements)."""
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron.fit import plan

    target, draft = models[0], models[1][layout]
    built = runs[(layout, "buffers")]
    cfg = KimiK2Config.from_file(target)
    spec = RunSpec(tp=2, lnc=2, seq_len=built["seq_len"], batch=len(PROMPTS), moe_prefill="torch",
                   scheme=expert_scheme(cfg, None, None),
                   draft=DraftSpec(path=str(draft), speculation_length=K, checkpoint=read_draft(draft, cfg)))
    rows = {r.kind.split(" (")[0]: r.bytes // 2 for r in plan(cfg, spec).speculation.rows}
    assert rows == {"EAGLE3 draft weights": built["draft_weights"], "EAGLE3 draft KV cache": built["draft_kv"],
                    "EAGLE hidden-state buffer": built["buffer"],
                    "verify MoE temporaries": rows.get("verify MoE temporaries")}


def test_compile_for_vllm_with_a_draft_prints_the_speculative_config(models, tmp_path, env):
    """compile_and_save.py --dry-run --for-vllm --draft: the NeuronConfig NxDI would compile (fused EAGLE3, the
    draft's config and class saved beside it for the reload), the fused submodel with Kimi's compiler arguments, and
    the vllm serve line with --speculative-config."""
    target, draft = models[0], models[1]["eagle3"]
    out = tmp_path / "compiled"
    r = subprocess.run([sys.executable, str(REPO / "scripts/compile_and_save.py"), "--model", str(target), "--out",
                        str(out), "--tp", "2", "--seq-len", "64", "--batch", "2", "--moe-prefill", "torch",
                        "--for-vllm", "--dry-run", "--draft", str(draft), "--speculation-length", str(K)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    nc = report["neuron_config"]
    assert (nc["enable_fused_speculation"], nc["enable_eagle_speculation"], nc["is_eagle3"],
            nc["speculation_length"], nc["kv_cache_tiling"]) == (True, True, True, K, False)
    assert set(report["compiler_args"]) == {"context_encoding_model", "fused_speculation_model"}
    assert "--enable-saturate-infinity" in report["compiler_args"]["fused_speculation_model"]
    config = json.loads(report["vllm_serve"].split("--speculative-config ")[1].strip().strip("'"))
    assert config == {"method": "eagle", "model": str(draft.resolve()), "num_speculative_tokens": K}


def test_the_draft_is_pre_sharded_with_the_target(runs):
    """NxD's ModelBuilder shards the fused state dict (draft_model. in NxDI's names after its pre-shard hooks,
    target_model.), one file per rank, and the model loaded from those files gives the same tokens."""
    from safetensors import safe_open

    with safe_open(str(runs["presharded_dir"] / "tp1_sharded_checkpoint.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "draft_model.layers.0.self_attn.qkv_proj.q_proj.weight" in names and "draft_model.fc.weight" in names
    assert any(n.startswith("target_model.layers.6.mlp.") for n in names)
    assert runs["presharded"][0] == [row[:NEW] for row in runs[("plain", "replicated")][0]]


@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_a_compiled_folders_config_reloads_the_draft(layout, models, tmp_path):
    """neuron_config.json as compile() saves it, loaded as a compiled folder is (and vllm-neuron's precompiled
    branch): NxDI rebuilds the draft's config with our draft class's config class (Llama's, or the MLA draft's),
    the target's worker class by name, and the reload's saved RunSpec holds the draft's facts (its layout and
    vocabulary map among them)."""
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron import contract
    from kimi_k2_neuron.neuron.draft_config import Eagle3DraftForCausalLM
    from kimi_k2_neuron.neuron.eagle3_mla import Eagle3MlaDraftForCausalLM
    from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig, NeuronKimiK2ForCausalLM, NeuronKimiK2Model

    target, draft = models[0], models[1][layout]
    cfg = KimiK2Config.from_file(target)
    d = DraftSpec(path=str(draft), speculation_length=K, checkpoint=read_draft(draft, cfg))
    spec = RunSpec(tp=2, lnc=2, seq_len=64, batch=2, scheme=expert_scheme(cfg, None, None), checkpoint="/converted",
                   moe_prefill="torch", draft=d)
    built = NeuronKimiK2ForCausalLM(str(target), KimiK2InferenceConfig.for_serving(cfg, spec))  # nothing traced
    built.config.save(tmp_path)  # as compile() does: the draft completed on the config first
    config = KimiK2InferenceConfig.load(tmp_path)
    fused = config.fused_spec_config
    want = Eagle3MlaDraftForCausalLM if layout == "eagle3.1-mla" else Eagle3DraftForCausalLM
    assert (fused.draft_model_cls, fused.worker_cls) == (want, NeuronKimiK2Model)
    dnc = fused.draft_config.neuron_config
    assert (dnc.is_eagle_draft, dnc.is_eagle3, dnc.enable_eagle_draft_input_norm, dnc.kv_cache_tiling) == (
        True, True, True, False)
    saved = contract.run_spec(config)
    assert saved == spec and saved.draft == d and saved.draft.checkpoint == d.checkpoint
    assert saved.draft.checkpoint.mapped == (layout == "eagle3-d2t")
