"""The converted (Neuron-ready) checkpoint layout: key names, expert FP8 schemes, and a reader for the CPU runner.

Key scheme (every name keeps the HF `model.` prefix, which NxDI's `get_state_dict` strips before loading:
nxdi/models/application_base.py:69,708-711):

- unchanged HF names, bf16 (FP8/INT4 sources dequantized): embeddings, all norms, all of `self_attn.*`, the
  dense layers' `mlp.{gate,up,down}_proj`, `mlp.shared_experts.*`, `lm_head`;
- router weight (HF `mlp.gate.weight`): `model.layers.L.mlp.router.linear_router.weight`, fp32 [E, H];
- router bias (HF `mlp.gate.e_score_correction_bias`): `model.layers.L.mlp.router.e_score_correction_bias`,
  fp32 [E];
- routed experts: `model.layers.L.mlp.expert_mlps.mlp_op.gate_up_proj.weight`, float8_e4m3fn [E, H, 2I] (gate
  columns, then up), and `model.layers.L.mlp.expert_mlps.mlp_op.down_proj.weight`, float8_e4m3fn [E, I, H];
  each with a fp32 `.scale` next to it (same prefix, `scale` instead of `weight`), shaped per scheme below.

Where the names come from (neuronx-distributed Release 2.29, fbac349): the MoE module holds `router`,
`expert_mlps`, `shared_experts` (nxd/modules/moe/model.py:115-117); `ExpertMLPsV2.mlp_op`
(expert_mlps_v2.py:136); `Experts.gate_up_proj` [E, in, out] with stride 2 and `down_proj` (experts.py:94-145);
the router's `linear_router` (routing.py:73). A quantized expert layer reads `prefix + "weight"` and
`prefix + "scale"` (quantization_layers.py:375,439). The router bias is the parameter NxDI's DeepSeek-V3 contrib
registers on its GroupLimitedRouter subclass (contrib/models/DeepSeek-V3/src/modeling_deepseek.py:160-166,240);
a Kimi NxDI shell must register it the same way, keep it (and the router weight) fp32 -- NxDI's `_cast_helper`
casts every float that is not FP8 and not named `*scale` to the model dtype (application_base.py:645-658) --
and apply it after the sigmoid, for selection only.

Expert schemes (what `kimi_k2_neuron_conversion.nxd` in config.json records, i.e. the NeuronConfig to use):

* `fp8-blockwise`: quantization_type `blockwise_symmetric`, quantization_dtype `f8e4m3`, block axis [1, 2]
  (in, out) of the [E, in, out] weights, block size [32, 32] from FP8/BF16 sources and [group, 1] = [32, 1] from
  INT4 sources, scale dtype f32. Full scale shape [E, in/b_in, out/b_out].
  Why these block sizes: NxD sizes the scale from the *per-rank* weight, `local // block`, and a local dim
  smaller than the block collapses to 1 (quantization_layers.py:271-299); the sharder then slices the full
  checkpoint tensor into `dim // tp` pieces, stride 2 for gate_up (trace.py:678-686, 796-825) and checks the
  result against that local shape. A block that divides every rank's slice therefore makes the full-resolution
  grid shard correctly for every TP that divides `I / b`, with no TP baked into the file: 32 divides Kimi's
  per-rank expert width 2048/64 = 32 at TP 64, so one converted checkpoint serves TP 1..64. (A [128, 128]
  grid, the source's own, would collapse to one scale per rank at TP 64 and mix gate and up blocks, the bug
  nxdi_contracts.md §5.3 describes.) Blocks never straddle the gate/up boundary because I % b_out == 0.
  NxD dequantizes blockwise weights by broadcasting, inferring each axis's block from weight/scale shapes
  (dequantize.py:43-122), and the MoE kernels dequantize blockwise scales before the matmul
  (modules/moe/blockwise.py:955-967), so any such grid runs.
  INT4 codes -8..7 are exact in e4m3 and the INT4 group scale becomes the block scale, so INT4 -> blockwise
  [32, 1] is lossless (at 4 B of scale per 32 weights, +12.5 % memory against +0.4 % for [32, 32]).
* `fp8-per-channel`: quantization_type `expert_wise_per_channel_symmetric`, per-channel axis 2 (the only one
  expert layers accept, quantization_layers.py:1046-1052), scale [E, 1, out] (l.244-266); the gate_up scale is
  sharded on dim 2 with the weight's stride 2, the down scale is replicated. TP-independent by construction.

Every stored FP8 value lies within +-240 (Neuron's e4m3 maximum: the compiler reinterprets OCP e4m3fn bytes
with exponent 15 as inf/NaN; NxD maps float8_e4m3fn to +-240, quantization_config.py:20-53).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KimiInputError
from ..checkpoint.shards import TensorInfo
from . import SCHEMES

CONVERSION_KEY = "kimi_k2_neuron_conversion"
LAYOUT_VERSION = 1
FP8_MAX = 240.0  # Neuron e4m3
FP8_MAX_BYTE = 0x77  # |code| <= 240 <=> (byte & 0x7F) <= 0x77 for e4m3fn (0x7F is NaN)
NXD_TYPE = {"fp8-blockwise": "blockwise_symmetric", "fp8-per-channel": "expert_wise_per_channel_symmetric"}
FINE_BLOCK = 32  # see the module docstring: the largest block that divides Kimi's expert width at TP 64

_EXPERTS = "mlp.expert_mlps.mlp_op."


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def gate_up_key(layer: int) -> str:
    return f"{layer_prefix(layer)}{_EXPERTS}gate_up_proj.weight"


def down_key(layer: int) -> str:
    return f"{layer_prefix(layer)}{_EXPERTS}down_proj.weight"


def scale_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "scale"


def router_keys(layer: int) -> dict[str, str]:
    """HF (logical) router name -> converted name."""
    p = layer_prefix(layer)
    return {p + "mlp.gate.weight": p + "mlp.router.linear_router.weight",
            p + "mlp.gate.e_score_correction_bias": p + "mlp.router.e_score_correction_bias"}


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"{layer_prefix(layer)}mlp.experts.{expert}.{proj}.weight"


@dataclass(frozen=True)
class ExpertScheme:
    """One NxD expert quantization: the scale layout of [E, in, out] FP8 weights."""

    name: str
    block: tuple[int, int] | None  # (in, out) block for blockwise; None = expert-wise per output channel

    def scale_shape(self, n_experts: int, in_f: int, out_f: int) -> tuple[int, int, int]:
        if self.block is None:
            return (n_experts, 1, out_f)
        return (n_experts, in_f // self.block[0], out_f // self.block[1])

    def nxd(self, moe_intermediate: int) -> dict:
        """The NeuronConfig quantization fields this layout loads under, and the MoE TP degrees it is valid for."""
        out = {"quantized": True, "quantization_dtype": "f8e4m3", "quantization_type": NXD_TYPE[self.name]}
        if self.block is None:
            out["quantization_per_channel_axis"] = 2
            tps = _divisors(moe_intermediate)
        else:
            out.update(quantization_block_axis=[1, 2], quantization_block_size=list(self.block),
                       quantization_scale_dtype="f32")
            # gate_up shards its out axis (block b_out) with stride 2, down its in axis (block b_in): every rank's
            # slice of either must hold whole blocks.
            tps = [t for t in _divisors(moe_intermediate)
                   if (moe_intermediate // t) % self.block[0] == 0 and (moe_intermediate // t) % self.block[1] == 0]
        out["valid_moe_tp_degrees"] = tps
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def scheme_for(name: str, source_format: str, group_size: int | None = None) -> ExpertScheme:
    if name not in SCHEMES:
        raise KimiInputError(f"--experts {name!r}: expected one of {', '.join(SCHEMES)}")
    if name == "fp8-per-channel":
        return ExpertScheme(name, None)
    if source_format == "int4":
        return ExpertScheme(name, (int(group_size), 1))  # one scale per INT4 group: lossless
    return ExpertScheme(name, (FINE_BLOCK, FINE_BLOCK))


# ----------------------------------------------------------------------------------- dequantizing the layout


def dequantize_nxd(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's FP8 [in, out] codes and its scale ([in/b_in, out/b_out], or [1, out]) -> float32 [in, out].

    Blocks are inferred from the shapes, as NxD's blockwise dequantize does."""
    if not torch.isfinite(scale).all():
        raise KimiInputError("converted expert scale contains NaN or inf")
    x = codes.to(torch.float32)
    (a, b), (sa, sb) = x.shape, scale.shape
    if a % sa or b % sb:
        raise KimiInputError(f"converted expert scale {list(scale.shape)} does not tile weight {list(x.shape)}")
    return x.view(sa, a // sa, sb, b // sb).mul_(scale[:, None, :, None]).view(a, b)


class ConvertedView:
    """A ShardedCheckpoint look-alike over a converted checkpoint that shows the logical HF names.

    WeightSource groups whatever keys this exposes, so the CPU runner loads a converted checkpoint exactly like an
    HF one: per-expert `...experts.E.{gate,up,down}_proj.weight` are virtual float32 tensors, dequantized on demand
    from one expert's slice of the fused tensors (read with safetensors' slicing, not the whole [E, ...] tensor),
    and the router keys are shown under their HF names. Everything else is passed through.
    """

    def __init__(self, ckpt, cfg, record: dict):
        self._ckpt, self.record = ckpt, record
        self._virtual: dict[str, tuple] = {}  # logical name -> (real weight key, expert, proj)
        self._renamed: dict[str, str] = {}  # logical router name -> real key
        hidden = set()
        for layer in range(cfg.num_hidden_layers):
            if gate_up_key(layer) in ckpt:
                hidden |= self._add_layer(layer)
        self._keyset = (set(ckpt.keys()) - hidden) | set(self._virtual) | set(self._renamed)

    def _add_layer(self, layer: int) -> set[str]:
        gu, dn = gate_up_key(layer), down_key(layer)
        for key in (gu, dn, scale_key(gu), scale_key(dn)):
            if key not in self._ckpt:
                raise KimiInputError(f"{self._ckpt.model_dir}: converted layer {layer} lacks tensor {key}")
        n_experts = self._ckpt.info(gu).shape[0]
        for e in range(n_experts):
            for proj, key in (("gate_proj", gu), ("up_proj", gu), ("down_proj", dn)):
                self._virtual[expert_name(layer, e, proj)] = (key, e, proj)
        hidden = {gu, dn, scale_key(gu), scale_key(dn)}
        for logical, real in router_keys(layer).items():
            if real in self._ckpt:
                self._renamed[logical] = real
                hidden.add(real)
        return hidden

    # -- the ShardedCheckpoint surface WeightSource and load_weights use ---------------------------------------
    def keys(self) -> list[str]:
        return sorted(self._keyset)

    def __contains__(self, name: object) -> bool:
        return name in self._keyset

    def info(self, name: str) -> TensorInfo:
        if name in self._renamed:
            real = self._ckpt.info(self._renamed[name])
            return TensorInfo(name, real.shard, real.dtype, real.shape, real.nbytes)
        if name not in self._virtual:
            return self._ckpt.info(name)
        key, _, proj = self._virtual[name]
        e, a, b = self._ckpt.info(key).shape  # [E, in, out]; gate_up's out holds gate then up
        shape = (b, a) if proj == "down_proj" else (b // 2, a)
        return TensorInfo(name, self._ckpt.info(key).shard, torch.float32, shape, 4 * shape[0] * shape[1])

    def get(self, name: str) -> torch.Tensor:
        if name in self._renamed:
            return self._ckpt.get(self._renamed[name])
        if name not in self._virtual:
            return self._ckpt.get(name)
        key, e, proj = self._virtual[name]
        codes, scale = self._slice(key, e), self._slice(scale_key(key), e)  # [in, out]
        if proj != "down_proj":  # only gate's or up's half: no scale block straddles the two (I % b_out == 0)
            half = 0 if proj == "gate_proj" else 1
            codes, scale = codes.chunk(2, dim=1)[half], scale.chunk(2, dim=1)[half]
        return dequantize_nxd(codes, scale).t().contiguous()  # HF [out, in]

    def _slice(self, key: str, e: int) -> torch.Tensor:
        return self._ckpt.get_slice(key)[e: e + 1][0]

    def close(self) -> None:
        self._ckpt.close()

    def __getattr__(self, attr):  # model_dir, shard_names, total_bytes, ... of the underlying checkpoint
        return getattr(self._ckpt, attr)


def read_record(model_dir: str | Path) -> dict | None:
    """The `kimi_k2_neuron_conversion` object of a converted checkpoint's config.json, or None."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # KimiK2Config.from_file reports unreadable configs
    rec = raw.get(CONVERSION_KEY) if isinstance(raw, dict) else None
    if rec is None:
        return None
    if not isinstance(rec, dict) or rec.get("layout_version") != LAYOUT_VERSION or rec.get("experts") not in SCHEMES:
        raise KimiInputError(f"{path}: field {CONVERSION_KEY} is not a layout-version {LAYOUT_VERSION} record with "
                             f"experts in {list(SCHEMES)}")
    return rec


def maybe_converted_view(model_dir, cfg, ckpt):
    """Wrap `ckpt` in a ConvertedView when model_dir holds a converted checkpoint; return it unchanged otherwise."""
    rec = read_record(model_dir)
    return ckpt if rec is None else ConvertedView(ckpt, cfg, rec)


