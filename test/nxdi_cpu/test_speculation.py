"""Speculative decoding with an EAGLE3 draft (issue 29) through the real NxDI fused speculation in NxD's CPU mode:
NxDI's fused submodels (context encoding with the draft's prefill, one fused graph: draft steps, one target verify of
speculation_length tokens, NxDI's greedy acceptance), NxDI's Llama EAGLE3 draft, our NeuronKimiK2Model as the target
(its 3-layer capture, the 4H gather), the replicated and the sequence-sharded latent cache, our generation loop and
the CLI. A tiny 7-layer FP8 target (three distinct captured layers) and the tiny draft `make-tiny --draft-for`
writes, at TP 2.

Oracles: the tokens of the same model without a draft (NxDI's token-generation graph, a different graph), which the
rest of the tier checks against transformers; and test-only drafts whose proposals are known: one proposing the
target's own next tokens (must be accepted whole: speculation_length tokens a step), one proposing tokens it never
picks (accepted 1 a step), both through the real EAGLE3 graph with the draft's sampled token replaced by a forward
hook on the draft model (test code). NxD's greedy speculation calls torch_neuronx's Argmax custom op, device-only:
stood in by torch.argmax in test code (device_ops/sitecustomize.py). Not here: the sampling branch of the fused step
(it does not run in NxD's CPU mode), neuronx-cc, trn2 accept lengths and latency.
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

from kimi_k2_neuron.checkpoint.draft import read_draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.neuron.spec import GREEDY, DraftSpec, RunSpec
from kimi_k2_neuron.nxdi_cpu import backend
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.chat import prompt_ids
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft

K = 4  # --speculation-length: the draft proposes 3, a step emits 1..4
NEW = 8
PROMPTS = ["Hello there, how are you today?", "Hi"]  # ragged rows in one batch

pytestmark = pytest.mark.fp8_selective_cpu  # the baseline decodes on NxD's FP8 selective-loading path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculation")
    target = make_tiny(root / "target", quant="fp8", shards=2, seed=1, config_overrides={"num_hidden_layers": 7})
    return target, make_tiny_draft(root / "draft", target, seed=2)


@pytest.fixture(scope="module")
def chat(models):
    """The prompts' token ids through the chat template, and the stop ids, as the CLI makes them."""
    tok = KimiTokenizer.from_dir(models[0])
    return prompt_ids(tok, PROMPTS), tok.stop_ids(list(KimiK2Config.from_file(models[0]).eos_token_ids))


def _generate_job(rank: int, o, rows, presharded: str):
    """At each rank: the non-speculative tokens (replicated and sequence-sharded cache), and the fused model's with
    the tiny draft, the oracle draft and the wrong draft, and from NxD's pre-sharded files of the fused model;
    -> {name: (tokens, tokens each step emitted per row)}."""
    from kimi_k2_neuron.neuron.serving import Decoding, generate_ids

    plain = dataclasses.replace(o.spec, draft=None)
    out = {}
    for name, spec in (("plain", plain), ("plain-sequence", dataclasses.replace(plain, layout=Layout(kv_group=2)))):
        app = backend.build(dataclasses.replace(o, spec=spec), _seq_len(rows), len(rows), GREEDY)
        # K more than the speculative runs ask: the oracle's truth for every position a step can propose
        out[name] = (generate_ids(app, rows, set(), Decoding(NEW + K)), [])
    truth = [row + new for row, new in zip(rows, out["plain"][0])]
    app = backend.build(o, _seq_len(rows), len(rows), GREEDY)
    fused = app.fused_spec_model.model
    out["buffers"] = {"seq_len": app.neuron_config.seq_len,  # this rank's, as NxDI built them
                      "draft_weights": sum(p.numel() for p in fused.draft_model.parameters() if p.is_floating_point())
                      - sum(t.numel() for t in fused.draft_model.kv_mgr.past_key_values),
                      "draft_kv": sum(t.numel() for t in fused.draft_model.kv_mgr.past_key_values),
                      "buffer": fused.hidden_state_rolling_buffer.hidden_states.numel()}
    for name, proposals in (("tiny", None), ("oracle", truth), ("wrong", [[t + 1 for t in row] for row in truth])):
        handle = _propose(app, proposals, app.config.vocab_size) if proposals else None
        steps: list = []
        out[name] = (generate_ids(app, rows, set(), Decoding(NEW), accepted=steps), steps)
        if handle:
            handle.remove()
    app = backend.build(dataclasses.replace(o, presharded=presharded), _seq_len(rows), len(rows), GREEDY)
    out["presharded"] = (generate_ids(app, rows, set(), Decoding(NEW)), [])
    return out


