"""Helpers that break one thing in a copy of a tiny checkpoint (the `ckpt` fixture of conftest.py): rewrite a shard,
a tensor, the index or config.json, keeping the rest as it was."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kimi_k2_neuron.runtime.runner import CpuRunner

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"
SHARD3 = "model-00003-of-00003.safetensors"
O_PROJ = "model.layers.0.self_attn.o_proj"  # FP8 in the fp8 checkpoint: weight [192, 128] + scale_inv [2, 1]
BIAS1 = "model.layers.1.mlp.gate.e_score_correction_bias"
EXPERT = "model.layers.1.mlp.experts.0.up_proj"  # INT4 in the int4 checkpoint: logical [64, 192]
NORM = "model.layers.0.input_layernorm.weight"


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


def set_element(index, value):
    """An edit_tensor function that writes one element of a copy."""
    def edit(t):
        t = t.clone()
        t[index] = value
        return t
    return edit


def set_field(key, value):
    """An edit_config function setting one top-level field."""
    return lambda c: c.__setitem__(key, value)


def del_field(key):
    return lambda c: c.pop(key)


def load(d: Path, streamed: bool = False):
    """What a user does: open the runner and ask for logits (streamed mode loads layers during logits)."""
    runner = CpuRunner(d, layer_streamed=streamed)
    return runner.logits([[1, 2, 3]])


EMBED = "model.embed_tokens.weight"


def scramble_data(d: Path, shard: str, seed: int = 0) -> None:
    """Overwrite a shard's whole data region (everything after its header) with random bytes: the header still
    parses and every size still matches, as after a bad download or a disk error."""
    path = d / shard
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    g = torch.Generator().manual_seed(seed)
    raw[start:] = torch.randint(0, 256, (len(raw) - start,), dtype=torch.uint8, generator=g).numpy().tobytes()
    path.write_bytes(bytes(raw))


def set_code(index, byte: int):
    """An edit_tensor function that writes one raw byte (an FP8 code) of a copy."""
    def edit(t):
        t = t.clone()
        t.view(torch.uint8)[index] = byte
        return t
    return edit
