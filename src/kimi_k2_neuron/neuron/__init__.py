"""Kimi-K2 on AWS Trainium2 through NxDI: the thin shell around the kimi_k2_neuron core.

Needs the Neuron SDK (neuronx-distributed-inference, neuronx-distributed, torch-neuronx; SDK 2.29+). Without it this
import raises ImportError naming what is missing; `import kimi_k2_neuron` never needs it.

Module map, SDK-free: contract (serving options -> NeuronConfig, checks, compiler args), keys (checkpoint keys ->
state dict), layers (attention and router in NxDI/NxD's contracts), loader (memory-mapped converted checkpoint);
then config (InferenceConfig) -> kv_cache (latent cache manager) -> modeling (decoder layer, model, application
class) -> serving (compile, load, generate).
"""

from .contract import missing_neuron_packages

_missing = missing_neuron_packages()
if _missing:
    raise ImportError(
        "kimi_k2_neuron.neuron needs the AWS Neuron SDK; missing: " + ", ".join(_missing) + ". Use a Neuron DLAMI "
        "virtualenv (SDK 2.29+) or `pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
        + " ".join(_missing) + "` (the PyPI packages of these names are placeholders); to run this NxDI model "
        "on CPU without them, see the README section 'The NxDI model on CPU'. The CPU core (kimi_k2_neuron) works "
        "without them.")

from .config import KimiK2InferenceConfig  # noqa: E402
from .modeling import (  # noqa: E402
    KimiK2DecoderLayer,
    NeuronKimiK2ForCausalLM,
    NeuronKimiK2Model,
    NxDParallelContext,
)

__all__ = ["NeuronKimiK2ForCausalLM", "NeuronKimiK2Model", "KimiK2InferenceConfig", "KimiK2DecoderLayer",
           "NxDParallelContext", "missing_neuron_packages"]
