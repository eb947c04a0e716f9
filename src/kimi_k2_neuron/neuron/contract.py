"""Everything the Neuron shell computes that does not need the Neuron SDK.

The SDK-facing modules next to this one (config.py, modeling.py, kv_cache.py, serving.py) only translate; the
decisions live here (and in the SDK-free keys.py, layers.py and loader.py) so that a CPU test can check them
against the core's numbers:

- serving options -> MoENeuronConfig keyword arguments (batch sizes, FP8 scheme, on-device sampling, dropless MoE)
- InferenceConfig derived fields, idempotent under NxDI's JSON round trip
- the checks that refuse NxDI features this port does not implement
- compiler arguments, the FP8 environment, pre-sharding in passes
(layers.py holds the decoder's attention and router in NxDI/NxD's contracts, keys.py the checkpoint key mapping.)

This file imports only torch and the core. Importing anything under `kimi_k2_neuron.neuron` runs the package's SDK
check first, so the CPU tests and scripts/check_nxdi_api.py import it through an alias package over this folder
that skips that check (test/unit/test_neuron_shell.py:_sdk_free).

Line references: NxDI = aws-neuron/neuronx-distributed-inference @4bcdc54, src/neuronx_distributed_inference/;
NxD = aws-neuron/neuronx-distributed @fbac349 (Release 2.29), src/neuronx_distributed/.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.config import language_model_fields
from kimi_k2_neuron.formats import DEFAULT_SCHEME, EXPERT_FORMATS
from kimi_k2_neuron.formats.scheme import NXD_DTYPE, NXD_TYPE
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.launch import FP8_ENV
from kimi_k2_neuron.plan import (ALL_EXPERTS_BLOCK_SIZE, check_compile_options, check_moe_tp, decodes_all_experts,
                                 ep_layout_supported)

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


# -- serving options -> MoENeuronConfig ---------------------------------------------------------------------------

# FP8_ENV (launch.py) is what NxDI asks for with the FP8 experts' quantization_dtype (formats.scheme.NXD_DTYPE); NxDI
# keys its matching compiler flag on quantization_dtype == "f8e4m3" exactly (model_wrapper.py:148-157).
# How prefill runs the routed experts once T * top_k >= the block size (expert_mlps_v2.py:1485-1497), as
# blockwise_matmul_config (moe_configs.py:79-129). "kernel": NxD's choice, the NKI blockwise kernel when
# can_use_blockwise_matmul_nki holds (blockwise.py:719-801), else its torch fallback. "torch": that fallback, a
# Python loop over ~400 blocks per MoE layer (expert_mlps_v2.py:716-720, 1380) unrolled into the graph.
# "all-experts": every token through every expert, no blockwise path at all (what GLM-5.2's contrib does,
# block_size 2**30) -- dropless and simple, but E / top_k times the expert FLOPs and an [E, tokens, hidden] output.
# The kernel path handles expert-wise per-channel scales: like blockwise ones they are 3-D ([E, 1, out]), so
# BlockwiseMatmulNKIFunc dequantizes both schemes' local experts to bf16 and calls the kernel without scales
# (blockwise.py:955-967; plan.moe_temporaries counts the copies). (NxD's expert-wise qconfig docstring,
# quantization_config.py:230-238, says its LNC=2 kernel does not support several experts per token with them; the
# kernel never receives them here.) If the kernel fails to compile at 32 expert columns per rank, fall back to
# all-experts, not torch: plan.MOE_PREFILL_FALLBACK.
MOE_PREFILL = {"kernel": {}, "torch": {"use_torch_block_wise": True},
               "all-experts": {"block_size": ALL_EXPERTS_BLOCK_SIZE}}


@dataclass(frozen=True)
class ServeOptions:
    """One compiled configuration: the arguments of scripts/compile_and_save.py."""

    tp: int  # ranks (logical cores); attention, embedding, lm_head and the shared expert split tp ways
    # Expert parallelism inside those ranks (NxDI moe_ep_degree / moe_tp_degree, moe_v2.py:135-161): routed experts
    # split ep ways, each expert's intermediate tp / ep ways. Not NxD's global ep_degree (see UNSUPPORTED).
    ep: int = 1
    lnc: int | None = 2  # None: NxDI's choice (NEURON_LOGICAL_NC_CONFIG, else the platform's, config.py:729-759)
    seq_len: int = 1024
    max_context_length: int | None = None  # CTE bucket; defaults to seq_len (NxDI config.py:134)
    batch: int = 1
    experts: str = DEFAULT_SCHEME  # the recommended expert format (kimi_k2_neuron.formats)
    checkpoint: str | None = None  # converted checkpoint folder (NxDI requires a path when quantized, config.py:218)
    on_device_sampling: bool = True
    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    global_topk: int = 256
    output_logits: bool = False
    moe_prefill: str = "kernel"  # see MOE_PREFILL
    # The converted checkpoint's record of its expert quantization (formats.record.ConversionRecord.nxd): quantization type, block axis/size, the TP degrees its scales shard for.
    quant_record: dict | None = None
    extra: dict = field(default_factory=dict)  # passed through as further NeuronConfig kwargs (checked by NxDI)

    @property
    def context_length(self) -> int:
        return self.seq_len if self.max_context_length is None else self.max_context_length


def check_serve_options(cfg: KimiK2Config, o: ServeOptions) -> None:
    """Refuse a configuration that cannot compile or would compute something else, naming the argument. The
    layout and MoE prefill rules are the fit planner's (plan.check_compile_options), so `kimi-k2-neuron plan` and
    compile_and_save's fit check refuse the same configurations."""
    if o.experts not in EXPERT_FORMATS:
        raise KimiInputError(f"--experts {o.experts!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    check_compile_options(cfg, o.tp, o.ep, o.lnc, o.seq_len, o.context_length, o.batch, o.moe_prefill)
    if o.experts != "bf16":
        _check_quant_record(o)
    if o.on_device_sampling and not 1 <= o.top_k <= o.global_topk:
        raise KimiInputError(f"--top-k {o.top_k}: on-device sampling needs 1 <= top_k <= {o.global_topk}")


# NeuronConfig fields a converted checkpoint's record sets (NeuronConfig l.216-226). Its
# quantization_per_channel_axis is not a NeuronConfig field: expert layers default it to 2 and accept only 2
# (quantization_layers.py:1046-1052).
QUANT_FIELDS = ("quantized", "quantization_dtype", "quantization_type", "quantization_block_axis",
                "quantization_block_size", "quantization_scale_dtype")


def _check_quant_record(o: ServeOptions) -> None:
    rec = o.quant_record
    if not o.checkpoint or not rec:
        raise KimiInputError(f"--experts {o.experts}: needs a converted checkpoint (see kimi_k2_neuron.convert), "
                             f"whose config.json records the expert quantization")
    if rec.get("quantization_type") != NXD_TYPE[o.experts] or rec.get("quantization_dtype") != NXD_DTYPE:
        raise KimiInputError(f"--experts {o.experts}: the checkpoint holds {rec.get('quantization_type')} "
                             f"{rec.get('quantization_dtype')} experts, expected {NXD_TYPE[o.experts]} {NXD_DTYPE}")
    check_moe_tp(rec.get("valid_moe_tp_degrees"), o.tp, o.ep)


def neuron_config_kwargs(cfg: KimiK2Config, o: ServeOptions) -> dict[str, Any]:
    """Keyword arguments for MoENeuronConfig (NxDI config.py:798-846, NeuronConfig l.92-643)."""
    check_serve_options(cfg, o)
    kw: dict[str, Any] = dict(
        tp_degree=o.tp,
        seq_len=o.seq_len,
        max_context_length=o.context_length,
        # Only batch_size sets all four (config.py:161-167); setting them explicitly makes the CTE and TKG graphs
        # really compile at this batch, instead of ModelWrapper splitting a bigger batch into batch-1 calls.
        batch_size=o.batch,
        ctx_batch_size=o.batch,
        tkg_batch_size=o.batch,
        max_batch_size=o.batch,
        kv_cache_batch_size=o.batch,
        padding_side="right",
        torch_dtype="bfloat16",
        # "as-declared": the router weight and e_score_correction_bias are float32 parameters of the core router;
        # cast_type "config" would make them bf16 at build time (model_wrapper.py:1459-1476).
        cast_type="as-declared",
        save_sharded_checkpoint=True,
        # MoE: dropless (capacity_factor None, expert_mlps_v2.py:1486-1497), GLU = silu(gate) * up, and no
        # renormalization in ExpertMLPsV2 (l.315-317, 604-606): our router already normalizes and scales.
        capacity_factor=None,
        glu_mlp=True,
        glu_type="glu",
        disable_normalize_top_k_affinities=True,
        router_config={"act_fn": "sigmoid", "dtype": "float32"},
        # Without on-device sampling lm_head already gathers the logits (gather_output=True) and they are the output;
        # output_logits would all-gather them a second time along the vocab (model_base.py:1018-1023,
        # `_gather_along_dim(logits, partition_dim=2, ...)`), giving [B, 1, tp * vocab].
        output_logits=o.output_logits and o.on_device_sampling,
        # As NxDI's Qwen3-MoE (qwen3_moe/modeling_qwen3_moe.py:266-269) and the DSV3 contrib (modeling_deepseek.py
        # l.330-331, README item 6 "required for all-gather/reduce-scatter collectives"): we all-gather in the
        # embedding (shard_across_embedding), the on-device top-k and output_logits. compile() exports it as
        # DISABLE_NUMERIC_CC_TOKEN=1 (compile_env.py:23-24, called at application_base.py:294).
        disable_numeric_cc_token=True,
    )
    if o.lnc is not None:
        kw["logical_nc_config"] = o.lnc
    if o.ep > 1:  # MoE-internal EP: build_moe's initialize_moe_process_group makes the groups (moe_v2.py:147-154)
        kw.update(moe_ep_degree=o.ep, moe_tp_degree=o.tp // o.ep)
    # The MoE kernel's LNC defaults to the platform's (model_utils.py:96), not to the NeuronConfig's.
    lnc = {} if o.lnc is None else {"logical_nc_config": o.lnc}
    kw["blockwise_matmul_config"] = {**lnc, **MOE_PREFILL[o.moe_prefill]}
    if o.on_device_sampling:
        kw["on_device_sampling_config"] = dict(do_sample=o.do_sample, top_k=o.top_k, top_p=o.top_p,
                                               temperature=o.temperature, dynamic=True, global_topk=o.global_topk)
    if o.experts in NXD_TYPE:  # FP8 experts
        kw.update({k: v for k, v in o.quant_record.items() if k in QUANT_FIELDS})
        kw.update(quantized_checkpoints_path=o.checkpoint, modules_to_not_convert=modules_to_not_convert(cfg))
    kw.update(o.extra)
    return kw


def modules_to_not_convert(cfg: KimiK2Config) -> list[str]:
    """Every non-expert parallel linear, as NxD matches them: substrings of the dotted module path from the model
    root (quantize.py:109-129). Expert-wise per-channel raises on a layer without experts, so nothing may slip
    through. q_a_proj/kv_a_proj_with_mqa and the router are plain nn.Linear/nn.Module and never converted."""
    dense = [f"layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    return ["embed_tokens", "lm_head", "self_attn", "shared_experts", *dense]


def fp8_env(quantized: bool, quantization_dtype: str | None) -> dict[str, str]:
    """The environment a NeuronConfig with these quantization fields needs before anything is traced or run."""
    return dict(FP8_ENV) if quantized and quantization_dtype == NXD_DTYPE else {}


# -- InferenceConfig ----------------------------------------------------------------------------------------------

# HF fields NxDI reads from the config that a plain config.json lacks (model_base.py:3467-3483). Not
# use_return_dict: it is a read-only property of transformers' PretrainedConfig, which HuggingFaceGenerationAdapter
# builds from these attributes (hf_adapter.py:91-101, 106).
HF_DEFAULTS = {"output_attentions": False, "output_hidden_states": False, "return_dict": True}


def hf_attributes(model_dir: str | Path) -> dict[str, Any]:
    """config.json as InferenceConfig attributes, read as plain JSON (no checkpoint code runs; NxDI's
    load_pretrained_config would need trust_remote_code for model_type kimi_k2, hf_adapter.py:49) and validated by
    the core. Kimi-K2.5's text_config is flattened. torch_dtype is dropped: neuron_config carries the dtype."""
    path = Path(model_dir) / "config.json"
    KimiK2Config.from_file(path)  # raises KimiInputError naming the bad field
    raw = language_model_fields(json.loads(path.read_text()))
    attrs = {k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "auto_map")}
    return {**HF_DEFAULTS, **attrs}


def derived_fields(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Fields add_derived_config sets. Each is a function of HF fields this shell never overwrites, so running it
    again on a config reloaded from neuron_config.json gives the same values:
    - head_dim = kv_lora_rank + qk_rope_head_dim: the KV cache width (kv_cache_manager.py:188-192); the latent is
      stored as one KV head (the model's num_key_value_heads = 1, which is what sizes the cache, model_base.py
      l.120-131, 173-179; config.num_key_value_heads keeps its HF value).
    - num_local_experts: NxD's name for n_routed_experts.
    - intermediate_size keeps its HF meaning (the dense MLP). Unlike DSV3/GLM we build ExpertMLPsV2 and
      SharedExperts ourselves with moe_intermediate_size, so nothing is overwritten and no guard is needed."""
    return {
        "head_dim": attrs["kv_lora_rank"] + attrs["qk_rope_head_dim"],
        "num_local_experts": attrs["n_routed_experts"],
        "num_cores_per_group": 1,  # no flash decoding (model_base.py:95; config.py:888-893)
        **{k: attrs.get(k, v) for k, v in HF_DEFAULTS.items()},
    }


# NxDI features this port does not implement, as (attribute, allowed values, why).
UNSUPPORTED = (
    ("sequence_parallel_enabled", (False,), "MLA attention here has no sequence-parallel path"),
    ("flash_decoding_enabled", (False,), "the latent cache is not split across cores"),
    ("attention_dp_degree", (1,), "attention data parallel needs DataParallelKVCacheManager"),
    ("cp_degree", (1,), "context parallel attention is not implemented for MLA"),
    ("is_block_kv_layout", (False,), "the latent cache uses the contiguous layout"),
    ("is_prefix_caching", (False,), "prefix caching needs the block layout"),
    ("speculation_length", (0,), "speculative decoding is not implemented"),
    ("enable_fused_speculation", (False,), "speculative decoding is not implemented"),
    ("is_medusa", (False,), "Medusa is not implemented"),
    ("layer_boundary_markers", (False,), "per-layer KV update is not implemented (model_base.py:1299-1305)"),
    ("attn_block_tkg_nki_kernel_enabled", (False,), "the GQA attention kernels do not compute MLA"),
    ("k_cache_transposed", (False,), "the latent cache is read untransposed"),
    ("kv_cache_tiling", (False,), "the V slot is 1 wide; a tiled layout is not handled"),
    ("kv_cache_quant", (False,), "the latent cache stays bf16"),
    ("kv_quant_config", (None,), "the latent cache stays bf16"),
    ("padding_side", ("right",), "masks assume right padding"),
    ("moe_fused_nki_kernel_enabled", (None, False), "the stock fused TKG kernel cannot apply the selection-only bias"),
    # NxD's global EP makes attention data-parallel across EP replicas, and MoE then reduces its output over all
    # tp x ep ranks (modules/moe/model.py:236-240) after adding the shared expert, which is TP-sharded within each
    # replica (l.220, 333-359): the shared expert would be counted ep times. --ep sets moe_ep_degree instead.
    ("ep_degree", (1,), "global EP counts the shared expert ep times; --ep sets moe_ep_degree"),
    ("hybrid_sharding_config", (None, False), "hybrid MoE sharding is not wired"),
    ("lora_config", (None, False), "LoRA is not implemented"),
    # The decoder layer returns no residual; with this flag prefill adds `residual + hidden` (model_base.py:1421-24).
    ("qkv_kernel_fuse_residual_add", (False,), "the QKV kernel does not compute MLA; the layer returns no residual"),
    # A TKG batch below the KV cache batch takes kv_cache_manager.py:537-569, which builds V's scatter index and its
    # zero-filled update from K's shape (`scatter_index_new_v = scatter_index_new_k`, `updated_latest_kv_shape =
    # k_cache.shape[:1] + latest_k.shape[1:]`): with the 1-wide latent V slot the scatter fails.
    ("token_generation_batches", (None,), "batch bucketing scatters V with K's index shape (latent V is 1 wide)"),
    # Windowed context encoding hands CTE windows >= 1 a cached past_key_value (model_base.py:1325-1333), which the
    # decoder layer takes for decode.
    ("windowed_context_encoding_size", (None,), "windowed context encoding is not implemented for MLA"),
)


def enforce_neuron_config(nc, n_experts: int | None = None, top_k: int | None = None) -> None:
    """Set and check what this model needs on an (MoE)NeuronConfig. Idempotent: run by add_derived_config on every
    construction, including NxDI's reload from neuron_config.json, which restores normalize_top_k_affinities to its
    default because the saved JSON carries it under a name MoENeuronConfig does not read (config.py:822)."""
    bad = [f"{name}={getattr(nc, name)!r} ({why})" for name, ok, why in UNSUPPORTED
           if hasattr(nc, name) and getattr(nc, name) not in ok]
    if getattr(nc, "capacity_factor", None) is not None:
        bad.append(f"capacity_factor={nc.capacity_factor} (drops prefill tokens; Kimi-K2 is dropless)")
    tkg_b, kv_b = getattr(nc, "tkg_batch_size", None), getattr(nc, "kv_cache_batch_size", None)
    if tkg_b is not None and kv_b is not None and tkg_b < kv_b:  # kv_cache_manager.py:537-569, see UNSUPPORTED
        bad.append(f"tkg_batch_size={tkg_b} < kv_cache_batch_size={kv_b} (that KV update path assumes V is shaped "
                   f"like K; the latent V slot is 1 wide)")
    # The cache is allocated in attention_dtype (kv_cache_manager.py:141-146) and its writes (kvcache/utils.py:76-84,
    # kv_cache_manager.py:577-585) need the update in that dtype; the layer produces the latent in torch_dtype.
    att = getattr(nc, "attention_dtype", None)
    if att is not None and att != getattr(nc, "torch_dtype", att):
        bad.append(f"attention_dtype={att} != torch_dtype={nc.torch_dtype} (the latent cache entry is written in "
                   f"torch_dtype)")
    bad += _moe_ep_problems(nc, n_experts, top_k)
    if bad:
        raise KimiInputError("unsupported NeuronConfig settings for Kimi-K2: " + "; ".join(bad))
    nc.normalize_top_k_affinities = False
    nc.glu_mlp, nc.glu_type = True, "glu"
    nc.cast_type = "as-declared"
    rc = getattr(nc, "router_config", None)
    if rc is not None:  # unused by our router (the core's, float32), kept truthful for anything that reads it
        rc.act_fn, rc.dtype = "sigmoid", torch.float32


def sampler_settings(temperature: float, top_k: int, top_p: float) -> dict:
    """Generation's do_sample/temperature/top_k/top_p for the CPU runner's (temperature, top_k, top_p), where
    temperature 0 is greedy and top_k 0 means no filter: NxDI's sampler always filters, at most its global top-k
    (ServeOptions.global_topk), so 0 becomes that."""
    if temperature <= 0:
        return {"do_sample": False, "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    return {"do_sample": True, "temperature": temperature, "top_k": top_k or ServeOptions.global_topk,
            "top_p": top_p}


# -- NxD's CPU mode -----------------------------------------------------------------------------------------------

def check_cpu_run(torch_dtype, tp: int, moe_ep: int | None, sampling: bool, on_cpu: bool) -> None:
    """What NeuronKimiK2ForCausalLM.to_cpu needs of a NeuronConfig's fields: gloo has no bfloat16 collectives (NxDI's
    to_cpu refuses bf16 at TP > 1, application_base.py:563-566) and NxD no float16 CPU path; NxD's MoE expert
    parallelism needs XLA process groups; NxDI's sampler takes its CPU branches only with on_cpu
    (modules/generation/sampling.py:223-235, 271, 303)."""
    if torch_dtype not in (torch.float32, torch.bfloat16) or (torch_dtype == torch.bfloat16 and tp > 1):
        raise KimiInputError(f"--dtype {torch_dtype} at --tp {tp}: NxD's CPU mode runs float32, or bfloat16 at "
                             f"--tp 1 (gloo has no bfloat16 collectives)")
    if (moe_ep or 1) > 1:
        raise KimiInputError(f"--ep {moe_ep}: NxD's MoE expert parallelism does not run in its CPU mode (its "
                             f"expert-rank lookup reads the XLA process group's _mesh, parallel_state.py:991, which "
                             f"gloo groups lack); use --ep 1 on CPU")
    if sampling and not on_cpu:
        raise KimiInputError("on-device sampling in NxD's CPU mode needs NeuronConfig(on_cpu=True)")


# -- generation through NxDI's HF adapter --------------------------------------------------------------------------

def check_prompt_lengths(lengths: list[int]) -> None:
    """Refuse a batch NxDI's HuggingFaceGenerationAdapter would get wrong: it gives right-padding slots position 1
    (hf_adapter.py:283-294), so a one-token row among longer ones reads its first token from a pad slot
    (model_base.py:974 takes the argmax position) and decodes from position 2 (hf_adapter.py:296-298)."""
    if not lengths or min(lengths) < 1:
        raise KimiInputError("every prompt needs at least one token")
    if min(lengths) == 1 < max(lengths):
        raise KimiInputError("a one-token prompt cannot share a batch with longer prompts (NxDI's HF adapter "
                             "positions its padding wrongly); run it in a batch of its own")


# -- pre-sharding in passes ---------------------------------------------------------------------------------------

# NxD's shard_checkpoint keeps every rank's sharded dict until the last rank is written (trace/model_builder.py:
# 827-858), and the stride-2 split of gate_up makes each rank's part a real copy (trace/trace.py:678-684): ~10 GB per
# rank for Kimi-K2, ~680 GB for 64 ranks at once. Sharding a few ranks per pass bounds it at ~85 GB.
SHARD_RANKS_PER_PASS = 8
# NxD's weight-layout option (trace/hlo_utils.py:36) transforms the window the builder had at trace time
# (model_builder.py:1301-1321), i.e. every rank, after sharding (application_base.py:262-265): it must run once.
LAYOUT_TRANSFORM_ENV = "NXD_LAYOUT_TRANSFORMATION_OPTIONS"


def rank_passes(start: int, size: int, env: Mapping[str, str],
                per_pass: int = SHARD_RANKS_PER_PASS) -> list[tuple[int, int]]:
    """(start_rank_id, local_ranks_size) windows that together cover [start, start + size), for pre-sharding."""
    if LAYOUT_TRANSFORM_ENV in env:
        return [(start, size)]
    return [(s, min(per_pass, start + size - s)) for s in range(start, start + size, per_pass)]


def _moe_ep_problems(nc, n_experts: int | None, top_k: int | None) -> list[str]:
    """What check_serve_options guarantees for moe_ep_degree > 1, re-checked on any NeuronConfig (a reloaded
    neuron_config.json, `extra`): NxDI checks none of it (config.py:833-834, moe_v2.py:147-150). The batch rule
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
    if bmm is not None and not getattr(bmm, "parallelize_token_to_block_mapping", True):
        out.append("parallelize_token_to_block_mapping=False with EP (no spmd_rank for the local experts, "
                   "expert_mlps_v2.py:121-138)")
    if bmm is not None and getattr(bmm, "block_size", 0) >= MOE_PREFILL["all-experts"]["block_size"]:
        out.append("all-experts prefill with EP (no EP variant, expert_mlps_v2.py:1492-1494)")
    return out


# -- compiler arguments -------------------------------------------------------------------------------------------

# What Kimi adds to NxDI's default neuronx-cc arguments (ModelWrapper computes them per submodel when the application's
# get_compiler_args returns None, model_wrapper.py:85-162: --auto-cast=none, --model-type=transformer, the tensorizer's
# collective overlap and pipeline tiling, --lnc, -O1 and --modular-flow-mac-threshold=10 for prefill, -O2 for decode,
# --hbm-scratchpad-page-size, --verify-hlo, the f8e4m3 flag). As the DeepSeek-V3 and Qwen3-MoE ports: saturating
# casts, fp32 accumulation (unless NxDI's long-context mode turned it off on purpose), and vector dynamic-offset DGE for
# the per-token expert gathers of selective loading (unless NxDI already chose DGE levels).
KIMI_COMPILER_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation",
                      "--internal-enable-dge-levels vector_dynamic_offsets")


def compiler_args(nxdi_args: str) -> str:
    """One submodel's neuronx-cc arguments: NxDI's own for it, plus KIMI_COMPILER_ARGS where they do not contradict
    a flag NxDI set."""
    clashes = {"--enable-mixed-precision-accumulation": "--disable-mixed-precision-accumulation",
               "--internal-enable-dge-levels vector_dynamic_offsets": "--internal-enable-dge-levels"}
    extra = [f for f in KIMI_COMPILER_ARGS if f not in nxdi_args and clashes.get(f, f) not in nxdi_args]
    return " ".join([nxdi_args.strip(), *extra])
