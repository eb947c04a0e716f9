"""What Kimi-K2 requires of NxDI, in one table, applied by the shell, its CPU harness and the fit planner.

Needs torch and the core, not the Neuron SDK. Each rule cites by name the NxDI/NxD code in NXDI_CONTRACT.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing
from kimi_k2_neuron.formats import DEFAULT_SCHEME, layout
from kimi_k2_neuron.formats.scheme import NXD_DTYPE, ExpertScheme
from kimi_k2_neuron.parallel import check_tp_divides, check_weight_sharding

from . import moe_paths
from .moe_paths import ALL_EXPERTS_BLOCK_SIZE, decodes_all_experts

# -- the Neuron SDK ----------------------------------------------------------------------------------------------

# (import name, pip name). torch_xla comes with torch-neuronx.
NEURON_PACKAGES = (
    ("neuronx_distributed_inference", "neuronx-distributed-inference"),
    ("neuronx_distributed", "neuronx-distributed"),
    ("torch_neuronx", "torch-neuronx"),
)


def missing_neuron_packages() -> list[str]:
    """pip names of the Neuron packages that cannot be imported (imported, not looked up: PyPI has placeholders)."""
    missing = []
    for module, pip_name in NEURON_PACKAGES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(pip_name)
    return missing


def require_neuron_sdk() -> None:
    """ImportError naming the missing Neuron packages, before any SDK import."""
    missing = missing_neuron_packages()
    if missing:
        raise ImportError(
            "kimi_k2_neuron.neuron needs the AWS Neuron SDK; missing: " + ", ".join(missing) + ". Use a Neuron DLAMI "
            "virtualenv (SDK 2.29+) or `pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
            + " ".join(missing) + "` (the PyPI packages of these names are placeholders); to run this NxDI model "
            "on CPU without them, build the nxdi-cpu venv from a clone of the kimi-k2-neuron repository: `bash "
            "scripts/build_nxdi_cpu_tier.sh VENV` (docs/nxdi_on_cpu.md). The CPU core (kimi_k2_neuron) works "
            "without them.")


# -- serving options -> MoENeuronConfig ---------------------------------------------------------------------------

# Dropless, GLU = silu(gate) * up, combine weights as the core router gives them; set on every construction
# (NXDI_CONTRACT.md: moe-settings, normalize-reload).
MOE_SETTINGS = {"capacity_factor": None, "glu_mlp": True, "glu_type": "glu", "normalize_top_k_affinities": False}
# NeuronConfig fields a converted checkpoint's record sets. Its quantization_per_channel_axis is not one: expert
# layers default it to 2 and accept only 2 (NXDI_CONTRACT.md: quant-fields, expert-per-channel-axis).
QUANT_FIELDS = ("quantized", "quantization_dtype", "quantization_type", "quantization_block_axis",
                "quantization_block_size", "quantization_scale_dtype")


@dataclass(frozen=True)
class LayoutOptions:
    """--kv-shard/--kv-group, --prefill-chunk, --shard-attn-a, --shard-router; the default replicates all."""

    # G: position p on rank p % G, slot p // G (NXDI_CONTRACT.md: fd-cache-size)
    kv_group: int | None = None
    prefill_chunk: int | None = None  # tokens per prefill graph call (batch 1); None: one call of the whole bucket
    shard_attn_a: bool = False  # q_a_proj + kv_a_proj_with_mqa split by output rows, all-gathered (parallel.py)
    shard_router: bool = False  # the router's experts split across the ranks, its float32 logits all-gathered

    @property
    def sequence_sharded(self) -> bool:
        return self.kv_group is not None

    @property
    def flags(self) -> list[str]:
        """The command-line flags that ask for this layout (none for the default)."""
        given = ((f"--kv-shard sequence --kv-group {self.kv_group}", self.sequence_sharded),
                 (f"--prefill-chunk {self.prefill_chunk}", self.prefill_chunk is not None),
                 ("--shard-attn-a", self.shard_attn_a), ("--shard-router", self.shard_router))
        return [flag for flag, on in given if on]


# NxDI's flash-decoding cache keeps this many slots per rank beyond seq_len / G: non-owners of a decoded token write
# it into the last one, which no mask exposes (NXDI_CONTRACT.md: fd-cache-size).
FD_RESERVED_SLOTS = 128


def cache_slots(seq_len: int, layout: LayoutOptions) -> int:
    """Latent cache slots per rank: NxDI's get_cache_size when sequence-sharded."""
    if not layout.sequence_sharded:
        return seq_len
    return seq_len // layout.kv_group + FD_RESERVED_SLOTS


def context_bucket(seq_len: int, layout: LayoutOptions, max_context_length: int | None = None) -> int:
    """The context-encoding bucket: --max-context-length, else the chunk, else the whole cache."""
    return max_context_length or layout.prefill_chunk or seq_len


def prefill_batch(batch: int, layout: LayoutOptions, continuous_batching: bool = False) -> int:
    """Rows of one prefill call. One per chunk: a batch-B chunk graph would hold B x chunk tokens of activations; one
    under continuous batching: each sequence into its own cache line (NXDI_CONTRACT.md: continuous-batching)."""
    return 1 if layout.prefill_chunk or continuous_batching else batch


