"""KimiK2InferenceConfig: NxDI's InferenceConfig for Kimi-K2, built from the checkpoint's config.json.

InferenceConfig.__init__ runs load_config, then the kwargs, then add_derived_config, then validate_config (NxDI
models/config.py:853-876); `load(path)` rebuilds it from neuron_config.json the same way (l.965-1038). All
derivation therefore lives in add_derived_config and is idempotent (contract.derived_fields,
contract.enforce_neuron_config), so a compiled folder's config reloads to the same model.
"""

from __future__ import annotations

from pathlib import Path

from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig

from kimi_k2_neuron.config import KimiK2Config

from . import contract

# InferenceConfig attributes that are not config.json fields.
_NOT_HF = ("neuron_config", "fused_spec_config", "metadata", "quantization_config")


class KimiK2InferenceConfig(InferenceConfig):
    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, neuron_config: MoENeuronConfig,
                        **kwargs) -> "KimiK2InferenceConfig":
        """The config of the checkpoint in `model_dir` (raw HF or converted; both carry the HF config.json)."""
        attrs = contract.hf_attributes(model_dir)

        def load_config(self):
            self.__dict__.update(attrs)

        return cls(neuron_config, load_config=load_config, **kwargs)

    def add_derived_config(self):
        for name, value in contract.derived_fields(vars(self)).items():
            setattr(self, name, value)
        contract.enforce_neuron_config(self.neuron_config, getattr(self, "n_routed_experts", None),
                                       getattr(self, "num_experts_per_tok", None))

    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig

    def core_config(self) -> KimiK2Config:
        """The core's typed config, re-parsed (and re-validated) from these attributes. quantization_config is left
        out: it describes the source checkpoint's storage, which the Neuron model does not read."""
        raw = {k: v for k, v in vars(self).items() if k not in _NOT_HF}
        return KimiK2Config.from_dict(raw, source="KimiK2InferenceConfig")
