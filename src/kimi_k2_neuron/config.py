"""Kimi-K2 model configuration, parsed directly from a checkpoint's config.json.

We never execute checkpoint code to read a config: Kimi ships `model_type: kimi_k2` with an `auto_map` to its own
`configuration_deepseek.py`, but every field we need is plain JSON. Every dimension comes from the file; a missing
or out-of-range field is an error naming the field, never a silent DeepSeek-V3 default (those differ for Kimi:
first_k_dense_replace, n_group, routed_scaling_factor, heads, YaRN factor and beta_fast all do).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import KimiInputError, MissingConfig, broken_link, special_file

# owner/name, as the Hub spells model ids (a relative path of two parts looks the same, hence "looks like")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
# Every key a DeepSeek-V3 / Kimi-K2 `rope_scaling` may hold (the real configs in test/data/configs use all of them).
# transformers' YaRN also knows attention_factor, truncate and partial_rotary_factor, which this port does not
# implement: they are refused like a misspelled key, since ignoring any key silently changes the model.
YARN_KEYS = ("type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-style YaRN parameters (`rope_scaling` with type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class QuantConfig:
    """What the checkpoint's quantization_config says, reduced to what the loader needs."""

    method: str  # "fp8" (blockwise e4m3fn + weight_scale_inv) or "compressed-tensors" (INT4 pack-quantized)
    weight_block_size: tuple[int, int] | None = None  # fp8
    group_size: int | None = None  # compressed-tensors
    num_bits: int | None = None  # compressed-tensors
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def format(self) -> str:
        """The storage format this method names: "fp8" (blockwise FP8) or "int4" (compressed-tensors INT4)."""
        return {"fp8": "fp8", "compressed-tensors": "int4"}[self.method]


