"""An EAGLE3 draft checkpoint in the public Llama EAGLE3 layout (TorchSpec's and SpecForge's LlamaForCausalLMEagle3:
config.json + safetensors), read and checked against the target it drafts for, before any work.

NxDI 2.29's only EAGLE3 draft is its Llama (NXDI_CONTRACT.md: llama-eagle3-draft): one decoder layer whose QKV takes
[embedding | hidden] (2H), an `fc` from the target's three captured hidden states (3H) to H, the target's
vocabulary (no draft-vocabulary map), the draft's hidden equal to the target's. Anything else (an MLA draft, an
EAGLE3.1 draft with fc_norm/norm_output, a pruned vocabulary) is refused here with one line. The public drafts name
the layer `midlayer.`, which NxDI's Llama does not load (it would silently keep a random layer): neuron_names gives
NxDI's `layers.0.` names. A draft without `embed_tokens` uses the target's (trained drafts freeze it). Pure: torch
and safetensors, no SDK.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Architectures of public Kimi drafts that NxDI 2.29 cannot load, and why (docs/speculative.md).
NOT_LOADABLE = {
    "Eagle3DeepseekV2ForCausalLM": "an MLA EAGLE3 draft; NxDI's only EAGLE3 draft class is Llama's (MHA)",
}
LAYER_NAMES = ("midlayer.", "layers.0.")  # the public layout's, NxDI's
MIN_TARGET_LAYERS = 7  # NxDI captures layers 1, N//2 - 1, N - 4: distinct only from 7 layers (eagle3-capture)
ROPE_TYPES = (None, "default", "llama3")  # what NxDI's Llama draft builds its rotary embedding from


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose hidden states the draft reads, in vLLM's convention (the input of layer i), which
    draft configs declare: NxDI captures the outputs of layers 1, N//2 - 1, N - 4, the inputs of 2, N//2, N - 3
    (NXDI_CONTRACT.md: eagle3-capture)."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class Eagle3Draft:
    """What a draft's config.json says, checked; its tensors by the names it stores them under."""

    path: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    has_embedding: bool = True  # False: the target's embed_tokens is used
    # read from the folder each time, never saved with a run spec (spec.RunSpec.to_json)
    raw: dict = field(default_factory=dict, compare=False, repr=False, metadata={"saved": False})
    stored: dict = field(default_factory=dict, compare=False, repr=False,
                         metadata={"saved": False})  # NxDI name -> stored name

    @property
    def weight_bytes(self) -> int:
        """bf16 bytes of the weights NxDI holds (the embedding included), before any split."""
        h, q, kv, i, v = (self.hidden_size, self.num_attention_heads * self.head_dim,
                          self.num_key_value_heads * self.head_dim, self.intermediate_size, self.vocab_size)
        return 2 * (2 * v * h + 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * i + 4 * h)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """NxDI's names (layers.0.) -> shape, embed_tokens included."""
        h, q, kv, i, v = (self.hidden_size, self.num_attention_heads * self.head_dim,
                          self.num_key_value_heads * self.head_dim, self.intermediate_size, self.vocab_size)
        layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
                 "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        return {"embed_tokens.weight": (v, h), "fc.weight": (h, 3 * h),
                **{f"layers.0.{k}": s for k, s in layer.items()}, "norm.weight": (h,), "lm_head.weight": (v, h)}