def check_layout(cfg: KimiK2Config, tp: int, seq_len: int, context_len: int, layout: LayoutOptions) -> None:
    g, n = layout.kv_group, layout.prefill_chunk
    check_counts(*((flag, v) for flag, v in (("--kv-group", g), ("--prefill-chunk", n)) if v is not None))
    if g is not None:
        if tp % g:  # NxD's initialize_kv_group asserts it; the masks take rank % G (NXDI_CONTRACT.md: kv-group)
            raise KimiInputError(f"--kv-group {g}: must divide --tp {tp} (a KV group is G adjacent ranks)")
        if seq_len % g:
            raise KimiInputError(f"--seq-len {seq_len}: with --kv-shard sequence must be a multiple of --kv-group {g} "
                                 f"(NxDI's get_cache_size divides it; its cache manager would pad it silently)")
        # rank r keeps prefill positions r, r + G, ...; a chunk's own rule below (NXDI_CONTRACT.md: fd-cte-filter)
        if n is None and context_len % g:
            raise KimiInputError(f"--max-context-length {context_len}: with --kv-shard sequence must be a multiple of "
                                 f"--kv-group {g} (each rank writes every G-th position of a prefill)")
    if n is not None:
        if seq_len % n:
            raise KimiInputError(f"--prefill-chunk {n}: must divide --seq-len {seq_len} (the last chunk would write "
                                 f"past the cache)")
        if g is not None and n % g:
            raise KimiInputError(f"--prefill-chunk {n}: must be a multiple of --kv-group {g} (a chunk writes whole "
                                 f"stripes of positions, N / G slots on every rank)")
        if context_len != n:
            raise KimiInputError(f"--max-context-length {context_len}: with --prefill-chunk {n} the prefill bucket "
                                 f"is the chunk; leave it out or give {n}")
    check_weight_sharding(cfg, tp, layout.shard_attn_a, layout.shard_router)


# The InferenceConfig attribute holding the layout, which survives NxDI's save and load where an unknown NeuronConfig
# field would not (NXDI_CONTRACT.md: layout-attribute).
LAYOUT_KEY = "kimi_k2_layout"


def layout_attribute(layout: LayoutOptions) -> dict[str, Any]:
    return dataclasses.asdict(layout)


def layout_of(config) -> LayoutOptions:
    """The LayoutOptions an InferenceConfig (or a reload of one) carries; none: the replicated default."""
    value = getattr(config, LAYOUT_KEY, None)
    if value is None:
        return LayoutOptions()
    names = {f.name for f in dataclasses.fields(LayoutOptions)}
    if not isinstance(value, dict) or set(value) - names:
        raise KimiInputError(f"neuron_config.json field {LAYOUT_KEY}: expected an object with fields among "
                             f"{sorted(names)}, got {value!r}")
    return LayoutOptions(**value)


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """One compiled configuration: the arguments of scripts/compile_and_save.py."""

    tp: int  # ranks (logical cores); attention, embedding, lm_head and the shared expert split tp ways
    scheme: ExpertScheme
    ep: int = 1  # NxDI moe_ep_degree, not NxD's global ep_degree (see UNSUPPORTED)
    lnc: int | None = 2  # None: NxDI's choice (NEURON_LOGICAL_NC_CONFIG, else the platform's)
    seq_len: int = 1024
    max_context_length: int | None = None  # CTE bucket; NxDI defaults it to seq_len
    batch: int = 1
    checkpoint: str | None = None  # converted checkpoint folder (NxDI requires a path when quantized)
    on_device_sampling: bool = True
    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    global_topk: int = 256
    output_logits: bool = False
    moe_prefill: str = moe_paths.DEFAULT_MODE  # how prefill runs the routed experts (moe_paths.MODES)
    # one sequence per prefill into its seq_id's line (NXDI_CONTRACT.md: continuous-batching)
    continuous_batching: bool = False
    # the long-context layout; an InferenceConfig attribute (LAYOUT_KEY), not a NeuronConfig field. Its prefill_chunk
    # is the CTE bucket, then the chunk submodel's width (neuron/chunked_prefill.py), one row a call
    layout: LayoutOptions = LayoutOptions()
    extra: dict = field(default_factory=dict)  # passed through as further NeuronConfig kwargs (checked by NxDI)

    @property
    def context_length(self) -> int:
        return context_bucket(self.seq_len, self.layout, self.max_context_length)

    @property
    def prefill_batch(self) -> int:
        return prefill_batch(self.batch, self.layout, self.continuous_batching)


