"""The tiny checkpoints (kimi_k2_neuron.tiny.checkpoint) are stored the way the real ones are: FP8 blockwise
with partial blocks, INT4 pack-quantized experts, experts cut across shards, Kimi's tokenizer."""

import json
import math

import pytest
import torch

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from kimi_k2_neuron.tiny.checkpoint import LAYOUTS, make_tiny
from kimi_k2_neuron.tiny.tokenizer_files import tiny_special_id


def test_fp8_tiny_layout(tiny):
    d = tiny["fp8"]
    ck, cfg = ShardedCheckpoint(d), KimiK2Config.from_file(d)
    assert cfg.quant.method == "fp8" and len(ck.shard_names()) == 3
    w = ck.info("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    s = ck.info("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == tuple(math.ceil(n / 128) for n in w.shape)
    assert any(n % 128 for n in w.shape)  # partial edge blocks
    assert ck.info("model.embed_tokens.weight").dtype == torch.bfloat16
    assert ck.info("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert ck.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in ck
    shards = {ck.info(k).shard for k in ck.keys() if k.startswith("model.layers.1.mlp.experts.")}
    assert len(shards) == 2  # one layer's experts span two files


def test_one_layer_is_dense_and_still_split_into_the_files_asked(tmp_path):
    """--layers 1: Kimi's first layer is dense (first_k_dense_replace 1), so there are no experts to cut in."""
    d = make_tiny(tmp_path / "one", config_overrides={"num_hidden_layers": 1})
    ck = ShardedCheckpoint(d)
    assert len(ck.shard_names()) == 3 and not any(".experts." in k for k in ck.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in ck


def test_int4_tiny_layout(tiny):
    ck = ShardedCheckpoint(tiny["int4"])
    p = "model.layers.2.mlp.experts.5.down_proj."
    assert ck.info(p + "weight_packed").dtype == torch.int32
    assert ck.info(p + "weight_scale").dtype == torch.bfloat16
    assert ck.get(p + "weight_shape").tolist() == [192, 64]
    assert ck.info(p + "weight_packed").shape == (192, 64 // 8)
    assert ck.info(p + "weight_scale").shape == (192, 64 // 32)
    # only routed experts are INT4, as in Kimi-K2-Thinking
    assert ck.info("model.layers.2.mlp.shared_experts.down_proj.weight").dtype == torch.bfloat16
    assert ck.info("model.layers.2.self_attn.o_proj.weight").dtype == torch.bfloat16


def test_tiny_tokenizer_matches_config(tiny):
    d = tiny["bf16"]
    tok, cfg = KimiTokenizer.from_dir(d), KimiK2Config.from_file(d)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_id in cfg.eos_token_ids and tok.bos_id == cfg.bos_token_id
    assert tok.token_to_id("<|im_end|>") in tok.stop_ids(cfg.eos_token_ids)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    return {name: make_tiny(root / name, layout=name, seed=0) for name in LAYOUTS}


@pytest.mark.parametrize("name", LAYOUTS)
def test_release_layouts(releases, name):
    """K2.5, K2.6 and K2.7-Code keep K2.5's layout: the language model under text_config and `language_model.`, a
    vision tower and projector beside it, INT4 experts; K2-Thinking and K2.6+ end turns with <|im_end|> (163586)."""
    d, spec = releases[name], LAYOUTS[name]
    raw, ck, cfg = json.loads((d / "config.json").read_text()), ShardedCheckpoint(d), KimiK2Config.from_file(d)
    assert cfg.storage_format == spec.quant
    assert cfg.eos_token_ids == (tiny_special_id(spec.eos, 256),)
    prefix = "language_model." if spec.multimodal else ""
    assert (prefix + "model.layers.1.mlp.experts.0.down_proj.weight_packed" in ck) == (spec.quant == "int4")
    assert ("text_config" in raw) == spec.multimodal == ("vision_tower.blocks.0.attn.qkv.weight" in ck)
    if spec.multimodal:
        assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and "quantization_config" in raw
        assert not [k for k in ck.keys() if not k.startswith(("language_model.", "vision_tower.", "mm_projector."))]
    generation = json.loads((d / "generation_config.json").read_text())
    assert {k: generation[k] for k in spec.generation} == spec.generation


@pytest.mark.parametrize("name, opens", [("k2", ""), ("k2-thinking", ""), ("k2.5", "<think>"), ("k2.6", "<think>"),
                                         ("k2.7", "<think>")])
def test_release_chat_templates_thinking_toggle_and_preserved_thinking(releases, name, opens):
    """The generation prompt opens <think> (K2.5+), or closes it at once with thinking false (not K2.7, thinking
    only); earlier turns' reasoning is rendered back with preserve_thinking (always for K2.7), else only for the
    turns after the last user message."""
    tok = KimiTokenizer.from_dir(releases[name])
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "R1"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "R2"},
            {"role": "user", "content": [{"type": "text", "text": "e"}]}]  # content as vLLM's parts, too
    on, off, kept = (tok.apply_chat_template(chat, **kw) for kw in ({}, {"thinking": False},
                                                                    {"preserve_thinking": True}))
    assert on.endswith("<|im_assistant|>assistant<|im_middle|>" + opens)
    thinking = name != "k2"
    assert off.endswith("<think></think>" if name in ("k2.5", "k2.6") else "<|im_middle|>" + opens)
    assert ("<think>R1</think>b" in on) == ("<think>R2</think>d" in on) == (name == "k2.7")
    assert "<|im_user|>user<|im_middle|>e<|im_end|>" in on
    assert ("<think>R1</think>b" in kept) == thinking
    assert ("<think></think>b" in on) == (thinking and name != "k2.7")
