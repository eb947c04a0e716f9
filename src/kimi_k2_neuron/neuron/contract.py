"""What Kimi-K2 sets in NxDI: the NeuronConfig a RunSpec derives (one way: nothing reads a RunSpec back from a
NeuronConfig), the RunSpec saved whole on the InferenceConfig and read back on a reload, the NeuronConfig fields it
refuses, the FP8 environment and the compiler arguments.

Needs torch and the core, not the Neuron SDK. Each choice cites by name the NxDI/NxD code in NXDI_CONTRACT.md.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.scheme import NXD_DTYPE
from kimi_k2_neuron.placement import Layout

from . import moe_paths, rules
from .spec import RUN_SPEC_KEY, RunSpec, prefix_caching_buckets

# Dropless, GLU = silu(gate) * up, combine weights as the core router gives them; set on every construction
# (NXDI_CONTRACT.md: moe-settings, normalize-reload).
MOE_SETTINGS = {"capacity_factor": None, "glu_mlp": True, "glu_type": "glu", "normalize_top_k_affinities": False}
# NeuronConfig fields a converted checkpoint's record sets. Its quantization_per_channel_axis is not one: expert
# layers default it to 2 and accept only 2 (NXDI_CONTRACT.md: quant-fields, expert-per-channel-axis).
QUANT_FIELDS = ("quantized", "quantization_dtype", "quantization_type", "quantization_block_axis",
                "quantization_block_size", "quantization_scale_dtype")


# -- the RunSpec on the InferenceConfig: saved whole as JSON, an attribute that survives NxDI's save and load where an
# unknown NeuronConfig field would not (NXDI_CONTRACT.md: layout-attribute, config-construction) --------------------

# The typed spec beside each config, as core_config is: NxDI saves every attribute to neuron_config.json
_SPECS: "weakref.WeakKeyDictionary[Any, RunSpec]" = weakref.WeakKeyDictionary()


def adopt_run_spec(config, cfg: KimiK2Config) -> RunSpec:
    """The RunSpec an InferenceConfig carries, kept typed beside it and saved on it as JSON. A build put the RunSpec
    itself there, after rules.check (KimiK2InferenceConfig.for_serving); a reload holds the JSON, which is read and
    put through the same rules here: once per build either way."""
    value = getattr(config, RUN_SPEC_KEY, None)
    if isinstance(value, RunSpec):
        spec = value
    else:
        spec = saved_run_spec(value)
        try:
            rules.check(cfg, spec)
        except KimiInputError as e:
            raise KimiInputError(f"neuron_config.json field {RUN_SPEC_KEY} (as the flags would ask): {e}") from None
    setattr(config, RUN_SPEC_KEY, spec.to_json())
    _SPECS[config] = spec
    return spec


def saved_run_spec(value) -> RunSpec:
    """A RunSpec from neuron_config.json's RUN_SPEC_KEY; none there: not compiled by this package (or by one before it
    saved the spec)."""
    if value is None:
        raise KimiInputError(f"neuron_config.json: no field {RUN_SPEC_KEY}: not compiled by this version of "
                             f"kimi-k2-neuron; compile again with scripts/compile_and_save.py")
    return RunSpec.from_json(value, f"neuron_config.json field {RUN_SPEC_KEY}")


def run_spec(config) -> RunSpec:
    """The RunSpec of an InferenceConfig that adopt_run_spec has seen (or a copy of one: read from its JSON)."""
    spec = _SPECS.get(config)
    return spec if spec is not None else saved_run_spec(getattr(config, RUN_SPEC_KEY, None))


# -- the RunSpec -> the NeuronConfig, one way ---------------------------------------------------------------------

def neuron_config_kwargs(cfg: KimiK2Config, spec: RunSpec) -> dict[str, Any]:
    """Keyword arguments for MoENeuronConfig (NXDI_CONTRACT.md: neuron-config) of a spec the rules passed: the fields
    it derives, and its extra ones, which may add fields but never change a derived one (enforce_neuron_config)."""
    return {**derived_fields(cfg, spec), **spec.extra}


def derived_fields(cfg: KimiK2Config, spec: RunSpec) -> dict[str, Any]:
    """The NeuronConfig fields the spec's own fields decide."""
    s, sampling = spec, spec.sampling
    kw: dict[str, Any] = dict(
        tp_degree=s.tp, seq_len=s.seq_len, max_context_length=s.context_length,
        # explicit, or ModelWrapper splits the batch into batch-1 calls (NXDI_CONTRACT.md: batch-sizes)
        batch_size=s.batch, ctx_batch_size=s.prefill_batch, tkg_batch_size=s.batch, max_batch_size=s.batch,
        kv_cache_batch_size=s.batch,
        padding_side="right", torch_dtype=s.dtype,
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
    if s.one_row_prefill:  # each prefill into its row's line (a chunked prefill's chunk 0 too), one row a call
        kw["is_continuous_batching"] = True
    # the latent cache in blocks for vLLM's prefix caching only, else contiguous (named either way: a reload that
    # holds the other is refused); pa_num_blocks counts vLLM's null block (NXDI_CONTRACT.md: prefix-buckets,
    # vllm-block-pool)
    kw.update(is_block_kv_layout=s.prefix_caching, is_prefix_caching=s.prefix_caching)
    if s.prefix_caching:
        prefill, prefix = prefix_caching_buckets(s)
        kw.update(pa_block_size=s.block_size, pa_num_blocks=s.pool_blocks + 1, enable_bucketing=True,
                  context_encoding_buckets=prefill, prefix_buckets=prefix, token_generation_buckets=[s.seq_len])
    # NxDI's cache sizing, masks and KV group; G: the run spec's layout (NXDI_CONTRACT.md: fd-config)
    if s.layout.sequence_sharded:
        kw["flash_decoding_enabled"] = True
    if s.lnc is not None:
        kw["logical_nc_config"] = s.lnc
    if s.ep > 1:  # NxDI checks none of EP; differing_fields does (NXDI_CONTRACT.md: moe-ep-unchecked)
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
    return kw


def modules_to_not_convert(cfg: KimiK2Config, layout: Layout = Layout()) -> list[str]:
    """Every non-expert parallel linear: expert-wise per-channel raises on any other
    (NXDI_CONTRACT.md: modules-to-not-convert); the router's with --shard-router (NXDI_CONTRACT.md: router-linear)."""
    dense = [f"layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    return ["embed_tokens", "lm_head", "self_attn", "shared_experts", *dense,
            *(["mlp.router"] if layout.shard_router else [])]


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


def enforce_neuron_config(nc, spec: RunSpec, expected, derived: dict) -> None:
    """Idempotent: runs on every construction, including the reload (NXDI_CONTRACT.md: normalize-reload): the fields
    no RunSpec sets; the spec's extra fields against the ones it derives (`derived`: derived_fields'), which they may
    add to but never change; then every field of nc against `expected`, the NeuronConfig the spec's fields make
    (derived and extra): one a neuron_config.json holds otherwise is named."""
    bad = _field_problems(nc, spec.layout)
    bad += [f"{name}={_plain(value)!r} (the run spec {RUN_SPEC_KEY} implies {_plain(derived[name])!r})"
            for name, value in spec.extra.items() if name in derived and _plain(value) != _plain(derived[name])]
    bad += differing_fields(nc, expected)
    if bad:
        raise KimiInputError("unsupported NeuronConfig settings for Kimi-K2: " + "; ".join(dict.fromkeys(bad)))
    for name, value in MOE_SETTINGS.items():
        setattr(nc, name, value)
    nc.cast_type = "as-declared"
    rc = nc.router_config
    if rc is not None:  # unused by our router (the core's, float32), kept truthful for anything that reads it
        rc.act_fn, rc.dtype = "sigmoid", torch.float32


def differing_fields(nc, expected) -> list[str]:
    """Every field nc holds otherwise than `expected`, the NeuronConfig its run spec makes: a neuron_config.json
    edited by hand, or one whose spec was. MOE_SETTINGS are set, not compared: a reload restores one
    (NXDI_CONTRACT.md: normalize-reload)."""
    have, want = vars(nc), vars(expected)
    return [f"{name}={_plain(have.get(name))!r} (the run spec {RUN_SPEC_KEY} implies {_plain(want[name])!r})"
            for name in want if name not in MOE_SETTINGS and _plain(have.get(name)) != _plain(want[name])]


def _plain(value):
    """A NeuronConfig value as NxDI saves it to JSON, for comparing a reload with a build."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, dict):
        if "_name_" in value and "__objclass__" in value:  # an enum as NxDI saves it (NXDI_CONTRACT.md: strategy-reload)
            return value["_name_"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _plain(v) for k, v in vars(value).items()}
    return value


def _field_problems(nc, layout: Layout) -> list[str]:
    """What no RunSpec writes: NxDI features Kimi's model does not have, and settings that break its own. `nc` is a
    MoENeuronConfig, which defines every attribute read here (some only in some branches: UNSUPPORTED's)."""
    held = vars(nc)
    bad = [f"{name}={held[name]!r} ({why})" for name, ok, why in UNSUPPORTED if name in held and held[name] not in ok]
    if nc.capacity_factor != MOE_SETTINGS["capacity_factor"]:
        bad.append(f"capacity_factor={nc.capacity_factor} (drops prefill tokens; Kimi-K2 is dropless)")
    tkg_b, kv_b = nc.tkg_batch_size, nc.kv_cache_batch_size
    if tkg_b is not None and kv_b is not None and tkg_b < kv_b:  # NXDI_CONTRACT.md: tkg-batch-below-kv-batch
        bad.append(f"tkg_batch_size={tkg_b} < kv_cache_batch_size={kv_b} (that KV update path assumes V is shaped "
                   f"like K; the latent V slot is 1 wide)")
    att = nc.attention_dtype  # NXDI_CONTRACT.md: cache-dtype
    if att is not None and att != nc.torch_dtype:
        bad.append(f"attention_dtype={att} != torch_dtype={nc.torch_dtype} (the latent cache entry is written in "
                   f"torch_dtype)")
    bmm = nc.blockwise_matmul_config
    if bmm is not None:
        _restore_block_sharding_strategy(bmm)
        if moe_paths.mode_of(bmm) is None:  # NXDI_CONTRACT.md: blockwise-dispatch
            bad.append(f"blockwise_matmul_config={_blockwise_fields(bmm)} (none of --moe-prefill "
                       f"{', '.join(moe_paths.MODES)}; with no kernel flag at LNC=2 NxD 2.29 calls a kernel that only "
                       f"raises)")
        if (nc.moe_ep_degree or 1) > 1 and not bmm.parallelize_token_to_block_mapping:  # NXDI_CONTRACT.md: spmd-rank
            bad.append("parallelize_token_to_block_mapping=False with EP (no spmd_rank for the local experts)")
    if layout.prefill_chunk and nc.async_mode:
        # its path bypasses the chunk driver (NXDI_CONTRACT.md: async-bypasses-driver)
        bad.append("async_mode=True (NxDI's async path does not call _get_model_outputs, the chunk driver)")
    return bad + _bucket_problems(nc, layout)


def _bucket_problems(nc, layout: Layout) -> list[str]:
    """NxDI's get_cache_size divides each length by G (the manager pads max_length silently), and a context bucket's
    owned positions are every G-th (NXDI_CONTRACT.md: fd-cache-size, fd-cte-filter)."""
    if not nc.flash_decoding_enabled:
        return []
    g, lengths = layout.kv_group, {"max_length": nc.max_length}
    for name in ("context_encoding_buckets", "token_generation_buckets"):
        lengths |= {f"{name}[{i}]": b for i, b in enumerate(vars(nc)[name] or ())}
    return [f"{name}={n} (not a multiple of {RUN_SPEC_KEY}.layout.kv_group={g})" for name, n in lengths.items()
            if isinstance(n, int) and n % g]


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
