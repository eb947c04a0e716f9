"""The EAGLE3 draft's side of NxDI's fused speculation (NXDI_CONTRACT.md: fused-spec): the Llama-layout draft model
(NxDI's Llama EAGLE3, NXDI_CONTRACT.md: llama-eagle3-draft; a reduced vocabulary mapped by draft_vocab.py), the
config of the MLA-layout draft (its model: eagle3_mla.py), their NeuronConfig and InferenceConfig from the target's,
the FusedSpecNeuronConfig, and the draft's config as vllm-neuron builds it. No Kimi model here: the InferenceConfig
reads it and the fused speculation (fused_spec.py) builds on it."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from .sdk import require_neuron_sdk

require_neuron_sdk()

from neuronx_distributed_inference.models.config import (FusedSpecNeuronConfig, InferenceConfig,  # noqa: E402
                                                         NeuronConfig)
from neuronx_distributed_inference.models.llama.modeling_llama import (LlamaInferenceConfig,  # noqa: E402
                                                                       NeuronLlamaForCausalLM, NeuronLlamaModel)

from kimi_k2_neuron.checkpoint.draft import (ARCHITECTURES, MLA, mapped_vocabulary, mla_core_config,  # noqa: E402
                                             read_draft)
from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402

from . import vllm_request  # noqa: E402
from .draft_vocab import MAPPED, DraftVocabMap, draft_lm_head, draft_rows  # noqa: E402

# The target's NeuronConfig fields the draft's takes as they are: one graph runs both at one TP, batch and cache
# length (NXDI_CONTRACT.md: draft-tp), with one sampler's settings (the draft's forced greedy by NxDI).
SHARED_FIELDS = ("tp_degree", "seq_len", "max_context_length", "batch_size", "ctx_batch_size", "tkg_batch_size",
                 "max_batch_size", "kv_cache_batch_size", "padding_side", "torch_dtype", "cast_type", "output_logits",
                 "is_continuous_batching", "logical_nc_config", "on_cpu", "save_sharded_checkpoint",
                 "speculation_length", "disable_argmax_kernel", "rpl_reduce_dtype")
# Every module of NxDI's Llama draft: bf16, never quantized when the target's experts are (NXDI_CONTRACT.md:
# fused-quantize)
DRAFT_MODULES = ["embed_tokens", "lm_head", "layers.", "fc", "fc_norm", "norm"]


class NoOpGqaWarning(logging.Filter):
    """Drops NxDI's "TP degree (T) and KV heads (K) are not divisible" warning where K is a multiple of T: the draft
    keeps its K heads, K / T a rank, whatever the strategy's name (NXDI_CONTRACT.md: draft-gqa-warning), and Kimi's
    MLA, which users took it for, never reaches it. A record for any other K stays."""

    PATTERN = re.compile(r"TP degree \((\d+)\) and KV heads \((\d+)\) are not divisible")

    def filter(self, record: logging.LogRecord) -> bool:
        m = self.PATTERN.search(record.getMessage())
        return not (m and int(m[2]) % int(m[1]) == 0)


logging.getLogger("Neuron").addFilter(NoOpGqaWarning())  # NxDI's logger (modules/attention/gqa.py)


class Eagle3DraftModel(DraftVocabMap, NeuronLlamaModel):
    """NxDI's Llama EAGLE3 draft in the draft's dtype throughout. Its fc (WeightGatheredColumnParallel) declares no
    dtype, so under the target's cast_type "as-declared" (which keeps Kimi's router float32) it would stay float32
    beside bf16 activations; NxDI's own EAGLE flow casts the whole model (cast_type "config"), which this does for the
    draft alone (NXDI_CONTRACT.md: llama-eagle3-draft). A reduced vocabulary: its lm_head's rows, its map
    (draft_vocab.py)."""

    def __init__(self, config, optimize_inference: bool = True):
        super().__init__(config, optimize_inference)
        self.to(config.neuron_config.torch_dtype)

    def init_model(self, config):
        super().init_model(config)
        on_cpu = config.neuron_config.on_cpu  # NxDI's CPU sampler reads whole logits, as the target's (cpu-sampler)
        if draft_rows(config) != config.vocab_size or on_cpu:
            self.lm_head = draft_lm_head(config, gather_output=not self.on_device_sampling or on_cpu)
        self.init_vocab_map(config)


class Eagle3DraftForCausalLM(NeuronLlamaForCausalLM):
    """The draft_model_cls: NxDI builds the draft from its _model_cls and reloads its config with its config class
    (Llama's); its weights come from fused_spec.state_dict, not its get_state_dict."""

    _model_cls = Eagle3DraftModel


class Eagle3MlaInferenceConfig(InferenceConfig):
    """The MLA draft's config (its model: eagle3_mla.Eagle3MlaDraftModel): config.json's fields as attributes (as
    draft_config loads them); its layer as a core config (checkpoint/draft.py: mla_core_config)."""

    def add_derived_config(self):
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim  # the latent entry as one KV head
        self.num_key_value_heads = 1
        self.num_cores_per_group = 1  # the draft's cache is never sequence-sharded

    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_attention_heads", "vocab_size", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "rms_norm_eps"]

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig

    def core_config(self) -> KimiK2Config:
        fields = {k: v for k, v in vars(self).items() if k not in ("neuron_config", "fused_spec_config", "metadata")}
        return mla_core_config(fields, source=str(Path(getattr(self, "_name_or_path", "draft")) / "config.json"))


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


def draft_config(target_nc, path: str) -> InferenceConfig:
    """NxDI's config of the draft folder `path` (Llama's, or the MLA draft's): config.json's fields as plain JSON (as
    the target's, KimiK2InferenceConfig.from_core), pad_token_id defaulted as transformers' LlamaConfig does, and
    whether its vocabulary is mapped (draft_vocab.MAPPED)."""
    raw = json_of(Path(path) / "config.json")
    attrs = {"pad_token_id": None, "output_attentions": False, "output_hidden_states": False, "return_dict": True,
             **{k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "auto_map", "architectures")},
             MAPPED: mapped_vocabulary(path)}

    def load_config(self):
        self.__dict__.update(attrs)

    return config_class(raw)(draft_neuron_config(target_nc), load_config=load_config)


