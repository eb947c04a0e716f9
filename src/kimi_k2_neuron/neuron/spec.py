"""One run of Kimi-K2 on NxDI as a typed spec, and the one way everything else derives from it: the flags are built
from its fields (FLAGS, read by arguments.add_spec_args), the NeuronConfig is derived from it
(contract.neuron_config_kwargs), it is saved whole on the InferenceConfig (RUN_SPEC_KEY) and read back from there on a
reload (RunSpec.from_json). The only reverse mapping is vLLM's own request (vllm_request.run_spec). The
refusals are rules.py's, the fit planner's fit.py. Pure: no SDK, no torch.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from kimi_k2_neuron.checkpoint.draft import Eagle3Draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import DEFAULT_SCHEME, SCHEMES
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.placement import Layout, slots_for

from . import moe_paths

# NxDI's flash-decoding cache keeps this many slots per rank beyond seq_len / G: non-owners of a decoded token write
# it into the last one, which no mask exposes (NXDI_CONTRACT.md: fd-cache-size).
FD_RESERVED_SLOTS = 128

# The InferenceConfig attribute the whole RunSpec is saved under, as JSON: not NeuronConfig fields, which NxDI drops
# when it does not know them (NXDI_CONTRACT.md: layout-attribute).
RUN_SPEC_KEY = "kimi_k2_run_spec"


@dataclass(frozen=True)
class Sampling:
    """NxDI's on-device sampler as compiled, and the per-request settings it draws with."""

    on_device: bool = True  # False: lm_head's logits go to the host
    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    global_topk: int = 256  # the compiled top-k pre-selection; a request's top_k is at most this

    @classmethod
    def of(cls, temperature: float, top_k: int, top_p: float) -> "Sampling":
        """temperature 0 is greedy; top_k 0 becomes global_topk (NxDI's sampler always filters)."""
        if temperature <= 0:
            return cls()
        return cls(do_sample=True, temperature=temperature, top_k=top_k or cls.global_topk, top_p=top_p)

    @property
    def settings(self) -> dict[str, Any]:
        """The per-request settings, as generation configs and NxDI's sampler take them."""
        return {"do_sample": self.do_sample, "top_k": self.top_k, "top_p": self.top_p,
                "temperature": self.temperature}


GREEDY = Sampling()


@dataclass(frozen=True)
class DraftSpec:
    """An EAGLE3 draft run with the target in NxDI's fused speculation (neuron/fused_spec.py)."""

    path: str | None  # the draft folder; None where it is not known yet (a vLLM request before vllm-neuron adds it)
    # NxDI's speculation_length: tokens the target verifies per step, the most a step emits; drafts per step one
    # fewer (vLLM's num_speculative_tokens is this number: NXDI_CONTRACT.md: vllm-spec-config)
    speculation_length: int = 4
    checkpoint: Eagle3Draft | None = None  # its config.json's facts, when read (saved with the spec)


