# SPDX-License-Identifier: Apache-2.0
"""Kimi-K2 (Moonshot AI) for NxD Inference: the application class, and what converts, plans, compiles, loads and runs
it. The contrib's entry point (`src` on the path: pytest.ini puts it there for the tests).

The implementation is the `kimi_k2_neuron` package beside this file (src/kimi_k2_neuron/, an exact copy written by
the kimi-k2-neuron repository's scripts/export_contrib.py; edit it there, not here): a thin NxDI shell
(kimi_k2_neuron.neuron) over a backend-neutral PyTorch core that also runs, and is tested, on CPU. Importing this
module needs the Neuron SDK; without it the ImportError names the missing packages.
"""

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.convert import convert
from kimi_k2_neuron.formats import DEFAULT_SCHEME
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.neuron import (
    KimiK2DecoderLayer,
    KimiK2InferenceConfig,
    NeuronKimiK2ForCausalLM,
    NeuronKimiK2Model,
    NxDParallelContext,
)
from kimi_k2_neuron.neuron.contract import neuron_config_kwargs
from kimi_k2_neuron.neuron.fit import plan
from kimi_k2_neuron.neuron.plan_report import format_plan
from kimi_k2_neuron.neuron.serving import Decoding, compile_model, generate, load_compiled
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

__all__ = [
    "NeuronKimiK2ForCausalLM",
    "NeuronKimiK2Model",
    "KimiK2InferenceConfig",
    "KimiK2DecoderLayer",
    "NxDParallelContext",
    "KimiK2Config",
    "DEFAULT_SCHEME",
    "convert",
    "ConversionRecord",
    "plan",
    "format_plan",
    "RunSpec",
    "neuron_config_kwargs",
    "compile_model",
    "load_compiled",
    "KimiTokenizer",
    "generate",
    "Decoding",
]