def neuron_config_kwargs(cfg: KimiK2Config, o: ServeOptions) -> dict[str, Any]:
    """Keyword arguments for MoENeuronConfig (NXDI_CONTRACT.md: neuron-config)."""
    check_serve_options(cfg, o)
    kw: dict[str, Any] = dict(
        tp_degree=o.tp,
        seq_len=o.seq_len,
        max_context_length=o.context_length,
        # explicit, or ModelWrapper splits the batch into batch-1 calls (NXDI_CONTRACT.md: batch-sizes)
        batch_size=o.batch,
        ctx_batch_size=o.prefill_batch,
        tkg_batch_size=o.batch,
        max_batch_size=o.batch,
        kv_cache_batch_size=o.batch,
        padding_side="right",
        torch_dtype="bfloat16",
        # keeps the router's float32 parameters float32 (NXDI_CONTRACT.md: cast-type)
        cast_type="as-declared",
        save_sharded_checkpoint=True,
        **{k: v for k, v in MOE_SETTINGS.items() if k != "normalize_top_k_affinities"},
        disable_normalize_top_k_affinities=not MOE_SETTINGS["normalize_top_k_affinities"],
        router_config={"act_fn": "sigmoid", "dtype": "float32"},
        # without on-device sampling it would gather lm_head's logits twice (NXDI_CONTRACT.md: output-logits-gather)
        output_logits=o.output_logits and o.on_device_sampling,
        # as NxDI's Qwen3-MoE: we all-gather in the embedding (NXDI_CONTRACT.md: numeric-cc-token)
        disable_numeric_cc_token=True,
    )
    if o.continuous_batching or o.layout.prefill_chunk:  # the CTE writes chunk 0 into its row's line, one row a call
        kw["is_continuous_batching"] = True
    # NxDI's cache sizing, masks and KV group; G: the config's (NXDI_CONTRACT.md: fd-config)
    if o.layout.sequence_sharded:
        kw["flash_decoding_enabled"] = True
    if o.lnc is not None:
        kw["logical_nc_config"] = o.lnc
    if o.ep > 1:
        kw.update(moe_ep_degree=o.ep, moe_tp_degree=o.tp // o.ep)
    # The MoE kernel's LNC defaults to the platform's, not to the NeuronConfig's (NXDI_CONTRACT.md: moe-kernel-lnc).
    lnc = {} if o.lnc is None else {"logical_nc_config": o.lnc}
    kw["blockwise_matmul_config"] = {**lnc, **moe_paths.mode(o.moe_prefill).blockwise}
    if o.on_device_sampling:
        kw["on_device_sampling_config"] = dict(do_sample=o.do_sample, top_k=o.top_k, top_p=o.top_p,
                                               temperature=o.temperature, dynamic=True, global_topk=o.global_topk)
    if o.scheme.quantized:
        kw.update({k: v for k, v in o.scheme.nxd(cfg.moe_intermediate_size).items() if k in QUANT_FIELDS})
        kw.update(quantized_checkpoints_path=o.checkpoint,
                  modules_to_not_convert=modules_to_not_convert(cfg, o.layout))
    kw.update(o.extra)
    return kw


def modules_to_not_convert(cfg: KimiK2Config, layout: LayoutOptions = LayoutOptions()) -> list[str]:
    """Every non-expert parallel linear: expert-wise per-channel raises on any other
    (NXDI_CONTRACT.md: modules-to-not-convert); the router's with --shard-router (NXDI_CONTRACT.md: router-linear)."""
    dense = [f"layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    return ["embed_tokens", "lm_head", "self_attn", "shared_experts", *dense,
            *(["mlp.router"] if layout.shard_router else [])]


# -- the parallel layout and the MoE prefill --------------------------------------------------------------------------

# --ep layouts by (tp, lnc) that NxD's trn2 replica groups support (NXDI_CONTRACT.md: ep-replica-groups); 8 x 8 is
# documented unsupported and 32 x 2 mixes EP halves. Kimi-K2 fits only at TP=64 LNC=2.
EP_LAYOUTS = {(64, 2): (1, 4, 16, 64)}


def ep_layout_supported(tp: int, ep: int, lnc: int | None) -> bool:
    return ep == 1 or ep in EP_LAYOUTS.get((tp, lnc), ())


def check_ep(cfg: KimiK2Config, tp: int, ep: int, lnc: int | None, batch: int) -> None:
    """lnc None skips the layout rule; enforce_neuron_config re-checks the resolved config."""
    if tp % ep or cfg.n_routed_experts % ep:
        raise KimiInputError(f"--ep {ep}: must divide --tp {tp} and n_routed_experts={cfg.n_routed_experts}")
    if ep == 1:
        return
    if lnc is not None and not ep_layout_supported(tp, ep, lnc):
        raise KimiInputError(f"--ep {ep} at --tp {tp} --lnc {lnc}: not an expert layout NxD's replica groups "
                             f"support; use --ep in {list(EP_LAYOUTS.get((tp, lnc), (1,)))}")
    if not decodes_all_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch):
        need = -(-cfg.n_routed_experts // cfg.num_experts_per_tok)
        raise KimiInputError(f"--ep {ep} with --batch {batch}: NxD decodes with EP > 1 only on the all-experts "
                             f"path, which needs batch >= {need} (n_routed_experts / num_experts_per_tok)")


def check_compile_options(cfg: KimiK2Config, tp, ep, lnc, seq_len, context_len, batch, moe_prefill,
                          layout: LayoutOptions = LayoutOptions(), prefill_rows: int | None = None) -> None:
    """What NxD can compile, naming the refused argument. lnc None skips the LNC rules (re-checked at enforce)."""
    check_counts(("--tp", tp), ("--ep", ep), ("--seq-len", seq_len), ("--batch", batch))
    if seq_len > cfg.max_position_embeddings:  # positions past it are not the model's (YaRN is scaled to it)
        raise KimiInputError(f"--seq-len {seq_len}: exceeds config.json field max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    if lnc not in (None, 1, 2):
        raise KimiInputError(f"--lnc {lnc!r}: expected 1 or 2 (physical NeuronCores per logical core on trn2)")
    if isinstance(context_len, bool) or not isinstance(context_len, int) or not 1 <= context_len <= seq_len:
        # the bucket is the chunk unless --max-context-length was given: name the flag the user gave
        flag = "--prefill-chunk" if context_len == layout.prefill_chunk else "--max-context-length"
        raise KimiInputError(f"{flag} {context_len!r}: expected 1..--seq-len {seq_len}")
    check_tp_divides(cfg, tp, split_embedding_dim=True)  # NxD's embedding shards the embedding dim
    check_layout(cfg, tp, seq_len, context_len, layout)
    check_ep(cfg, tp, ep, lnc, batch)
    rows = prefill_rows or prefill_batch(batch, layout)
    moe_paths.check_prefill_mode(cfg, moe_prefill, tp, ep, lnc, context_len * rows)


def check_counts(*named) -> None:
    for name, v in named:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KimiInputError(f"{name} {v!r}: expected an integer >= 1")


def check_moe_tp(scheme: ExpertScheme, cfg: KimiK2Config, tp: int, ep: int) -> None:
    """The experts' scales shard only for the expert TP degrees (tp / ep) whose slices hold whole scale blocks."""
    valid = scheme.nxd(cfg.moe_intermediate_size)["valid_moe_tp_degrees"]
    if tp // ep not in valid:
        raise KimiInputError(f"--tp {tp} --ep {ep}: experts split {tp // ep} ways (tp / ep), but {scheme.name} "
                             f"expert scales of block {scheme.block} shard only {valid} ways")


# -- what this port refuses ------------------------------------------------------------------------------------------

def check_serve_options(cfg: KimiK2Config, o: ServeOptions) -> None:
    check_compile_options(cfg, o.tp, o.ep, o.lnc, o.seq_len, o.context_length, o.batch, o.moe_prefill, o.layout,
                          prefill_rows=o.prefill_batch)
    check_moe_tp(o.scheme, cfg, o.tp, o.ep)
    if o.scheme.quantized and not o.checkpoint:
        raise KimiInputError(f"--experts {o.scheme.name}: needs a converted checkpoint (kimi-k2-neuron convert), "
                             f"whose config.json records the expert quantization")
    if o.on_device_sampling:
        check_top_k(o.top_k, o.global_topk)


def check_top_k(top_k: int, global_topk: int = ServeOptions.global_topk) -> None:
    """NxDI's on-device sampler draws from at most the compiled global top-k."""
    if not 1 <= top_k <= global_topk:
        raise KimiInputError(f"--top-k {top_k}: on-device sampling needs 1 <= top_k <= {global_topk}")


# (attribute, allowed values, why)
UNSUPPORTED = (
    ("sequence_parallel_enabled", (False,), "MLA attention here has no sequence-parallel path"),
    ("attention_dp_degree", (1,), "attention data parallel needs DataParallelKVCacheManager"),
    ("cp_degree", (1,), "context parallel attention is not implemented for MLA"),
    ("is_block_kv_layout", (False,), "the latent cache uses the contiguous layout"),
    ("is_prefix_caching", (False,), "prefix caching needs the block layout"),
    ("is_chunked_prefill", (False,), "chunked prefill needs the block layout"),
    ("speculation_length", (0,), "speculative decoding is not implemented"),
    ("enable_fused_speculation", (False,), "speculative decoding is not implemented"),
    ("is_medusa", (False,), "Medusa is not implemented"),
    # NXDI_CONTRACT.md: layer-boundary-markers
    ("layer_boundary_markers", (False,), "per-layer KV update is not implemented"),
    ("attn_block_tkg_nki_kernel_enabled", (False,), "the GQA attention kernels do not compute MLA"),
    ("k_cache_transposed", (False,), "the latent cache is read untransposed"),
    ("kv_cache_tiling", (False,), "the V slot is 1 wide; a tiled layout is not handled"),
    ("kv_cache_quant", (False,), "the latent cache stays bf16"),
    ("kv_quant_config", (None,), "the latent cache stays bf16"),
    ("padding_side", ("right",), "masks assume right padding"),
    ("moe_fused_nki_kernel_enabled", (None, False), "the stock fused TKG kernel cannot apply the selection-only bias"),
    # NxD's global EP would count the shared expert ep times (NXDI_CONTRACT.md: global-ep-shared-expert).
    ("ep_degree", (1,), "global EP counts the shared expert ep times; --ep sets moe_ep_degree"),
    ("hybrid_sharding_config", (None, False), "hybrid MoE sharding is not wired"),
    ("lora_config", (None, False), "LoRA is not implemented"),
    # The decoder layer returns no residual (NXDI_CONTRACT.md: fused-residual-add).
    ("qkv_kernel_fuse_residual_add", (False,), "the QKV kernel does not compute MLA; the layer returns no residual"),
    # NXDI_CONTRACT.md: tkg-batch-below-kv-batch
    ("token_generation_batches", (None,), "batch bucketing scatters V with K's index shape (latent V is 1 wide)"),
    # NXDI_CONTRACT.md: windowed-context-encoding
    ("windowed_context_encoding_size", (None,), "windowed context encoding is not implemented for MLA"),
)


def enforce_neuron_config(nc, n_experts: int | None = None, top_k: int | None = None,
                          kv_group: int | None = None) -> None:
    """Idempotent: runs on every construction, including the reload (NXDI_CONTRACT.md: normalize-reload). kv_group:
    the config's layout's (layout_of)."""
    bad = [f"{name}={getattr(nc, name)!r} ({why})" for name, ok, why in UNSUPPORTED
           if hasattr(nc, name) and getattr(nc, name) not in ok]
    if getattr(nc, "capacity_factor", None) != MOE_SETTINGS["capacity_factor"]:
        bad.append(f"capacity_factor={nc.capacity_factor} (drops prefill tokens; Kimi-K2 is dropless)")
    tkg_b, kv_b = getattr(nc, "tkg_batch_size", None), getattr(nc, "kv_cache_batch_size", None)
    if tkg_b is not None and kv_b is not None and tkg_b < kv_b:  # NXDI_CONTRACT.md: tkg-batch-below-kv-batch
        bad.append(f"tkg_batch_size={tkg_b} < kv_cache_batch_size={kv_b} (that KV update path assumes V is shaped "
                   f"like K; the latent V slot is 1 wide)")
    # NXDI_CONTRACT.md: cache-dtype
    att = getattr(nc, "attention_dtype", None)
    if att is not None and att != getattr(nc, "torch_dtype", att):
        bad.append(f"attention_dtype={att} != torch_dtype={nc.torch_dtype} (the latent cache entry is written in "
                   f"torch_dtype)")
    bad += _moe_ep_problems(nc, n_experts, top_k)
    bad += _flash_decoding_problems(nc, kv_group)
    bmm = getattr(nc, "blockwise_matmul_config", None)
    if bmm is not None:
        _restore_block_sharding_strategy(bmm)
        if moe_paths.mode_of(bmm) is None:  # NXDI_CONTRACT.md: blockwise-dispatch
            bad.append(f"blockwise_matmul_config={_blockwise_fields(bmm)} (none of --moe-prefill "
                       f"{', '.join(moe_paths.MODES)}; with no kernel flag at LNC=2 NxD 2.29 calls a kernel that only "
                       f"raises)")
    if bad:
        raise KimiInputError("unsupported NeuronConfig settings for Kimi-K2: " + "; ".join(bad))
    for name, value in MOE_SETTINGS.items():
        setattr(nc, name, value)
    nc.cast_type = "as-declared"
    rc = getattr(nc, "router_config", None)
    if rc is not None:  # unused by our router (the core's, float32), kept truthful for anything that reads it
        rc.act_fn, rc.dtype = "sigmoid", torch.float32


def check_chunked_prefill(nc, chunk: int | None) -> None:
    """What the chunked-prefill driver needs of the NeuronConfig, on every construction including the reload."""
    if chunk is None:
        return
    bad = []
    if getattr(nc, "async_mode", False):  # its path bypasses the driver (NXDI_CONTRACT.md: async-bypasses-driver)
        bad.append("async_mode=True (NxDI's async path does not call _get_model_outputs, the chunk driver)")
    if nc.max_context_length != chunk:
        bad.append(f"max_context_length={nc.max_context_length} (the CTE bucket is the chunk, {chunk})")
    if nc.seq_len % chunk:
        bad.append(f"seq_len={nc.seq_len} (not a multiple of the chunk {chunk}: the last chunk would write past it)")
    if not nc.is_continuous_batching or nc.ctx_batch_size != 1:
        # NXDI_CONTRACT.md: continuous-batching
        bad.append(f"is_continuous_batching={nc.is_continuous_batching}, ctx_batch_size={nc.ctx_batch_size} (chunk 0 "
                   f"is one row's CTE call into its seq_id's cache line)")
    if bad:
        raise KimiInputError(f"prefill_chunk={chunk}: " + "; ".join(bad))


def _restore_block_sharding_strategy(bmm) -> None:
    """A reloaded config holds the enum's __dict__ (NXDI_CONTRACT.md: strategy-reload); put the enum back."""
    value = getattr(bmm, "block_sharding_strategy", None)
    if isinstance(value, dict) and "_name_" in value:
        from neuronx_distributed.modules.moe.moe_configs import BlockShardStrategy

        bmm.block_sharding_strategy = BlockShardStrategy[value["_name_"]]


def _blockwise_fields(bmm) -> dict:
    keys = {k for m in moe_paths.MODES.values() for k in m.blockwise}
    return {k: getattr(getattr(bmm, k, None), "name", getattr(bmm, k, None)) for k in sorted(keys)}


def _flash_decoding_problems(nc, kv_group: int | None) -> list[str]:
    """check_layout's rules for the sequence-sharded cache on any NeuronConfig (NXDI_CONTRACT.md: fd-config,
    fd-cache-size, kv-group, fd-cte-filter)."""
    fd = bool(getattr(nc, "flash_decoding_enabled", False))
    if fd != (kv_group is not None):
        return [f"flash_decoding_enabled={fd} with {LAYOUT_KEY}.kv_group={kv_group} (the sequence-sharded latent cache "
                f"needs both; --kv-shard sequence sets them)"]
    if not fd:
        return []
    tp = getattr(nc, "tp_degree", None)
    if isinstance(kv_group, bool) or not isinstance(kv_group, int) or kv_group < 1 or (tp and tp % kv_group):
        return [f"{LAYOUT_KEY}.kv_group={kv_group!r} (a KV group is G adjacent ranks: G must divide tp_degree={tp})"]
    lengths = {"max_length": getattr(nc, "max_length", None), "max_context_length": getattr(nc, "max_context_length",
                                                                                              None)}
    for name in ("context_encoding_buckets", "token_generation_buckets"):
        lengths |= {f"{name}[{i}]": b for i, b in enumerate(getattr(nc, name, None) or ())}
    # get_cache_size divides each length by G (the manager pads max_length silently), and a context bucket's
    # owned positions are every G-th (NXDI_CONTRACT.md: fd-cache-size, fd-cte-filter)
    return [f"{name}={n} (not a multiple of {LAYOUT_KEY}.kv_group={kv_group})" for name, n in lengths.items()
            if isinstance(n, int) and n % kv_group]


def _moe_ep_problems(nc, n_experts: int | None, top_k: int | None) -> list[str]:
    """check_serve_options' EP rules on any NeuronConfig; NxDI checks none (NXDI_CONTRACT.md: moe-ep-unchecked)."""
    ep, tp = getattr(nc, "moe_ep_degree", 1) or 1, getattr(nc, "tp_degree", None)
    if ep <= 1:
        return []
    out = []
    moe_tp = getattr(nc, "moe_tp_degree", None)
    if not isinstance(moe_tp, int) or moe_tp * ep != tp:
        out.append(f"moe_tp_degree={moe_tp} x moe_ep_degree={ep} != tp_degree={tp}")
    batch = getattr(nc, "tkg_batch_size", None) or getattr(nc, "max_batch_size", None)
    if n_experts and top_k and batch and not decodes_all_experts(n_experts, top_k, batch):
        out.append(f"moe_ep_degree={ep} with batch {batch}: NxD decodes EP only on all experts, which needs "
                   f"batch x top_k >= {n_experts}")
    if not ep_layout_supported(tp, ep, getattr(nc, "logical_nc_config", None)):
        out.append(f"moe_ep_degree={ep} at tp_degree={tp} (not an expert layout NxD's replica groups support)")
    bmm = getattr(nc, "blockwise_matmul_config", None)
    if bmm is not None and not getattr(bmm, "parallelize_token_to_block_mapping", True):  # NXDI_CONTRACT.md: spmd-rank
        out.append("parallelize_token_to_block_mapping=False with EP (no spmd_rank for the local experts)")
    if bmm is not None and getattr(bmm, "block_size", 0) >= ALL_EXPERTS_BLOCK_SIZE:
        # NXDI_CONTRACT.md: all-experts-no-ep
        out.append("all-experts prefill with EP (NxD has no EP variant of it)")
    return out


# -- a serving framework's request (vllm-neuron) ----------------------------------------------------------------------

# vllm-neuron loads precompiled artifacts from this folder, else compiles into it (NXDI_CONTRACT.md: vllm-precompiled).
COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"


@dataclass(frozen=True)
class ServingRequest:
    """The run's shape from vllm-neuron's generic NeuronConfig, and nothing else
    (NXDI_CONTRACT.md: vllm-generic-config)."""

    tp: int  # vLLM's --tensor-parallel-size
    batch: int  # --max-num-seqs: the KV cache lines and the decode batch
    seq_len: int  # --max-model-len
    context_length: int  # the longest prefill (--max-model-len)
    dtype: Any  # --dtype
    lnc: int | None = None
    ep: int = 1
    on_device_sampling: bool = True
    global_topk: int = ServeOptions.global_topk
    continuous_batching: bool = False
    prefill_batch: int = 1
    prefix_caching: bool = False
    block_layout: bool = False
    chunked_prefill: bool = False
    on_cpu: bool = False  # NxD's CPU mode (the nxdi-cpu tests)

    @classmethod
    def of(cls, nc) -> "ServingRequest":
        ods = getattr(nc, "on_device_sampling_config", None)
        return cls(tp=nc.tp_degree, batch=nc.batch_size, seq_len=nc.seq_len, context_length=nc.max_context_length,
                   dtype=nc.torch_dtype, lnc=getattr(nc, "logical_nc_config", None),
                   ep=getattr(nc, "moe_ep_degree", 1) or 1, on_device_sampling=ods is not None,
                   global_topk=getattr(ods, "global_topk", ServeOptions.global_topk),
                   continuous_batching=bool(getattr(nc, "is_continuous_batching", False)),
                   prefill_batch=getattr(nc, "ctx_batch_size", nc.batch_size),
                   prefix_caching=bool(getattr(nc, "is_prefix_caching", False)),
                   block_layout=bool(getattr(nc, "is_block_kv_layout", False)),
                   chunked_prefill=bool(getattr(nc, "is_chunked_prefill", False)),
                   on_cpu=bool(getattr(nc, "on_cpu", False)))

    def describe(self) -> str:
            return (f"--tensor-parallel-size {self.tp} --max-num-seqs {self.batch} --max-model-len {self.seq_len} "
                f"--dtype {str(self.dtype).removeprefix('torch.')}")


def check_request(r: ServingRequest) -> None:
    if r.chunked_prefill:
        raise KimiInputError("chunked prefill (vllm-neuron's with DISABLE_NEURON_CUSTOM_SCHEDULER=1) needs NxDI's "
                             "block KV layout, which Kimi-K2's latent cache does not have; unset "
                             "DISABLE_NEURON_CUSTOM_SCHEDULER")
    if r.prefix_caching or r.block_layout:
        raise KimiInputError("--enable-prefix-caching (on by default in vLLM) needs NxDI's block KV layout, which "
                             "Kimi-K2's latent cache does not have; pass --no-enable-prefix-caching")
    if r.dtype != torch.bfloat16:
        raise KimiInputError(f"--dtype {str(r.dtype).removeprefix('torch.')}: Kimi-K2 runs in bfloat16 on Neuron; "
                             f"pass --dtype bfloat16")
    if r.continuous_batching and r.prefill_batch != 1:
        raise KimiInputError(f"continuous batching with a prefill batch of {r.prefill_batch}: NxDI's cache writes "
                             f"by seq_id take one sequence per prefill (ctx_batch_size 1)")


def request_options(cfg: KimiK2Config, r: ServingRequest, record, checkpoint) -> ServeOptions:
    """The request's shape, the checkpoint's experts (record: a ConversionRecord), the rest ServeOptions'."""
    check_request(r)
    if record is None:
        raise KimiInputError(f"{checkpoint}: a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron "
                             f"convert {checkpoint} DST --experts {DEFAULT_SCHEME}, then serve DST")
    mode = moe_paths.default_mode(cfg, r.tp, r.ep, r.lnc, r.context_length * r.prefill_batch)
    return ServeOptions(tp=r.tp, ep=r.ep, lnc=r.lnc, seq_len=r.seq_len, max_context_length=r.context_length,
                        batch=r.batch, scheme=record.scheme, checkpoint=str(checkpoint),
                        on_device_sampling=r.on_device_sampling, global_topk=r.global_topk, moe_prefill=mode,
                        continuous_batching=r.continuous_batching,
                        extra={"on_cpu": True} if r.on_cpu else {})


def compiled_mismatches(r: ServingRequest, nc) -> list[str]:
    """Smaller than compiled is served, more is not (NXDI_CONTRACT.md: vllm-precompiled)."""
    bad = []
    if r.tp != nc.tp_degree:
        bad.append(f"--tensor-parallel-size {r.tp}, compiled for TP {nc.tp_degree}")
    if r.batch > nc.max_batch_size:
        bad.append(f"--max-num-seqs {r.batch} > the compiled batch {nc.max_batch_size}")
    if r.seq_len > nc.seq_len:
        bad.append(f"--max-model-len {r.seq_len} > the compiled seq_len {nc.seq_len}")
    elif r.context_length > nc.max_context_length:
        bad.append(f"--max-model-len {r.seq_len}: prompts that long need a prefill of {r.context_length} tokens, "
                   f"compiled for {nc.max_context_length}")
    if r.continuous_batching and not (nc.is_continuous_batching and nc.ctx_batch_size == 1):
        bad.append(f"--max-num-seqs {r.batch} runs NxDI's continuous batching, compiled without it "
                   f"(is_continuous_batching={nc.is_continuous_batching}, ctx_batch_size={nc.ctx_batch_size})")
    ods = nc.on_device_sampling_config
    if ods is not None and not ods.dynamic:
        bad.append("compiled with static on-device sampling, which ignores each request's temperature, top_k, top_p")
    return bad


# -- the FP8 environment and compiler arguments ------------------------------------------------------------------

# read when torch-xla is imported, so set before (NXDI_CONTRACT.md: fp8-environment)
FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}


def fp8_env(quantized: bool, quantization_dtype: str | None) -> dict[str, str]:
    return dict(FP8_ENV) if quantized and quantization_dtype == NXD_DTYPE else {}


# Added to NxDI's own args as the DeepSeek-V3 and Qwen3-MoE ports do; DGE for selective loading's per-token
# gathers (NXDI_CONTRACT.md: compiler-args).
KIMI_COMPILER_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation",
                      "--internal-enable-dge-levels vector_dynamic_offsets")


