"""The EAGLE3(.1) MLA draft's math (model/eagle3.py on the core's MLA) against transformers: a draft step assembled from
transformers' DeepseekV3 modules (its MLA attention over the 2H input with its own interleaved YaRN RoPE and softmax
scale, its MLP and RMSNorms) wired as TorchSpec's Eagle3DeepseekV2ForCausalLM, vLLM's deepseek_eagle3.py and SGLang's
kimi_k25_eagle3.py wire the draft: [input_layernorm(embedding) | hidden_norm(fc(fc_norm_i(aux_i)))] into the attention,
the un-normed hidden as the residual, lm_head over the final norm, and the normed state fed back under norm_output.
The tiny eagle3.1-mla draft make-tiny writes, float32; prefill (naive attention) and a decode step (absorbed)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kimi_k2_neuron.checkpoint.draft import read_draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.model.eagle3 import Eagle3Layer, draft_outputs, fc_norms, fuse_aux
from kimi_k2_neuron.model.norm import RMSNorm
from kimi_k2_neuron.model.rope import RotaryTable
from kimi_k2_neuron.parallel import SINGLE
from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.tiny.draft_checkpoint import make_tiny_draft

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

S = 6  # prefill tokens; then one decode step


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-mla")
    target = make_tiny(root / "target", shards=1, config_overrides={"num_hidden_layers": 7})
    path = make_tiny_draft(root / "draft", target, seed=5, layout="eagle3.1-mla")
    d = read_draft(path, KimiK2Config.from_file(target))
    tensors = {k.replace("midlayer.", "layers.0."): t.float() for k, t in load_file(path / "model.safetensors").items()}
    return d, tensors


def _ours(d, t):
    cfg = d.core_config()
    layer = Eagle3Layer(cfg, torch.float32, SINGLE)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in t.items() if k.startswith("layers.0.")}, strict=True)
    fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
    fc.weight.data = t["fc.weight"]
    norms = fc_norms(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
    for i, n in enumerate(norms):
        n.weight.data = t[f"fc_norm.{i}.weight"]
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
    norm.weight.data = t["norm.weight"]
    rotary = RotaryTable(cfg)

    def step(ids, aux, positions, cache, absorbed):
        x = torch.cat([t["embed_tokens.weight"][ids], fuse_aux(aux, fc, norms)], dim=-1)
        out = layer(x, positions, rotary(positions), cache, absorbed)
        logits_in, feedback = draft_outputs(norm, out, d.norm_output)
        return logits_in @ t["lm_head.weight"].T, feedback

    return cfg, step


def _reference(d, t):
    """transformers' modules, the EAGLE3 wiring of the public implementations."""
    cfg = d.core_config()
    h, ys = cfg.hidden_size, cfg.rope_scaling
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **ys.__dict__}
    config = hf.DeepseekV3Config(
        hidden_size=2 * h, intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
        rope_interleave=True, attention_bias=False, vocab_size=cfg.vocab_size)
    config._attn_implementation = "eager"
    attn = hf.DeepseekV3Attention(config, layer_idx=0)
    attn.o_proj = nn.Linear(cfg.num_attention_heads * cfg.v_head_dim, h, bias=False)  # back to the draft's H
    attn.load_state_dict({k[len("layers.0.self_attn."):]: v for k, v in t.items()
                          if k.startswith("layers.0.self_attn.")}, strict=True)
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    mlp_config = hf.DeepseekV3Config(hidden_size=h, intermediate_size=cfg.intermediate_size)
    mlp = hf.DeepseekV3MLP(mlp_config)
    mlp.load_state_dict({k[len("layers.0.mlp."):]: v for k, v in t.items() if k.startswith("layers.0.mlp.")})

    def norm(name):
        n = hf.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        n.weight.data = t[name]
        return n

    ln_in, ln_hidden, ln_post = (norm(f"layers.0.{n}.weight") for n in
                                  ("input_layernorm", "hidden_norm", "post_attention_layernorm"))
    ln_final = norm("norm.weight")
    aux_norms = [norm(f"fc_norm.{i}.weight") for i in range(3)]

    def run(ids, aux):
        """The whole sequence at once, causal."""
        s = ids.shape[1]
        hidden = torch.cat([n(c) for n, c in zip(aux_norms, aux.chunk(3, dim=-1))], dim=-1) @ t["fc.weight"].T
        x = torch.cat([ln_in(t["embed_tokens.weight"][ids]), ln_hidden(hidden)], dim=-1)
        positions = torch.arange(s)[None]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        out = attn(x, rotary(x, positions), mask)[0]
        h1 = hidden + out
        h2 = h1 + mlp(ln_post(h1))
        normed = ln_final(h2)
        return normed @ t["lm_head.weight"].T, normed if d.norm_output else h2

    return run


@torch.no_grad()
def test_the_mla_draft_step_matches_transformers_modules_wired_as_published(draft):
    d, t = draft
    assert d.fc_norm and d.norm_output
    cfg, ours = _ours(d, t)
    reference = _reference(d, t)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, S + 1), generator=g)
    aux = torch.randn(2, S + 1, 3 * cfg.hidden_size, generator=g) * 3
    want_logits, want_feedback = reference(ids, aux)
    cache = torch.zeros(2, S + 1, cfg.latent_dim)
    positions = torch.arange(S)[None].expand(2, S)
    logits, feedback = ours(ids[:, :S], aux[:, :S], positions, cache, absorbed=False)
    scale = want_logits.abs().max()
    assert float((logits - want_logits[:, :S]).abs().max() / scale) < 1e-5
    assert float((feedback - want_feedback[:, :S]).abs().max() / want_feedback.abs().max()) < 1e-5
    # one decode step over the latent cache, absorbed
    logits, feedback = ours(ids[:, S:], aux[:, S:], torch.full((2, 1), S), cache, absorbed=True)
    assert float((logits - want_logits[:, S:]).abs().max() / scale) < 1e-5
    assert float((feedback - want_feedback[:, S:]).abs().max() / want_feedback.abs().max()) < 1e-5


@torch.no_grad()
def test_without_eagle31_the_feedback_is_the_final_norms_input(draft):
    """EAGLE3's feedback (norm_output off) is the pre-norm state; lm_head reads the normed one either way."""
    norm = RMSNorm(4, 1e-5, torch.float32)
    x = torch.randn(1, 2, 4) * 5
    assert torch.equal(draft_outputs(norm, x, False)[1], x)
    assert torch.equal(draft_outputs(norm, x, True)[1], norm(x))
    assert torch.equal(draft_outputs(norm, x, False)[0], norm(x))
