"""vllm-neuron's request as a RunSpec: the run's shape from the generic NeuronConfig the plugin builds from vLLM's
flags, and nothing else (NXDI_CONTRACT.md: vllm-generic-config); the checkpoint's experts from its conversion record;
precompiled artifacts checked against it before vllm-neuron loads them. No SDK."""

from __future__ import annotations

import dataclasses

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import DEFAULT_SCHEME
from kimi_k2_neuron.parallel import Layout

from . import contract, moe_paths
from .spec import DraftSpec, RunSpec

# vllm-neuron loads precompiled artifacts from this folder, else compiles into it (NXDI_CONTRACT.md: vllm-precompiled).
COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"


def describe(nc) -> str:
    """The vLLM flags a request came from."""
    cache = (f" --enable-prefix-caching --block-size {nc.pa_block_size} --num-gpu-blocks-override "
             f"{nc.pa_num_blocks - 1}" if getattr(nc, "is_prefix_caching", False) else "")
    return (f"--tensor-parallel-size {nc.tp_degree} --max-num-seqs {nc.batch_size} --max-model-len {nc.seq_len} "
            f"--dtype {str(nc.torch_dtype).removeprefix('torch.')}{cache}")


def cache_flags(spec: RunSpec) -> list[str]:
    """vLLM's cache flags for the compiled spec: its block pool with prefix caching (and the cached-token count in
    every reply's usage), else one vLLM block per sequence, the plugin's block being --max-model-len long
    (docs/vllm.md)."""
    if not spec.prefix_caching:
        return ["--no-enable-prefix-caching", "--num-gpu-blocks-override", str(spec.batch)]
    return ["--enable-prefix-caching", "--block-size", str(spec.block_size), "--num-gpu-blocks-override",
            str(spec.pool_blocks), "--enable-prompt-tokens-details"]


