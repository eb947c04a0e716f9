"""vLLM plugins of kimi-k2-neuron's nxdi-cpu tier: the public vllm-neuron 0.2.0 plugin on vLLM 0.13, on a host
without Neuron devices, so that vLLM's engine and OpenAI server drive an NxDI application in NxD's CPU mode.

- platform() (vllm.platform_plugins): vllm-neuron's platform, with max_model_len on the scheduler config, unless
  the host has Neuron devices (vllm-neuron's own entry point is active there, and vLLM allows one) or
  KIMI_K2_VLLM_NEURON_ON_CPU=0 (then vLLM picks its own CPU platform).
- adapt() (vllm.general_plugins, run in every vLLM process): what vLLM 0.13 moved or removed since 0.11, which
  vllm-neuron 0.2.0 was written for; each step looks for the 0.13 shape first and leaves 0.11 alone.

Registers no model: the model package does that from its own entry point.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import inspect
import os

OFF = "KIMI_K2_VLLM_NEURON_ON_CPU"


def platform() -> str | None:
    if os.environ.get(OFF, "1").strip().lower() in ("0", "false", "no", "off") or glob.glob("/dev/neuron*"):
        return None
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # NxD/NxDI import torch_xla; its device is never used here
    return f"{__name__}.NeuronPlatformOnCpu"


def __getattr__(name):
    # The platform class is built on first use: importing vllm_neuron's platform imports vLLM, which must not happen
    # while vLLM is still asking the plugins which platform to load.
    if name == "NeuronPlatformOnCpu":
        globals()[name] = cls = _platform_class()
        return cls
    raise AttributeError(name)


def _platform_class():
    from vllm_neuron.platform import NeuronPlatform

    class NeuronPlatformOnCpu(NeuronPlatform):
        """vllm-neuron's platform. vLLM 0.13 turned SchedulerConfig.max_model_len into an init-only value, which
        vllm-neuron's loader, runner and scheduler still read: it is copied from the model config here, where the
        config is settled and before it goes to the engine's other processes."""

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            super().check_and_update_config(vllm_config)
            scheduler, model = vllm_config.scheduler_config, vllm_config.model_config
            if scheduler is not None and model is not None and getattr(scheduler, "max_model_len", None) is None:
                object.__setattr__(scheduler, "max_model_len", model.max_model_len)

    NeuronPlatformOnCpu.__module__, NeuronPlatformOnCpu.__qualname__ = __name__, "NeuronPlatformOnCpu"
    return NeuronPlatformOnCpu


# vLLM 0.13 moved these out of vllm.utils, where vllm-neuron 0.2.0's runner and worker import them from
MOVED_UTILS = {"make_tensor_with_pad": "vllm.utils.torch_utils", "init_cached_hf_modules": "vllm.utils.import_utils"}
_adapted = False


def adapt() -> None:
    global _adapted
    if _adapted or importlib.util.find_spec("vllm_neuron") is None:
        return
    _adapted = True
    import vllm.utils

    for name, home in MOVED_UTILS.items():
        if not hasattr(vllm.utils, name):
            setattr(vllm.utils, name, getattr(importlib.import_module(home), name))
    _restore_as_kwargs()
    _input_batch_for_the_runner()


def _restore_as_kwargs() -> None:
    """vLLM 0.13 dropped MultiModalKwargs.as_kwargs, which vllm-neuron's runner calls on every forward (text only:
    with an empty dict). What it did in 0.11: every tensor in the nested inputs moved to `device`."""
    from vllm.multimodal import MultiModalKwargs

    if hasattr(MultiModalKwargs, "as_kwargs"):
        return
    from vllm.utils.jsontree import json_map_leaves

    def as_kwargs(batched_inputs, *, device):
        return json_map_leaves(lambda t: t.to(device=device, non_blocking=True), batched_inputs)

    MultiModalKwargs.as_kwargs = staticmethod(as_kwargs)


def _input_batch_for_the_runner() -> None:
    """vLLM 0.13's InputBatch requires kernel_block_sizes, which vllm-neuron's runner does not pass: its module gets
    an InputBatch that takes one kernel block per KV block when none is given (vLLM's own runners keep theirs)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm_neuron.worker import neuronx_distributed_model_runner as runner

    if runner.InputBatch is not InputBatch or "kernel_block_sizes" not in inspect.signature(InputBatch).parameters:
        return

    class InputBatchOneKernelBlockPerKvBlock(InputBatch):
        def __init__(self, *args, kernel_block_sizes=None, **kwargs):
            super().__init__(*args, kernel_block_sizes=list(kwargs["block_sizes"]) if kernel_block_sizes is None
                             else kernel_block_sizes, **kwargs)

    runner.InputBatch = InputBatchOneKernelBlockPerKvBlock
