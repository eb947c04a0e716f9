"""An EAGLE3 draft checkpoint as the public drafts are downloaded (config.json + safetensors), read and checked against
the target it drafts for, before any work. Two layouts (docs/speculative.md has the public drafts of each):

- the Llama EAGLE3 layout (TorchSpec's and SpecForge's LlamaForCausalLMEagle3): one MHA decoder layer whose QKV takes
  [embedding | hidden] (2H), which NxDI 2.29's own Llama EAGLE3 draft runs (NXDI_CONTRACT.md: llama-eagle3-draft);
- the MLA layout (TorchSpec's Eagle3DeepseekV2ForCausalLM, vLLM's deepseek_eagle3.py, SGLang's kimi_k25_eagle3.py):
  the same layer with DeepSeek's MLA attention (q_a_proj and kv_a_proj_with_mqa over the 2H input), which the shell's
  own draft class runs with the core's MLA and a latent cache like the target's (NXDI_CONTRACT.md: eagle3-mla-draft);
  optionally EAGLE3.1 (config fc_norm: an RMSNorm per captured hidden state before fc; norm_output: the post-norm
  hidden state fed to the next draft step).

Either may have a reduced draft vocabulary (draft_vocab_size < vocab_size, its lm_head that many rows) with `d2t`
(draft id i -> target id i + d2t[i], as vLLM's llama_eagle3.py applies it) and optionally `t2d` (a target-vocabulary
mask of the same ids): checked here, applied in the fused graph by the shell (NXDI_CONTRACT.md: draft-vocab-map).
The three aux layer ids a draft declares follow one of two conventions, both accepted and both NxDI's capture
(NXDI_CONTRACT.md: eagle3-capture): the outputs of layers 1, N//2 - 1, N - 4 (SGLang's and SpecForge's reading),
or the inputs of the next ones, 2, N//2, N - 3 (vLLM's). The public drafts name the layer `midlayer.`; neuron names
are `layers.0.`. A draft without `embed_tokens` uses the target's (trained drafts freeze it). Pure: torch and
safetensors, no SDK.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing

LLAMA, MLA = "eagle3", "eagle3-mla"  # Eagle3Draft.kind
ARCHITECTURES = {"LlamaForCausalLMEagle3": LLAMA, "Eagle3DeepseekV2ForCausalLM": MLA,
                 "Eagle3DeepseekV3ForCausalLM": MLA}  # the last: vLLM's alias of the MLA draft
ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_NAMES = ("midlayer.", "layers.0.")  # the public layout's, NxDI's
MIN_TARGET_LAYERS = 7  # NxDI captures layers 1, N//2 - 1, N - 4: distinct only from 7 layers (eagle3-capture)
ROPE_TYPES = (None, "default", "llama3")  # what NxDI's Llama draft builds its rotary embedding from
AUX_INPUTS = 3  # hidden states NxDI captures and the draft's fc fuses
DRAFT_IDS = "draft_token_ids"  # the shell's name for the draft -> target id table (int32), when not the identity
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def aux_conventions(num_layers: int) -> dict[str, tuple[int, int, int]]:
    """The aux layer ids a draft may declare for NxDI's capture (the outputs of layers 1, N//2 - 1, N - 4,
    NXDI_CONTRACT.md: eagle3-capture), by convention: "output" names the layer (SGLang adds 1 and captures the next layer's input;
    SpecForge hooks the layer's output), "input" the next layer whose input it is (vLLM captures before layer i)."""
    out = (1, num_layers // 2 - 1, num_layers - 4)
    return {"output": out, "input": tuple(i + 1 for i in out)}


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's convention, which make-tiny's Llama drafts declare (as TorchSpec's and SpecForge's Kimi configs do)."""
    return aux_conventions(num_layers)["input"]


@dataclass(frozen=True)
class MlaDims:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    kind: str = LLAMA
    draft_vocab_size: int | None = None  # None: the target's vocabulary
    mla: MlaDims | None = None
    fc_norm: bool = False  # EAGLE3.1: an RMSNorm per captured hidden state before fc
    norm_output: bool = False  # EAGLE3.1: the post-norm hidden state feeds the next draft step
    # how its config declares the aux layer ids (aux_conventions), if it does
    aux_convention: str | None = field(default=None, compare=False)
    mapped: bool = False  # has a draft -> target id map that is not the identity (d2t)
    # read from the folder each time, never saved with a run spec (spec.RunSpec.to_json)
    raw: dict = field(default_factory=dict, compare=False, repr=False, metadata={"saved": False})
    stored: dict = field(default_factory=dict, compare=False, repr=False,
                         metadata={"saved": False})  # NxDI name -> stored name

    @property
    def lm_head_rows(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def eagle31(self) -> bool:
        return self.fc_norm or self.norm_output

    @property
    def weight_bytes(self) -> int:
        """bf16 bytes of the weights the draft holds (the embedding included), before any split."""
        return 2 * sum(_numel(s) for s in self.shapes().values())

    @property
    def kv_width(self) -> int:
        """Cache elements per position per KV head: K and V of one head (Llama), or the latent entry (MLA, V's slot
        one wide, as the target's: NXDI_CONTRACT.md: latent-v-slot)."""
        return 2 * self.head_dim if self.mla is None else self.mla.latent_dim + 1

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """NxDI's names (layers.0.) -> shape, embed_tokens included."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        if self.mla is None:
            q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
            layer.update({"self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
                          "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q)})
        else:
            m, n = self.mla, self.num_attention_heads
            layer.update({"self_attn.q_a_proj.weight": (m.q_lora_rank, 2 * h),
                          "self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
                          "self_attn.q_b_proj.weight": (n * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank),
                          "self_attn.kv_a_proj_with_mqa.weight": (m.latent_dim, 2 * h),
                          "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
                          "self_attn.kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                          "self_attn.o_proj.weight": (h, n * m.v_head_dim)})
        norms = {f"fc_norm.{k}.weight": (h,) for k in range(AUX_INPUTS)} if self.fc_norm else {}
        return {"embed_tokens.weight": (v, h), "fc.weight": (h, AUX_INPUTS * h), **norms,
                **{f"layers.0.{k}": s for k, s in layer.items()}, "norm.weight": (h,),
                "lm_head.weight": (self.lm_head_rows, h)}

    def core_config(self) -> KimiK2Config:
        """The MLA draft's layer as a core config (mla_core_config)."""
        return mla_core_config(self.raw, str(Path(self.path) / "config.json"))


# What makes a draft's MLA layer a one-layer dense Kimi config: no expert field is read by a dense layer
DENSE_LAYER = {"num_hidden_layers": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 1,
               "n_shared_experts": 0, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
               "routed_scaling_factor": 1.0, "moe_intermediate_size": 1, "topk_method": "noaux_tc",
               "scoring_func": "sigmoid", "model_type": "kimi_k2"}


def mla_core_config(raw: dict, source: str) -> KimiK2Config:
    """An MLA draft's config.json as the core config of its one dense layer (its own MLA ranks, norms and RoPE: no
    rope_scaling is none), every field checked as a Kimi config's."""
    fields = {k: v for k, v in raw.items() if k not in ("quantization_config", "text_config")}
    fields.setdefault("rope_scaling", None)
    return KimiK2Config.from_dict({**fields, **DENSE_LAYER, "num_key_value_heads": raw.get("num_attention_heads")},
                                  source=source)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def facts(path: str | Path, raw: dict, f: "_Fields | None" = None) -> Eagle3Draft:
    """A draft config's fields (config.json's object, or the attributes of a reloaded draft config) as checked
    facts, before any check against the target."""
    f = f or _Fields(raw, str(Path(path) / "config.json"))
    arch = raw.get("architectures")
    name = arch[0] if isinstance(arch, list) and len(arch) == 1 else arch
    if name not in ARCHITECTURES:
        raise KimiInputError(f"{f.source}: field architectures={arch!r}, expected one of {list(ARCHITECTURES)} (the "
                             f"Llama EAGLE3 layout NxDI's draft loads, or the MLA EAGLE3 layout the shell's draft "
                             f"class runs)")
    h, heads = f.int("hidden_size"), f.int("num_attention_heads")
    kind = ARCHITECTURES[name]
    mla = MlaDims(**{k: f.int(k) for k in MLA_FIELDS}) if kind == MLA else None
    kv_heads, head_dim = (heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim) if mla else \
        (f.int("num_key_value_heads", heads), f.int("head_dim", h // heads))
    return Eagle3Draft(
        path=str(path), kind=kind, hidden_size=h, intermediate_size=f.int("intermediate_size"),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=f.int("vocab_size"),
        draft_vocab_size=f.int("draft_vocab_size", None), rms_norm_eps=f.number("rms_norm_eps"),
        rope_theta=f.number("rope_theta"), max_position_embeddings=f.int("max_position_embeddings"), mla=mla,
        fc_norm=f.flag("fc_norm"), norm_output=f.flag("norm_output"), raw=raw)


def read_config(path: str | Path, target: KimiK2Config) -> Eagle3Draft:
    """config.json of the draft folder `path`, checked against the target's config; no tensor read."""
    folder = Path(path)
    file = folder / "config.json"
    if not folder.is_dir() or not file.is_file():
        raise KimiInputError(f"--draft {path}: expected an EAGLE3 draft folder with a config.json")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KimiInputError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise KimiInputError(f"{file}: expected a JSON object")
    f = _Fields(raw, str(file))
    draft = facts(folder, raw, f)
    draft = replace(draft, aux_convention=_check_against(draft, f, target))
    if draft.kind == MLA:
        draft.core_config()  # its RoPE and MLA fields, as a Kimi config's
    return draft


def _check_against(d: Eagle3Draft, f: "_Fields", target: KimiK2Config) -> str | None:
    """-> the aux-id convention its config declares (None: it declares none)."""
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
    if d.draft_vocab_size is not None and d.draft_vocab_size > d.vocab_size:
        raise KimiInputError(f"{src}: field draft_vocab_size={d.draft_vocab_size}, expected at most vocab_size "
                             f"{d.vocab_size} (a draft vocabulary is a subset of the target's)")
    if target.num_hidden_layers < MIN_TARGET_LAYERS:
        raise KimiInputError(f"{target.source}: num_hidden_layers={target.num_hidden_layers}; an EAGLE3 target "
                             f"needs >= {MIN_TARGET_LAYERS} (NxDI captures layers 1, N//2 - 1 and N - 4)")
    convention = _aux_convention(f, target.num_hidden_layers)
    if f.raw.get("hidden_act", "silu") != "silu":
        raise KimiInputError(f"{src}: field hidden_act={f.raw['hidden_act']!r}, expected 'silu'")
    if f.raw.get("attention_bias") or f.raw.get("mlp_bias") or f.raw.get("bias"):
        raise KimiInputError(f"{src}: attention, MLP or fc biases: not in the EAGLE3 layouts read here")
    for name in ("norm_before_residual", "norm_before_fc"):  # vLLM's other EAGLE3 variants, not trained for Kimi
        if f.raw.get(name):
            raise KimiInputError(f"{src}: field {name}=true: an EAGLE3 variant no public Kimi draft uses, not run "
                                 f"here")
    if d.kind == LLAMA:
        if d.eagle31:
            raise KimiInputError(f"{src}: fields fc_norm/norm_output (EAGLE3.1) with the Llama layout: run here "
                                 f"for the MLA layout (Eagle3DeepseekV2ForCausalLM) only, the EAGLE3.1 drafts "
                                 f"published for Kimi")
        rope = f.raw.get("rope_scaling")
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else rope
        if rope_type not in ROPE_TYPES:
            raise KimiInputError(f"{src}: field rope_scaling={rope!r}, expected none or llama3 (what NxDI's Llama "
                                 f"draft applies on device)")
        if d.num_attention_heads * d.head_dim == 0 or d.num_attention_heads % d.num_key_value_heads:
            raise KimiInputError(f"{src}: num_attention_heads={d.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads={d.num_key_value_heads}")
    return convention


def _aux_convention(f: "_Fields", num_layers: int) -> str | None:
    """Either convention names NxDI's capture; any other ids, one line (NxDI's capture is fixed:
    NXDI_CONTRACT.md: eagle3-capture)."""
    nested = f.raw.get("eagle_config") if isinstance(f.raw.get("eagle_config"), dict) else {}
    if nested.get("use_aux_hidden_state", f.raw.get("use_aux_hidden_state", True)) is False:
        raise KimiInputError(f"{f.source}: field use_aux_hidden_state=false: an EAGLE (not EAGLE3) draft; NxDI's "
                             f"fused EAGLE3 speculation reads three captured hidden states")
    n_aux = f.raw.get("num_aux_hidden_states", AUX_INPUTS)
    if n_aux != AUX_INPUTS:
        raise KimiInputError(f"{f.source}: field num_aux_hidden_states={n_aux!r}, expected {AUX_INPUTS} (NxDI "
                             f"captures three layers)")
    declared = f.raw.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))
    if declared is None:
        return None
    conventions = aux_conventions(num_layers)
    for name, ids in conventions.items():
        if isinstance(declared, list) and tuple(declared) == ids:
            return name
    out, inp = conventions["output"], conventions["input"]
    raise KimiInputError(f"{f.source}: field eagle_aux_hidden_state_layer_ids={declared!r}, expected {list(out)} "
                         f"(the outputs of those layers) or {list(inp)} (the inputs of the next ones): NxDI captures "
                         f"only the outputs of layers {', '.join(map(str, out))} of the target's {num_layers}")


def read_draft(path: str | Path, target: KimiK2Config, finite: bool = True) -> Eagle3Draft:
    """config.json and every tensor's name, shape and dtype (and each value finite, with `finite`; a d2t/t2d map
    always read and checked), before any work. Stored names may carry a `model.` prefix and the public `midlayer.`
    or NxDI's `layers.0.`."""
    from kimi_k2_neuron.quant import PLAIN_DTYPES, check_finite

    from .shards import ShardedCheckpoint

    d = read_config(path, target)
    with ShardedCheckpoint(path) as ckpt:
        stored, maps = _stored_names(d, ckpt)
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
        ids = _draft_ids(d, {k.removeprefix("model."): ckpt.get(k) for k in maps})
    if "d2t" in maps and ids is not None:
        stored[DRAFT_IDS] = maps["d2t"]
    return replace(d, has_embedding="embed_tokens.weight" in stored, stored=stored, mapped=ids is not None)


def _stored_names(d: Eagle3Draft, ckpt) -> tuple[dict[str, str], dict[str, str]]:
    """(NxDI name -> stored name, every stored tensor placed; {"d2t"/"t2d": stored name})."""
    where = f"--draft {d.path}"
    out: dict[str, str] = {}
    maps: dict[str, str] = {}
    shapes = d.shapes()
    for key in ckpt.keys():
        name = key.removeprefix("model.")
        if name in ("d2t", "t2d"):
            maps[name] = key
            continue
        if name.startswith(LAYER_NAMES[0]):
            name = LAYER_NAMES[1] + name[len(LAYER_NAMES[0]):]
        if name not in shapes:
            hint = " (an EAGLE3.1 draft's: its config sets fc_norm)" if name.startswith("fc_norm") else ""
            raise KimiInputError(f"{where}: tensor {key} is not part of the {d.kind} layout{hint}")
        if name in out:
            raise KimiInputError(f"{where}: tensors {out[name]} and {key} both load into {name}")
        out[name] = key
    missing = sorted(set(shapes) - set(out) - {"embed_tokens.weight"})
    if missing:
        raise KimiInputError(f"{where}: {len(missing)} tensor(s) missing: {listing(missing)}")
    return out, maps


def _draft_ids(d: Eagle3Draft, maps: dict):
    """The target id of each draft id (int64), or None where the draft's ids are the target's. d2t holds offsets
    (target id = draft id + d2t[draft id]: TorchSpec's and SpecForge's maps, vLLM's reading); t2d, where saved, marks
    the same target ids."""
    import torch

    where, n, v = f"--draft {d.path}", d.lm_head_rows, d.vocab_size
    d2t, t2d = maps.get("d2t"), maps.get("t2d")
    if d2t is None:
        if n < v:
            raise KimiInputError(f"{where}: draft_vocab_size={n} < vocab_size={v} without a d2t tensor (the map of "
                                 f"its ids to the target's)")
        if t2d is not None:
            raise KimiInputError(f"{where}: tensor t2d without d2t; expected both or neither")
        return None
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (n,):
        raise KimiInputError(f"{where}: tensor d2t is {d2t.dtype} {list(d2t.shape)}, expected integer [{n}] (one "
                             f"offset per draft id)")
    ids = torch.arange(n, dtype=torch.int64) + d2t.to(torch.int64)
    bad = ((ids < 0) | (ids >= v)).nonzero()
    if len(bad):
        j = int(bad[0])
        raise KimiInputError(f"{where}: tensor d2t maps draft id {j} to target id {int(ids[j])}, outside the "
                             f"target's vocabulary 0..{v - 1}")
    sorted_ids, order = ids.sort()
    dup = (sorted_ids[1:] == sorted_ids[:-1]).nonzero()
    if len(dup):
        a, b = sorted((int(order[int(dup[0])]), int(order[int(dup[0]) + 1])))
        raise KimiInputError(f"{where}: tensor d2t maps draft ids {a} and {b} to one target id {int(ids[a])}")
    if t2d is not None:
        marked = t2d.to(torch.bool) if t2d.dtype == torch.bool or not t2d.dtype.is_floating_point else None
        if marked is None or tuple(t2d.shape) != (v,) or not torch.equal(marked.nonzero().view(-1), sorted_ids):
            raise KimiInputError(f"{where}: tensor t2d does not mark the {n} target ids d2t maps to (expected a "
                                 f"bool [{v}] mask of them)")
    return None if torch.equal(ids, torch.arange(n)) else ids


def mapped_vocabulary(path: str | Path) -> bool:
    """Whether the draft folder's d2t moves any draft id off the target id of the same number (read_draft checks
    the map; this reads it alone, for a config built from the folder)."""
    from .shards import ShardedCheckpoint

    with ShardedCheckpoint(path) as ckpt:
        key = next((k for k in ckpt.keys() if k.removeprefix("model.") == "d2t"), None)
        return key is not None and bool((ckpt.get(key) != 0).any())


def neuron_tensors(d: Eagle3Draft, target_checkpoint: str | Path) -> dict:
    """The draft's tensors under NxDI's names (read_draft's `stored`), the target's embedding where the draft has
    none, and DRAFT_IDS, the target id of each draft id (int32), where the draft's vocabulary is mapped.
    `target_checkpoint`: a raw or converted Kimi checkpoint folder."""
    import torch

    from .shards import ShardedCheckpoint

    if not d.stored:
        raise ValueError("neuron_tensors takes a draft read by read_draft")
    with ShardedCheckpoint(d.path) as ckpt:
        out = {name: ckpt.get(key) for name, key in d.stored.items()}
    if DRAFT_IDS in out:
        out[DRAFT_IDS] = (torch.arange(d.lm_head_rows) + out[DRAFT_IDS].to(torch.int64)).to(torch.int32)
    if not d.has_embedding:
        with ShardedCheckpoint(target_checkpoint) as target:
            out["embed_tokens.weight"] = target.get("model.embed_tokens.weight")
    return out


class _Fields:
    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def int(self, name: str, default=...) -> int | None:
        v = self.raw.get(name)
        if v is None and default is not ...:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected an integer >= 1")
        return v

    def number(self, name: str) -> float:
        v = self.raw.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected a finite number > 0")
        return float(v)

    def flag(self, name: str) -> bool:
        v = self.raw.get(name, False)
        if not isinstance(v, bool):
            raise KimiInputError(f"{self.source}: field {name}={v!r}, expected true or false")
        return v
