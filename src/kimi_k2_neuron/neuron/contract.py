"""What Kimi-K2 sets in NxDI: the NeuronConfig a RunSpec writes (and the RunSpec a saved one holds), the NeuronConfig
fields it refuses, the layout attribute saved beside them, the FP8 environment and the compiler arguments.

Needs torch and the core, not the Neuron SDK. Each choice cites by name the NxDI/NxD code in NXDI_CONTRACT.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.scheme import NXD_DTYPE, ExpertScheme
from kimi_k2_neuron.parallel import Layout

from . import moe_paths, rules
from .spec import LAYOUT_KEY, DraftSpec, RunSpec, Sampling, prefix_caching_buckets

# Dropless, GLU = silu(gate) * up, combine weights as the core router gives them; set on every construction
# (NXDI_CONTRACT.md: moe-settings, normalize-reload).
MOE_SETTINGS = {"capacity_factor": None, "glu_mlp": True, "glu_type": "glu", "normalize_top_k_affinities": False}
# NeuronConfig fields a converted checkpoint's record sets. Its quantization_per_channel_axis is not one: expert
# layers default it to 2 and accept only 2 (NXDI_CONTRACT.md: quant-fields, expert-per-channel-axis).
QUANT_FIELDS = ("quantized", "quantization_dtype", "quantization_type", "quantization_block_axis",
                "quantization_block_size", "quantization_scale_dtype")

# -- the layout: an InferenceConfig attribute, which survives NxDI's save and load where an unknown NeuronConfig field
# would not (NXDI_CONTRACT.md: layout-attribute) ------------------------------------------------------------------


def layout_attribute(layout: Layout) -> dict[str, Any]:
    return dataclasses.asdict(layout)


def layout_of(config) -> Layout:
    """The Layout an InferenceConfig (or a reload of one) carries; none: the replicated default."""
    value = getattr(config, LAYOUT_KEY, None)
    if value is None:
        return Layout()
    names = {f.name for f in dataclasses.fields(Layout)}
    if not isinstance(value, dict) or set(value) - names:
        raise KimiInputError(f"neuron_config.json field {LAYOUT_KEY}: expected an object with fields among "
                             f"{sorted(names)}, got {value!r}")
    group = value.get("kv_group", 1)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise KimiInputError(f"neuron_config.json field {LAYOUT_KEY}.kv_group: expected an integer >= 1 (1: the "
                             f"replicated cache), got {group!r}")
    try:
        return Layout(**value)
    except KimiInputError as e:  # Layout's own check (chunk_group), named by the field that holds it
        raise KimiInputError(f"neuron_config.json field {LAYOUT_KEY}.{e}") from None


# -- the RunSpec -> the NeuronConfig, and back ---------------------------------------------------------------------

def neuron_config_kwargs(cfg: KimiK2Config, spec: RunSpec) -> dict[str, Any]:
    """Keyword arguments for MoENeuronConfig (NXDI_CONTRACT.md: neuron-config), after every rule."""
    rules.check(cfg, spec)
    s, sampling = spec, spec.sampling
    kw: dict[str, Any] = dict(
        tp_degree=s.tp, seq_len=s.seq_len, max_context_length=s.context_length,
        # explicit, or ModelWrapper splits the batch into batch-1 calls (NXDI_CONTRACT.md: batch-sizes)
        batch_size=s.batch, ctx_batch_size=s.prefill_batch, tkg_batch_size=s.batch, max_batch_size=s.batch,
        kv_cache_batch_size=s.batch,
        padding_side="right", torch_dtype="bfloat16",
        # keeps the router's float32 parameters float32 (NXDI_CONTRACT.md: cast-type)
        cast_type="as-declared",
        save_sharded_checkpoint=True,
        **{k: v for k, v in MOE_SETTINGS.items() if k != "normalize_top_k_affinities"},
        disable_normalize_top_k_affinities=not MOE_SETTINGS["normalize_top_k_affinities"],
        router_config={"act_fn": "sigmoid", "dtype": "float32"},
        # without on-device sampling it would gather lm_head's logits twice (NXDI_CONTRACT.md: output-logits-gather)
        output_logits=s.output_logits and sampling.on_device,
        # as NxDI's Qwen3-MoE: we all-gather in the embedding (NXDI_CONTRACT.md: numeric-cc-token)
        disable_numeric_cc_token=True,
    )
    if s.continuous_batching or s.layout.prefill_chunk or s.prefix_caching:  # one row a prefill call
        kw["is_continuous_batching"] = True
    if s.prefix_caching:  # pa_num_blocks counts vLLM's null block (NXDI_CONTRACT.md: prefix-buckets, vllm-block-pool)
        prefill, prefix = prefix_caching_buckets(s)
        kw.update(is_block_kv_layout=True, is_prefix_caching=True, pa_block_size=s.block_size,
                  pa_num_blocks=s.pool_blocks + 1, enable_bucketing=True, context_encoding_buckets=prefill,
                  prefix_buckets=prefix, token_generation_buckets=[s.seq_len])
    # NxDI's cache sizing, masks and KV group; G: the layout attribute's (NXDI_CONTRACT.md: fd-config)
    if s.layout.sequence_sharded:
        kw["flash_decoding_enabled"] = True
    if s.lnc is not None:
        kw["logical_nc_config"] = s.lnc
    if s.ep > 1:
        kw.update(moe_ep_degree=s.ep, moe_tp_degree=s.tp // s.ep)
    # The MoE kernel's LNC defaults to the platform's, not to the NeuronConfig's (NXDI_CONTRACT.md: moe-kernel-lnc).
    lnc = {} if s.lnc is None else {"logical_nc_config": s.lnc}
    kw["blockwise_matmul_config"] = {**lnc, **moe_paths.mode(s.prefill_mode(cfg)).blockwise}
    if s.draft:  # NxDI's fused EAGLE3 speculation, no KV tiling (NXDI_CONTRACT.md: fused-spec, fused-kv-tiling)
        kw.update(enable_fused_speculation=True, enable_eagle_speculation=True, is_eagle3=True,
                  speculation_length=s.draft.speculation_length, disable_kv_cache_tiling=True)
    if sampling.on_device:
        kw["on_device_sampling_config"] = dict(**sampling.settings, dynamic=True, global_topk=sampling.global_topk)
    if s.scheme.quantized:
        kw.update({k: v for k, v in s.scheme.nxd(cfg.moe_intermediate_size).items() if k in QUANT_FIELDS})
        kw.update(quantized_checkpoints_path=s.checkpoint, modules_to_not_convert=modules_to_not_convert(cfg, s.layout))
    kw.update(s.extra)
    return kw


def modules_to_not_convert(cfg: KimiK2Config, layout: Layout = Layout()) -> list[str]:
    """Every non-expert parallel linear: expert-wise per-channel raises on any other
    (NXDI_CONTRACT.md: modules-to-not-convert); the router's with --shard-router (NXDI_CONTRACT.md: router-linear)."""
    dense = [f"layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    return ["embed_tokens", "lm_head", "self_attn", "shared_experts", *dense,
            *(["mlp.router"] if layout.shard_router else [])]


