"""Kimi-K2's InferenceConfig: built from a RunSpec (one way: contract.neuron_config_kwargs), which it saves whole;
reloaded from neuron_config.json by reading that spec back; or built from vllm-neuron's request, the one NeuronConfig
read as a RunSpec (vllm_request.run_spec). The rules run once per build (rules.check)."""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from pathlib import Path

from .sdk import require_neuron_sdk

require_neuron_sdk()

from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config, language_model_fields  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402
from kimi_k2_neuron.formats.record import CONVERSION_KEY, ConversionRecord  # noqa: E402

from . import contract, draft_config, rules, vllm_request  # noqa: E402
from .spec import RUN_SPEC_KEY, RunSpec, layout_flags  # noqa: E402

# HF fields NxDI reads that a plain config.json lacks; not use_return_dict, a read-only property in transformers
# (NXDI_CONTRACT.md: hf-defaults).
HF_DEFAULTS = {"output_attentions": False, "output_hidden_states": False, "return_dict": True}
_NOT_HF = ("neuron_config", "fused_spec_config", "metadata", "quantization_config", RUN_SPEC_KEY)
# Beside each config rather than in it: NxDI saves every attribute to neuron_config.json.
_CORE: "weakref.WeakKeyDictionary[KimiK2InferenceConfig, KimiK2Config]" = weakref.WeakKeyDictionary()


class KimiK2InferenceConfig(InferenceConfig):
    """Derived only in add_derived_config, so a reload is the same model (NXDI_CONTRACT.md: config-construction)."""

    @classmethod
    def from_core(cls, cfg: KimiK2Config, neuron_config: MoENeuronConfig, **kwargs) -> "KimiK2InferenceConfig":
        """config.json's fields as plain JSON: no checkpoint code runs (NXDI_CONTRACT.md: remote-code-config)."""
        fields = language_model_fields(cfg.raw)
        attrs = {**HF_DEFAULTS, **{k: v for k, v in fields.items() if k not in ("torch_dtype", "dtype", "auto_map")}}

        def load_config(self):
            self.__dict__.update(attrs)

        config = cls(neuron_config, load_config=load_config, **kwargs)
        _CORE[config] = dataclasses.replace(cfg, quant=None)  # quant describes the source's storage
        return config

    @classmethod
    def for_serving(cls, cfg: KimiK2Config, spec: RunSpec) -> "KimiK2InferenceConfig":
        """The config of a run spec, after the rules: its NeuronConfig derived from it, the spec saved on it."""
        rules.check(cfg, spec)
        nc = MoENeuronConfig(**contract.neuron_config_kwargs(cfg, spec))
        return cls.from_core(cfg, nc, **{RUN_SPEC_KEY: spec})

    @classmethod
    def for_request(cls, request: MoENeuronConfig, checkpoint) -> "KimiK2InferenceConfig":
        if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
            raise KimiInputError(f"{checkpoint}: not a checkpoint folder with a config.json; serve the converted "
                                 f"checkpoint's folder")
        compiled = os.environ.get(vllm_request.COMPILED_ARTIFACTS_ENV)
        try:
            cfg = KimiK2Config.from_file(checkpoint)
            spec = vllm_request.run_spec(cfg, request, ConversionRecord.of(cfg), checkpoint)
            config = cls.for_serving(cfg, spec)
            if compiled and (Path(compiled) / "neuron_config.json").is_file():
                _check_compiled(compiled, spec, config)
        except KimiInputError as e:
            raise KimiInputError(f"serving {checkpoint} with {vllm_request.describe(request)}: {e}") from None
        return config

    def add_derived_config(self):
        if self.neuron_config.is_eagle_draft:  # NXDI_CONTRACT.md: vllm-spec-config
            return draft_config.as_vllm_draft_config(self)
        if isinstance(self.neuron_config, KimiK2ServingRequest):
            # vllm-neuron's load_pretrained_config records the checkpoint folder as _name_or_path.
            built = self.for_request(self.neuron_config, getattr(self, "_name_or_path", None))
            self.__dict__.clear()
            self.__dict__.update(vars(built))
            _CORE[self] = built.core_config()
            setattr(self, RUN_SPEC_KEY, contract.run_spec(built))  # typed: through the rules once, in for_serving
            contract.adopt_run_spec(self, _CORE[self])
            return
        # The latent [c_kv | k_pe] as one KV head (NXDI_CONTRACT.md: latent-kv-head).
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.num_local_experts = self.n_routed_experts
        cfg = self.core_config()
        # the build's spec, or a reload's read back and put through the rules (NXDI_CONTRACT.md: config-construction)
        spec = contract.adopt_run_spec(self, cfg)
        # G of the sequence-sharded cache; 1 is no flash decoding (NXDI_CONTRACT.md: cores-per-group, fd-config)
        self.num_cores_per_group = spec.layout.kv_group
        for name, value in HF_DEFAULTS.items():
            setattr(self, name, getattr(self, name, value))
        expected = MoENeuronConfig(**contract.neuron_config_kwargs(cfg, spec))
        contract.enforce_neuron_config(self.neuron_config, spec, expected, contract.derived_fields(cfg, spec))

    def get_required_attributes(self) -> list[str]:
        return ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig

    def core_config(self) -> KimiK2Config:
        if self not in _CORE:
            raw = {k: v for k, v in vars(self).items() if k not in _NOT_HF}
            _CORE[self] = KimiK2Config.from_dict(raw, source="KimiK2InferenceConfig")
        return _CORE[self]


