"""config.json parsing on the real Kimi-K2 family configs (data only: nothing is hard-coded in the package), and
every bad field of a tiny checkpoint's config.json refused in one line, by the config and by the runner that loads
it."""

import json
from pathlib import Path

import pytest
from checkpoint_edits import del_field, edit_config, set_field

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.runtime.runner import CpuRunner

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def test_real_configs_parse():
    k2 = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct.json")
    assert (k2.num_attention_heads, k2.latent_dim, k2.qk_head_dim) == (64, 576, 192)
    assert k2.rope_scaling.factor == 32.0 and k2.quant.method == "fp8" and k2.quant.weight_block_size == (128, 128)
    assert not k2.is_moe_layer(0) and k2.is_moe_layer(1) and k2.is_moe_layer(60)
    thinking = KimiK2Config.from_file(CONFIGS / "kimi-k2-thinking.json")
    assert thinking.quant.method == "compressed-tensors" and thinking.quant.group_size == 32
    assert thinking.rms_norm_eps == 1e-5 and thinking.eos_token_ids == (163586,)
    assert KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json").rope_scaling.factor == 64.0


def test_k25_text_config_and_deepseek_model_type():
    inner = json.loads((CONFIGS / "kimi-k2-thinking.json").read_text())
    quant = inner.pop("quantization_config")
    k25 = {"model_type": "kimi_k25", "text_config": {**inner, "model_type": "deepseek_v3"},
           "quantization_config": quant}
    cfg = KimiK2Config.from_dict(k25)
    assert cfg.model_type == "deepseek_v3" and cfg.quant.method == "compressed-tensors"


def test_to_dict_round_trips():
    cfg = KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct.json")
    assert KimiK2Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("field,value,needle", [
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("routed_scaling_factor", -1.0, "routed_scaling_factor"),
    ("norm_topk_prob", "yes", "norm_topk_prob"),
    ("scoring_func", "softmax", "scoring_func"),
])
def test_bad_fields_name_the_field(field, value, needle):
    raw = json.loads((CONFIGS / "kimi-k2-instruct.json").read_text())
    raw[field] = value
    with pytest.raises(ValueError, match=needle):
        KimiK2Config.from_dict(raw)


# -- bad config.json of a checkpoint -----------------------------------------------------------------------------------

def _set_rope(key, value):
    return lambda c: c["rope_scaling"].__setitem__(key, value)


