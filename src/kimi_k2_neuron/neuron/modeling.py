"""Kimi-K2 as an NxDI model, in NxDI's order: the config (inference_config.py), the model and the application, each
composed of the base (base.py) and the parts a run may add: chunked prefill (chunked_prefill.py), vLLM's prefix
caching (prefix_caching.py), EAGLE3 fused speculation (fused_spec.py) and the logits a grammar masks on the host
(host_logits.py). A part does nothing unless the run spec asks for it. The math is the core's, the settings
contract.py's."""

from __future__ import annotations

from .sdk import require_neuron_sdk

require_neuron_sdk()

from .base import KimiK2Application, KimiK2DecoderLayer, KimiK2Model, NxDParallelContext  # noqa: E402,F401
from .chunked_prefill import ChunkedPrefill, ChunkedPrefillModel  # noqa: E402
from .fused_spec import Eagle3Target, FusedSpeculation  # noqa: E402
from .host_logits import HostLogits  # noqa: E402
from .inference_config import KimiK2InferenceConfig, KimiK2ServingRequest  # noqa: E402,F401
from .nxd_moe import NxDRouter  # noqa: E402,F401 (the router NxD's MoE gets, named here too)
from .prefix_caching import PrefixCaching, PrefixCachingModel  # noqa: E402


class NeuronKimiK2Model(ChunkedPrefillModel, PrefixCachingModel, Eagle3Target, KimiK2Model):
    """One submodel: chunk=True builds the chunked-prefill submodel; with prefix caching the cache is in blocks and a
    prefill attends over cached ones; the EAGLE3 target's capture is gathered 4H wide when the fused speculation asks
    for it."""


class NeuronKimiK2ForCausalLM(HostLogits, ChunkedPrefill, PrefixCaching, FusedSpeculation, KimiK2Application):
    """`NeuronKimiK2ForCausalLM(converted_dir, config)`, then compile(out) / load(out)."""

    _model_cls = NeuronKimiK2Model