def speculation_overrun(speculation_length: int) -> int:
    """Cache positions a generation must leave free past its last new token's, beyond a plain decode's: a fused step
    at p writes p .. p + K - 1 (NXDI_CONTRACT.md: fused-positions); 0 without speculation."""
    return max(speculation_length - 2, 0)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One compiled (or CPU-mode) configuration of the model."""

    tp: int = 1  # ranks (logical cores); attention, embedding, lm_head and the shared expert split tp ways
    ep: int = 1  # NxDI moe_ep_degree inside the tp ranks, not NxD's global ep_degree (contract.UNSUPPORTED)
    lnc: int | None = 2  # None: NxDI's choice (NEURON_LOGICAL_NC_CONFIG, else the platform's)
    seq_len: int = 1024  # the KV cache's positions per sequence
    max_context_length: int | None = None  # the prefill bucket; default the chunk, else seq_len
    batch: int = 1
    scheme: ExpertScheme | None = None  # the routed experts on device; None: not known yet (a checkpoint's own)
    checkpoint: str | None = None  # the converted checkpoint folder (NxDI requires a path when quantized)
    sampling: Sampling = GREEDY
    output_logits: bool = False  # also return logits under on-device sampling
    # moe_paths.MODES; None: the default where its kernel can run these shapes, else torch (moe_paths.default_mode)
    moe_prefill: str | None = moe_paths.DEFAULT_MODE
    # the token-generation MoE path, moe_paths.DECODE_PATHS (one of NxD's public forward_* methods, nxd_moe.py); None:
    # the fastest the time model gives at this batch and EP (moe_decode.py), NxD's own threshold on CPU (lnc None)
    moe_decode: str | None = None
    # one sequence per prefill into its seq_id's line (NXDI_CONTRACT.md: continuous-batching)
    continuous_batching: bool = False
    # how the cache and the small layers lie over the ranks; its prefill_chunk is the CTE bucket, then the chunk
    # submodel's width (neuron/chunked_prefill.py), one row a call
    layout: Layout = Layout()
    draft: DraftSpec | None = None  # speculative decoding with this EAGLE3 draft (NXDI_CONTRACT.md: fused-spec)
    dtype: str = "bfloat16"  # NxDI's torch_dtype: the device's; the CPU harness may run float32
    # vLLM's prefix caching: the latent cache in NxDI's block layout, a pool of num_blocks blocks of block_size
    # positions shared by every sequence, found through the block tables vLLM's scheduler keeps
    # (neuron/prefix_caching.py)
    prefix_caching: bool = False
    block_size: int = 32  # vLLM's --block-size, NxDI's pa_block_size
    num_blocks: int | None = None  # vLLM's --num-gpu-blocks-override; None: min_blocks, a full sequence per row
    # further NeuronConfig fields, JSON values: added beside the derived ones, never changing one (NxDI checks them)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        """The context-encoding bucket: --max-context-length, else the chunk, else the whole cache."""
        return self.max_context_length or self.layout.prefill_chunk or self.seq_len

    @property
    def prefill_batch(self) -> int:
        """Rows of one prefill call. One per chunk: a batch-B chunk graph would hold B x chunk tokens of activations;
        one under continuous batching: each sequence into its own cache line (NXDI_CONTRACT.md:
        continuous-batching)."""
        return 1 if self.one_row_prefill else self.batch

    @property
    def one_row_prefill(self) -> bool:
        """Each prefill call writes one sequence into its own line: NxDI's continuous batching, which a chunked
        prefill needs too (its CTE call writes chunk 0 into the row's line), and prefix caching (each sequence's
        prefill into its own blocks)."""
        return self.continuous_batching or bool(self.layout.prefill_chunk) or self.prefix_caching

    @property
    def chunk_submodel(self) -> bool:
        """--prefill-chunk by the chunked-prefill submodel (neuron/chunked_prefill.py); with prefix caching each chunk
        is a prefill over the blocks written before it instead (neuron/prefix_caching.py)."""
        return bool(self.layout.prefill_chunk) and not self.prefix_caching

    @property
    def prefill_tokens(self) -> int:
        """Tokens of one prefill call, what decides its MoE path."""
        return self.context_length * self.prefill_batch

    @property
    def cache_slots(self) -> int:
        """Latent cache slots per rank and sequence: NxDI's get_cache_size when sequence-sharded."""
        g = self.layout.kv_group
        return self.seq_len if g == 1 else slots_for(self.seq_len, g) + FD_RESERVED_SLOTS  # seq_len % G == 0 (rules)

    @property
    def min_blocks(self) -> int:
        """Blocks for every row's full sequence at once: the fewest vllm-neuron accepts (its
        _validate_neuron_config)."""
        return self.batch * -(-self.seq_len // self.block_size)

    @property
    def pool_blocks(self) -> int:
        """Blocks of the prefix-caching pool vLLM hands out (NxDI's pa_num_blocks is one more: vLLM's null block 0)."""
        return self.num_blocks or self.min_blocks

    def prefill_mode(self, cfg: KimiK2Config) -> str:
        """--moe-prefill, else the default mode where its kernel can run these shapes."""
        return self.moe_prefill or moe_paths.default_mode(cfg, self.tp, self.ep, self.lnc, self.prefill_tokens)

    def decode_path(self, cfg: KimiK2Config) -> str | None:
        """The token-generation MoE path the spec itself decides: --moe-decode; else all-experts under EP (selective
        loading has none); NxD's own threshold where no trn2 time model applies (NxD's CPU mode: lnc None, or NxDI's
        on_cpu as vLLM's request on CPU sets it). None: the time model's to choose (the planner, fit.plan;
        moe_decode.choose)."""
        if self.moe_decode is not None:
            return self.moe_decode
        if self.ep > 1:
            return "all-experts"
        if self.lnc is None or self.scheme is None or self.extra.get("on_cpu"):
            return moe_paths.nxd_decode_path(cfg, self.batch)
        return None

    def to_json(self) -> dict:
        """Every field as JSON values (what RUN_SPEC_KEY holds); from_json reads it back equal."""
        return _to_json(self)

    @classmethod
    def from_json(cls, value, where: str = RUN_SPEC_KEY) -> "RunSpec":
        """A saved spec, each value checked against its field's type; `where` names it in a one-line error."""
        return _from_json(cls, value, where)


# The smallest prefill (active) and prefix bucket of a prefix-caching build, as NxDI's own default 2D buckets start
# (modules/autobucketing.py generate_buckets_for_cte), unless a context of fewer than 8 of them asks for smaller ones
PREFIX_BUCKET_MIN = 512


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out = []
    while lo < hi:
        out.append(lo)
        lo *= 2
    return out + [hi]


def prefix_caching_buckets(spec: RunSpec) -> tuple[list[int], list[int]]:
    """(prefill buckets, prefix buckets) of the context-encoding graphs: one graph per pair, and one per prefill
    bucket with no prefix (NXDI_CONTRACT.md: prefix-buckets). A turn's new tokens pick the smallest prefill bucket
    that holds them and NxDI fills the rest of it with cached positions recomputed, so the prefix bucket covers what
    is left of the cached prefix."""
    bs = spec.block_size
    lo = -(-min(PREFIX_BUCKET_MIN, max(bs, spec.context_length // 8)) // bs) * bs  # whole blocks: NxDI reads a prefix
    return powers_of_two(lo, spec.context_length), powers_of_two(lo, spec.seq_len)


def prefix_caching_calls(spec: RunSpec, cached: int, new: int) -> list[tuple[int, int]]:
    """(prefill bucket, prefix bucket) of each context-encoding call that prefills `new` tokens after `cached` ones in
    blocks: chunks of --prefill-chunk (neuron/prefix_caching.py), each at the bucket NxDI's wrapper picks: the smallest
    prefill bucket holding the call's tokens, the rest of it refilled with cached positions recomputed, the smallest
    prefix bucket holding the cached positions left, or a 512-token bucket without a prefix for 257-512 positions in
    all (NXDI_CONTRACT.md: prefix-buckets)."""
    prefill, prefix = prefix_caching_buckets(spec)
    calls, start, end = [], cached, cached + new
    while start < end:
        stop = min(start + (spec.layout.prefill_chunk or end), end)
        n = stop - start
        if 256 < stop <= 512 and 512 in prefill:
            calls.append((512, 0))
        else:
            a = min(b for b in prefill if b >= n)
            left = max(0, start - (a - n))
            calls.append((a, min(b for b in prefix if b >= left) if left else 0))
        start = stop
    return calls


def layout_flags(layout: Layout) -> list[str]:
    """The command-line flags that ask for this layout (none for the default)."""
    given = ((f"--kv-shard sequence --kv-group {layout.kv_group}", layout.sequence_sharded),
             (f"--prefill-chunk {layout.prefill_chunk}", layout.prefill_chunk is not None),
             ("--shard-attn-a", layout.shard_attn_a), ("--shard-router", layout.shard_router))
    return [flag for flag, on in given if on]


# -- the spec as JSON: dataclasses as objects, tuples as lists; a field with metadata saved=False stays out ----------

def _to_json(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("saved", True)}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    return value


def _from_json(tp, value, where: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_json(inner, value, where)
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_json(tp, value, where)
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise KimiInputError(f"{where}: expected a list of {len(args)}, got {value!r}")
        return tuple(_from_json(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (collections.abc.Mapping, dict) or tp is dict:
        if not isinstance(value, dict):
            raise KimiInputError(f"{where}: expected an object, got {value!r}")
        return dict(value)
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool), str: isinstance(value, str)}
    if not ok.get(tp, False):
        names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        raise KimiInputError(f"{where}: expected {names.get(tp, tp)}, got {value!r}")
    return float(value) if tp is float else value


def _dataclass_from_json(cls, value, where: str):
    saved = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("saved", True)}
    if not isinstance(value, dict) or set(value) - set(saved):
        raise KimiInputError(f"{where}: expected an object with fields among {sorted(saved)}, got {value!r}")
    hints = typing.get_type_hints(cls)
    kw = {name: _from_json(hints[name], v, f"{where}.{name}") for name, v in value.items()}
    try:
        return cls(**kw)
    except KimiInputError as e:  # a dataclass's own check (Layout.chunk_group), named by where it is
        raise KimiInputError(f"{where}.{e}") from None
    except TypeError as e:  # a required field missing
        raise KimiInputError(f"{where}: {e}") from None


# == the flags: each spec field a command can set, by the field it sets, where it is taken, and how ==================
#
# arguments.add_spec_args builds a command's flags from this table, with the spec's own defaults; launch.run_spec
# builds the RunSpec back from them; arguments.check_spec_flags refuses a flag given where its command's backend does
# not take it. A new setting is a RunSpec field and one Flag here, then its use.

# Where a flag is taken: compile_and_save.py; plan; trace-cpu; the NxDI model in NxD's CPU mode (--backend nxdi-cpu,
# the scripts' --cpu); the core runner generating in one process; the core runner's logits over TP ranks. A script on
# a compiled folder takes none: the folder has its own.
COMPILE, PLAN, TRACE, CPU, CORE, CORE_RANKS = "compile", "plan", "trace", "nxdi-cpu", "core", "core-ranks"
EVERYWHERE = frozenset({COMPILE, PLAN, TRACE, CPU, CORE, CORE_RANKS})
NEURON = frozenset({COMPILE, PLAN})  # a trn2 configuration's own: compiled, or planned


@dataclass(frozen=True)
class Flag:
    """One command-line flag of the run spec."""

    name: str  # "--tp"
    field: str | None  # the RunSpec field it sets, dotted into nested ones; None: with another flag (--kv-shard)
    group: str  # parallel, shape, experts, moe, layout, cache, sampler, draft: what a command asks for by name
    help: str
    kind: str = "count"  # count (an integer >= `least`), switch (store_true), choice, path (not empty)
    least: int = 1
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    taken: frozenset[str] = NEURON
    why_not: str = ""  # why a command's backend that does not take it refuses it, where that is not obvious

    unset: bool = False  # the parser's default is None: not given differs from the spec's default (see its help)
    neutral: tuple = ()  # values that ask for nothing a backend lacks (--kv-shard none), beside the defaults

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def spec_default(self):
        """The field's default in a RunSpec (a nested field's in its own class where the RunSpec holds None)."""
        if self.field is None:
            return None
        cls, value = RunSpec, RunSpec()
        for part in self.field.split("."):
            f = next(f for f in dataclasses.fields(cls) if f.name == part)
            value = getattr(value, part) if value is not None else f.default
            hint = typing.get_type_hints(cls)[part]
            cls = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
        return value

    @property
    def default(self):
        """The parser's default."""
        if self.kind == "switch":
            return False
        return None if self.unset else self.spec_default


_RANKS = "the core runner generates in one process; give --backend nxdi-cpu --tp N for ranks (`logits --tp N` " \
         "runs them on the core runner)"

FLAGS = (
    Flag("--tp", "tp", "parallel", "tensor-parallel degree (logical cores per model replica; on CPU: ranks, one "
         "process each)", metavar="N", taken=EVERYWHERE - {CORE}, why_not=_RANKS),
    Flag("--ep", "ep", "parallel", "expert parallelism inside the --tp ranks (NxDI moe_ep_degree): experts split ep "
         "ways, each tp/ep ways; 4, 16 or 64 at --tp 64 --lnc 2 (token generation then runs every local expert)",
         metavar="E", taken=NEURON | {CPU}, why_not="the core runner has no expert parallelism"),
    Flag("--lnc", "lnc", "parallel", "physical NeuronCores per logical core: 1 or 2 (trn2's default: 2)"),
    Flag("--seq-len", "seq_len", "shape", "KV cache length (prompt + generated tokens)", taken=NEURON | {TRACE}),
    Flag("--max-context-length", "max_context_length", "shape", "prefill bucket: tokens per sequence in one prefill "
         "call (default: the chunk with --prefill-chunk, else --seq-len)"),
    Flag("--batch", "batch", "shape", "sequences decoded together (the KV cache's rows)", taken=NEURON | {TRACE}),
    Flag("--experts", "scheme", "experts", f"routed-expert format on device (default: what a converted checkpoint "
         f"holds; {DEFAULT_SCHEME}, exact from FP8 and INT4 sources, for a raw one, converted first into "
         f"$KIMI_K2_NEURON_CACHE/converted)", kind="choice", choices=SCHEMES, taken=NEURON | {TRACE, CPU},
         why_not="the core runner reads any checkpoint as it is"),
    Flag("--moe-prefill", "moe_prefill", "moe", "how prefill runs the routed experts: " + moe_paths.modes_help()
         + f" (default: {moe_paths.DEFAULT_MODE} where its kernel runs the model's shapes, else torch: tiny models)",
         kind="choice", choices=tuple(moe_paths.MODES), unset=True),
    Flag("--moe-decode", "moe_decode", "moe", "how token generation runs the routed experts, through NxD's public "
         "methods: selective = each token's top-k experts, one token at a time (forward_selective_loading; not with "
         "--ep); all-experts = every local expert for the whole batch (forward_all_experts, its EP variant with --ep) "
         "(default: the one kimi-k2-neuron plan's time model says is fastest at this --batch and --ep, where NxD picks "
         "by a fixed threshold; on CPU, NxD's threshold: docs/planner.md, \"Serving many users\")", kind="choice",
         choices=moe_paths.DECODE_PATHS, taken=NEURON | {CPU},
         why_not="the core runner computes each token's chosen experts, with no NxD path to choose"),
    Flag("--kv-shard", None, "layout", "none: every rank holds the whole latent KV cache; sequence: the ranks of a KV "
         "group split every sequence, position p on rank p %% G (NxDI's flash-decoding layout), and decode merges "
         "their partial attention (default: none; compile_and_save.py: any layout flag given, even --kv-shard none, "
         "builds the layout as given, not the planner's choice)", kind="choice", choices=("none", "sequence"),
         taken=EVERYWHERE - {CORE}, why_not=_RANKS, neutral=("none",)),
    Flag("--kv-group", "layout.kv_group", "layout", "with --kv-shard sequence: ranks per KV group, dividing --tp "
         "(default: --tp, one group)", metavar="G", taken=EVERYWHERE - {CORE}, why_not=_RANKS, unset=True),
    Flag("--prefill-chunk", "layout.prefill_chunk", "layout", "tokens per prefill call: a longer prompt runs as "
         "successive chunks, each attending to the cache written so far (default: the prompt in one call)",
         metavar="N", taken=EVERYWHERE),
    Flag("--shard-attn-a", "layout.shard_attn_a", "layout", "split attention's two input projections (q_a_proj, "
         "kv_a_proj_with_mqa) across the ranks by output rows and all-gather their output (one collective per layer) "
         "instead of holding them whole on every rank", kind="switch", taken=EVERYWHERE - {CORE, TRACE},
         why_not=_RANKS),
    Flag("--shard-router", "layout.shard_router", "layout", "split the float32 router across the ranks by experts "
         "and all-gather its logits (one collective per MoE layer); every rank still selects from the same float32 "
         "logits", kind="switch", taken=EVERYWHERE - {CORE, TRACE}, why_not=_RANKS),
    Flag("--prefix-caching", "prefix_caching", "cache", "vLLM's prefix caching (--enable-prefix-caching): the latent "
         "cache in NxDI's block layout, a pool of blocks shared by every sequence, so a request whose first blocks "
         "another one prefilled reads them instead of computing them (docs/vllm.md)", kind="switch",
         why_not="the block tables come from vLLM's scheduler"),
    Flag("--block-size", "block_size", "cache", "with --prefix-caching: positions per block (vLLM's --block-size), "
         "dividing --seq-len", metavar="N", why_not="the block tables come from vLLM's scheduler"),
    Flag("--num-blocks", "num_blocks", "cache", "with --prefix-caching: blocks in the pool (vLLM's "
         "--num-gpu-blocks-override), at least --batch x --seq-len / --block-size (default: that; more keeps more "
         "history for later turns to reuse)", metavar="N", why_not="the block tables come from vLLM's scheduler"),
    Flag("--no-on-device-sampling", None, "sampler", "return logits to the host instead", kind="switch",
         taken=frozenset({COMPILE})),
    Flag("--output-logits", "output_logits", "sampler", "also return logits with on-device sampling (needed by the "
         "logit-parity test)", kind="switch", taken=frozenset({COMPILE})),
    Flag("--global-topk", "sampling.global_topk", "sampler", "on-device sampling's top-k pre-selection",
         taken=frozenset({COMPILE})),
    Flag("--draft", "draft.path", "draft", "speculate with this EAGLE3 draft as downloaded (the Llama or MLA "
         "EAGLE3(.1) layout, config.json + safetensors; docs/speculative.md): NxDI's fused speculation, the target "
         "verifying --speculation-length tokens a step (default: no speculation)", kind="path", metavar="DIR",
         taken=NEURON | {CPU}, why_not="speculative decoding is NxDI's fused speculation", unset=True),
    Flag("--speculation-length", "draft.speculation_length", "draft", "with --draft: tokens the target verifies per "
         "step, the most one step emits; the draft proposes K - 1 (vLLM's num_speculative_tokens)", least=2,
         metavar="K", taken=NEURON | {CPU}, why_not="speculative decoding is NxDI's fused speculation", unset=True),
)
FLAG = {f.name: f for f in FLAGS}