def spec_of(nc, layout: Layout, draft: DraftSpec | None = None) -> RunSpec:
    """The RunSpec a NeuronConfig holds (a reload, or one a framework built): what neuron_config_kwargs reads; the
    draft is its config's (fused_spec.draft_of)."""
    ods = getattr(nc, "on_device_sampling_config", None)
    sampling = Sampling(on_device=False) if ods is None else Sampling(
        do_sample=bool(getattr(ods, "do_sample", False)), top_k=getattr(ods, "top_k", 1),
        top_p=getattr(ods, "top_p", 1.0), temperature=getattr(ods, "temperature", 1.0),
        global_topk=getattr(ods, "global_topk", Sampling.global_topk))
    bmm = getattr(nc, "blockwise_matmul_config", None)
    return RunSpec(tp=nc.tp_degree, ep=getattr(nc, "moe_ep_degree", 1) or 1, lnc=getattr(nc, "logical_nc_config", None),
                   seq_len=nc.seq_len, max_context_length=nc.max_context_length,
                   batch=getattr(nc, "max_batch_size", None) or nc.batch_size,
                   scheme=ExpertScheme.from_nxd(vars(nc)), checkpoint=getattr(nc, "quantized_checkpoints_path", None),
                   sampling=sampling, output_logits=bool(getattr(nc, "output_logits", False)),
                   moe_prefill=None if bmm is None else moe_paths.mode_of(bmm),
                   continuous_batching=bool(getattr(nc, "is_continuous_batching", False)) and not layout.prefill_chunk
                   and not getattr(nc, "is_prefix_caching", False),
                   layout=layout, draft=draft, **(dict(prefix_caching=True, block_size=nc.pa_block_size,
                                                       num_blocks=nc.pa_num_blocks - 1)
                                                  if getattr(nc, "is_prefix_caching", False) else {}))