def spec_of_request(cfg: KimiK2Config, nc, record, checkpoint) -> RunSpec:
    """The request's shape and sampler, the checkpoint's experts (record: a ConversionRecord), the MoE prefill mode
    these shapes allow; what the latent cache cannot serve is refused in one line."""
    if getattr(nc, "is_chunked_prefill", False):
        # NXDI_CONTRACT.md: nxdi-chunked-prefill
        raise KimiInputError("chunked prefill (vllm-neuron's with DISABLE_NEURON_CUSTOM_SCHEDULER=1): NxDI's "
                             "application raises NotImplementedError for it; unset DISABLE_NEURON_CUSTOM_SCHEDULER "
                             "(prefix caching, --enable-prefix-caching, reuses what earlier requests prefilled "
                             "without it)")
    if getattr(nc, "is_prefix_caching", False):
        need = nc.batch_size * -(-nc.seq_len // nc.pa_block_size)
        if nc.pa_num_blocks - 1 < need:  # vllm-neuron counts the null block in pa_num_blocks when told the pool
            raise KimiInputError(f"--enable-prefix-caching: give --num-gpu-blocks-override, at least --max-num-seqs "
                                 f"x --max-model-len / --block-size = {need} (the pool the model is built with)")
    elif getattr(nc, "is_block_kv_layout", False):
        raise KimiInputError("a block KV layout without prefix caching: Kimi-K2's latent cache has blocks for "
                             "--enable-prefix-caching only")
    if nc.torch_dtype != torch.bfloat16:
        raise KimiInputError(f"--dtype {str(nc.torch_dtype).removeprefix('torch.')}: Kimi-K2 runs in bfloat16 on "
                             f"Neuron; pass --dtype bfloat16")
    if record is None:
        raise KimiInputError(f"{checkpoint}: a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron "
                             f"convert {checkpoint} DST --experts {DEFAULT_SCHEME}, then serve DST")
    spec = dataclasses.replace(contract.spec_of(nc, Layout(), draft_of_request(nc)), scheme=record.scheme,
                               checkpoint=str(checkpoint), moe_prefill=None,
                               extra={"on_cpu": True} if getattr(nc, "on_cpu", False) else {})
    bad = contract.derived_problems(nc, spec)
    if bad:
        raise KimiInputError("; ".join(bad))
    tile = moe_paths.OUTPUT_TILE
    if spec.prefill_mode(cfg) == "shard-on-block" and spec.prefill_tokens % tile:
        # the kernel's rule, in vLLM's words: a prefill of whole output tiles, never a silent torch loop of hundreds of
        # unrolled blocks (moe_paths.default_mode)
        lower = spec.seq_len // tile * tile
        raise KimiInputError(f"--max-model-len {spec.seq_len}: NxD's prefill kernel at these shapes computes whole "
                             f"{tile}-token tiles; use a multiple of {tile} ({lower + tile}"
                             + (f" or {lower})" if lower else ")"))
    return spec


def draft_of_request(nc) -> DraftSpec | None:
    """--speculative-config as vllm-neuron passes it: num_speculative_tokens is NxDI's speculation_length, and only
    method "eagle" sets NxDI's EAGLE flow (vLLM 0.13 refuses "eagle3" for a kimi_k2 target); the draft folder comes
    later, in the FusedSpecNeuronConfig vllm-neuron attaches (NXDI_CONTRACT.md: vllm-spec-config)."""
    if not (getattr(nc, "enable_fused_speculation", False) or getattr(nc, "speculation_length", 0)):
        return None
    if not getattr(nc, "enable_eagle_speculation", False):
        raise KimiInputError("--speculative-config: Kimi-K2 speculates with an EAGLE3 draft only; give "
                             "'{\"method\": \"eagle\", \"model\": DRAFT, \"num_speculative_tokens\": K}'")
    return DraftSpec(path=None, speculation_length=nc.speculation_length)


def compiled_mismatches(request: RunSpec, nc) -> list[str]:
    """What the request needs that compiled artifacts (their NeuronConfig `nc`) lack: smaller than compiled is
    served, more is not (NXDI_CONTRACT.md: vllm-precompiled)."""
    r, bad = request, []
    if r.tp != nc.tp_degree:
        bad.append(f"--tensor-parallel-size {r.tp}, compiled for TP {nc.tp_degree}")
    if r.batch > nc.max_batch_size:
        bad.append(f"--max-num-seqs {r.batch} > the compiled batch {nc.max_batch_size}")
    if r.seq_len > nc.seq_len:
        bad.append(f"--max-model-len {r.seq_len} > the compiled seq_len {nc.seq_len}")
    elif r.context_length > nc.max_context_length and not getattr(nc, "is_prefix_caching", False):
        bad.append(f"--max-model-len {r.seq_len}: prompts that long need a prefill of {r.context_length} tokens, "
                   f"compiled for {nc.max_context_length}")
    if r.continuous_batching and not (nc.is_continuous_batching and nc.ctx_batch_size == 1):
        bad.append(f"--max-num-seqs {r.batch} runs NxDI's continuous batching, compiled without it "
                   f"(is_continuous_batching={nc.is_continuous_batching}, ctx_batch_size={nc.ctx_batch_size})")
    compiled_k = getattr(nc, "speculation_length", 0) if getattr(nc, "enable_fused_speculation", False) else 0
    asked_k = r.draft.speculation_length if r.draft else 0
    if asked_k != compiled_k:
        bad.append(f"--speculative-config num_speculative_tokens {asked_k or 'none'}, compiled for "
                   f"{compiled_k or 'no speculation'} (NxDI's speculation_length)")
    bad += _cache_mismatches(r, nc)
    ods = nc.on_device_sampling_config
    if ods is not None and not ods.dynamic:
        bad.append("compiled with static on-device sampling, which ignores each request's temperature, top_k, top_p")
    return bad


def _cache_mismatches(r: RunSpec, nc) -> list[str]:
    """Prefix caching needs the block layout compiled, at vLLM's block size and with a pool at least vLLM's (its block
    ids index the pool); the block layout compiled needs vLLM's block tables (NXDI_CONTRACT.md: vllm-block-pool)."""
    compiled = bool(getattr(nc, "is_prefix_caching", False))
    if r.prefix_caching and not compiled:
        return ["--enable-prefix-caching, compiled without the block KV layout (compile_and_save.py --for-vllm "
                "--prefix-caching), or pass --no-enable-prefix-caching"]
    if compiled and not r.prefix_caching:
        return [f"compiled with --prefix-caching (the block KV layout, --block-size {nc.pa_block_size}), served "
                f"without --enable-prefix-caching"]
    if not compiled:
        return []
    bad = []
    if r.block_size != nc.pa_block_size:
        bad.append(f"--block-size {r.block_size}, compiled for {nc.pa_block_size}")
    if r.pool_blocks > nc.pa_num_blocks - 1:
        bad.append(f"--num-gpu-blocks-override {r.pool_blocks} > the compiled pool of {nc.pa_num_blocks - 1} blocks")
    return bad