def _seq_len(rows) -> int:
    """The plain runs' NEW + K tokens (nxdi_cpu.options.request_spec adds K more with a draft)."""
    return max(map(len, rows)) + NEW + K


def _propose(app, proposals, vocab: int):
    """A forward hook on the fused graph's draft model: each single-token draft call proposes proposals[row][q] for
    the position q it drafts (draft position p - 1 + i proposes position p + i + 1: the draft runs one behind)."""
    draft = app.fused_spec_model.model.draft_model

    def hook(_module, args, output):
        ids, positions = args[0], args[2]
        if ids.shape[1] != 1:  # the draft's prefill and its cache rewrite after the verify
            return output
        want = [proposals[r][q + 2] % vocab if q + 2 < len(proposals[r]) else 0
                for r, q in enumerate(positions.view(-1).tolist())]
        output = list(output)
        output[0] = torch.tensor(want, dtype=output[0].dtype).view_as(output[0])
        return output

    return draft.register_forward_hook(hook)


@pytest.fixture(scope="module")
def runs(models, chat, tmp_path_factory):
    """One run of ranks for every in-process case (builds are the tier's cost); the fused model's weights pre-sharded
    first, as compile_and_save's compile() does after its trace (backend.preshard: NxD's ModelBuilder)."""
    stand_in_device_ops()
    target, draft = models
    rows, _ = chat
    spec = DraftSpec(path=str(draft), speculation_length=K,
                     checkpoint=read_draft(draft, KimiK2Config.from_file(target)))
    o = backend.prepare(cpu_options(target, tp=2, draft=spec), _seq_len(rows), len(rows), GREEDY, rows)
    presharded = backend.preshard(o, tmp_path_factory.mktemp("presharded"), _seq_len(rows), len(rows))
    return {**backend.run(o, _generate_job, rows, str(presharded)), "presharded_dir": presharded}


def test_the_fused_graph_gives_the_plain_tokens_with_the_tiny_draft(runs):
    """A random draft: NxDI accepts only position 0's token (the target's own), so every token is the verify's."""
    plain = [row[:NEW] for row in runs["plain"][0]]
    tokens, steps = runs["tiny"]
    assert runs["plain-sequence"][0] == runs["plain"][0]
    assert tokens == plain and [len(t) for t in tokens] == [NEW, NEW]
    assert steps and all(1 <= n <= K for step in steps for n in step)