@dataclass(frozen=True)
class KimiK2Config:
    hidden_size: int
    intermediate_size: int  # dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int  # DeepSeek-V3's MTP layers (0 for Kimi-K2); their tensors are skipped by name
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: YarnScaling | None
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    model_type: str
    quant: QuantConfig | None
    source: str = field(default="<dict>", compare=False)
    # config.json's object as read, for what the typed fields leave out (NxDI's config attributes, the conversion
    # record), so that nothing reads the file twice.
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # Derived sizes used throughout the model.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA cache entry: the compressed KV plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def storage_format(self) -> str:
        """How the checkpoint stores its quantized weights: "fp8", "int4" or, without a quantization_config, "bf16"."""
        return "bf16" if self.quant is None else self.quant.format

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @classmethod
    def from_file(cls, path: str | Path) -> "KimiK2Config":
        raw_path, path = path, Path(path)
        for p in (path.parent, path, path / "config.json"):
            broken = broken_link(p)
            if broken:
                raise KimiInputError(f"{p}: {broken}; expected a checkpoint folder or its config.json")
        folder = path.parent if path.name == "config.json" else path
        if not folder.exists():
            # owner/name, not written as a path (./, /, ~) and whose owner is no folder here: a Hub id
            if (HUB_ID.fullmatch(str(folder)) and not str(raw_path).startswith(("./", "../", "/", "~"))
                    and not folder.parent.exists()):
                raise KimiInputError(f"{folder}: no such folder; it looks like a Hugging Face model id, which is not "
                                     f"downloaded here: download it first (`hf download {folder} --local-dir DIR`) "
                                     f"and give the folder DIR")
            if path.suffix != ".json" or path.name == "config.json":
                raise KimiInputError(f"{folder}: config.json not found (no such folder)")
        if path.is_dir():
            path = path / "config.json"
        node = special_file(path)
        if node or (path.exists() and not path.is_file()):
            raise KimiInputError(f"{path}: is {node or 'a folder'}; expected a config.json file or the checkpoint "
                                 f"folder holding one")
        if not path.is_file():
            # a folder's config.json, or a missing folder; else a file named directly (plan --config)
            what = "not found (expected a config.json)" if path.suffix == ".json" and path.name != "config.json" \
                else "config.json not found"
            raise MissingConfig(f"{path}: {what}", folder=path.parent if path.name == "config.json" else None)
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KimiInputError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> "KimiK2Config":
        if not isinstance(raw, dict):
            raise KimiInputError(f"{source}: expected a JSON object")
        fields = language_model_fields(raw, source)
        return dataclasses.replace(_parse(_Fields(fields, source), fields.get("quantization_config")), raw=raw)

    def to_dict(self) -> dict[str, Any]:
        """HF-style dict (what make-tiny writes as config.json)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("rope_scaling", "quant", "source", "eos_token_ids", "raw"):
                continue
            out[f.name] = getattr(self, f.name)
        out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **self.rope_scaling.__dict__}
        if self.quant is not None:
            out["quantization_config"] = self.quant.raw
        out["num_key_value_heads"] = self.num_attention_heads
        out["topk_method"] = "noaux_tc"
        out["scoring_func"] = "sigmoid"
        out["hidden_act"] = "silu"
        out["attention_bias"] = False
        out["architectures"] = ["DeepseekV3ForCausalLM"]
        return out


def language_model_fields(raw: dict, source: str = "<dict>") -> dict:
    """config.json's language-model fields and its quantization_config. Kimi-K2.5 nests the language model's
    fields under text_config, and its quantization_config may sit there or on top; other checkpoints are flat."""
    if "text_config" not in raw:
        return raw
    text = raw["text_config"]
    if not isinstance(text, dict):
        raise KimiInputError(f"{source}: field text_config must be an object")
    quant = text.get("quantization_config", raw.get("quantization_config"))
    # none at all (a converted checkpoint's): no key, since a None quantization_config breaks transformers' to_dict
    return {**text, **({"quantization_config": quant} if quant is not None else {})}


def pop_quantization_config(raw: dict):
    """Take the quantization_config out of a config.json object (on top, and in K2.5's text_config) and return it
    (the one in text_config when both are there)."""
    quant = raw.pop("quantization_config", None)
    if isinstance(raw.get("text_config"), dict):
        quant = raw["text_config"].pop("quantization_config", quant)
    return quant


class _Fields:
    """Typed, range-checked access to config.json fields; every error names the field."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def _get(self, name, default=..., obj=None, prefix=""):
        obj = self.raw if obj is None else obj
        if name not in obj or obj[name] is None:
            if default is ...:
                raise KimiInputError(f"{self.source}: missing required field {prefix}{name}")
            return default
        return obj[name]

    def int(self, name, lo=1, default=..., obj=None, prefix=""):
        v = self._get(name, default, obj, prefix)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise KimiInputError(f"{self.source}: field {prefix}{name}={v!r}, expected an integer >= {lo}")
        return v

    def float(self, name, lo=0.0, strict=False, default=..., obj=None, prefix=""):
        v = self._get(name, default, obj, prefix)
        bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        if bad or v < lo or (strict and v == lo):
            op = ">" if strict else ">="
            raise KimiInputError(f"{self.source}: field {prefix}{name}={v!r}, expected a finite number {op} {lo}")
        return float(v)

    def bool(self, name, default=...):
        v = self._get(name, default)
        if not isinstance(v, bool):
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected true or false")
        return v

    def choice(self, name, allowed, default=...):
        v = self._get(name, default)
        if v not in allowed:
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected one of {list(allowed)}")
        return v


def _parse(f: _Fields, quant_raw) -> KimiK2Config:
    f.choice("model_type", SUPPORTED_MODEL_TYPES)
    # Kimi's MoE is defined by these three choices; anything else is a different model.
    f.choice("topk_method", ("noaux_tc",))
    f.choice("scoring_func", ("sigmoid",))
    f.choice("hidden_act", ("silu",), default="silu")
    if f.raw.get("attention_bias", False):
        raise KimiInputError(f"{f.source}: field attention_bias=true is not supported (Kimi-K2 has no biases)")
    cfg = KimiK2Config(
        hidden_size=f.int("hidden_size"),
        intermediate_size=f.int("intermediate_size"),
        moe_intermediate_size=f.int("moe_intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers"),
        num_attention_heads=f.int("num_attention_heads"),
        q_lora_rank=_parse_q_lora_rank(f),
        kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=f.int("qk_nope_head_dim"),
        qk_rope_head_dim=f.int("qk_rope_head_dim"),
        v_head_dim=f.int("v_head_dim"),
        n_routed_experts=f.int("n_routed_experts"),
        n_shared_experts=f.int("n_shared_experts", lo=0),
        num_experts_per_tok=f.int("num_experts_per_tok"),
        n_group=f.int("n_group"),
        topk_group=f.int("topk_group"),
        norm_topk_prob=f.bool("norm_topk_prob"),
        routed_scaling_factor=f.float("routed_scaling_factor", strict=True),
        first_k_dense_replace=f.int("first_k_dense_replace", lo=0),
        moe_layer_freq=f.int("moe_layer_freq", default=1),
        num_nextn_predict_layers=f.int("num_nextn_predict_layers", lo=0, default=0),
        vocab_size=f.int("vocab_size"),
        rms_norm_eps=f.float("rms_norm_eps", strict=True),
        rope_theta=f.float("rope_theta", lo=1.0, strict=True),
        max_position_embeddings=f.int("max_position_embeddings"),
        rope_scaling=_parse_rope_scaling(f),
        tie_word_embeddings=_parse_tie_word_embeddings(f),
        eos_token_ids=_parse_eos(f),
        bos_token_id=f.int("bos_token_id", lo=0, default=None),
        model_type=f.raw["model_type"],
        quant=_parse_quant(quant_raw, f.source),
        source=f.source,
    )
    _check_consistency(cfg, f.source)
    return cfg


def _parse_q_lora_rank(f: _Fields) -> int:
    if f.raw.get("q_lora_rank", 0) is None:  # DeepSeek-V2-Lite's: queries straight from the hidden state
        raise KimiInputError(f"{f.source}: field q_lora_rank is null: MLA without a query LoRA is not implemented "
                             f"(Kimi-K2 and DeepSeek-V3 have one); expected an integer >= 1")
    return f.int("q_lora_rank")


def _parse_tie_word_embeddings(f: _Fields) -> bool:
    """Kimi's and DeepSeek-V3's releases are untied: lm_head has its own weights. A tied config would read the
    embedding as the output projection, which this port does not do, so it is refused rather than ignored."""
    tied = f.bool("tie_word_embeddings", default=False)
    if tied:
        raise KimiInputError(f"{f.source}: field tie_word_embeddings=true is not supported (Kimi-K2's lm_head has "
                             f"its own weights; every Kimi release is untied); expected false")
    return tied


def _parse_rope_scaling(f: _Fields) -> YarnScaling | None:
    rs = f.raw.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise KimiInputError(f"{f.source}: field rope_scaling must be an object")
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise KimiInputError(f"{f.source}: field rope_scaling.type={kind!r}, expected 'yarn'")
    unknown = [k for k in rs if k not in YARN_KEYS]
    if unknown:
        raise KimiInputError(f"{f.source}: field rope_scaling.{unknown[0]} is not a YaRN key this port reads, "
                             f"expected only {', '.join(YARN_KEYS)}")
    p = "rope_scaling."
    ys = YarnScaling(
        factor=f.float("factor", lo=1.0, obj=rs, prefix=p),
        original_max_position_embeddings=f.int("original_max_position_embeddings", obj=rs, prefix=p),
        beta_fast=f.float("beta_fast", strict=True, default=32.0, obj=rs, prefix=p),
        beta_slow=f.float("beta_slow", strict=True, default=1.0, obj=rs, prefix=p),
        mscale=f.float("mscale", default=1.0, obj=rs, prefix=p),
        mscale_all_dim=f.float("mscale_all_dim", default=0.0, obj=rs, prefix=p),
    )
    if ys.beta_fast < ys.beta_slow:
        raise KimiInputError(
            f"{f.source}: field rope_scaling.beta_fast={ys.beta_fast} must be >= beta_slow={ys.beta_slow}"
        )
    return ys


def _parse_eos(f: _Fields) -> tuple[int, ...]:
    v = f.raw.get("eos_token_id")
    ids = v if isinstance(v, list) else [v]
    if v is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise KimiInputError(f"{f.source}: field eos_token_id={v!r}, expected a token id or a list of them")
    return tuple(ids)


def _parse_quant(q, source: str) -> QuantConfig | None:
    if q is None:
        return None
    if not isinstance(q, dict):
        raise KimiInputError(f"{source}: field quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise KimiInputError(
                f"{source}: field quantization_config.weight_block_size={block!r}, expected [rows, cols]"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise KimiInputError(f"{source}: field quantization_config.fmt={q.get('fmt')!r}, expected 'e4m3'")
        return QuantConfig("fp8", weight_block_size=(block[0], block[1]), raw=q)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q, source)
    raise KimiInputError(
        f"{source}: field quantization_config.quant_method={method!r}, expected 'fp8' or 'compressed-tensors'"
    )


def _parse_compressed_tensors(q: dict, source: str) -> QuantConfig:
    p = "quantization_config"
    if q.get("format") != "pack-quantized":
        raise KimiInputError(f"{source}: field {p}.format={q.get('format')!r}, expected 'pack-quantized'")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise KimiInputError(f"{source}: field {p}.config_groups must hold exactly one group")
    w = next(iter(groups.values())).get("weights") or {}
    expect = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for k, v in expect.items():
        if w.get(k) != v:
            raise KimiInputError(f"{source}: field {p}.config_groups.*.weights.{k}={w.get(k)!r}, expected {v!r}")
    gs = w.get("group_size")
    if not isinstance(gs, int) or gs <= 0:
        raise KimiInputError(f"{source}: field {p}.config_groups.*.weights.group_size={gs!r}, expected > 0")
    return QuantConfig("compressed-tensors", group_size=gs, num_bits=4, raw=q)


def _check_consistency(c: KimiK2Config, source: str) -> None:
    def bad(msg):
        raise KimiInputError(f"{source}: {msg}")

    if c.num_experts_per_tok > c.n_routed_experts:
        bad(f"field num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_routed_experts % c.n_group:
        bad(f"field n_routed_experts={c.n_routed_experts} is not divisible by n_group={c.n_group}")
    if c.topk_group > c.n_group:
        bad(f"field topk_group={c.topk_group} exceeds n_group={c.n_group}")
    if c.qk_rope_head_dim % 2:
        bad(f"field qk_rope_head_dim={c.qk_rope_head_dim} must be even (rotary pairs)")
    if c.first_k_dense_replace > c.num_hidden_layers:
        bad(f"field first_k_dense_replace={c.first_k_dense_replace} exceeds num_hidden_layers")
    for fname, ids in (("eos_token_id", c.eos_token_ids), ("bos_token_id", (c.bos_token_id,))):
        for i in ids:
            if i is not None and i >= c.vocab_size:
                bad(f"field {fname}={i} is outside the vocabulary, expected < vocab_size={c.vocab_size}")
    # The router needs 2 candidates per group to score groups (top-2 sum), as Kimi's modeling_deepseek.py does.
    if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
        bad(f"field n_group={c.n_group} leaves fewer than 2 experts per group")
