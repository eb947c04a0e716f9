"""Kimi-K2 on AWS Trainium2 through NxDI: the thin shell around the kimi_k2_neuron core, what runs on trn2.

    contract.py        what Kimi requires of NxDI: the SDK, NeuronConfig settings and refusals, EP and compile
                       rules, FP8 environment, compiler arguments, the checkpoint's keys in the state dict (pure)
    moe_paths.py       which NxD MoE path a call takes; the prefill modes and what their kernels need (pure)
    loader.py          the converted checkpoint as the model's state dict, memory-mapped (pure)
    modeling.py        KimiK2InferenceConfig, NeuronKimiK2Model, NeuronKimiK2ForCausalLM (needs the SDK)
    serving.py         compile, load, generate: what the trn2 scripts and tests share (needs the SDK)
    vllm_parsers.py    vLLM tool-call and reasoning parsers for Kimi's output, a plugin file (needs vLLM)
    NXDI_CONTRACT.md   the NxDI/NxD code each choice rests on (file:line), by name

Its CPU verification harness (NxD's CPU mode, torch_xla traces) is kimi_k2_neuron.nxdi_cpu.

The pure modules import anywhere; the SDK-backed ones, and the names below taken from this package, raise the
ImportError that names the missing Neuron packages (SDK 2.29+) when the SDK is not there.
"""

from .contract import missing_neuron_packages

# Resolved on first use from modeling.py, so that importing the pure modules never needs the SDK.
_MODELING = ("NeuronKimiK2ForCausalLM", "NeuronKimiK2Model", "KimiK2InferenceConfig", "KimiK2DecoderLayer",
             "NxDParallelContext")

__all__ = [*_MODELING, "missing_neuron_packages"]


def __getattr__(name: str):
    if name in _MODELING:
        from . import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