class KimiK2ServingRequest(MoENeuronConfig):
    """NxDI never builds this class, so the type alone marks a request (NXDI_CONTRACT.md: vllm-generic-config)."""


def _check_compiled(folder: str, request: RunSpec, config: KimiK2InferenceConfig) -> None:
    """Before vllm-neuron loads them: a ValueError there would recompile (NXDI_CONTRACT.md: vllm-precompiled). Two
    RunSpecs compared: the request's and the one the artifacts were compiled from, read from their
    neuron_config.json (no second build, no second pass of the rules)."""
    where = f"{vllm_request.COMPILED_ARTIFACTS_ENV}={folder}"
    try:
        compiled, saved = compiled_run_spec(folder)
    except KimiInputError as e:
        raise KimiInputError(f"{where}: {e}") from None
    bad = vllm_request.compiled_mismatches(request, compiled)
    layout = compiled.layout
    if compiled.prefix_caching:  # chunks behind vLLM's whole-prompt prefill (prefix_caching.py)
        layout = dataclasses.replace(layout, prefill_chunk=None)
    flags = layout_flags(layout)  # compile_and_save.py refuses these flags with --for-vllm
    if flags:  # vllm-neuron drives the prefills itself and builds the model from its request
        bad.append(f"compiled with {' '.join(flags)}, a layout vllm-neuron's request cannot carry")
    if saved.get(CONVERSION_KEY) != getattr(config, CONVERSION_KEY, None):
        bad.append(f"compiled from another conversion than {request.checkpoint or ''} (its config.json's "
                   f"{CONVERSION_KEY} differs)")
    if bad:
        raise KimiInputError(f"{where}: " + "; ".join(bad) + "; compile for these flags with "
                             "scripts/compile_and_save.py --for-vllm, or change them")


def compiled_run_spec(folder) -> tuple[RunSpec, dict]:
    """(the RunSpec a compiled folder was built from, its neuron_config.json), read without building its config: no
    second pass of the rules for a folder that is only compared or measured."""
    path = Path(folder) / "neuron_config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KimiInputError(f"{path}: expected the neuron_config.json NxDI writes ({type(e).__name__}: {e})") from None
    return contract.saved_run_spec(saved.get(RUN_SPEC_KEY) if isinstance(saved, dict) else None), saved
