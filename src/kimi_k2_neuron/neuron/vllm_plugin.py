"""vLLM's entry point into this package (`vllm.general_plugins`: `kimi_k2_neuron`, setup.cfg), which vLLM runs in
each of its processes: the API server, the engine core and its workers.

vllm-neuron finds the NxDI application for a checkpoint in NxDI's MODEL_TYPES, by the name it derives from the
checkpoint's architecture (NXDI_CONTRACT.md: vllm-model-types): Kimi-K2, -Instruct, -0905 and -Thinking declare
DeepseekV3ForCausalLM, which it looks up as MODEL_TYPES["deepseekv3"]["causal-lm"], absent from NxDI. register() puts
NeuronKimiK2ForCausalLM there, in place (vllm-neuron imported the dict by name), and keeps a subclass of it already
registered (a user's or a test's own). What the application then makes of vllm-neuron's generic NeuronConfig is
modeling.py's (KimiK2ServingRequest).

It also registers `model_type: kimi_k2` with transformers' AutoConfig, as a plain config holding config.json's
fields: vllm-neuron reads the checkpoint's config through NxDI's load_pretrained_config, which calls AutoConfig
without trust_remote_code, and transformers knows no kimi_k2 (NXDI_CONTRACT.md: remote-code-config). The model
itself reads config.json as plain JSON; with --trust-remote-code vLLM's own process still reads it with Moonshot's
configuration_deepseek.py.

Without NxDI (or the Neuron shell's SDK packages) importable it does nothing and logs why at debug level.
"""

from __future__ import annotations

import logging

from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# vllm-neuron's MODEL_TYPES keys for the architectures Kimi checkpoints declare: DeepseekV3ForCausalLM.
MODEL_TYPE_KEYS = (("deepseekv3", "causal-lm"),)
HF_MODEL_TYPE = "kimi_k2"


class KimiK2HFConfig(PretrainedConfig):
    """config.json's fields as they are, under Kimi-K2's model_type (no defaults added, nothing derived)."""

    model_type = HF_MODEL_TYPE


def register() -> None:
    """The vllm.general_plugins entry point; vLLM may call it more than once per process."""
    try:
        from neuronx_distributed_inference.utils.constants import MODEL_TYPES

        from .modeling import NeuronKimiK2ForCausalLM
    except ImportError as e:
        log.debug("kimi_k2_neuron: not registered with vllm-neuron (NxDI's MODEL_TYPES): %s", e)
        return
    for model, task in MODEL_TYPE_KEYS:
        tasks = MODEL_TYPES.setdefault(model, {})
        current = tasks.get(task)
        if not (isinstance(current, type) and issubclass(current, NeuronKimiK2ForCausalLM)):
            tasks[task] = NeuronKimiK2ForCausalLM
            log.debug("kimi_k2_neuron: MODEL_TYPES[%r][%r] = NeuronKimiK2ForCausalLM (was %r)", model, task, current)
    _register_hf_config()


def _register_hf_config() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if HF_MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(HF_MODEL_TYPE, KimiK2HFConfig)
