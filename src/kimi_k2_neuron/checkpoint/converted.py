"""A converted checkpoint seen under the HF names, so the CPU runner loads it as an HF one: per-expert weights are
virtual float32 tensors dequantized on demand from one expert's slice (never the whole [E, ...] tensor).
"""

from __future__ import annotations

import torch

from ..config import KimiK2Config
from ..errors import KimiInputError
from ..formats.layout import down_key, expert_name, gate_up_key, scale_key
from ..formats.record import ConversionRecord
from ..quant import check_finite
from ..quant.nxd_fp8 import dequantize_nxd
from .shards import ShardedCheckpoint, TensorInfo


class ConvertedView:
    def __init__(self, ckpt: ShardedCheckpoint, cfg: KimiK2Config):
        self._ckpt = ckpt
        self._virtual: dict[str, tuple] = {}  # logical name -> (real weight key, expert, proj)
        hidden = set()
        for layer in range(cfg.num_hidden_layers):
            if gate_up_key(layer) in ckpt:
                hidden |= self._add_layer(layer)
        self._keyset = (set(ckpt.keys()) - hidden) | set(self._virtual)

    def _add_layer(self, layer: int) -> set[str]:
        gu, dn = gate_up_key(layer), down_key(layer)
        for key in (gu, dn, scale_key(gu), scale_key(dn)):
            if key not in self._ckpt:
                raise KimiInputError(f"{self._ckpt.model_dir}: converted layer {layer} lacks tensor {key}")
        n_experts = self._ckpt.info(gu).shape[0]
        for e in range(n_experts):
            for proj, key in (("gate_proj", gu), ("up_proj", gu), ("down_proj", dn)):
                self._virtual[expert_name(layer, e, proj)] = (key, e, proj)
        return {gu, dn, scale_key(gu), scale_key(dn)}

    # -- the ShardedCheckpoint surface WeightSource and load_weights use ---------------------------------------
    def keys(self) -> list[str]:
        return sorted(self._keyset)

    def __contains__(self, name: object) -> bool:
        return name in self._keyset

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self._ckpt.info(name)
        key, _, proj = self._virtual[name]
        e, a, b = self._ckpt.info(key).shape  # [E, in, out]; gate_up's out holds gate then up
        shape = (b, a) if proj == "down_proj" else (b // 2, a)
        return TensorInfo(name, self._ckpt.info(key).shard, torch.float32, shape, 4 * shape[0] * shape[1])

    def get(self, name: str) -> torch.Tensor:
        if name not in self._virtual:
            return self._ckpt.get(name)
        key, e, proj = self._virtual[name]
        codes, scale = self._slice(key, e), self._slice(scale_key(key), e)  # [in, out]
        check_finite(codes, f"{self._ckpt.info(key).shard}: tensor {key} (expert {e})")
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


def open_checkpoint(model_dir, cfg: KimiK2Config):
    """The checkpoint in model_dir: a ConvertedView when it is a converted one, else its ShardedCheckpoint."""
    ckpt = ShardedCheckpoint(model_dir)
    return ckpt if ConversionRecord.of(cfg) is None else ConvertedView(ckpt, cfg)
