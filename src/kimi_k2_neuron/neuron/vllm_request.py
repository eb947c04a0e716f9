"""vllm-neuron's request as a RunSpec: the run's shape from the generic NeuronConfig the plugin builds from vLLM's
flags, and nothing else (NXDI_CONTRACT.md: vllm-generic-config); the checkpoint's experts from its conversion record;
precompiled artifacts checked against it before vllm-neuron loads them; whether a server can hold replies to a
grammar (vllm_worker.py). No SDK."""

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
# vLLM's --worker-cls that applies the grammar bitmask, and the structured-output backend it is tested with
WORKER_CLS = "kimi_k2_neuron.neuron.vllm_worker.KimiNeuronWorker"
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
# xgrammar reads Kimi's tokenizer (tiktoken, byte-level token strings) as raw text before this version (xgrammar
# #483, fixed by #484 in 0.1.29): a space token would be 'Ġ' to it. vLLM 0.13 pins 0.1.27.
XGRAMMAR_MIN = (0, 1, 29)


def describe(nc) -> str:
    """The vLLM flags a request came from."""
    return (f"--tensor-parallel-size {nc.tp_degree} --max-num-seqs {nc.batch_size} --max-model-len {nc.seq_len} "
            f"--dtype {str(nc.torch_dtype).removeprefix('torch.')}")


def spec_of_request(cfg: KimiK2Config, nc, record, checkpoint) -> RunSpec:
    """The request's shape and sampler, the checkpoint's experts (record: a ConversionRecord), the MoE prefill mode
    these shapes allow; what the latent cache cannot serve is refused in one line."""
    if getattr(nc, "is_chunked_prefill", False):
        raise KimiInputError("chunked prefill (vllm-neuron's with DISABLE_NEURON_CUSTOM_SCHEDULER=1) needs NxDI's "
                             "block KV layout, which Kimi-K2's latent cache does not have; unset "
                             "DISABLE_NEURON_CUSTOM_SCHEDULER")
    if getattr(nc, "is_prefix_caching", False) or getattr(nc, "is_block_kv_layout", False):
        raise KimiInputError("--enable-prefix-caching (on by default in vLLM) needs NxDI's block KV layout, which "
                             "Kimi-K2's latent cache does not have; pass --no-enable-prefix-caching")
    if nc.torch_dtype != torch.bfloat16:
        raise KimiInputError(f"--dtype {str(nc.torch_dtype).removeprefix('torch.')}: Kimi-K2 runs in bfloat16 on "
                             f"Neuron; pass --dtype bfloat16")
    if record is None:
        raise KimiInputError(f"{checkpoint}: a raw (unconverted) checkpoint; serve the converted one: kimi-k2-neuron "
                             f"convert {checkpoint} DST --experts {DEFAULT_SCHEME}, then serve DST")
    spec = for_vllm(dataclasses.replace(contract.spec_of(nc, Layout(), draft_of_request(nc)), scheme=record.scheme,
                                        checkpoint=str(checkpoint), moe_prefill=None,
                                        extra={"on_cpu": True} if getattr(nc, "on_cpu", False) else {}))
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
    elif r.context_length > nc.max_context_length:
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
    ods = nc.on_device_sampling_config
    if ods is not None and not ods.dynamic:
        bad.append("compiled with static on-device sampling, which ignores each request's temperature, top_k, top_p")
    return bad


# -- replies held to a grammar (neuron/vllm_worker.py) ---------------------------------------------------------------

def for_vllm(spec: RunSpec) -> RunSpec:
    """What vLLM serves: with on-device sampling the logits come back beside the tokens (output_logits), for the
    steps a grammar constrains (vllm_worker.py); not with fused speculation, whose outputs are the accepted tokens."""
    return dataclasses.replace(spec, output_logits=spec.sampling.on_device and spec.draft is None)


SPECULATION_WHY = ("speculative decoding: NxDI's fused speculation accepts drafted tokens on the device, where no "
                   "grammar reaches them; serve without --speculative-config")
NO_LOGITS_WHY = ("the model samples on the device and returns no logits to mask: compile with scripts/"
                 "compile_and_save.py --for-vllm (it compiles output_logits) or without on-device sampling")


def unconstrained_why(config) -> str | None:
    """Why a model with this NeuronConfig (an object, or neuron_config.json's dict) cannot be held to a grammar;
    None: it can."""
    fields = config if isinstance(config, dict) else vars(config)
    if fields.get("enable_fused_speculation", False):
        return SPECULATION_WHY
    if fields.get("on_device_sampling_config") is not None and not fields.get("output_logits", False):
        return NO_LOGITS_WHY
    return None


def grammar_refusal(vllm_config, environ=None) -> str | None:
    """Why this `vllm serve` cannot hold replies to a grammar, read from its config before any request (the API
    middleware's check, in vLLM's API process); None: it can."""
    import importlib.metadata
    import json
    import os
    from pathlib import Path

    environ = os.environ if environ is None else environ
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
    compiled = environ.get(COMPILED_ARTIFACTS_ENV)
    if not compiled:  # vllm-neuron compiles the request: for_vllm returns the logits whatever the sampling
        return None
    path = Path(compiled) / "neuron_config.json"
    try:
        return unconstrained_why(json.loads(path.read_text())["neuron_config"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path}: unreadable; cannot tell whether the compiled model returns logits"