def is_mla(raw: dict) -> bool:
    """Whether a draft config.json's fields are the MLA layout's (checkpoint/draft.py: ARCHITECTURES)."""
    arch = raw.get("architectures")
    return isinstance(arch, list) and len(arch) == 1 and ARCHITECTURES.get(arch[0]) == MLA


def config_class(raw: dict) -> type:
    return Eagle3MlaInferenceConfig if is_mla(raw) else LlamaInferenceConfig


def fused_spec_config(target_nc, path: str, worker_cls, draft_cls) -> FusedSpecNeuronConfig:
    """worker_cls: Kimi's model; draft_cls: NxDI's Llama draft (Eagle3DraftForCausalLM) or the MLA draft
    (eagle3_mla.py), whose _model_cls builds the draft."""
    return FusedSpecNeuronConfig(worker_cls, draft_config=draft_config(target_nc, path), draft_model_path=path,
                                 draft_model_cls=draft_cls)


def as_vllm_draft_config(config) -> None:
    """vllm-neuron builds the draft's config with the target's config class (NXDI_CONTRACT.md: vllm-spec-config):
    the draft folder (load_pretrained_config's _name_or_path) is checked against the target (the draft NeuronConfig
    is a copy of the target's, whose quantized_checkpoints_path is the target), and against precompiled artifacts;
    `config` becomes a draft config of its kind (Llama's, the MLA draft's), which complete() replaces by ours."""
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
    config.__class__ = config_class(json_of(Path(path) / "config.json"))  # (its validate_config follows, on the
    config.__class__.add_derived_config(config)  # draft's own fields)


def json_of(file: Path) -> dict:
    import json

    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise KimiInputError(f"{file}: expected a readable JSON file ({e})") from None
