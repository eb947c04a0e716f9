"""Checkpoints whose tensors have one trn2 rank's real shapes: test fixtures for the branches NxD takes at Kimi's size.

Which path NxD takes (NKI kernel or torch, selective loading or all experts, which kernel variant) depends on the
per-rank shapes, so a tiny config cannot show the branch trn2 takes. rank_slice_config turns a real config.json into
one that, split over `ranks` ranks, gives each rank exactly what a rank holds at TP=`tp`: every dimension NxD splits
(attention heads, the dense, shared and routed experts' intermediate columns, the vocabulary of lm_head) is divided
by tp / ranks; everything NxD keeps whole per rank (hidden size, q/kv LoRA ranks, RoPE width, the 384 experts of
each layer under EP=1, the router) keeps its real size. One dense layer and `moe_layers` MoE layers.

The embedding is the exception: NxD splits it along hidden (shard_across_embedding), so its per-rank slice
[vocab / (tp / ranks), hidden / ranks] is not the real [vocab, hidden / tp]; it is a gather, with no branch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import KimiK2Config
from ..errors import KimiInputError
from ..interrupts import atomic_folder
from ..formats.layout import logical_shapes
from ..runtime.tokenizer import KIMI_SPECIAL_BASE
from ..tiny.checkpoint import TINY_BASE_TOKENS, random_weight, store, stray_buffer
from ..tiny.tokenizer_files import tiny_special_id, write_tiny_tokenizer

# Dimensions NxD splits across the TP ranks (attention by heads, MLPs by intermediate columns, lm_head by vocab).
SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "vocab_size")


def rank_slice_config(real: dict, tp: int, ranks: int = 1, moe_layers: int = 2) -> dict:
    """config.json of `ranks` ranks' worth of one TP=`tp` rank of the model `real` describes (module docstring)."""
    if tp < 1 or ranks < 1 or tp % ranks:
        raise KimiInputError(f"--tp {tp} --ranks {ranks}: expected ranks dividing tp")
    per = tp // ranks
    out = dict(real)
    for name in SPLIT_FIELDS:
        if real[name] % per:
            raise KimiInputError(f"config.json field {name}={real[name]} does not split {per} ways")
        out[name] = real[name] // per
    dense = real["first_k_dense_replace"]
    out.update(num_hidden_layers=dense + moe_layers, num_nextn_predict_layers=0,
               # the tiny tokenizer's special ids, which sit inside the sliced vocabulary
               bos_token_id=tiny_special_id(KIMI_SPECIAL_BASE, TINY_BASE_TOKENS),
               eos_token_id=tiny_special_id(KIMI_SPECIAL_BASE + 1, TINY_BASE_TOKENS))
    if out["vocab_size"] < TINY_BASE_TOKENS + 256:
        raise KimiInputError(f"vocab_size {out['vocab_size']} per slice is below the tiny tokenizer's "
                             f"{TINY_BASE_TOKENS + 256}")
    return out


def make_rank_slice(out: str | Path, real_config: str | Path, tp: int, ranks: int = 1, moe_layers: int = 2,
                    seed: int = 0) -> Path:
    """Write a random checkpoint of rank_slice_config(real_config...) to `out` (new), stored as the real checkpoint
    is (its quantization_config: blockwise FP8 or compressed-tensors INT4), one shard per decoder layer, generated
    and written one shard at a time (a layer's 384 experts are ~0.5 GB in FP8). Renamed into place at the end
    (interrupts.atomic_folder)."""
    out = Path(out)
    if out.exists():
        raise KimiInputError(f"{out} already exists; a new folder is written")
    raw_cfg = rank_slice_config(json.loads(Path(real_config).read_text()), tp, ranks, moe_layers)
    cfg = KimiK2Config.from_dict(raw_cfg, source=f"rank slice of {real_config}")
    with atomic_folder(out) as tmp:
        _write_by_layer(tmp, cfg, seed)
        (tmp / "config.json").write_text(json.dumps(raw_cfg, indent=2))
        write_tiny_tokenizer(tmp, num_base_tokens=TINY_BASE_TOKENS)
    return out


def _write_by_layer(d: Path, cfg: KimiK2Config, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in logical_shapes(cfg).items():
        # the embedding with layer 0, the final norm and lm_head with the last layer
        layer = name.split(".")[2] if name.startswith("model.layers.") else (
            "0" if "embed_tokens" in name else str(cfg.num_hidden_layers - 1))
        groups.setdefault(layer, []).append((name, shape))
    weight_map, total, n = {}, 0, len(groups)
    for k, (layer, names) in enumerate(groups.items(), 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in names:
            tensors.update(store(name, random_weight(name, shape, g), cfg))
            tensors.update(stray_buffer(name, cfg))
        save_file({t: v.contiguous() for t, v in tensors.items()}, str(d / fname), metadata={"format": "pt"})
        for t, v in tensors.items():
            weight_map[t] = fname
            total += v.numel() * v.element_size()
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
