"""What Kimi-K2 requires of NxDI, in one table: the SDK, the NeuronConfig it compiles with and what it refuses, the
parallel layout and MoE prefill rules (with moe_paths.py), the FP8 environment and compiler arguments, the
checkpoint's keys in the model's state dict, and the rules of generation, NxD's CPU mode and pre-sharding. The
shell's modules and its CPU harness (kimi_k2_neuron.nxdi_cpu) apply it, and so does the fit planner.

Pure: this module needs torch and the core, not the Neuron SDK. The NxDI/NxD code each rule rests on is cited by
name from NXDI_CONTRACT.md beside this file (file:line at NxDI @4bcdc54, NxD @fbac349).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing
from kimi_k2_neuron.formats import DEFAULT_SCHEME, layout
from kimi_k2_neuron.formats.scheme import NXD_DTYPE, ExpertScheme
from kimi_k2_neuron.parallel import check_tp_divides

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
    """pip names of the Neuron packages that cannot be imported. An import is attempted (not just looked up)
    because PyPI serves placeholder packages under these names that install fine and raise ImportError."""
    missing = []
    for module, pip_name in NEURON_PACKAGES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(pip_name)
    return missing


def require_neuron_sdk() -> None:
    """Raise the ImportError naming the missing Neuron packages; the SDK-backed modules call it before their SDK
    imports."""
    missing = missing_neuron_packages()
    if missing:
        raise ImportError(
            "kimi_k2_neuron.neuron needs the AWS Neuron SDK; missing: " + ", ".join(missing) + ". Use a Neuron DLAMI "
            "virtualenv (SDK 2.29+) or `pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
            + " ".join(missing) + "` (the PyPI packages of these names are placeholders); to run this NxDI model "
            "on CPU without them, see docs/nxdi_on_cpu.md in the kimi-k2-neuron repository. The CPU core "
            "(kimi_k2_neuron) works without them.")


# -- serving options -> MoENeuronConfig ---------------------------------------------------------------------------

# Kimi's MoE in NxD's terms: dropless (no capacity factor, which drops prefill tokens), GLU = silu(gate) * up, and
# the router's combine weights used as they are (the core router normalizes and scales them). neuron_config_kwargs
# passes this to MoENeuronConfig, enforce_neuron_config sets it again on every construction, and build_moe
# (modeling.py) reads it from the NeuronConfig (NXDI_CONTRACT.md: moe-settings, normalize-reload).
MOE_SETTINGS = {"capacity_factor": None, "glu_mlp": True, "glu_type": "glu", "normalize_top_k_affinities": False}
# NeuronConfig fields a converted checkpoint's record sets. Its quantization_per_channel_axis is not one: expert
# layers default it to 2 and accept only 2 (NXDI_CONTRACT.md: quant-fields, expert-per-channel-axis).
QUANT_FIELDS = ("quantized", "quantization_dtype", "quantization_type", "quantization_block_axis",
                "quantization_block_size", "quantization_scale_dtype")


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """One compiled configuration: the arguments of scripts/compile_and_save.py."""

    tp: int  # ranks (logical cores); attention, embedding, lm_head and the shared expert split tp ways
    # How the routed experts are stored: the converted checkpoint's (ConversionRecord.scheme), or BF16_EXPERTS.
    scheme: ExpertScheme
    # Expert parallelism inside those ranks (NxDI moe_ep_degree / moe_tp_degree): routed experts split ep ways, each
    # expert's intermediate tp / ep ways. Not NxD's global ep_degree (see UNSUPPORTED).
    ep: int = 1
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
    # NxDI's continuous batching, as vllm-neuron runs it: prefill one sequence per call (ctx_batch_size 1) into the
    # cache line its seq_id names, decode all `batch` lines together (NXDI_CONTRACT.md: continuous-batching).
    continuous_batching: bool = False
    extra: dict = field(default_factory=dict)  # passed through as further NeuronConfig kwargs (checked by NxDI)

    @property
    def context_length(self) -> int:
        return self.seq_len if self.max_context_length is None else self.max_context_length

    @property
    def prefill_batch(self) -> int:
        """Rows of one prefill (context-encoding) call."""
        return 1 if self.continuous_batching else self.batch


def neuron_config_kwargs(cfg: KimiK2Config, o: ServeOptions) -> dict[str, Any]:
    """Keyword arguments for MoENeuronConfig (NXDI_CONTRACT.md: neuron-config)."""
    check_serve_options(cfg, o)
    kw: dict[str, Any] = dict(
        tp_degree=o.tp,
        seq_len=o.seq_len,
        max_context_length=o.context_length,
        # Only batch_size sets all four (NXDI_CONTRACT.md: batch-sizes); setting them explicitly makes the CTE and
        # TKG graphs really compile at this batch, instead of ModelWrapper splitting a bigger batch into batch-1 calls.
        batch_size=o.batch,
        ctx_batch_size=o.prefill_batch,
        tkg_batch_size=o.batch,
        max_batch_size=o.batch,
        kv_cache_batch_size=o.batch,
        padding_side="right",
        torch_dtype="bfloat16",
        # "as-declared": the router weight and e_score_correction_bias are float32 parameters of the core router;
        # cast_type "config" would make them bf16 at build time (NXDI_CONTRACT.md: cast-type).
        cast_type="as-declared",
        save_sharded_checkpoint=True,
        **{k: v for k, v in MOE_SETTINGS.items() if k != "normalize_top_k_affinities"},
        disable_normalize_top_k_affinities=not MOE_SETTINGS["normalize_top_k_affinities"],
        router_config={"act_fn": "sigmoid", "dtype": "float32"},
        # Without on-device sampling lm_head already gathers the logits (gather_output=True) and they are the output;
        # output_logits would all-gather them a second time along the vocab, giving [B, 1, tp * vocab]
        # (NXDI_CONTRACT.md: output-logits-gather).
        output_logits=o.output_logits and o.on_device_sampling,
        # As NxDI's Qwen3-MoE and the DSV3 contrib: we all-gather in the embedding (shard_across_embedding), the
        # on-device top-k and output_logits (NXDI_CONTRACT.md: numeric-cc-token).
        disable_numeric_cc_token=True,
    )
    if o.continuous_batching:
        kw["is_continuous_batching"] = True
    if o.lnc is not None:
        kw["logical_nc_config"] = o.lnc
    if o.ep > 1:  # MoE-internal EP: build_moe's initialize_moe_process_group makes the groups
        kw.update(moe_ep_degree=o.ep, moe_tp_degree=o.tp // o.ep)
    # The MoE kernel's LNC defaults to the platform's, not to the NeuronConfig's (NXDI_CONTRACT.md: moe-kernel-lnc).
    lnc = {} if o.lnc is None else {"logical_nc_config": o.lnc}
    kw["blockwise_matmul_config"] = {**lnc, **moe_paths.mode(o.moe_prefill).blockwise}
    if o.on_device_sampling:
        kw["on_device_sampling_config"] = dict(do_sample=o.do_sample, top_k=o.top_k, top_p=o.top_p,
                                               temperature=o.temperature, dynamic=True, global_topk=o.global_topk)
    if o.scheme.quantized:
        kw.update({k: v for k, v in o.scheme.nxd(cfg.moe_intermediate_size).items() if k in QUANT_FIELDS})
        kw.update(quantized_checkpoints_path=o.checkpoint, modules_to_not_convert=modules_to_not_convert(cfg))
    kw.update(o.extra)
    return kw


def modules_to_not_convert(cfg: KimiK2Config) -> list[str]:
    """Every non-expert parallel linear, as NxD matches them: substrings of the dotted module path from the model
    root (NXDI_CONTRACT.md: modules-to-not-convert). Expert-wise per-channel raises on a layer without experts, so
    nothing may slip through. q_a_proj/kv_a_proj_with_mqa and the router are plain nn.Linear/nn.Module and never
    converted."""
    dense = [f"layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    return ["embed_tokens", "lm_head", "self_attn", "shared_experts", *dense]


# -- the parallel layout and the MoE prefill --------------------------------------------------------------------------

# --ep layouts by (tp, lnc): NxD builds the MoE groups with its trn2 replica-group logic (NXDI_CONTRACT.md:
# ep-replica-groups): at 64 ranks on LNC=2, 4 x 16, 16 x 4 and 64 x 1 (tp x replicas) are documented to work, 8 x 8
# as unsupported, and 32 x 2 mixes the two EP halves in one expert-TP group; 1 x 64 is what NxDI's MiniMax-M3 contrib
# runs. Kimi-K2 fits only at TP=64 LNC=2, so no other layout is listed.
EP_LAYOUTS = {(64, 2): (1, 4, 16, 64)}


def ep_layout_supported(tp: int, ep: int, lnc: int | None) -> bool:
    return ep == 1 or ep in EP_LAYOUTS.get((tp, lnc), ())


def check_ep(cfg: KimiK2Config, tp: int, ep: int, lnc: int | None, batch: int) -> None:
    """The expert parallelism NxD can run for this model. lnc None (NxDI resolves it later) skips the layout rule;
    enforce_neuron_config re-checks the resolved config."""
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
                          prefill_batch: int | None = None) -> None:
    """The parallel layout and MoE prefill settings NxD can compile for this model, naming the argument it refuses
    (check_serve_options, the fit planner and NxD's CPU mode all call this). lnc None (NxDI resolves it later) skips
    the LNC rules; enforce_neuron_config re-checks the resolved config. prefill_batch: rows of one prefill call
    (default `batch`; 1 under continuous batching)."""
    check_counts(("--tp", tp), ("--ep", ep), ("--seq-len", seq_len), ("--batch", batch))
    if seq_len > cfg.max_position_embeddings:  # positions past it are not the model's (YaRN is scaled to it)
        raise KimiInputError(f"--seq-len {seq_len}: exceeds config.json field max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    if lnc not in (None, 1, 2):
        raise KimiInputError(f"--lnc {lnc!r}: expected 1 or 2 (physical NeuronCores per logical core on trn2)")
    if isinstance(context_len, bool) or not isinstance(context_len, int) or not 1 <= context_len <= seq_len:
        raise KimiInputError(f"--max-context-length {context_len!r}: expected 1..--seq-len {seq_len}")
    check_tp_divides(cfg, tp, split_embedding_dim=True)  # NxD's embedding shards the embedding dim
    check_ep(cfg, tp, ep, lnc, batch)
    moe_paths.check_prefill_mode(cfg, moe_prefill, tp, ep, lnc, context_len * (prefill_batch or batch))


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
    """Refuse a configuration that cannot compile or would compute something else, naming the argument."""
    check_compile_options(cfg, o.tp, o.ep, o.lnc, o.seq_len, o.context_length, o.batch, o.moe_prefill,
                          o.prefill_batch)
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


# NxDI features this port does not implement, as (attribute, allowed values, why).
UNSUPPORTED = (
    ("sequence_parallel_enabled", (False,), "MLA attention here has no sequence-parallel path"),
    ("flash_decoding_enabled", (False,), "the latent cache is not split across cores"),
    ("attention_dp_degree", (1,), "attention data parallel needs DataParallelKVCacheManager"),
    ("cp_degree", (1,), "context parallel attention is not implemented for MLA"),
    ("is_block_kv_layout", (False,), "the latent cache uses the contiguous layout"),
    ("is_prefix_caching", (False,), "prefix caching needs the block layout"),
    ("is_chunked_prefill", (False,), "chunked prefill needs the block layout"),
    ("speculation_length", (0,), "speculative decoding is not implemented"),
    ("enable_fused_speculation", (False,), "speculative decoding is not implemented"),
    ("is_medusa", (False,), "Medusa is not implemented"),
    # NXDI_CONTRACT.md: layer-boundary-markers
    ("layer_boundary_markers", (False,), "per-layer KV update is not implemented (model_base.py:1299-1305)"),
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


def enforce_neuron_config(nc, n_experts: int | None = None, top_k: int | None = None) -> None:
    """Check and set what this model needs on an (MoE)NeuronConfig. Idempotent: add_derived_config runs it on every
    construction, including NxDI's reload from neuron_config.json (NXDI_CONTRACT.md: normalize-reload)."""
    bad = [f"{name}={getattr(nc, name)!r} ({why})" for name, ok, why in UNSUPPORTED
           if hasattr(nc, name) and getattr(nc, name) not in ok]
    if getattr(nc, "capacity_factor", None) != MOE_SETTINGS["capacity_factor"]:
        bad.append(f"capacity_factor={nc.capacity_factor} (drops prefill tokens; Kimi-K2 is dropless)")
    tkg_b, kv_b = getattr(nc, "tkg_batch_size", None), getattr(nc, "kv_cache_batch_size", None)
    if tkg_b is not None and kv_b is not None and tkg_b < kv_b:  # NXDI_CONTRACT.md: tkg-batch-below-kv-batch
        bad.append(f"tkg_batch_size={tkg_b} < kv_cache_batch_size={kv_b} (that KV update path assumes V is shaped "
                   f"like K; the latent V slot is 1 wide)")
    # The cache is allocated in attention_dtype and written with updates in that dtype; the layer produces the
    # latent in torch_dtype (NXDI_CONTRACT.md: cache-dtype).
    att = getattr(nc, "attention_dtype", None)
    if att is not None and att != getattr(nc, "torch_dtype", att):
        bad.append(f"attention_dtype={att} != torch_dtype={nc.torch_dtype} (the latent cache entry is written in "
                   f"torch_dtype)")
    bad += _moe_ep_problems(nc, n_experts, top_k)
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


def _restore_block_sharding_strategy(bmm) -> None:
    """NxDI saves the strategy enum in neuron_config.json as the enum's __dict__ and NxD's from_kwargs converts only
    strings back (NXDI_CONTRACT.md: strategy-reload): a reloaded config would hand the kernel a dict. Put the enum
    back, by name."""
    value = getattr(bmm, "block_sharding_strategy", None)
    if isinstance(value, dict) and "_name_" in value:
        from neuronx_distributed.modules.moe.moe_configs import BlockShardStrategy

        bmm.block_sharding_strategy = BlockShardStrategy[value["_name_"]]


def _blockwise_fields(bmm) -> dict:
    keys = {k for m in moe_paths.MODES.values() for k in m.blockwise}
    return {k: getattr(getattr(bmm, k, None), "name", getattr(bmm, k, None)) for k in sorted(keys)}


def _moe_ep_problems(nc, n_experts: int | None, top_k: int | None) -> list[str]:
    """What check_serve_options guarantees for moe_ep_degree > 1, re-checked on any NeuronConfig (a reloaded
    neuron_config.json, `extra`): NxDI checks none of it (NXDI_CONTRACT.md: moe-ep-unchecked). The batch rule
    needs the model's expert count and top-k."""
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
        out.append("parallelize_token_to_block_mapping=False with EP (no spmd_rank for the local experts, "
                   "expert_mlps_v2.py:121-138)")
    if bmm is not None and getattr(bmm, "block_size", 0) >= ALL_EXPERTS_BLOCK_SIZE:
        # NXDI_CONTRACT.md: all-experts-no-ep
        out.append("all-experts prefill with EP (no EP variant, expert_mlps_v2.py:1492-1494)")
    return out


# -- a serving framework's request (vllm-neuron) ----------------------------------------------------------------------

# vllm-neuron loads precompiled artifacts from this folder, else compiles into it (NXDI_CONTRACT.md: vllm-precompiled).
COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"


@dataclass(frozen=True)
class ServingRequest:
    """What a serving framework asks of the model, read from the generic NeuronConfig it builds from its own flags
    (vllm-neuron: NXDI_CONTRACT.md: vllm-generic-config). The model takes the run's shape from it and nothing else:
    the rest of its NeuronConfig is this contract's for the checkpoint (request_options)."""

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
        """The request in vLLM's flags."""
        return (f"--tensor-parallel-size {self.tp} --max-num-seqs {self.batch} --max-model-len {self.seq_len} "
                f"--dtype {str(self.dtype).removeprefix('torch.')}")


def check_request(r: ServingRequest) -> None:
    """Refuse, naming vLLM's flag, a request this model cannot serve (before anything is built or loaded)."""
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
    """The options this contract compiles for a serving request on `checkpoint`, whose conversion record (a
    formats.record.ConversionRecord) is `record`: the request's shape, the checkpoint's experts, everything else
    ServeOptions' own. Refuses a raw checkpoint and what check_request refuses."""
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
    """What keeps the NeuronConfig `nc` of precompiled artifacts from serving request `r`, in vLLM's flags. A
    smaller batch or shorter sequences than compiled are served (NxDI pads the batch; the cache is longer than
    needed); more are not (NXDI_CONTRACT.md: vllm-precompiled)."""
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

# The e4m3 reinterpretation NxDI asks for with FP8 weights, read when torch-xla is imported, so it must be set
# before; NxDI adds the matching compiler flag itself when quantization_dtype is exactly NXD_DTYPE
# (NXDI_CONTRACT.md: fp8-environment).
FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}


