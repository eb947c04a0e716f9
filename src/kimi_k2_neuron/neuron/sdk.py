"""Whether the Neuron SDK is here: the shell's modules that import it call require_neuron_sdk() first, so that its
absence is one ImportError naming what to install. No SDK, no torch."""

from __future__ import annotations

import importlib

# (import name, pip name). torch_xla comes with torch-neuronx.
NEURON_PACKAGES = (
    ("neuronx_distributed_inference", "neuronx-distributed-inference"),
    ("neuronx_distributed", "neuronx-distributed"),
    ("torch_neuronx", "torch-neuronx"),
)


def missing_neuron_packages() -> list[str]:
    """pip names of the Neuron packages that cannot be imported (imported, not looked up: PyPI has placeholders)."""
    missing = []
    for module, pip_name in NEURON_PACKAGES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(pip_name)
    return missing


def require_neuron_sdk() -> None:
    """ImportError naming the missing Neuron packages, before any SDK import."""
    missing = missing_neuron_packages()
    if missing:
        raise ImportError(
            "kimi_k2_neuron.neuron needs the AWS Neuron SDK; missing: " + ", ".join(missing) + ". Use a Neuron DLAMI "
            "virtualenv (SDK 2.29+) or `pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
            + " ".join(missing) + "` (the PyPI packages of these names are placeholders); to run this NxDI model "
            "on CPU without them, build the nxdi-cpu venv from a clone of the kimi-k2-neuron repository: `bash "
            "scripts/build_nxdi_cpu_tier.sh VENV` (docs/nxdi_on_cpu.md). The CPU core (kimi_k2_neuron) works "
            "without them.")