def read_config(path: str | Path, target: KimiK2Config) -> Eagle3Draft:
    """config.json of the draft folder `path`, checked against the target's config; no tensor read."""
    where = f"--draft {path}"
    folder = Path(path)
    file = folder / "config.json"
    if not folder.is_dir() or not file.is_file():
        raise KimiInputError(f"{where}: expected an EAGLE3 draft folder with a config.json")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KimiInputError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise KimiInputError(f"{file}: expected a JSON object")
    arch = raw.get("architectures")
    name = arch[0] if isinstance(arch, list) and len(arch) == 1 else arch
    if name in NOT_LOADABLE:
        raise KimiInputError(f"{file}: architectures={arch!r} is {NOT_LOADABLE[name]}; use a Llama EAGLE3 draft "
                             f"({ARCHITECTURE})")
    if name != ARCHITECTURE:
        raise KimiInputError(f"{file}: field architectures={arch!r}, expected [{ARCHITECTURE!r}] (the Llama EAGLE3 "
                             f"layout, NxDI's only EAGLE3 draft)")
    f = _Fields(raw, str(file))
    h, heads = f.int("hidden_size"), f.int("num_attention_heads")
    draft = Eagle3Draft(
        path=str(folder), hidden_size=h, intermediate_size=f.int("intermediate_size"), num_attention_heads=heads,
        num_key_value_heads=f.int("num_key_value_heads", heads), head_dim=f.int("head_dim", h // heads),
        vocab_size=f.int("vocab_size"), rms_norm_eps=f.number("rms_norm_eps"), rope_theta=f.number("rope_theta"),
        max_position_embeddings=f.int("max_position_embeddings"), raw=raw)
    _check_against(draft, f, target)
    return draft


def _check_against(d: Eagle3Draft, f: "_Fields", target: KimiK2Config) -> None:
    src = f.source
    if f.int("num_hidden_layers") != 1:
        raise KimiInputError(f"{src}: field num_hidden_layers={f.raw['num_hidden_layers']}, expected 1 (an EAGLE3 "
                             f"draft is one decoder layer)")
    th = f.raw.get("target_hidden_size")
    if d.hidden_size != target.hidden_size or (th is not None and th != target.hidden_size):
        got = f"target_hidden_size={th}" if th is not None and th != target.hidden_size else \
            f"hidden_size={d.hidden_size}"
        raise KimiInputError(f"{src}: field {got}, expected the target's hidden_size {target.hidden_size} (NxDI's "
                             f"draft fc maps the target's 3 x hidden to its own hidden, the same)")
    if d.vocab_size != target.vocab_size:
        raise KimiInputError(f"{src}: field vocab_size={d.vocab_size}, expected the target's {target.vocab_size}")
    dv = f.raw.get("draft_vocab_size")
    if dv is not None and dv != d.vocab_size:
        raise KimiInputError(f"{src}: field draft_vocab_size={dv}, expected {d.vocab_size} (a pruned draft "
                             f"vocabulary needs a d2t map, which NxDI does not apply: its draft ids are target ids)")
    if target.num_hidden_layers < MIN_TARGET_LAYERS:
        raise KimiInputError(f"{target.source}: num_hidden_layers={target.num_hidden_layers}; an EAGLE3 target "
                             f"needs >= {MIN_TARGET_LAYERS} (NxDI captures layers 1, N//2 - 1 and N - 4)")
    declared = _declared_aux_ids(f.raw)
    want = aux_layer_ids(target.num_hidden_layers)
    if declared is not None and tuple(declared) != want:
        raise KimiInputError(f"{src}: field eagle_aux_hidden_state_layer_ids={list(declared)}, expected {list(want)} "
                             f"(NxDI reads the hidden states entering layers {', '.join(map(str, want))} of the "
                             f"target's {target.num_hidden_layers}, and cannot read others)")
    if f.raw.get("hidden_act", "silu") != "silu":
        raise KimiInputError(f"{src}: field hidden_act={f.raw['hidden_act']!r}, expected 'silu'")
    if f.raw.get("attention_bias") or f.raw.get("mlp_bias"):
        raise KimiInputError(f"{src}: attention or MLP biases: not in the Llama EAGLE3 layout NxDI loads")
    rope = f.raw.get("rope_scaling")
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else rope
    if rope_type not in ROPE_TYPES:
        raise KimiInputError(f"{src}: field rope_scaling={rope!r}, expected none or llama3 (what NxDI's Llama "
                             f"draft applies on device)")
    if d.num_attention_heads * d.head_dim == 0 or d.num_attention_heads % d.num_key_value_heads:
        raise KimiInputError(f"{src}: num_attention_heads={d.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={d.num_key_value_heads}")


def _declared_aux_ids(raw: dict):
    """The aux layer ids a config declares (vLLM reads them at the top or under eagle_config), else None."""
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    return raw.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))