def fp8_env(quantized: bool, quantization_dtype: str | None) -> dict[str, str]:
    """The environment a NeuronConfig with these quantization fields needs before anything is traced or run."""
    return dict(FP8_ENV) if quantized and quantization_dtype == NXD_DTYPE else {}


# What Kimi adds to NxDI's own per-submodel neuronx-cc arguments (NXDI_CONTRACT.md: compiler-args). As the
# DeepSeek-V3 and Qwen3-MoE ports: saturating casts, fp32 accumulation (unless NxDI's long-context mode turned it off
# on purpose), and vector dynamic-offset DGE for the per-token expert gathers of selective loading (unless NxDI
# already chose DGE levels).
KIMI_COMPILER_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation",
                      "--internal-enable-dge-levels vector_dynamic_offsets")


def compiler_args(nxdi_args: str) -> str:
    """One submodel's neuronx-cc arguments: NxDI's own for it, plus KIMI_COMPILER_ARGS where they do not contradict
    a flag NxDI set."""
    clashes = {"--enable-mixed-precision-accumulation": "--disable-mixed-precision-accumulation",
               "--internal-enable-dge-levels vector_dynamic_offsets": "--internal-enable-dge-levels"}
    extra = [f for f in KIMI_COMPILER_ARGS if f not in nxdi_args and clashes.get(f, f) not in nxdi_args]
    return " ".join([nxdi_args.strip(), *extra])


