"""Test infrastructure of the nxdi-cpu tier, not the product. The tier's torch stand-ins for torch_neuronx's Argmax and
xla_hlo_call DynamicUpdateSlice and Rng live in scripts/nxdi_cpu_tier/device_ops.py, which the import shim that
scripts/build_nxdi_cpu_tier.sh writes already serves. With this folder on PYTHONPATH, every Python process of a test
(the CLI, its spawned ranks, vLLM's engine) gets them in a venv whose shim only raises there (one built by ../shared's
setup.sh): installed when torch_neuronx.xla_impl.ops is first imported, so a process that never imports it pays
nothing; nxdi_support.stand_in_device_ops does the same in a process that already has."""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

TARGET = "torch_neuronx.xla_impl.ops"
SOURCE = Path(__file__).resolve().parents[3] / "scripts" / "nxdi_cpu_tier" / "device_ops.py"
# the modules that imported the ops by name before they were stood in
USERS = {"Argmax": ("neuronx_distributed.operators.argmax",),
         "xla_hlo_call": ("neuronx_distributed_inference.modules.kvcache.utils",)}


# This repository's copy under a name of its own: a venv's shim imports the copy it was built with as
# _nxdi_cpu_device_ops, which may predate an op the tests need (Rng)
NAME = "_nxdi_cpu_device_ops_repo"


def _ops():
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, SOURCE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[NAME] = module
    return sys.modules[NAME]


def _install(module) -> None:
    for name in USERS:
        setattr(module, name, getattr(_ops(), name))


def patch_loaded() -> None:
    """Where the ops are already imported: the shim's module, and the modules that imported them by name."""
    for name, users in USERS.items():
        for user in (TARGET, *users):
            module = sys.modules.get(user)
            if module is not None:
                setattr(module, name, getattr(_ops(), name))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _install(module)

        spec.loader.exec_module = exec_module
        return spec


if TARGET in sys.modules:
    patch_loaded()
else:
    sys.meta_path.insert(0, _Finder())
