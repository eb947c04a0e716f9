"""Logical weights of a Kimi-K2 checkpoint, whatever format it stores them in (plain `X.weight`, blockwise FP8 with
`X.weight_scale_inv`, INT4 `X.weight_packed/_scale/_shape`), handed out dense one at a time so a caller holds no more
than the weight it loads. Raw keys that are no weights (rotary buffers, MTP layers, K2.5's vision tower) are set aside
by name in `ignored`; anything else that forms no complete weight is an error. Converted checkpoints are read through
converted.py's ConvertedView under the same names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import KimiK2Config
from ..errors import KimiInputError
from ..formats.layout import is_ignored
from ..quant import check_finite, check_plain
from ..quant.fp8 import dequantize_blockwise
from ..quant.int4 import dequantize_group
from .converted import open_checkpoint

FP8_SCALE = "_scale_inv"  # X.weight_scale_inv
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
_K25_PREFIX = "language_model."  # Kimi-K2.5 nests the language model under this prefix
# ... next to its vision tower and projector, which this port does not serve (text in, text out): set aside by name.
_K25_MULTIMODAL = ("vision_tower.", "mm_projector.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LogicalWeight:
    name: str  # e.g. model.layers.3.mlp.experts.7.up_proj.weight
    kind: str  # "plain" | "fp8" | "int4"
    raw: tuple[str, ...]  # the checkpoint keys it is made of


class WeightSource:
    def __init__(self, model_dir: str | Path, cfg: KimiK2Config | None = None):
        self.dir = Path(model_dir)
        self.cfg = cfg or KimiK2Config.from_file(self.dir)
        self.ckpt = open_checkpoint(self.dir, self.cfg)
        self.ignored: list[str] = []
        self.weights: dict[str, LogicalWeight] = {}
        self._group(self.ckpt.keys())
        self._check_format()

    @property
    def format(self) -> str:
        """The storage format of the experts: fp8, int4 or bf16 (config.json's, checked against the tensors)."""
        return self.cfg.storage_format

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.weights if n.startswith(prefix)]

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The dense logical weight `name` in `dtype` (dequantized in float32 first when stored quantized), checked
        finite: a NaN or inf weight, or a NaN FP8 code, is a one-line error naming the tensor and its file."""
        w = self.weights[name]
        what = f"{self._where(w.raw[0])}: tensor {w.raw[0]}"
        base = self.described(name)
        if w.kind == "fp8":
            q, s = (self.ckpt.get(k) for k in w.raw)
            t = dequantize_blockwise(q, s, self.cfg.quant.weight_block_size, out_dtype=dtype, name=base)
        elif w.kind == "int4":
            packed, scale, shape = (self.ckpt.get(k) for k in w.raw)
            t = dequantize_group(packed, scale, shape, self.cfg.quant.group_size, out_dtype=dtype, name=base)
        else:
            t = self.ckpt.get(w.raw[0])
            check_plain(t, what)
            t = t.to(dtype)
        check_finite(t, what)  # after any cast or scaling: a finite code times a finite scale can still overflow
        return t

    def described(self, name: str) -> str:
        """How error messages name quantized weight `name`'s parts: '<shard>: tensor <name minus .weight>', to which
        the quant functions append '.weight_scale_inv' etc."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        return f"{self._where(self.weights[name].raw[0])}: tensor {base}"

    def close(self):
        self.ckpt.close()

    # -- grouping raw keys into logical weights -------------------------------------------------------------
    def _group(self, raw_keys: list[str]) -> None:
        strip = any(k.startswith(_K25_PREFIX) for k in raw_keys)
        parts: dict[str, dict[str, str]] = {}
        for raw in raw_keys:
            key = raw[len(_K25_PREFIX):] if strip and raw.startswith(_K25_PREFIX) else raw
            if self._is_ignored(key) or (strip and raw.startswith(_K25_MULTIMODAL)):
                self.ignored.append(raw)
                continue
            base, part = key.rsplit(".", 1) if "." in key else ("", key)
            parts.setdefault(base, {})[part] = raw
        for base, p in parts.items():
            self._add_logical(base, p)

    def _is_ignored(self, key: str) -> bool:
        if is_ignored(key):
            return True
        m = _LAYER.match(key)
        if m is None:
            return False
        idx, n = int(m.group(1)), self.cfg.num_hidden_layers
        return n <= idx < n + self.cfg.num_nextn_predict_layers  # DeepSeek-V3 MTP layers: not used for decoding

    def _add_logical(self, base: str, p: dict[str, str]) -> None:
        def add(name, kind, raw):
            self.weights[name] = LogicalWeight(name, kind, tuple(raw))

        if any(k in p for k in INT4_PARTS):
            missing = [k for k in INT4_PARTS if k not in p]
            if missing:
                raise KimiInputError(f"{self._where(next(iter(p.values())))}: INT4 weight {base} lacks "
                                     f"{', '.join(base + '.' + m for m in missing)}")
            add(f"{base}.weight", "int4", [p.pop(k) for k in INT4_PARTS])
        if "weight" + FP8_SCALE in p:
            if "weight" not in p:
                raise KimiInputError(f"{self._where(p['weight' + FP8_SCALE])}: {base}.weight_scale_inv has no "
                                     f"{base}.weight")
            add(f"{base}.weight", "fp8", [p.pop("weight"), p.pop("weight" + FP8_SCALE)])
        for part, raw in p.items():
            name = f"{base}.{part}" if base else part
            if self.ckpt.info(raw).dtype == torch.float8_e4m3fn:
                raise KimiInputError(f"{self._where(raw)}: FP8 tensor {raw} has no {raw}{FP8_SCALE}")
            add(name, "plain", [raw])

    def _check_format(self) -> None:
        kinds = {w.kind for w in self.weights.values()}
        q, fmt = self.cfg.quant, self.cfg.storage_format
        expected = "plain" if fmt == "bf16" else fmt
        for kind in kinds - {"plain", expected}:
            example = next(w for w in self.weights.values() if w.kind == kind)
            said = f"quant_method {q.method!r}" if q else "no quantization_config"
            raise KimiInputError(f"{self.dir / 'config.json'}: {said}, but tensor {example.raw[0]} is "
                                 f"{kind.upper()}-quantized")

    def _where(self, raw: str) -> str:
        return self.ckpt.info(raw).shard if raw in self.ckpt else str(self.dir)