def compiler_args(nxdi_args: str) -> str:
    """NxDI's args plus those KIMI_COMPILER_ARGS no NxDI flag contradicts."""
    clashes = {"--enable-mixed-precision-accumulation": "--disable-mixed-precision-accumulation",
               "--internal-enable-dge-levels vector_dynamic_offsets": "--internal-enable-dge-levels"}
    extra = [f for f in KIMI_COMPILER_ARGS if f not in nxdi_args and clashes.get(f, f) not in nxdi_args]
    return " ".join([nxdi_args.strip(), *extra])


# -- the checkpoint in the model's state dict -------------------------------------------------------------------------

def expected_keys(cfg: KimiK2Config, scheme: ExpertScheme, options: LayoutOptions = LayoutOptions()) -> set[str]:
    """No spmd_rank tensor: NxD generates it (NXDI_CONTRACT.md: spmd-rank)."""
    return set(layout.neuron_tensors(cfg, scheme, options.shard_attn_a, options.shard_router))


def to_neuron_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: KimiK2Config, nc,
                         where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Strict both ways, unlike NxD (NXDI_CONTRACT.md: sharding-not-strict); shapes and FP8 dtypes checked before NxD
    shards or casts them (NXDI_CONTRACT.md: checkpoint-dtype-cast). The replicated layout's keys: see
    for_layout."""
    scheme = ExpertScheme.from_nxd(vars(nc))
    experts = scheme.name
    want = layout.neuron_tensors(cfg, scheme)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if layout.is_ignored(key):
            continue
        nk = layout.module_key(key)
        if nk in out:
            raise KimiInputError(f"{where}: two tensors load into {nk} (the second is {key})")
        out[nk] = tensor
    unexpected, missing = sorted(set(out) - set(want)), sorted(set(want) - set(out))
    if unexpected:
        per_expert = any(layout.is_routed_expert(k) for k in unexpected)
        hint = ("; per-expert HF tensors: a raw checkpoint, to convert first (kimi-k2-neuron convert SRC DST "
                f"--experts {experts})") if per_expert else ""
        raise KimiInputError(f"{where}: {len(unexpected)} tensor(s) the model has no place for (experts={experts}): "
                             f"{listing(unexpected)}{hint}")
    if missing:
        raise KimiInputError(f"{where}: {len(missing)} tensor(s) missing for experts={experts}: {listing(missing)}")
    for name, (dtype, shape) in want.items():
        _check_tensor(out[name], name, dtype, shape, scheme.quantized, where, experts)
    out["rank_util.rank"] = torch.arange(nc.tp_degree, dtype=torch.int32)
    return out


def for_layout(state: dict[str, torch.Tensor], cfg: KimiK2Config, options: LayoutOptions) -> dict[str, torch.Tensor]:
    """to_neuron_state_dict's tensors in the layers the sharded weights build (NXDI_CONTRACT.md: gathered-linear):
    q_a_proj | kv_a_proj_with_mqa concatenated by rows (bf16 both, unquantized: only the routed experts are FP8, so
    there is no scale to fuse), the router weight under its linear. In place; the converted checkpoint is unchanged."""
    for i in range(cfg.num_hidden_layers):
        if options.shard_attn_a:
            state[layout.fused_attention_a_key(i)] = torch.cat([state.pop(k) for k in layout.attention_a_keys(i)])
        if options.shard_router and cfg.is_moe_layer(i):
            state[layout.router_weight_key(i, linear=True)] = state.pop(layout.router_weight_key(i))
    return state


def _check_tensor(t: torch.Tensor, name: str, dtype, shape, fp8: bool, where: str, experts: str) -> None:
    if tuple(t.shape) != shape:
        raise KimiInputError(f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
    expert = ".expert_mlps." in name
    if expert and fp8 and t.dtype != dtype:
        raise KimiInputError(f"{where}: tensor {name} is {t.dtype}, expected {dtype} for experts={experts}")
    if not expert and t.dtype == torch.float8_e4m3fn:
        raise KimiInputError(f"{where}: tensor {name} is FP8; only routed experts may be (dequantize the rest)")


# -- generation, NxD's CPU mode, pre-sharding ----------------------------------------------------------------------

def check_prompt_lengths(lengths: list[int]) -> None:
    """NxDI's HF adapter mispositions a one-token row among longer ones (NXDI_CONTRACT.md: adapter-pad-positions)."""
    if not lengths or min(lengths) < 1:
        raise KimiInputError("every prompt needs at least one token")
    if min(lengths) == 1 < max(lengths):
        raise KimiInputError("a one-token prompt cannot share a batch with longer prompts (NxDI's HF adapter "
                             "positions its padding wrongly); run it in a batch of its own")