def read_draft(path: str | Path, target: KimiK2Config, finite: bool = True) -> Eagle3Draft:
    """config.json and every tensor's name, shape and dtype (and each value finite, with `finite`), before any
    work. Stored names may carry a `model.` prefix and the public `midlayer.` or NxDI's `layers.0.`."""
    from kimi_k2_neuron.quant import PLAIN_DTYPES, check_finite

    from .shards import ShardedCheckpoint

    d = read_config(path, target)
    with ShardedCheckpoint(path) as ckpt:
        stored = _stored_names(d, ckpt)
        want = d.shapes()
        for name, key in stored.items():
            info = ckpt.info(key)
            if info.dtype not in PLAIN_DTYPES:
                raise KimiInputError(f"--draft {path}: tensor {key} is {info.dtype}, expected bf16/fp16/fp32")
            if info.shape != want[name]:
                raise KimiInputError(f"--draft {path}: tensor {key} has shape {list(info.shape)}, expected "
                                     f"{list(want[name])}")
            if finite:
                check_finite(ckpt.get(key), f"--draft {path}: tensor {key}")
    return Eagle3Draft(**{**d.__dict__, "has_embedding": "embed_tokens.weight" in stored, "stored": stored})


def _stored_names(d: Eagle3Draft, ckpt) -> dict[str, str]:
    """NxDI name -> stored name, every stored tensor placed (an identity d2t/t2d aside)."""
    where = f"--draft {d.path}"
    out: dict[str, str] = {}
    maps = []
    for key in ckpt.keys():
        name = key.removeprefix("model.")
        if name in ("d2t", "t2d"):
            maps.append(key)
            continue
        for layer in LAYER_NAMES[:1]:
            if name.startswith(layer):
                name = LAYER_NAMES[1] + name[len(layer):]
        if name not in d.shapes():
            hint = " (an EAGLE3.1 draft's: NxDI 2.29 implements EAGLE3)" if name.split(".")[0] in (
                "fc_norm", "norm_output") else ""
            raise KimiInputError(f"{where}: tensor {key} is not part of the Llama EAGLE3 layout{hint}")
        if name in out:
            raise KimiInputError(f"{where}: tensors {out[name]} and {key} both load into {name}")
        out[name] = key
    missing = sorted(set(d.shapes()) - set(out) - {"embed_tokens.weight"})
    if missing:
        raise KimiInputError(f"{where}: {len(missing)} tensor(s) missing: {listing(missing)}")
    for key in maps:
        _check_identity_map(ckpt.get(key), key, d)
    return out


def _check_identity_map(t, key: str, d: Eagle3Draft) -> None:
    """TorchSpec saves d2t (draft id -> offset to the target id) and t2d (target id -> in the draft vocabulary) only
    for a pruned vocabulary; a full one's are the identity, which is all NxDI can run."""
    identity = t.numel() == d.vocab_size and bool((t == 0).all() if key.endswith("d2t") else (t != 0).all())
    if not identity:
        raise KimiInputError(f"--draft {d.path}: tensor {key} maps a pruned draft vocabulary onto the target's; "
                             f"NxDI uses draft ids as target ids, so only a full-vocabulary draft runs")


def neuron_tensors(d: Eagle3Draft, target_checkpoint: str | Path) -> dict:
    """The draft's tensors under NxDI's Llama names (read_draft's `stored`), the target's embedding where the draft
    has none. `target_checkpoint`: a raw or converted Kimi checkpoint folder."""
    from .shards import ShardedCheckpoint

    if not d.stored:
        raise ValueError("neuron_tensors takes a draft read by read_draft")
    with ShardedCheckpoint(d.path) as ckpt:
        out = {name: ckpt.get(key) for name, key in d.stored.items()}
    if not d.has_embedding:
        with ShardedCheckpoint(target_checkpoint) as target:
            out["embed_tokens.weight"] = target.get("model.embed_tokens.weight")
    return out


class _Fields:
    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def int(self, name: str, default=None) -> int:
        v = self.raw.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected an integer >= 1")
        return v

    def number(self, name: str) -> float:
        v = self.raw.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected a finite number > 0")
        return float(v)