# -- the checkpoint in the model's state dict -------------------------------------------------------------------------

def expected_keys(cfg: KimiK2Config, scheme: ExpertScheme) -> set[str]:
    """Every tensor the loader must deliver for the Neuron model: the format's (formats.layout.neuron_tensors) and
    no spmd_rank tensor, which NxD generates itself (NXDI_CONTRACT.md: spmd-rank); the loader adds rank_util.rank."""
    return set(layout.neuron_tensors(cfg, scheme))


def to_neuron_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: KimiK2Config, nc,
                         where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the Neuron model's state dict, by the format's key map, strict both ways where NxD
    would drop an unexpected key with a warning and skip a missing one (NXDI_CONTRACT.md: sharding-not-strict).
    Shapes of full tensors are checked here, before NxD shards them, and FP8 expert weights must be float8_e4m3fn and
    their scales float32, which NxD would silently cast (NXDI_CONTRACT.md: checkpoint-dtype-cast). Adds
    rank_util.rank, the per-rank index NeuronBaseModel's SPMDRank reads."""
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
    """Refuse a batch NxDI's HuggingFaceGenerationAdapter would get wrong: it gives right-padding slots position 1,
    so a one-token row among longer ones reads its first token from a pad slot and decodes from position 2
    (NXDI_CONTRACT.md: adapter-pad-positions)."""
    if not lengths or min(lengths) < 1:
        raise KimiInputError("every prompt needs at least one token")
    if min(lengths) == 1 < max(lengths):
        raise KimiInputError("a one-token prompt cannot share a batch with longer prompts (NxDI's HF adapter "
                             "positions its padding wrongly); run it in a batch of its own")


