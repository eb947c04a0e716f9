"""vllm-neuron's request as a RunSpec: the run's shape from the generic NeuronConfig the plugin builds from vLLM's
flags, and nothing else (NXDI_CONTRACT.md: vllm-generic-config); the checkpoint's experts from its conversion record;
precompiled artifacts checked against it before vllm-neuron loads them. No SDK."""

from __future__ import annotations

import dataclasses

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import DEFAULT_SCHEME

from . import moe_paths
from .spec import DraftSpec, RunSpec, Sampling

# vllm-neuron loads precompiled artifacts from this folder, else compiles into it (NXDI_CONTRACT.md: vllm-precompiled).
COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"


def describe(nc) -> str:
    """The vLLM flags a request came from."""
    return (f"--tensor-parallel-size {nc.tp_degree} --max-num-seqs {nc.batch_size} --max-model-len {nc.seq_len} "
            f"--dtype {str(nc.torch_dtype).removeprefix('torch.')}")


def run_spec(cfg: KimiK2Config, nc, record, checkpoint) -> RunSpec:
    """The request's shape and sampler, the checkpoint's experts (record: a ConversionRecord), the MoE prefill mode
    these shapes allow; what the latent cache cannot serve is refused in one line. The one reverse mapping of the
    package: vllm-neuron's NeuronConfig is what vLLM's flags made, not one a RunSpec derived (NXDI_CONTRACT.md:
    vllm-generic-config)."""
    if nc.is_chunked_prefill:
        raise KimiInputError("chunked prefill (vllm-neuron's with DISABLE_NEURON_CUSTOM_SCHEDULER=1) needs NxDI's "
                             "block KV layout, which Kimi-K2's latent cache does not have; unset "
                             "DISABLE_NEURON_CUSTOM_SCHEDULER")
    if nc.is_prefix_caching or nc.is_block_kv_layout:
        raise KimiInputError("--enable-prefix-caching (on by default in vLLM) needs NxDI's block KV layout, which "
                             "Kimi-K2's latent cache does not have; pass --no-enable-prefix-caching")
    if nc.torch_dtype != torch.bfloat16:
        raise KimiInputError(f"--dtype {str(nc.torch_dtype).removeprefix('torch.')}: Kimi-K2 runs in bfloat16 on "
                             f"Neuron; pass --dtype bfloat16")
    if record is None:
        raise KimiInputError(f"{checkpoint}: a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron "
                             f"convert {checkpoint} DST --experts {DEFAULT_SCHEME}, then serve DST")
    if nc.is_continuous_batching and nc.ctx_batch_size != 1:
        raise KimiInputError(f"continuous batching with a prefill batch of {nc.ctx_batch_size}: NxDI's cache writes "
                             f"by seq_id take one sequence per prefill (ctx_batch_size 1)")
    ods = nc.on_device_sampling_config
    spec = RunSpec(tp=nc.tp_degree, ep=nc.moe_ep_degree or 1, lnc=nc.logical_nc_config, seq_len=nc.seq_len,
                   max_context_length=nc.max_context_length, batch=nc.max_batch_size or nc.batch_size,
                   scheme=record.scheme, checkpoint=str(checkpoint), moe_prefill=None,
                   sampling=Sampling(on_device=False) if ods is None else Sampling(
                       do_sample=ods.do_sample, top_k=ods.top_k, top_p=ods.top_p, temperature=ods.temperature,
                       global_topk=ods.global_topk),
                   output_logits=bool(nc.output_logits), continuous_batching=bool(nc.is_continuous_batching),
                   draft=draft(nc), extra={"on_cpu": True} if nc.on_cpu else {})
    tile = moe_paths.OUTPUT_TILE
    if spec.prefill_mode(cfg) == "shard-on-block" and spec.prefill_tokens % tile:
        # the kernel's rule, in vLLM's words: a prefill of whole output tiles, never a silent torch loop of hundreds of
        # unrolled blocks (moe_paths.default_mode)
        lower = spec.seq_len // tile * tile
        raise KimiInputError(f"--max-model-len {spec.seq_len}: NxD's prefill kernel at these shapes computes whole "
                             f"{tile}-token tiles; use a multiple of {tile} ({lower + tile}"
                             + (f" or {lower})" if lower else ")"))
    # vLLM has no flag for it: the token-generation MoE path the time model says is fastest at this batch (NxD's own
    # threshold in NxD's CPU mode), recorded in the spec saved with the artifacts (moe_decode.choose)
    from .moe_decode import choose  # the planner

    return dataclasses.replace(spec, moe_decode=choose(cfg, spec))


def draft(nc) -> DraftSpec | None:
    """--speculative-config as vllm-neuron passes it: num_speculative_tokens is NxDI's speculation_length, and only
    method "eagle" sets NxDI's EAGLE flow (vLLM 0.13 refuses "eagle3" for a kimi_k2 target); the draft folder comes
    later, in the FusedSpecNeuronConfig vllm-neuron attaches (NXDI_CONTRACT.md: vllm-spec-config)."""
    if not (nc.enable_fused_speculation or nc.speculation_length):
        return None
    if not nc.enable_eagle_speculation:
        raise KimiInputError("--speculative-config: Kimi-K2 speculates with an EAGLE3 draft only; give "
                             "'{\"method\": \"eagle\", \"model\": DRAFT, \"num_speculative_tokens\": K}'")
    return DraftSpec(path=None, speculation_length=nc.speculation_length)


def compiled_mismatches(request: RunSpec, compiled: RunSpec) -> list[str]:
    """What the request needs that compiled artifacts (built from the spec `compiled`) lack: smaller than compiled is
    served, more is not (NXDI_CONTRACT.md: vllm-precompiled)."""
    r, c, bad = request, compiled, []
    if r.tp != c.tp:
        bad.append(f"--tensor-parallel-size {r.tp}, compiled for TP {c.tp}")
    if r.batch > c.batch:
        bad.append(f"--max-num-seqs {r.batch} > the compiled batch {c.batch}")
    if r.seq_len > c.seq_len:
        bad.append(f"--max-model-len {r.seq_len} > the compiled seq_len {c.seq_len}")
    elif r.context_length > c.context_length:
        bad.append(f"--max-model-len {r.seq_len}: prompts that long need a prefill of {r.context_length} tokens, "
                   f"compiled for {c.context_length}")
    if r.continuous_batching and not c.one_row_prefill:
        bad.append(f"--max-num-seqs {r.batch} runs NxDI's continuous batching, compiled without it (a prefill batch "
                   f"of {c.prefill_batch})")
    asked_k, compiled_k = (s.draft.speculation_length if s.draft else 0 for s in (r, c))
    if asked_k != compiled_k:
        bad.append(f"--speculative-config num_speculative_tokens {asked_k or 'none'}, compiled for "
                   f"{compiled_k or 'no speculation'} (NxDI's speculation_length)")
    if not c.sampling.on_device and r.sampling.on_device:
        bad.append("compiled to return logits (--no-on-device-sampling); vllm-neuron samples on the device")
    return bad
