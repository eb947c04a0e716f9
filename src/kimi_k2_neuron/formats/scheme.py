"""One FP8 expert quantization of the converted checkpoint: the scale layout of the fused [E, in, out] expert
weights and the NeuronConfig settings it loads under (neuron/NXDI_CONTRACT.md: scale-grid, expert-per-channel-axis).
Blockwise uses [32, 32] blocks ([32, 1] from INT4: lossless) because NxD sizes scales from each rank's local slice and
32 divides Kimi's per-rank expert width at TP 64 (docs/converter.md). Per-channel uses axis 2, the only one expert
layers accept. bf16 experts are planned and configured, never written (they do not fit at TP=64)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..config import KimiK2Config
from ..errors import KimiInputError
from . import SCHEMES

NXD_TYPE = {"fp8-blockwise": "blockwise_symmetric", "fp8-per-channel": "expert_wise_per_channel_symmetric"}
NXD_DTYPE = "f8e4m3"
FINE_BLOCK = 32  # the largest block that divides Kimi's expert width at TP 64 (module docstring)


@dataclass(frozen=True)
class ExpertScheme:
    """How the routed experts are stored on device: an NxD FP8 scale layout, or unquantized bf16."""

    name: str  # one of formats.EXPERT_FORMATS
    block: tuple[int, int] | None  # (in, out) block for blockwise; None otherwise

    @property
    def quantized(self) -> bool:
        return self.name != "bf16"

    def scale_shape(self, n_experts: int, in_f: int, out_f: int) -> tuple[int, int, int]:
        if not self.quantized:
            raise ValueError("bf16 experts have no scales")
        if self.block is None:
            return (n_experts, 1, out_f)
        return (n_experts, in_f // self.block[0], out_f // self.block[1])

    def nxd(self, moe_intermediate: int) -> dict:
        """The NeuronConfig quantization fields, and the MoE TP degrees whose slices hold whole blocks."""
        if not self.quantized:
            return {"quantized": False, "valid_moe_tp_degrees": _divisors(moe_intermediate)}
        out = {"quantized": True, "quantization_dtype": NXD_DTYPE, "quantization_type": NXD_TYPE[self.name]}
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

    @classmethod
    def from_nxd(cls, fields: Mapping) -> ExpertScheme:
        """From a record's `nxd` or a NeuronConfig's attributes."""
        if not fields.get("quantized"):
            return BF16_EXPERTS
        qtype = fields.get("quantization_type")
        name = next((n for n, t in NXD_TYPE.items() if t == qtype), None)
        if name is None:
            raise KimiInputError(f"quantization_type {qtype!r} is not one Kimi-K2 supports: "
                                 f"{', '.join(NXD_TYPE.values())}")
        if name == "fp8-per-channel":
            return cls(name, None)
        block = fields.get("quantization_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise KimiInputError(f"quantization_block_size {block!r}: expected [in, out], two integers >= 1, "
                                 f"for {qtype}")
        return cls(name, tuple(block))


BF16_EXPERTS = ExpertScheme("bf16", None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def scheme_for(name: str, source_format: str, group_size: int | None = None) -> ExpertScheme:
    """The scheme `kimi-k2-neuron convert --experts NAME` writes from a source of `source_format`."""
    if name == "bf16":
        return BF16_EXPERTS
    if name not in SCHEMES:
        raise KimiInputError(f"--experts {name!r}: expected one of {', '.join(SCHEMES)}")
    if name == "fp8-per-channel":
        return ExpertScheme(name, None)
    if source_format == "int4":
        return ExpertScheme(name, (int(group_size), 1))  # one scale per INT4 group: lossless
    return ExpertScheme(name, (FINE_BLOCK, FINE_BLOCK))


def converted_scheme(cfg: KimiK2Config, experts: str) -> ExpertScheme:
    """The expert scheme `kimi-k2-neuron convert --experts EXPERTS` writes from this (raw) checkpoint."""
    return scheme_for(experts, cfg.storage_format, cfg.quant.group_size if cfg.quant else None)
