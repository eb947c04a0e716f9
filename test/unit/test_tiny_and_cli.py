"""The tiny checkpoints are stored the way the real ones are, and the CLI keeps its documented contract."""

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint
from kimi_k2_neuron.cli import main
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.runner import CpuRunner
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


def test_make_tiny_cli_and_refuses_existing(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["make-tiny", str(out), "--quant", "int4", "--shards", "4", "--seed", "3"]) == 0
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert main(["make-tiny", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is importable here")
def test_trace_cpu_without_torch_xla_is_a_one_line_error(tiny_dirs, capsys):
    assert main(["trace-cpu", "--model", str(tiny_dirs["fp8"]), "--submodel", "token"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trace-cpu needs NxD, NxDI and torch_xla") and "torch_xla" in err.split(":", 2)[2]
    assert err.count("\n") == 1


def test_logits_cli_contract(tiny_dirs, tmp_path):
    out = tmp_path / "l.safetensors"
    assert main(["logits", "--model", str(tiny_dirs["fp8"]), "--input-ids", "1,2,3,4;5,6,7,8", "--prefill-len", "2",
                 "--out", str(out)]) == 0
    logits = load_file(out)["logits"]
    assert logits.dtype == torch.float32 and logits.shape == (2, 4, 512)
    assert torch.equal(logits, CpuRunner(tiny_dirs["fp8"]).logits([[1, 2, 3, 4], [5, 6, 7, 8]], 2))


def test_generate_cli_json(tiny_dirs, capsys):
    assert main(["generate", "--model", str(tiny_dirs["fp8"]), "--prompt", "hello", "--chat", "--max-new-tokens", "4",
                 "--temperature", "0.7", "--top-k", "50", "--top-p", "0.9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= len(out["tokens"][0]) <= 4 and isinstance(out["text"][0], str)


def test_demo_runs_and_matches_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path))
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text
    diff = float(text.split("max |logit difference| vs transformers")[1].split(": ")[1].split()[0])
    assert diff < 1e-3
