"""The tiny checkpoints (kimi_k2_neuron.testing.tiny_checkpoint) are stored the way the real ones are: FP8 blockwise
with partial blocks, INT4 pack-quantized experts, experts cut across shards, Kimi's tokenizer."""

import math

import torch

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer


def test_fp8_tiny_layout(tiny_dirs):
    d = tiny_dirs["fp8"]
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


def test_int4_tiny_layout(tiny_dirs):
    ck = ShardedCheckpoint(tiny_dirs["int4"])
    p = "model.layers.2.mlp.experts.5.down_proj."
    assert ck.info(p + "weight_packed").dtype == torch.int32
    assert ck.info(p + "weight_scale").dtype == torch.bfloat16
    assert ck.get(p + "weight_shape").tolist() == [192, 64]
    assert ck.info(p + "weight_packed").shape == (192, 64 // 8)
    assert ck.info(p + "weight_scale").shape == (192, 64 // 32)
    # only routed experts are INT4, as in Kimi-K2-Thinking
    assert ck.info("model.layers.2.mlp.shared_experts.down_proj.weight").dtype == torch.bfloat16
    assert ck.info("model.layers.2.self_attn.o_proj.weight").dtype == torch.bfloat16


def test_tiny_tokenizer_matches_config(tiny_dirs):
    d = tiny_dirs["bf16"]
    tok, cfg = KimiTokenizer.from_dir(d), KimiK2Config.from_file(d)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_id in cfg.eos_token_ids and tok.bos_id == cfg.bos_token_id
    assert tok.token_to_id("<|im_end|>") in tok.stop_ids(cfg.eos_token_ids)
