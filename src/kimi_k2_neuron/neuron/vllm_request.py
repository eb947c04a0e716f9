"""vllm-neuron's request as a RunSpec: the run's shape from the generic NeuronConfig the plugin builds from vLLM's
flags, and nothing else (NXDI_CONTRACT.md: vllm-generic-config); the checkpoint's experts from its conversion record;
precompiled artifacts checked against it before vllm-neuron loads them; whether a server can hold replies to a
grammar (vllm_worker.py). No SDK."""

from __future__ import annotations

import dataclasses
import json

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import DEFAULT_SCHEME

from . import moe_paths
from .spec import DraftSpec, RunSpec, Sampling

# vllm-neuron loads precompiled artifacts from this folder, else compiles into it (NXDI_CONTRACT.md: vllm-precompiled).
COMPILED_ARTIFACTS_ENV = "NEURON_COMPILED_ARTIFACTS"
# vLLM's --worker-cls that applies the grammar bitmask, and the structured-output backend it is tested with
WORKER_CLS = "kimi_k2_neuron.neuron.vllm_worker.KimiNeuronWorker"
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
# xgrammar reads Kimi's tokenizer (tiktoken, byte-level token strings) as raw text before this version (xgrammar
# #483, fixed by #484 in 0.1.29): a space token would be 'Ġ' to it. vLLM 0.13 pins 0.1.27.
XGRAMMAR_MIN = (0, 1, 29)
# vllm-neuron's option that serves a model compiled to return logits (vLLM's sampler on the host)
HOST_SAMPLING_CONFIG = {"override_neuron_config": {"on_device_sampling_config": None}}


def describe(nc) -> str:
    """The vLLM flags a request came from."""
    cache = (f" --enable-prefix-caching --block-size {nc.pa_block_size} --num-gpu-blocks-override "
             f"{nc.pa_num_blocks - 1}" if nc.is_prefix_caching else "")
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


def run_spec(cfg: KimiK2Config, nc, record, checkpoint) -> RunSpec:
    """The request's shape and sampler, the checkpoint's experts (record: a ConversionRecord), the MoE prefill mode
    these shapes allow; what the latent cache cannot serve is refused in one line. The one reverse mapping of the
    package: vllm-neuron's NeuronConfig is what vLLM's flags made, not one a RunSpec derived (NXDI_CONTRACT.md:
    vllm-generic-config)."""
    if nc.is_chunked_prefill:  # NXDI_CONTRACT.md: nxdi-chunked-prefill
        raise KimiInputError("chunked prefill (vllm-neuron's with DISABLE_NEURON_CUSTOM_SCHEDULER=1): NxDI's "
                             "application raises NotImplementedError for it; unset DISABLE_NEURON_CUSTOM_SCHEDULER "
                             "(prefix caching, --enable-prefix-caching, reuses what earlier requests prefilled "
                             "without it)")
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
    sampling = Sampling(on_device=False) if ods is None else Sampling(
        do_sample=ods.do_sample, top_k=ods.top_k, top_p=ods.top_p, temperature=ods.temperature,
        global_topk=ods.global_topk)
    spec = for_vllm(RunSpec(tp=nc.tp_degree, ep=nc.moe_ep_degree or 1, lnc=nc.logical_nc_config, seq_len=nc.seq_len,
                            max_context_length=nc.max_context_length, batch=nc.max_batch_size or nc.batch_size,
                            scheme=record.scheme, checkpoint=str(checkpoint), moe_prefill=None, sampling=sampling,
                            output_logits=bool(nc.output_logits), continuous_batching=bool(nc.is_continuous_batching),
                            draft=draft(nc), extra={"on_cpu": True} if nc.on_cpu else {}, **cache(nc)))
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