def test_an_oracle_draft_is_accepted_whole_every_step(runs):
    """Proposals equal to the target's own next tokens: every verify position's KV entry and logits must be right
    for NxDI to accept all of them, K tokens each step, and the tokens are still the plain ones."""
    tokens, steps = runs["oracle"]
    assert tokens == [row[:NEW] for row in runs["plain"][0]]
    assert steps and all(n == K for step in steps for n in step)
    assert len(steps) == -(-(NEW - 1) // K)  # the prefill's token, then K a step


def test_a_wrong_draft_is_accepted_one_token_a_step(runs):
    tokens, steps = runs["wrong"]
    assert tokens == [row[:NEW] for row in runs["plain"][0]]
    assert len(steps) == NEW - 1 and all(n == 1 for step in steps for n in step)


def test_generate_with_a_draft_over_the_sequence_sharded_cache_prints_the_plain_tokens(models, chat, runs, env):
    """`kimi-k2-neuron generate --backend nxdi-cpu --tp 2 --kv-shard sequence --draft D --speculation-length 4`,
    in a user's environment (the Argmax stand-in aside), two chat prompts: the tokens of the same model without a
    draft, cut at the stop tokens as the CLI cuts them, and the accept length on stderr."""
    target, draft = models
    cmd = [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--tp", "2", "--model",
           str(target), "--kv-shard", "sequence", "--draft", str(draft), "--speculation-length", str(K), "--greedy",
           "--max-new-tokens", str(NEW), "--json", *(a for p in PROMPTS for a in ("--prompt", p))]
    r = subprocess.run(cmd, capture_output=True, text=True, env=with_device_ops(env), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)["tokens"]
    stops = chat[1]
    want = [_cut(row[:NEW], stops) for row in runs["plain-sequence"][0]]
    assert got == want
    line = next(line for line in r.stderr.splitlines() if line.startswith("speculation (--speculation-length 4)"))
    assert re.search(r"\d+ fused steps, accept length [1-4]\.\d\d tokens per step per row", line), line


def test_generate_with_a_draft_at_tp_1_batch_1_prints_the_plain_tokens(models, env):
    """The other corner of the lossless claim (TP 2, batch 2 above; vLLM's test: TP 1, batch 2): `generate --tp 1`,
    one prompt, the replicated cache, with and without the draft."""
    target, draft = models
    cmd = [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--backend", "nxdi-cpu", "--tp", "1", "--model",
           str(target), "--greedy", "--max-new-tokens", str(NEW), "--json", "--prompt", PROMPTS[0]]
    runs = [subprocess.run(cmd + flags, capture_output=True, text=True, env=with_device_ops(env), timeout=900)
            for flags in ([], ["--draft", str(draft), "--speculation-length", str(K)])]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    plain, fused = (json.loads(r.stdout)["tokens"] for r in runs)
    assert fused == plain and len(plain[0]) > 1
    assert "speculation (--speculation-length 4)" in runs[1].stderr


def _cut(row, stops):
    return next((row[:i + 1] for i, t in enumerate(row) if t in stops), row)


def test_the_planners_draft_rows_are_the_buffers_nxdi_builds(models, runs):
    """plan's per-core rows for the draft (bf16 bytes) against the element counts of the draft's parameters, its KV
    cache and the hidden-state buffer in NxDI's fused model at TP 2 (float32 on CPU: compared in elements)."""
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron.fit import plan

    target, draft = models
    built = runs["buffers"]
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
    target, draft = models
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
    assert runs["presharded"][0] == [row[:NEW] for row in runs["plain"][0]]


def test_a_compiled_folders_config_reloads_the_draft(models, tmp_path):
    """neuron_config.json as compile() saves it, loaded as a compiled folder is (and vllm-neuron's precompiled
    branch): NxDI rebuilds the draft's config with our draft class's config class, the target's worker class by name,
    and the reload's spec holds the draft's facts (from its config, not its folder)."""
    from kimi_k2_neuron.formats.record import expert_scheme
    from kimi_k2_neuron.neuron import contract
    from kimi_k2_neuron.neuron.draft_config import Eagle3DraftForCausalLM
    from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig, NeuronKimiK2ForCausalLM, NeuronKimiK2Model

    target, draft = models
    cfg = KimiK2Config.from_file(target)
    d = DraftSpec(path=str(draft), speculation_length=K, checkpoint=read_draft(draft, cfg))
    spec = RunSpec(tp=2, lnc=2, seq_len=64, batch=2, scheme=expert_scheme(cfg, None, None), checkpoint="/converted",
                   moe_prefill="torch", draft=d)
    built = NeuronKimiK2ForCausalLM(str(target), KimiK2InferenceConfig.for_serving(cfg, spec))  # nothing traced
    built.config.save(tmp_path)  # as compile() does: the draft completed on the config first
    config = KimiK2InferenceConfig.load(tmp_path)
    fused = config.fused_spec_config
    assert (fused.draft_model_cls, fused.worker_cls) == (Eagle3DraftForCausalLM, NeuronKimiK2Model)
    dnc = fused.draft_config.neuron_config
    assert (dnc.is_eagle_draft, dnc.is_eagle3, dnc.enable_eagle_draft_input_norm, dnc.kv_cache_tiling) == (
        True, True, True, False)
    saved = contract.run_spec(config)
    assert saved == spec and saved.draft == d and saved.draft.checkpoint == d.checkpoint
