"""Test infrastructure of the nxdi-cpu tier, not the product. With this folder on PYTHONPATH every Python process of a
test (the CLI, its spawned ranks, vLLM's engine) gets a torch stand-in for torch_neuronx's Argmax custom op, which NxD's
greedy speculation calls directly (NxD operators/argmax.py; NXD_CPU_MODE.md: fused-spec-cpu) and the nxdi-cpu import
shim only raises. It is torch.argmax with the op's documented arguments (tensor, dim, keepdim), as NxD's docstring
gives it. Installed when torch_neuronx.xla_impl.ops is first imported, so a process that never imports it pays
nothing; nxdi_support.stand_in_device_ops does the same in a process that already has."""

import importlib.abc
import importlib.util
import sys

TARGET = "torch_neuronx.xla_impl.ops"


class TorchArgmax:
    @staticmethod
    def apply(tensor, dim, keepdim=False):
        import torch

        return torch.argmax(tensor, dim=dim, keepdim=keepdim)


def patch_loaded() -> None:
    """Where the op is already imported: the shim's module, and NxD's argmax module that imported it by name."""
    for name in (TARGET, "neuronx_distributed.operators.argmax"):
        module = sys.modules.get(name)
        if module is not None:
            module.Argmax = TorchArgmax


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.Argmax = TorchArgmax

        spec.loader.exec_module = exec_module
        return spec


if TARGET in sys.modules:
    patch_loaded()
else:
    sys.meta_path.insert(0, _Finder())