# -- what this port refuses of a NeuronConfig, on every construction (the reload too) ------------------------------

# (attribute, allowed values, why)
UNSUPPORTED = (
    ("sequence_parallel_enabled", (False,), "MLA attention here has no sequence-parallel path"),
    ("attention_dp_degree", (1,), "attention data parallel needs DataParallelKVCacheManager"),
    ("cp_degree", (1,), "context parallel attention is not implemented for MLA"),
    ("is_chunked_prefill", (False,), "NxDI's application raises NotImplementedError for it"),  # nxdi-chunked-prefill
    ("enable_token_tree", (False,), "EAGLE token trees are not implemented"),
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


def enforce_neuron_config(nc, cfg: KimiK2Config, layout: Layout, draft: DraftSpec | None = None) -> None:
    """Idempotent: runs on every construction, including the reload (NXDI_CONTRACT.md: normalize-reload): the fields
    no RunSpec sets, then the spec the NeuronConfig holds through the same rules the flags meet."""
    bad = _field_problems(nc, layout)
    try:
        spec = spec_of(nc, layout, draft)
        bad += derived_problems(nc, spec) + _speculation_problems(nc, spec)
        rules.check(cfg, spec)
    except KimiInputError as e:
        bad.append(rules.in_fields(str(e)))
    if bad:
        raise KimiInputError("unsupported NeuronConfig settings for Kimi-K2: " + "; ".join(bad))
    for name, value in MOE_SETTINGS.items():
        setattr(nc, name, value)
    nc.cast_type = "as-declared"
    rc = getattr(nc, "router_config", None)
    if rc is not None:  # unused by our router (the core's, float32), kept truthful for anything that reads it
        rc.act_fn, rc.dtype = "sigmoid", torch.float32


def _field_problems(nc, layout: Layout) -> list[str]:
    """What no RunSpec writes: NxDI features Kimi's model does not have, and settings that break its own."""
    bad = [f"{name}={getattr(nc, name)!r} ({why})" for name, ok, why in UNSUPPORTED
           if hasattr(nc, name) and getattr(nc, name) not in ok]
    if getattr(nc, "capacity_factor", None) != MOE_SETTINGS["capacity_factor"]:
        bad.append(f"capacity_factor={nc.capacity_factor} (drops prefill tokens; Kimi-K2 is dropless)")
    tkg_b, kv_b = getattr(nc, "tkg_batch_size", None), getattr(nc, "kv_cache_batch_size", None)
    if tkg_b is not None and kv_b is not None and tkg_b < kv_b:  # NXDI_CONTRACT.md: tkg-batch-below-kv-batch
        bad.append(f"tkg_batch_size={tkg_b} < kv_cache_batch_size={kv_b} (that KV update path assumes V is shaped "
                   f"like K; the latent V slot is 1 wide)")
    att = getattr(nc, "attention_dtype", None)  # NXDI_CONTRACT.md: cache-dtype
    if att is not None and att != getattr(nc, "torch_dtype", att):
        bad.append(f"attention_dtype={att} != torch_dtype={nc.torch_dtype} (the latent cache entry is written in "
                   f"torch_dtype)")
    bmm = getattr(nc, "blockwise_matmul_config", None)
    if bmm is not None:
        _restore_block_sharding_strategy(bmm)
        if moe_paths.mode_of(bmm) is None:  # NXDI_CONTRACT.md: blockwise-dispatch
            bad.append(f"blockwise_matmul_config={_blockwise_fields(bmm)} (none of --moe-prefill "
                       f"{', '.join(moe_paths.MODES)}; with no kernel flag at LNC=2 NxD 2.29 calls a kernel that only "
                       f"raises)")
        ep = getattr(nc, "moe_ep_degree", 1) or 1
        if ep > 1 and not getattr(bmm, "parallelize_token_to_block_mapping", True):  # NXDI_CONTRACT.md: spmd-rank
            bad.append("parallelize_token_to_block_mapping=False with EP (no spmd_rank for the local experts)")
    blocks, prefix = getattr(nc, "is_block_kv_layout", False), getattr(nc, "is_prefix_caching", False)
    if blocks != prefix:
        bad.append(f"is_block_kv_layout={blocks} with is_prefix_caching={prefix} (blocks for prefix caching only)")
    if layout.prefill_chunk and getattr(nc, "async_mode", False):
        # its path bypasses the chunk driver (NXDI_CONTRACT.md: async-bypasses-driver)
        bad.append("async_mode=True (NxDI's async path does not call _get_model_outputs, the chunk driver)")
    return bad + _bucket_problems(nc, layout)


def _bucket_problems(nc, layout: Layout) -> list[str]:
    """NxDI's get_cache_size divides each length by G (the manager pads max_length silently), and a context bucket's
    owned positions are every G-th (NXDI_CONTRACT.md: fd-cache-size, fd-cte-filter)."""
    if not getattr(nc, "flash_decoding_enabled", False):
        return []
    g, lengths = layout.kv_group, {"max_length": getattr(nc, "max_length", None)}
    for name in ("context_encoding_buckets", "token_generation_buckets"):
        lengths |= {f"{name}[{i}]": b for i, b in enumerate(getattr(nc, name, None) or ())}
    return [f"{name}={n} (not a multiple of {LAYOUT_KEY}.kv_group={g})" for name, n in lengths.items()
            if isinstance(n, int) and n % g]


def derived_problems(nc, spec: RunSpec) -> list[str]:
    """The fields neuron_config_kwargs derives from the spec, where a NeuronConfig (`spec_of` it) holds others."""
    bad = []
    if spec.layout.sequence_sharded and not getattr(nc, "flash_decoding_enabled", False):
        # (flash decoding at a group of 1 is NxDI's graph on one rank, as trace-cpu traces it)
        bad.append(f"flash_decoding_enabled=False with {LAYOUT_KEY}.kv_group={spec.layout.kv_group} (the "
                   f"sequence-sharded latent cache needs both; --kv-shard sequence sets them)")
    moe_tp = getattr(nc, "moe_tp_degree", None)  # NxDI checks none of EP (NXDI_CONTRACT.md: moe-ep-unchecked)
    if spec.ep > 1 and (not isinstance(moe_tp, int) or moe_tp * spec.ep != spec.tp):
        bad.append(f"moe_tp_degree={moe_tp} x moe_ep_degree={spec.ep} != tp_degree={spec.tp}")
    rows = getattr(nc, "ctx_batch_size", spec.prefill_batch)
    if spec.layout.prefill_chunk and (not getattr(nc, "is_continuous_batching", False) or rows != 1):
        # chunk 0 is one row's CTE call into its seq_id's cache line (NXDI_CONTRACT.md: continuous-batching)
        bad.append(f"is_continuous_batching={getattr(nc, 'is_continuous_batching', False)}, ctx_batch_size={rows} "
                   f"with {LAYOUT_KEY}.prefill_chunk={spec.layout.prefill_chunk} (each chunk is one row's call)")
    elif spec.continuous_batching and rows != 1:
        bad.append(f"continuous batching with a prefill batch of {rows}: NxDI's cache writes by seq_id take one "
                   f"sequence per prefill (ctx_batch_size 1)")
    return bad


def _speculation_problems(nc, spec: RunSpec) -> list[str]:
    """The only speculation this port runs (NXDI_CONTRACT.md: fused-spec); a vLLM request's flags are the plugin's."""
    fused = [f for f in ("enable_fused_speculation", "enable_eagle_speculation", "is_eagle3", "disable_kv_cache_tiling")
             if not getattr(nc, f, False)]
    return [f"speculation_length={spec.draft.speculation_length} without {', '.join(fused)} (Kimi-K2 speculates "
            f"through NxDI's fused EAGLE3 speculation only: --draft)"] if spec.draft and fused else []


def _restore_block_sharding_strategy(bmm) -> None:
    """A reloaded config holds the enum's __dict__ (NXDI_CONTRACT.md: strategy-reload); put the enum back."""
    value = getattr(bmm, "block_sharding_strategy", None)
    if isinstance(value, dict) and "_name_" in value:
        from neuronx_distributed.modules.moe.moe_configs import BlockShardStrategy

        bmm.block_sharding_strategy = BlockShardStrategy[value["_name_"]]


def _blockwise_fields(bmm) -> dict:
    keys = {k for m in moe_paths.MODES.values() for k in m.blockwise}
    return {k: getattr(getattr(bmm, k, None), "name", getattr(bmm, k, None)) for k in sorted(keys)}


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