def cache(nc) -> dict:
    """vLLM's cache flags as vllm-neuron passes them (NXDI_CONTRACT.md: vllm-block-pool): --enable-prefix-caching
    sets NxDI's block layout, --block-size its pa_block_size, and the pool its pa_num_blocks, vLLM's null block
    counted in; the pool is at least every row's full sequence."""
    if not nc.is_prefix_caching:
        if nc.is_block_kv_layout:
            raise KimiInputError("a block KV layout without prefix caching: Kimi-K2's latent cache has blocks for "
                                 "--enable-prefix-caching only")
        return {}
    need = nc.batch_size * -(-nc.seq_len // nc.pa_block_size)
    if nc.pa_num_blocks - 1 < need:
        raise KimiInputError(f"--enable-prefix-caching: give --num-gpu-blocks-override, at least --max-num-seqs x "
                             f"--max-model-len / --block-size = {need} (the pool the model is built with)")
    return dict(prefix_caching=True, block_size=nc.pa_block_size, num_blocks=nc.pa_num_blocks - 1)


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
    elif r.context_length > c.context_length and not c.prefix_caching:  # its chunks run behind one prefill
        bad.append(f"--max-model-len {r.seq_len}: prompts that long need a prefill of {r.context_length} tokens, "
                   f"compiled for {c.context_length}")
    if r.continuous_batching and not c.one_row_prefill:
        bad.append(f"--max-num-seqs {r.batch} runs NxDI's continuous batching, compiled without it (a prefill batch "
                   f"of {c.prefill_batch})")
    asked_k, compiled_k = (s.draft.speculation_length if s.draft else 0 for s in (r, c))
    if asked_k != compiled_k:
        bad.append(f"--speculative-config num_speculative_tokens {asked_k or 'none'}, compiled for "
                   f"{compiled_k or 'no speculation'} (NxDI's speculation_length)")
    bad += _cache_mismatches(r, c)
    if not c.sampling.on_device and r.sampling.on_device:
        bad.append(f"compiled to return logits (--no-on-device-sampling); vllm-neuron samples on the device unless "
                   f"served with --additional-config '{json.dumps(HOST_SAMPLING_CONFIG)}'")
    elif c.sampling.on_device and not r.sampling.on_device:
        bad.append("compiled with on-device sampling; the request samples on the host (on_device_sampling_config "
                   "null)")
    elif r.output_logits and not c.output_logits:
        bad.append("compiled without the logits beside the device's tokens (output_logits), which a grammar masks "
                   "(vllm_worker.py)")
    return bad


def _cache_mismatches(r: RunSpec, c: RunSpec) -> list[str]:
    """Prefix caching needs the block layout compiled, at vLLM's block size and with a pool at least vLLM's (its block
    ids index the pool); the block layout compiled needs vLLM's block tables (NXDI_CONTRACT.md: vllm-block-pool)."""
    if r.prefix_caching and not c.prefix_caching:
        return ["--enable-prefix-caching, compiled without the block KV layout (compile_and_save.py --for-vllm "
                "--prefix-caching), or pass --no-enable-prefix-caching"]
    if c.prefix_caching and not r.prefix_caching:
        return [f"compiled with --prefix-caching (the block KV layout, --block-size {c.block_size}), served "
                f"without --enable-prefix-caching"]
    if not c.prefix_caching:
        return []
    bad = []
    if r.block_size != c.block_size:
        bad.append(f"--block-size {r.block_size}, compiled for {c.block_size}")
    if r.pool_blocks > c.pool_blocks:
        bad.append(f"--num-gpu-blocks-override {r.pool_blocks} > the compiled pool of {c.pool_blocks} blocks")
    return bad


# -- replies held to a grammar (neuron/vllm_worker.py) ---------------------------------------------------------------

def for_vllm(spec: RunSpec) -> RunSpec:
    """What vLLM serves (compile_and_save.py --for-vllm; run_spec reads a request so): with on-device sampling the
    logits come back beside the tokens, for the steps a grammar constrains; not with fused speculation."""
    return dataclasses.replace(spec, output_logits=spec.output_logits or (spec.sampling.on_device
                                                                           and spec.draft is None))


SPECULATION_WHY = ("speculative decoding: NxDI's fused speculation accepts drafted tokens on the device, where no "
                   "grammar reaches them; serve without --speculative-config")
NO_LOGITS_WHY = ("the model samples on the device and returns no logits to mask: compile with scripts/"
                 "compile_and_save.py --for-vllm (it compiles output_logits) or without on-device sampling")


def unconstrained_why(spec: RunSpec) -> str | None:
    """Why a model built from this spec cannot be held to a grammar; None: it can."""
    if spec.draft is not None:
        return SPECULATION_WHY
    if spec.sampling.on_device and not spec.output_logits:
        return NO_LOGITS_WHY
    return None


def grammar_refusal(vllm_config) -> str | None:
    """Why this `vllm serve` cannot hold replies to a grammar, read from its config before any request (the API
    middleware's check, in vLLM's API process); None: it can. The model itself is read as a request (run_spec:
    output_logits under on-device sampling), and precompiled artifacts without them are refused at load
    (compiled_mismatches)."""
    import importlib.metadata

    if getattr(getattr(vllm_config, "parallel_config", None), "worker_cls", None) != WORKER_CLS:
        return f"vllm-neuron's own worker applies no grammar; serve with --worker-cls {WORKER_CLS}"
    backend = getattr(getattr(vllm_config, "structured_outputs_config", None), "backend", None)
    if backend != STRUCTURED_OUTPUTS_CONFIG["backend"]:
        return (f"structured-output backend {backend!r}: serve with --structured-outputs-config "
                f"'{json.dumps(STRUCTURED_OUTPUTS_CONFIG)}' (guidance needs a fast tokenizer; Kimi's is not one)")
    try:
        version = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return "xgrammar is not installed"
    if tuple(int(p) for p in version.split(".")[:3] if p.isdigit()) < XGRAMMAR_MIN:
        return (f"xgrammar {version} reads Kimi's tokenizer as raw text (xgrammar #483); pip install "
                f"'xgrammar>={'.'.join(map(str, XGRAMMAR_MIN))}'")
    if getattr(vllm_config, "speculative_config", None) is not None:
        return SPECULATION_WHY
    return None
