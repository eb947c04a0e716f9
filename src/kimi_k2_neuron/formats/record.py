"""The conversion record: config.json's `kimi_k2_neuron_conversion` object, the one place the scale block is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import KimiK2Config
from ..errors import KimiInputError
from . import DEFAULT_SCHEME, SCHEMES
from .layout import key_templates
from .scheme import ExpertScheme, converted_scheme

CONVERSION_KEY = "kimi_k2_neuron_conversion"
# 2: the router under its HF names (1 wrote NxD's older `mlp.router.linear_router.` ones); convert again.
LAYOUT_VERSION = 2


@dataclass(frozen=True)
class ConversionRecord:
    scheme: ExpertScheme  # the experts' scheme and scale block
    nxd: dict  # the NeuronConfig quantization fields it loads under, and the expert TP degrees its scales shard for
    source_format: str | None = None  # fp8, int4 or bf16 (None in a hand-made record)
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the whole object (stats, tool, ...)

    @property
    def experts(self) -> str:
        return self.scheme.name

    @classmethod
    def from_json(cls, rec, where: str) -> ConversionRecord:
        if (not isinstance(rec, dict) or rec.get("layout_version") != LAYOUT_VERSION
                or rec.get("experts") not in SCHEMES or not isinstance(rec.get("nxd"), dict)):
            raise KimiInputError(f"{where}: field {CONVERSION_KEY} is not a layout-version {LAYOUT_VERSION} record "
                                 f"with experts in {list(SCHEMES)}")
        scheme = ExpertScheme.from_nxd(rec["nxd"])
        if not scheme.quantized or scheme.name != rec["experts"]:
            raise KimiInputError(f"{where}: field {CONVERSION_KEY}.nxd does not describe experts={rec['experts']}")
        return cls(scheme, rec["nxd"], rec.get("source_format"), rec)

    @classmethod
    def of(cls, cfg: KimiK2Config) -> ConversionRecord | None:
        """The record in the config.json `cfg` was read from; None for a raw checkpoint's."""
        rec = cfg.raw.get(CONVERSION_KEY)
        return None if rec is None else cls.from_json(rec, cfg.source)

    @classmethod
    def read(cls, model_dir: str | Path) -> ConversionRecord | None:
        """The record of the converted checkpoint in `model_dir`; None for any other folder (KimiK2Config.from_file
        reports a missing or unreadable config.json)."""
        return cls.read_config(Path(model_dir) / "config.json")

    @classmethod
    def read_config(cls, path: str | Path) -> ConversionRecord | None:
        """The record in config.json file `path`; None when it holds none or cannot be read."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        rec = raw.get(CONVERSION_KEY) if isinstance(raw, dict) else None
        return None if rec is None else cls.from_json(rec, str(path))


def record_json(scheme: ExpertScheme, source_format: str, moe_intermediate: int, source_quantization_config,
                stats: dict, ignored_source_tensors: int) -> dict:
    """The record the converter writes (the NxD settings derived from the scheme), in its fixed field order."""
    from .. import __version__
    from ..quant.nxd_fp8 import FP8_MAX

    return {
        "layout_version": LAYOUT_VERSION, "tool": "kimi-k2-neuron convert", "tool_version": __version__,
        "source_format": source_format, "source_quantization_config": source_quantization_config,
        "experts": scheme.name, "nxd": scheme.nxd(moe_intermediate),
        "fp8_max": FP8_MAX, "non_expert_dtype": "bfloat16", "router_dtype": "float32",
        "keys": key_templates(), "stats": stats,
        # Source tensors set aside by name (rotary inv_freq, MTP layers, K2.5's vision tower and projector).
        "ignored_source_tensors": ignored_source_tensors,
    }


def experts_for(record: ConversionRecord | None, experts: str | None) -> str:
    """What a converted checkpoint holds (another value is refused, as the shell would), else given, else default."""
    held = record.experts if record else None
    if experts is None:
        return held or DEFAULT_SCHEME
    if held is not None and experts != held:
        raise KimiInputError(f"--experts {experts}: the converted checkpoint holds {held} experts; pass "
                             f"--experts {held} or leave it out")
    return experts


def expert_scheme(cfg: KimiK2Config, record: ConversionRecord | None, experts: str | None) -> ExpertScheme:
    """The experts' scheme on device: experts_for's, as convert would write it ("bf16": planned, never written)."""
    name = experts_for(record, experts)
    return record.scheme if record is not None else converted_scheme(cfg, name)
