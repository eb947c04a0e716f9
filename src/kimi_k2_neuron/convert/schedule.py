"""What the converter will write, decided before any tensor data is read.

Every source tensor must end up in an output tensor or be explicitly ignored (WeightSource sets aside
`*.rotary_emb.inv_freq`, DeepSeek MTP layers and Kimi-K2.5's vision tower and projector); the expected logical
weights are the format's (formats.layout.logical_shapes), so a leftover or a missing tensor is an error that lists
them. Shapes are checked here too, so a bad checkpoint fails before the destination is touched.

Output files: one per unit, in order -- the embeddings, each decoder layer, then the final norm + lm_head.
Inside a file the FP8 expert weights come first, then the fp32 tensors (their scales, the router), then bf16: the
expert slabs start on the page boundary the header is padded to (the writer sends them with O_DIRECT), every
tensor stays aligned to its element size (3 x E x H x I bytes of FP8, H a multiple of 4), and the fused expert
weights are streamed front to back with only their (small) scales held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.source import WeightSource
from ..config import KimiK2Config
from ..errors import KimiInputError, listing
from ..formats import layout
from ..formats.layout import BF16, F32, converted_dtype, is_routed_expert
from ..formats.scheme import ExpertScheme

_TOP_FIRST, _TOP_LAST = ("model.embed_tokens.",), ("model.norm.", "lm_head.")


@dataclass
class Unit:
    index: int
    file: str
    plain: list[str]  # logical names of the non-expert weights stored in this file
    moe_layer: int | None = None  # the layer whose routed experts this file holds
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = field(default_factory=list)
    src_bytes: int = 0


def check_accounting(src: WeightSource, expected: dict[str, tuple[int, ...]]) -> None:
    leftovers = set(src.weights) - set(expected)
    if leftovers:
        raise KimiInputError(f"{src.dir}: {len(leftovers)} source tensor(s) with no place in the converted "
                             f"checkpoint: {listing(sorted(leftovers))}")
    missing = set(expected) - set(src.weights)
    if missing:
        raise KimiInputError(f"{src.dir}: {len(missing)} tensor(s) missing from the source: "
                             f"{listing(sorted(missing))}")
    for name, shape in expected.items():
        got, where = _logical_shape(src, name)
        if got != shape:
            raise KimiInputError(f"{where}: tensor {name} has shape {list(got)}, expected {list(shape)} "
                                 f"from config.json")


def _logical_shape(src: WeightSource, name: str) -> tuple[tuple[int, ...], str]:
    w = src.weights[name]
    info = src.ckpt.info(w.raw[0])
    if w.kind != "int4":
        return tuple(info.shape), info.shard
    t = src.ckpt.get(w.raw[2])  # weight_shape: [out, in]
    if t.dim() != 1 or t.numel() != 2:
        raise KimiInputError(f"{src.ckpt.info(w.raw[2]).shard}: tensor {w.raw[2]} has shape {list(t.shape)}, "
                             f"expected [2] = [out, in]")
    return tuple(int(v) for v in t.tolist()), src.ckpt.info(w.raw[2]).shard


def check_dims(cfg: KimiK2Config, scheme: ExpertScheme, src: WeightSource) -> None:
    """The scheme's block grid must tile the expert weights (and the source's blocks, for FP8 sources)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    if h % 4:
        raise KimiInputError(f"config.json: hidden_size={h} must be a multiple of 4 for the converted layout")
    if scheme.block is None:
        return
    for dim, what in ((h, "hidden_size"), (i, "moe_intermediate_size")):
        for b in set(scheme.block) - {1}:
            if dim % b:
                raise KimiInputError(f"config.json: field {what}={dim} is not a multiple of the {b}-wide "
                                     f"{scheme.name} block")
    q = cfg.quant
    if src.format == "fp8" and any(s % b for s, b in zip(q.weight_block_size, scheme.block[::-1])):
        raise KimiInputError(f"config.json: field quantization_config.weight_block_size={list(q.weight_block_size)}"
                             f" is not a multiple of the {list(scheme.block)} {scheme.name} block")


def build(src: WeightSource, scheme: ExpertScheme) -> list[Unit]:
    cfg = src.cfg
    expected = layout.logical_shapes(cfg)
    check_accounting(src, expected)
    check_dims(cfg, scheme, src)
    # (plain names, MoE layer or None, routed-expert names) per output file
    groups: list[tuple[list[str], int | None, list[str]]] = [
        ([n for n in expected if n.startswith(_TOP_FIRST)], None, [])]
    for layer in range(cfg.num_hidden_layers):
        p = layout.layer_prefix(layer)
        names = [n for n in expected if n.startswith(p)]
        experts = [n for n in names if is_routed_expert(n)]
        groups.append(([n for n in names if not is_routed_expert(n)], layer if experts else None, experts))
    groups.append(([n for n in expected if n.startswith(_TOP_LAST)], None, []))
    total = len(groups)
    units = []
    for k, (plain, layer, experts) in enumerate(groups):
        u = Unit(k, f"model-{k + 1:05d}-of-{total:05d}.safetensors", sorted(plain), layer)
        u.entries = _entries(u, cfg, scheme, expected)
        u.src_bytes = sum(src.ckpt.info(r).nbytes for n in plain + experts for r in src.weights[n].raw)
        units.append(u)
    return units


def _entries(u: Unit, cfg: KimiK2Config, scheme: ExpertScheme, expected) -> list:
    plain = [(n, converted_dtype(n), expected[n]) for n in u.plain]
    first = sorted(e for e in plain if e[1] == F32)
    last = sorted(e for e in plain if e[1] == BF16)
    if u.moe_layer is None:
        return first + last
    return layout.expert_tensors(cfg, u.moe_layer, scheme) + first + last
