"""vLLM's plugin entry point (setup.cfg), run in every vLLM process. Kimi checkpoints declare DeepseekV3ForCausalLM,
absent from NxDI's MODEL_TYPES where vllm-neuron looks (NXDI_CONTRACT.md: vllm-model-types), and model_type kimi_k2,
which AutoConfig does not know without remote code (NXDI_CONTRACT.md: remote-code-config): register() adds both."""

from __future__ import annotations

import logging

from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# Updated in place: vllm-neuron imported MODEL_TYPES by name.
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