def sampler_settings(temperature: float, top_k: int, top_p: float) -> dict:
    """temperature 0 is greedy; top_k 0 becomes global_topk (NxDI's sampler always filters)."""
    if temperature <= 0:
        return {"do_sample": False, "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    return {"do_sample": True, "temperature": temperature, "top_k": top_k or ServeOptions.global_topk,
            "top_p": top_p}


def check_cpu_run(torch_dtype, tp: int, moe_ep: int | None) -> None:
    """NXDI_CONTRACT.md: cpu-mode-limits. The harness also sets on_cpu, or NxDI's sampler takes its device-only
    branches (NXDI_CONTRACT.md: device-sampler)."""
    if torch_dtype not in (torch.float32, torch.bfloat16) or (torch_dtype == torch.bfloat16 and tp > 1):
        dtype = str(torch_dtype).removeprefix("torch.")
        raise KimiInputError(f"--dtype {dtype} at --tp {tp}: NxD's CPU mode runs float32, or bfloat16 at "
                             f"--tp 1 (gloo has no bfloat16 collectives)")
    if (moe_ep or 1) > 1:
        raise KimiInputError(f"--ep {moe_ep}: NxD's MoE expert parallelism does not run in its CPU mode (its "
                             f"expert-rank lookup reads the XLA process group's _mesh, which gloo groups lack: "
                             f"NXDI_CONTRACT.md: cpu-mode-limits); use --ep 1 on CPU")


# NxD holds every rank's ~10 GB shard until the last is written; passes of 8 bound it at ~85 GB
# (NXDI_CONTRACT.md: presharding-memory).
SHARD_RANKS_PER_PASS = 8
# transforms every rank after sharding, so one pass (NXDI_CONTRACT.md: layout-transformation)
LAYOUT_TRANSFORM_ENV = "NXD_LAYOUT_TRANSFORMATION_OPTIONS"


def rank_passes(start: int, size: int, env: Mapping[str, str],
                per_pass: int = SHARD_RANKS_PER_PASS) -> list[tuple[int, int]]:
    """(start_rank_id, local_ranks_size) windows covering [start, start + size)."""
    if LAYOUT_TRANSFORM_ENV in env:
        return [(start, size)]
    return [(s, min(per_pass, start + size - s)) for s in range(start, start + size, per_pass)]