def sampler_settings(temperature: float, top_k: int, top_p: float) -> dict:
    """Generation's do_sample/temperature/top_k/top_p for the CPU runner's (temperature, top_k, top_p), where
    temperature 0 is greedy and top_k 0 means no filter: NxDI's sampler always filters, at most its global top-k
    (ServeOptions.global_topk), so 0 becomes that."""
    if temperature <= 0:
        return {"do_sample": False, "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    return {"do_sample": True, "temperature": temperature, "top_k": top_k or ServeOptions.global_topk,
            "top_p": top_p}


def check_cpu_run(torch_dtype, tp: int, moe_ep: int | None) -> None:
    """What NeuronKimiK2ForCausalLM.to_cpu needs of a NeuronConfig's fields: gloo has no bfloat16 collectives (NxDI's
    to_cpu refuses bf16 at TP > 1) and NxD no float16 CPU path; NxD's MoE expert parallelism needs XLA process
    groups (NXDI_CONTRACT.md: cpu-mode-limits). The CPU harness also sets on_cpu, without which NxDI's sampler takes
    its device branches, whose argmax and top-k are device-only ops (NXDI_CONTRACT.md: device-sampler)."""
    if torch_dtype not in (torch.float32, torch.bfloat16) or (torch_dtype == torch.bfloat16 and tp > 1):
        raise KimiInputError(f"--dtype {torch_dtype} at --tp {tp}: NxD's CPU mode runs float32, or bfloat16 at "
                             f"--tp 1 (gloo has no bfloat16 collectives)")
    if (moe_ep or 1) > 1:
        raise KimiInputError(f"--ep {moe_ep}: NxD's MoE expert parallelism does not run in its CPU mode (its "
                             f"expert-rank lookup reads the XLA process group's _mesh, parallel_state.py:991, which "
                             f"gloo groups lack); use --ep 1 on CPU")


# NxD's shard_checkpoint keeps every rank's sharded dict until the last rank is written, and the stride-2 split of
# gate_up makes each rank's part a real copy: ~10 GB per rank for Kimi-K2, ~680 GB for 64 ranks at once. Sharding a
# few ranks per pass bounds it at ~85 GB (NXDI_CONTRACT.md: presharding-memory).
SHARD_RANKS_PER_PASS = 8
# NxD's weight-layout option transforms the window the builder had at trace time, i.e. every rank, after sharding:
# it must run once (NXDI_CONTRACT.md: layout-transformation).
LAYOUT_TRANSFORM_ENV = "NXD_LAYOUT_TRANSFORMATION_OPTIONS"


def rank_passes(start: int, size: int, env: Mapping[str, str],
                per_pass: int = SHARD_RANKS_PER_PASS) -> list[tuple[int, int]]:
    """(start_rank_id, local_ranks_size) windows that together cover [start, start + size), for pre-sharding."""
    if LAYOUT_TRANSFORM_ENV in env:
        return [(start, size)]
    return [(s, min(per_pass, start + size - s)) for s in range(start, start + size, per_pass)]
