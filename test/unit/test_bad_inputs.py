"""Bad user input end to end: corrupt a real-format tiny checkpoint and load it the way a user does.

Every case must raise KimiInputError with a one-line message that names the offending file, tensor or field and
says what was expected. Each test copies a pristine tiny checkpoint (made once per format for this module) and
breaks one thing in it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k2_neuron.checkpoint.source import WeightSource
from kimi_k2_neuron.testing.tiny_checkpoint import make_tiny
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.runtime.runner import CpuRunner
from kimi_k2_neuron.runtime.sampling import SamplingParams

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"
SHARD3 = "model-00003-of-00003.safetensors"
O_PROJ = "model.layers.0.self_attn.o_proj"  # FP8 in the fp8 checkpoint: weight [192, 128] + scale_inv [2, 1]
BIAS1 = "model.layers.1.mlp.gate.e_score_correction_bias"
EXPERT = "model.layers.1.mlp.experts.0.up_proj"  # INT4 in the int4 checkpoint: logical [64, 192]
NORM = "model.layers.0.input_layernorm.weight"


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs_pristine")
    return {q: make_tiny(root / q, quant=q, shards=3, seed=0) for q in ("fp8", "int4", "bf16")}


@pytest.fixture
def ckpt(pristine, tmp_path):
    """ckpt("fp8") -> a fresh, writable copy of the pristine checkpoint of that format."""

    def copy(quant: str = "fp8") -> Path:
        return Path(shutil.copytree(pristine[quant], tmp_path / quant))

    return copy


def _index(d: Path) -> dict:
    return json.loads((d / INDEX).read_text())


def shard_of(d: Path, name: str) -> str:
    return _index(d)["weight_map"][name]


def edit_shard(d: Path, shard: str, fn) -> None:
    """Rewrite one shard: fn(tensors) edits the name->tensor dict in place; the index follows removed/added keys."""
    tensors = load_file(str(d / shard))
    before = set(tensors)
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / shard), metadata={"format": "pt"})
    index = _index(d)
    wm = index["weight_map"]
    for gone in before - set(tensors):
        wm.pop(gone, None)
    for new in set(tensors) - before:
        wm[new] = shard
    (d / INDEX).write_text(json.dumps(index, indent=2))


def edit_tensor(d: Path, name: str, fn) -> None:
    """Replace tensor `name` (in whatever shard holds it) by fn(old); fn returning None deletes it."""

    def apply(ts):
        new = fn(ts.pop(name))
        if new is not None:
            ts[name] = new

    edit_shard(d, shard_of(d, name), apply)


def add_tensor(d: Path, name: str, t: torch.Tensor, shard: str = SHARD1) -> None:
    edit_shard(d, shard, lambda ts: ts.__setitem__(name, t))


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def edit_index(d: Path, fn) -> None:
    index = _index(d)
    fn(index)
    (d / INDEX).write_text(json.dumps(index, indent=2))


def one_line_error(fn, *needles) -> str:
    with pytest.raises(KimiInputError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def load(d: Path, streamed: bool = False):
    """What a user does: open the runner and ask for logits (streamed mode loads layers during logits)."""
    runner = CpuRunner(d, layer_streamed=streamed)
    return runner.logits([[1, 2, 3]])


def test_pristine_copies_load(ckpt):
    # Sanity: the helpers themselves do not break a checkpoint (a no-op rewrite still loads in both modes).
    for quant in ("fp8", "int4", "bf16"):
        d = ckpt(quant)
        edit_tensor(d, NORM, lambda t: t)
        for streamed in (False, True):
            assert load(d, streamed).shape == (1, 3, 512)


# ------------------------------------------------------------------------------------------------ shard files


def test_truncated_shard(ckpt):
    d = ckpt("fp8")
    data = (d / SHARD2).read_bytes()
    (d / SHARD2).write_bytes(data[:-1000])
    one_line_error(lambda: CpuRunner(d), SHARD2, "truncated", f"file has {len(data) - 1000}")


def test_shard_truncated_inside_header(ckpt):
    d = ckpt("fp8")
    (d / SHARD2).write_bytes((d / SHARD2).read_bytes()[:100])
    one_line_error(lambda: CpuRunner(d), SHARD2, "truncated", "header needs")


def test_shard_with_garbage_header(ckpt):
    d = ckpt("fp8")
    data = bytearray((d / SHARD3).read_bytes())
    data[:8] = b"\xff" * 8
    (d / SHARD3).write_bytes(bytes(data))
    one_line_error(lambda: CpuRunner(d), SHARD3, "corrupt header", "expected an 8-byte little-endian length")


def test_missing_shard(ckpt):
    d = ckpt("int4")
    (d / SHARD3).unlink()
    one_line_error(lambda: CpuRunner(d), SHARD3, "does not exist", INDEX)


def test_index_names_tensor_missing_from_shard(ckpt):
    d = ckpt("fp8")
    fake = "model.layers.0.self_attn.fake_proj.weight"
    edit_index(d, lambda ix: ix["weight_map"].__setitem__(fake, SHARD2))
    one_line_error(lambda: CpuRunner(d), SHARD2, fake, "is not in the shard")


def test_index_not_json(ckpt):
    d = ckpt("fp8")
    (d / INDEX).write_text('{"weight_map": {')
    one_line_error(lambda: CpuRunner(d), INDEX, "not valid JSON", "line 1")


def test_index_without_weight_map(ckpt):
    d = ckpt("fp8")
    (d / INDEX).write_text('{"metadata": {}}')
    one_line_error(lambda: CpuRunner(d), INDEX, "weight_map")


def test_index_points_outside_the_checkpoint(ckpt):
    d = ckpt("fp8")
    edit_index(d, lambda ix: ix["weight_map"].__setitem__(NORM, "../" + SHARD1))
    one_line_error(lambda: CpuRunner(d), INDEX, NORM, "expected a bare file name")


def test_no_checkpoint_files(ckpt):
    d = ckpt("fp8")
    for f in d.glob("*.safetensors*"):
        f.unlink()
    one_line_error(lambda: CpuRunner(d), str(d), INDEX, "model.safetensors")


def test_model_dir_does_not_exist(tmp_path):
    one_line_error(lambda: CpuRunner(tmp_path / "nope"), "nope", "config.json not found")


# ------------------------------------------------------------------------------------------------ config.json


def _del(key):
    return lambda c: c.pop(key)


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _set_rope(key, value):
    return lambda c: c["rope_scaling"].__setitem__(key, value)


BAD_CONFIGS = {
    "missing num_attention_heads": (_del("num_attention_heads"), ["num_attention_heads", "missing required field"]),
    "negative kv_lora_rank": (_set("kv_lora_rank", -96), ["kv_lora_rank=-96", "expected an integer >= 1"]),
    "string hidden_size": (_set("hidden_size", "192"), ["hidden_size='192'", "expected an integer"]),
    "yarn factor below 1": (_set_rope("factor", 0.5), ["rope_scaling.factor=0.5", "expected a finite number >= 1"]),
    "yarn factor missing": (lambda c: c["rope_scaling"].pop("factor"), ["rope_scaling.factor", "missing"]),
    "rope type linear": (_set_rope("type", "linear"), ["rope_scaling.type='linear'", "expected 'yarn'"]),
    "rope type missing": (lambda c: c["rope_scaling"].pop("type"), ["rope_scaling.type=None", "expected 'yarn'"]),
    "rope key misspelled": (_set_rope("factr", 32.0), ["rope_scaling.factr", "expected only type, rope_type, factor"]),
    "rope key not implemented": (_set_rope("attention_factor", 1.2), ["rope_scaling.attention_factor",
                                                                      "original_max_position_embeddings"]),
    "beta_fast < beta_slow": (_set_rope("beta_slow", 4.0), ["rope_scaling.beta_fast", "beta_slow=4.0"]),
    "topk_group > n_group": (_set("topk_group", 2), ["topk_group=2", "n_group=1"]),
    "experts per token > experts": (_set("num_experts_per_tok", 9), ["num_experts_per_tok=9", "n_routed_experts=8"]),
    "experts not divisible by groups": (_set("n_group", 3), ["n_routed_experts=8", "n_group=3"]),
    "odd rope head dim": (_set("qk_rope_head_dim", 15), ["qk_rope_head_dim=15", "even"]),
    "model_type llama": (_set("model_type", "llama"), ["model_type='llama'", "kimi_k2"]),
    "scoring softmax": (_set("scoring_func", "softmax"), ["scoring_func='softmax'", "sigmoid"]),
    "eos_token_id string": (_set("eos_token_id", "x"), ["eos_token_id='x'", "expected a token id"]),
    "eos_token_id outside vocab": (_set("eos_token_id", [512, 7]), ["eos_token_id=512", "expected < vocab_size=512"]),
    "bos_token_id outside vocab": (_set("bos_token_id", 600), ["bos_token_id=600", "expected < vocab_size=512"]),
    "norm_topk_prob string": (_set("norm_topk_prob", "yes"), ["norm_topk_prob='yes'", "expected true or false"]),
    "zero rms_norm_eps": (_set("rms_norm_eps", 0), ["rms_norm_eps=0", "expected a finite number > 0"]),
    "attention bias": (_set("attention_bias", True), ["attention_bias", "not supported"]),
    "quant_method awq": (lambda c: c["quantization_config"].__setitem__("quant_method", "awq"),
                         ["quantization_config.quant_method='awq'", "expected 'fp8' or 'compressed-tensors'"]),
    "fp8 block size of one int": (lambda c: c["quantization_config"].__setitem__("weight_block_size", [128]),
                                  ["quantization_config.weight_block_size=[128]", "expected [rows, cols]"]),
    "fp8 e5m2": (lambda c: c["quantization_config"].__setitem__("fmt", "e5m2"),
                 ["quantization_config.fmt='e5m2'", "expected 'e4m3'"]),
    "quantization_config not an object": (_set("quantization_config", "fp8"),
                                          ["quantization_config", "must be an object"]),
    "text_config not an object": (_set("text_config", [1]), ["text_config", "must be an object"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_field(ckpt, case):
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
def test_bad_int4_quant_config(ckpt, field, value, needles):
    d = ckpt("int4")

    def edit(c):
        node = c
        for k in INT4_GROUP_WEIGHTS:
            node = node[k]
        node[field] = value

    edit_config(d, edit)
    one_line_error(lambda: CpuRunner(d), "config.json", *needles)


def test_config_not_json(ckpt):
    d = ckpt("fp8")
    (d / "config.json").write_text('{"hidden_size": 192,,}')
    one_line_error(lambda: CpuRunner(d), "config.json", "not valid JSON", "line 1")


def test_config_not_utf8(ckpt):
    d = ckpt("fp8")
    (d / "config.json").write_bytes(b'{"model_type": "\xff"}')
    one_line_error(lambda: CpuRunner(d), "config.json", "not valid JSON")


def test_config_not_an_object(ckpt):
    d = ckpt("fp8")
    (d / "config.json").write_text("[1, 2]")
    one_line_error(lambda: CpuRunner(d), "config.json", "expected a JSON object")


def test_config_missing(ckpt):
    d = ckpt("fp8")
    (d / "config.json").unlink()
    one_line_error(lambda: CpuRunner(d), str(d / "config.json"), "not found")
    one_line_error(lambda: KimiK2Config.from_file(d), "config.json", "not found")


def test_config_hidden_size_disagrees_with_tensors(ckpt):
    d = ckpt("bf16")
    edit_config(d, _set("hidden_size", 256))
    msg = one_line_error(lambda: CpuRunner(d), "has shape", "256]", "expected", "from config.json")
    assert "model-0000" in msg and ".weight" in msg  # names the shard and the tensor


def test_config_more_layers_than_checkpoint(ckpt):
    d = ckpt("fp8")
    edit_config(d, _set("num_hidden_layers", 4))
    one_line_error(lambda: CpuRunner(d), "missing from the checkpoint", "model.layers.3.")


def test_config_fewer_layers_than_checkpoint(ckpt):
    d = ckpt("fp8")
    edit_config(d, _set("num_hidden_layers", 2))
    one_line_error(lambda: CpuRunner(d), "no place for", "model.layers.2.")


# ------------------------------------------------------------------------------------------------ tensors


def _fp8_o_proj_transposed(d):
    edit_tensor(d, O_PROJ + ".weight", lambda t: t.t())
    edit_tensor(d, O_PROJ + ".weight_scale_inv", lambda t: t.t())


def _bf16_o_proj_transposed(d):
    edit_tensor(d, O_PROJ + ".weight", lambda t: t.t())


@pytest.mark.parametrize("quant, corrupt", [("fp8", _fp8_o_proj_transposed), ("bf16", _bf16_o_proj_transposed)])
@pytest.mark.parametrize("streamed", [False, True])
def test_transposed_weight(ckpt, quant, corrupt, streamed):
    d = ckpt(quant)
    corrupt(d)
    one_line_error(lambda: load(d, streamed), SHARD1, O_PROJ + ".weight", "has shape [128, 192]",
                   "expected [192, 128] from config.json")


def set_element(index, value):
    """An edit_tensor function that writes one element of a copy."""
    def edit(t):
        t = t.clone()
        t[index] = value
        return t
    return edit


# A tensor stored with the wrong dtype or shape: (format, tensor, edit, words the one-line error must hold).
WRONG_STORAGE = {
    "fp8 scale grid shape": ("fp8", O_PROJ + ".weight_scale_inv", lambda t: torch.ones(3, 1),
                             ["expected shape [2, 1]", "got [3, 1]"]),
    "fp8 scale as bf16": ("fp8", O_PROJ + ".weight_scale_inv", lambda t: t.to(torch.bfloat16),
                          ["expected float32", "bfloat16"]),
    "fp8 weight as int8": ("fp8", O_PROJ + ".weight", lambda t: t.view(torch.int8),
                           ["expected a 2-D float8_e4m3fn tensor", "int8"]),
    "plain weight as int": ("fp8", NORM, lambda t: t.to(torch.int32),
                            [SHARD1, "torch.int32", "expected bf16/fp16/fp32"]),
    "int4 scale as int": ("int4", EXPERT + ".weight_scale", lambda t: t.to(torch.int32),
                          ["expected floating [64, 6]", "int32"]),
    "int4 packed as int64": ("int4", EXPERT + ".weight_packed", lambda t: t.to(torch.int64),
                             ["expected int32 [64, 24]", "int64"]),
}


@pytest.mark.parametrize("case", WRONG_STORAGE)
def test_tensor_stored_wrong(ckpt, case):
    fmt, name, edit, words = WRONG_STORAGE[case]
    d = ckpt(fmt)
    edit_tensor(d, name, edit)
    one_line_error(lambda: CpuRunner(d), name, *words)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_fp8_bad_scale_value(ckpt, bad):
    d = ckpt("fp8")
    edit_tensor(d, O_PROJ + ".weight_scale_inv", set_element((1, 0), bad))
    want = "expected finite positive scales" if bad != bad or bad == float("inf") else "expected positive scales"
    one_line_error(lambda: CpuRunner(d), O_PROJ + ".weight_scale_inv", want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("streamed", [False, True])
def test_int4_bad_scale_value(ckpt, bad, streamed):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_scale", set_element((5, 2), bad))
    one_line_error(lambda: load(d, streamed), EXPERT + ".weight_scale", "NaN or inf", "expected finite scales")


def test_int4_weight_shape_disagrees_with_config(ckpt):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_shape", lambda t: torch.tensor([64, 192 + 32], dtype=torch.int32))
    one_line_error(lambda: CpuRunner(d), shard_of(d, EXPERT + ".weight_shape"), EXPERT + ".weight_shape",
                   "says shape [64, 224]", "expected [64, 192] from config.json")


def test_int4_packed_disagrees_with_weight_shape(ckpt):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_packed", lambda t: t[:, :20])
    one_line_error(lambda: CpuRunner(d), EXPERT + ".weight_packed", "expected int32 [64, 24]", "[64, 20]")


@pytest.mark.parametrize("shape, needles", [
    ([[64, 192]], ["has shape [1, 2]", "expected a 1-D [out, in]"]),  # used to leak a TypeError from int(list)
    ([64], ["says shape [64]", "expected [64, 192]"]),
    ([], ["says shape []", "expected [64, 192]"]),
], ids=["2-D", "one dim", "empty"])
def test_int4_weight_shape_malformed(ckpt, shape, needles):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_shape", lambda t: torch.tensor(shape, dtype=torch.int32))
    one_line_error(lambda: CpuRunner(d), EXPERT + ".weight_shape", *needles)


@pytest.mark.parametrize("part", ["weight_packed", "weight_scale", "weight_shape"])
def test_int4_weight_missing_part(ckpt, part):
    d = ckpt("int4")
    edit_tensor(d, f"{EXPERT}.{part}", lambda t: None)
    one_line_error(lambda: CpuRunner(d), f"INT4 weight {EXPERT} lacks {EXPERT}.{part}")


def test_fp8_weight_without_scale(ckpt):
    d = ckpt("fp8")
    edit_tensor(d, O_PROJ + ".weight_scale_inv", lambda t: None)
    one_line_error(lambda: CpuRunner(d), SHARD1, f"FP8 tensor {O_PROJ}.weight has no {O_PROJ}.weight_scale_inv")


def test_fp8_scale_without_weight(ckpt):
    d = ckpt("fp8")
    edit_tensor(d, O_PROJ + ".weight", lambda t: None)
    one_line_error(lambda: CpuRunner(d), SHARD1, f"{O_PROJ}.weight_scale_inv has no {O_PROJ}.weight")


def test_fp8_tensors_without_quantization_config(ckpt):
    d = ckpt("fp8")
    edit_config(d, _del("quantization_config"))
    one_line_error(lambda: CpuRunner(d), "config.json", "no quantization_config", "is FP8-quantized")


def test_int4_tensors_with_fp8_quantization_config(ckpt):
    d = ckpt("int4")
    edit_config(d, _set("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}))
    one_line_error(lambda: CpuRunner(d), "config.json", "quant_method 'fp8'", "weight_packed is INT4-quantized")


def test_fp8_tensors_with_int4_quantization_config(ckpt):
    # A config that says INT4 over FP8 tensors: the FP8 tensors are the unexpected ones.
    d = ckpt("fp8")
    int4_cfg = json.loads((ckpt("int4") / "config.json").read_text())["quantization_config"]
    edit_config(d, _set("quantization_config", int4_cfg))
    one_line_error(lambda: CpuRunner(d), "config.json", "quant_method 'compressed-tensors'", "is FP8-quantized")


@pytest.mark.parametrize("streamed", [False, True])
def test_missing_required_tensor(ckpt, streamed):
    d = ckpt("fp8")
    edit_tensor(d, BIAS1, lambda t: None)
    one_line_error(lambda: load(d, streamed), "1 tensor(s) missing from the checkpoint", BIAS1)


def test_tensor_in_shard_but_not_in_index_is_missing(ckpt):
    d = ckpt("int4")
    edit_index(d, lambda ix: ix["weight_map"].pop(BIAS1))
    one_line_error(lambda: CpuRunner(d), "missing from the checkpoint", BIAS1)


@pytest.mark.parametrize("streamed", [False, True])
def test_unexpected_layer_tensor(ckpt, streamed):
    d = ckpt("fp8")
    bogus = "model.layers.0.self_attn.bogus.weight"
    add_tensor(d, bogus, torch.zeros(4, 4, dtype=torch.bfloat16))
    one_line_error(lambda: load(d, streamed), "no place for", bogus)


@pytest.mark.parametrize("bogus", ["model.bogus.weight", "model.layers.3.input_layernorm.weight"])
@pytest.mark.parametrize("streamed", [False, True])
def test_unexpected_tensor_outside_layers(ckpt, bogus, streamed):
    d = ckpt("int4")
    add_tensor(d, bogus, torch.ones(192, dtype=torch.bfloat16), shard=SHARD3)
    one_line_error(lambda: load(d, streamed), "no place for", bogus)


@pytest.mark.parametrize("streamed", [False, True])
def test_streamed_layer_tensor_wrong_shape(ckpt, streamed):
    d = ckpt("int4")
    name = "model.layers.2.post_attention_layernorm.weight"
    edit_tensor(d, name, lambda t: t[:100])
    one_line_error(lambda: load(d, streamed), shard_of(d, name), name, "has shape [100]", "expected [192]")


def test_weight_source_is_the_natural_layer_for_grouping_errors(ckpt):
    d = ckpt("int4")
    edit_tensor(d, EXPERT + ".weight_scale", lambda t: None)
    one_line_error(lambda: WeightSource(d), EXPERT + ".weight_scale")
    d2 = ckpt("fp8")
    edit_config(d2, _del("quantization_config"))
    one_line_error(lambda: WeightSource(d2), "no quantization_config")


# ------------------------------------------------------------------------------------------------ input ids


@pytest.fixture(scope="module")
def runner(pristine):
    return CpuRunner(pristine["int4"])


@pytest.mark.parametrize("rows, needles", [
    ([[1, 512, 3]], ["token 512", "outside the vocabulary [0, 512)", "config.json"]),
    ([[-1, 2]], ["token -1", "outside the vocabulary"]),
    ([[1], []], ["every row needs at least one token"]),
    ([], ["every row needs at least one token"]),
    ([[1, 2.0]], ["token 2.0 is a float", "expected an integer id"]),
    ([["a", 2]], ["token 'a' is a str", "expected an integer id"]),
    ([[True, 2]], ["token True is a bool", "expected an integer id"]),
], ids=["too large", "negative", "empty row", "no rows", "float", "str", "bool"])
def test_bad_input_ids(runner, rows, needles):
    one_line_error(lambda: runner.logits(rows), "input ids", *needles)


def test_bad_sampling_params():
    one_line_error(lambda: SamplingParams(temperature=float("nan")), "temperature nan", "expected a finite number")
    one_line_error(lambda: SamplingParams(temperature=1.0, top_p=float("nan")), "top_p nan")
    one_line_error(lambda: SamplingParams(top_k=-3), "top_k -3", "expected an integer >= 0")


LIMIT = "expected at most max_position_embeddings=8 of config.json"


@pytest.mark.parametrize("call, needles", [
    (lambda r: r.logits([[1] * 9]), ["input ids: rows of 9 tokens need 9 positions", LIMIT]),
    (lambda r: r.generate([[1] * 5, [2]], 4), ["--max-new-tokens 4: a prompt of 5 tokens + 4 new tokens need 9",
                                               LIMIT]),
    (lambda r: r.generate([[1]], 0), ["--max-new-tokens 0", "expected an integer >= 1"]),
], ids=["logits", "generate", "no new tokens"])
def test_more_positions_than_the_model_has(ckpt, call, needles):
    d = ckpt("bf16")
    edit_config(d, _set("max_position_embeddings", 8))
    one_line_error(lambda: call(CpuRunner(d)), *needles)


def test_bad_prefill_len(runner):
    one_line_error(lambda: runner.logits([[1, 2, 3]], prefill_len=4), "--prefill-len 4", "sequence length 3")
    one_line_error(lambda: runner.logits([[1, 2, 3]], prefill_len=-1), "--prefill-len -1")


def test_bad_input_ids_streamed(pristine):
    r = CpuRunner(pristine["fp8"], layer_streamed=True)
    one_line_error(lambda: r.logits([[1, 2, 100_000]]), "token 100000", "outside the vocabulary")
