"""The NxDI shell around the core. modeling.py's names resolve on first use, so the pure modules import without the
SDK; without it those names raise the ImportError naming the missing Neuron packages. contract's too (it imports
torch): the command line's parser reads moe_paths, and builds without torch."""

_MODELING = ("NeuronKimiK2ForCausalLM", "NeuronKimiK2Model", "KimiK2InferenceConfig", "KimiK2DecoderLayer",
             "NxDParallelContext")

__all__ = [*_MODELING, "missing_neuron_packages"]


def __getattr__(name: str):
    if name in _MODELING:
        from . import modeling

        return getattr(modeling, name)
    if name == "missing_neuron_packages":
        from .sdk import missing_neuron_packages

        return missing_neuron_packages
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