BAD_CONFIGS = {
    "missing num_attention_heads": (del_field("num_attention_heads"),
                                    ["num_attention_heads", "missing required field"]),
    "negative kv_lora_rank": (set_field("kv_lora_rank", -96), ["kv_lora_rank=-96", "expected an integer >= 1"]),
    "string hidden_size": (set_field("hidden_size", "192"), ["hidden_size='192'", "expected an integer"]),
    "yarn factor below 1": (_set_rope("factor", 0.5), ["rope_scaling.factor=0.5", "expected a finite number >= 1"]),
    "yarn factor missing": (lambda c: c["rope_scaling"].pop("factor"), ["rope_scaling.factor", "missing"]),
    "rope type linear": (_set_rope("type", "linear"), ["rope_scaling.type='linear'", "expected 'yarn'"]),
    "rope type missing": (lambda c: c["rope_scaling"].pop("type"), ["rope_scaling.type=None", "expected 'yarn'"]),
    "rope key misspelled": (_set_rope("factr", 32.0), ["rope_scaling.factr", "expected only type, rope_type, factor"]),
    "rope key not implemented": (_set_rope("attention_factor", 1.2), ["rope_scaling.attention_factor",
                                                                      "original_max_position_embeddings"]),
    "beta_fast < beta_slow": (_set_rope("beta_slow", 4.0), ["rope_scaling.beta_fast", "beta_slow=4.0"]),
    "topk_group > n_group": (set_field("topk_group", 2), ["topk_group=2", "n_group=1"]),
    "experts per token > experts": (set_field("num_experts_per_tok", 9),
                                    ["num_experts_per_tok=9", "n_routed_experts=8"]),
    "experts not divisible by groups": (set_field("n_group", 3), ["n_routed_experts=8", "n_group=3"]),
    "odd rope head dim": (set_field("qk_rope_head_dim", 15), ["qk_rope_head_dim=15", "even"]),
    "model_type llama": (set_field("model_type", "llama"), ["model_type='llama'", "kimi_k2"]),
    "scoring softmax": (set_field("scoring_func", "softmax"), ["scoring_func='softmax'", "sigmoid"]),
    "eos_token_id string": (set_field("eos_token_id", "x"), ["eos_token_id='x'", "expected a token id"]),
    "eos_token_id outside vocab": (set_field("eos_token_id", [512, 7]),
                                   ["eos_token_id=512", "expected < vocab_size=512"]),
    "bos_token_id outside vocab": (set_field("bos_token_id", 600), ["bos_token_id=600", "expected < vocab_size=512"]),
    "norm_topk_prob string": (set_field("norm_topk_prob", "yes"), ["norm_topk_prob='yes'", "expected true or false"]),
    "zero rms_norm_eps": (set_field("rms_norm_eps", 0), ["rms_norm_eps=0", "expected a finite number > 0"]),
    "attention bias": (set_field("attention_bias", True), ["attention_bias", "not supported"]),
    # DeepSeek-V2-Lite's MLA (before: a bare ValueError from the model's constructor, 41 lines)
    "q_lora_rank null": (set_field("q_lora_rank", None), ["field q_lora_rank is null", "not implemented"]),
    # read and never used before: transformers would tie lm_head to the embedding; Kimi releases are untied
    "tie_word_embeddings true": (set_field("tie_word_embeddings", True),
                                 ["field tie_word_embeddings=true is not supported", "expected false"]),
    "tie_word_embeddings string": (set_field("tie_word_embeddings", "false"),
                                   ["tie_word_embeddings='false'", "expected true or false"]),
    "quant_method awq": (lambda c: c["quantization_config"].__setitem__("quant_method", "awq"),
                         ["quantization_config.quant_method='awq'", "expected 'fp8' or 'compressed-tensors'"]),
    "fp8 block size of one int": (lambda c: c["quantization_config"].__setitem__("weight_block_size", [128]),
                                  ["quantization_config.weight_block_size=[128]", "expected [rows, cols]"]),
    "fp8 e5m2": (lambda c: c["quantization_config"].__setitem__("fmt", "e5m2"),
                 ["quantization_config.fmt='e5m2'", "expected 'e4m3'"]),
    "quantization_config not an object": (set_field("quantization_config", "fp8"),
                                          ["quantization_config", "must be an object"]),
    "text_config not an object": (set_field("text_config", [1]), ["text_config", "must be an object"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_field(ckpt, case, one_line_error):
    edit, needles = BAD_CONFIGS[case]
    d = ckpt("fp8")
    edit_config(d, edit)
    msg = one_line_error(lambda: CpuRunner(d), "config.json", *needles)
    assert msg == one_line_error(lambda: KimiK2Config.from_file(d), *needles)


INT4_GROUP_WEIGHTS = ("quantization_config", "config_groups", "group_0", "weights")


@pytest.mark.parametrize("field, value, needles", [
    ("group_size", 0, ["weights.group_size=0", "expected > 0"]),
    ("num_bits", 8, ["weights.num_bits=8", "expected 4"]),
    ("symmetric", False, ["weights.symmetric=False", "expected True"]),
])
def test_bad_int4_quant_config(ckpt, field, value, needles, one_line_error):
    d = ckpt("int4")

    def edit(c):
        node = c
        for k in INT4_GROUP_WEIGHTS:
            node = node[k]
        node[field] = value

    edit_config(d, edit)
    one_line_error(lambda: CpuRunner(d), "config.json", *needles)


def test_config_not_json(ckpt, one_line_error):
    d = ckpt("fp8")
    (d / "config.json").write_text('{"hidden_size": 192,,}')
    one_line_error(lambda: CpuRunner(d), "config.json", "not valid JSON", "line 1")


def test_config_not_utf8(ckpt, one_line_error):
    d = ckpt("fp8")
    (d / "config.json").write_bytes(b'{"model_type": "\xff"}')
    one_line_error(lambda: CpuRunner(d), "config.json", "not valid JSON")


def test_config_not_an_object(ckpt, one_line_error):
    d = ckpt("fp8")
    (d / "config.json").write_text("[1, 2]")
    one_line_error(lambda: CpuRunner(d), "config.json", "expected a JSON object")


def test_config_missing(ckpt, one_line_error):
    d = ckpt("fp8")
    (d / "config.json").unlink()
    one_line_error(lambda: CpuRunner(d), str(d / "config.json"), "not found")
    one_line_error(lambda: KimiK2Config.from_file(d), "config.json", "not found")


def test_model_dir_does_not_exist(tmp_path, one_line_error):
    one_line_error(lambda: CpuRunner(tmp_path / "nope"), "nope", "config.json not found")
