"""The NxDI shell around the core. modeling.py's names resolve on first use, so the pure modules import without the
SDK; without it those names raise the ImportError naming the missing Neuron packages."""

from .contract import missing_neuron_packages

_MODELING = ("NeuronKimiK2ForCausalLM", "NeuronKimiK2Model", "KimiK2InferenceConfig", "KimiK2DecoderLayer",
             "NxDParallelContext")

__all__ = [*_MODELING, "missing_neuron_packages"]


def __getattr__(name: str):
    if name in _MODELING:
        from . import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
