"""The EAGLE3 draft's side of NxDI's fused speculation (NXDI_CONTRACT.md: fused-spec): the draft model (NxDI's Llama
EAGLE3, NXDI_CONTRACT.md: llama-eagle3-draft), its NeuronConfig and InferenceConfig from the target's, the
FusedSpecNeuronConfig, and the draft's config as vllm-neuron builds it. No Kimi model here: the InferenceConfig
reads it and the fused speculation (fused_spec.py) builds on it."""

from __future__ import annotations

import os
from pathlib import Path

from .sdk import require_neuron_sdk

require_neuron_sdk()

from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig, NeuronConfig  # noqa: E402
from neuronx_distributed_inference.models.llama.modeling_llama import (LlamaInferenceConfig,  # noqa: E402
                                                                       NeuronLlamaForCausalLM, NeuronLlamaModel)

from kimi_k2_neuron.checkpoint.draft import read_draft  # noqa: E402
from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402

from . import vllm_request  # noqa: E402

# The target's NeuronConfig fields the draft's takes as they are: one graph runs both at one TP, batch and cache
# length (NXDI_CONTRACT.md: draft-tp), with one sampler's settings (the draft's forced greedy by NxDI).
SHARED_FIELDS = ("tp_degree", "seq_len", "max_context_length", "batch_size", "ctx_batch_size", "tkg_batch_size",
                 "max_batch_size", "kv_cache_batch_size", "padding_side", "torch_dtype", "cast_type", "output_logits",
                 "is_continuous_batching", "logical_nc_config", "on_cpu", "save_sharded_checkpoint",
                 "speculation_length", "disable_argmax_kernel", "rpl_reduce_dtype")
# Every module of NxDI's Llama draft: bf16, never quantized when the target's experts are (NXDI_CONTRACT.md:
# fused-quantize)
DRAFT_MODULES = ["embed_tokens", "lm_head", "layers.", "fc", "norm"]

class Eagle3DraftModel(NeuronLlamaModel):
    """NxDI's Llama EAGLE3 draft in the draft's dtype throughout. Its fc (WeightGatheredColumnParallel) declares no
    dtype, so under the target's cast_type "as-declared" (which keeps Kimi's router float32) it would stay float32
    beside bf16 activations; NxDI's own EAGLE flow casts the whole model (cast_type "config"), which this does for the
    draft alone (NXDI_CONTRACT.md: llama-eagle3-draft)."""

    def __init__(self, config, optimize_inference: bool = True):
        super().__init__(config, optimize_inference)
        self.to(config.neuron_config.torch_dtype)


class Eagle3DraftForCausalLM(NeuronLlamaForCausalLM):
    """The draft_model_cls: NxDI builds the draft from its _model_cls and reloads its config with its config class
    (Llama's); its weights come from fused_spec.state_dict, not its get_state_dict."""

    _model_cls = Eagle3DraftModel


# -- the configs -------------------------------------------------------------------------------------------------

def draft_neuron_config(target_nc) -> NeuronConfig:
    """The draft's NeuronConfig from the target's: NxDI's EAGLE3 draft flags, its own dense cache (no flash decoding:
    the draft is MHA, NXDI_CONTRACT.md: llama-eagle3-draft), no KV tiling (NXDI_CONTRACT.md: fused-kv-tiling)."""
    kw = {k: getattr(target_nc, k) for k in SHARED_FIELDS if hasattr(target_nc, k)}
    ods = getattr(target_nc, "on_device_sampling_config", None)
    nc = NeuronConfig(**kw, on_device_sampling_config=None if ods is None else dict(vars(ods)),
                      enable_eagle_speculation=True, is_eagle3=True, is_eagle_draft=True,
                      enable_eagle_draft_input_norm=True, disable_kv_cache_tiling=True, quantized=False,
                      modules_to_not_convert=list(DRAFT_MODULES))
    nc.enable_fused_speculation = False  # NeuronConfig sets it with enable_eagle_speculation; the target fuses
    return nc


def draft_config(target_nc, path: str) -> LlamaInferenceConfig:
    """NxDI's Llama config of the draft folder `path`: config.json's fields as plain JSON (as the target's,
    KimiK2InferenceConfig.from_core), pad_token_id defaulted as transformers' LlamaConfig does."""
    raw = json_of(Path(path) / "config.json")
    attrs = {"pad_token_id": None, "output_attentions": False, "output_hidden_states": False, "return_dict": True,
             **{k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "auto_map", "architectures")}}

    def load_config(self):
        self.__dict__.update(attrs)

    return LlamaInferenceConfig(draft_neuron_config(target_nc), load_config=load_config)


def fused_spec_config(target_nc, path: str, worker_cls) -> FusedSpecNeuronConfig:
    """worker_cls: Kimi's model; draft_model_cls: NxDI's Llama, whose _model_cls builds the draft."""
    return FusedSpecNeuronConfig(worker_cls, draft_config=draft_config(target_nc, path), draft_model_path=path,
                                 draft_model_cls=Eagle3DraftForCausalLM)


def as_vllm_draft_config(config) -> None:
    """vllm-neuron builds the draft's config with the target's config class (NXDI_CONTRACT.md: vllm-spec-config):
    the draft folder (load_pretrained_config's _name_or_path) is checked against the target (the draft NeuronConfig
    is a copy of the target's, whose quantized_checkpoints_path is the target), and against precompiled artifacts;
    `config` becomes a Llama config of it, which complete() replaces by ours."""
    path, target = getattr(config, "_name_or_path", None), config.neuron_config.quantized_checkpoints_path
    where = f"--speculative-config model {path}"
    try:
        read_draft(path, KimiK2Config.from_file(target), finite=False)
        compiled = os.environ.get(vllm_request.COMPILED_ARTIFACTS_ENV)
        if compiled and (Path(compiled) / "neuron_config.json").is_file():
            saved = json_of(Path(compiled) / "neuron_config.json").get("fused_spec_config") or {}
            if saved.get("draft_model_path") and Path(saved["draft_model_path"]).resolve() != Path(path).resolve():
                raise KimiInputError(f"{vllm_request.COMPILED_ARTIFACTS_ENV}={compiled}: compiled with the draft "
                                     f"{saved['draft_model_path']}; compile for this draft with "
                                     f"scripts/compile_and_save.py --for-vllm --draft {path}")
    except KimiInputError as e:
        raise KimiInputError(f"{where}: {e}") from None
    config.__class__ = LlamaInferenceConfig  # (its validate_config follows, on the draft's own fields)
    LlamaInferenceConfig.add_derived_config(config)


def json_of(file: Path) -> dict:
    import json

    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise KimiInputError(f"{file}: expected a readable JSON file ({e})") from None
