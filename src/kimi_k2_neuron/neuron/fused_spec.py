"""Speculative decoding with an EAGLE3 draft through NxDI's fused speculation (NXDI_CONTRACT.md: fused-spec): the
context encoding and one fused graph (draft steps, one target verify of speculation_length tokens, NxDI's acceptance),
no plain token-generation graph. The target is Kimi's own NeuronKimiK2Model, unchanged but for the 4H-wide gather of
its captured hidden states (NXDI_CONTRACT.md: eagle3-cte-gather); the draft is NxDI's Llama EAGLE3 model
(NXDI_CONTRACT.md: llama-eagle3-draft), its weights read and checked by checkpoint/draft.py. Here: the draft's
InferenceConfig and FusedSpecNeuronConfig (also in place of the one vllm-neuron builds), the fused state dict, the
verify graph's MoE blocks and the per-step generation loop."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.modules.moe.moe_configs import BlockwiseMatmulConfig  # noqa: E402
from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig, NeuronConfig  # noqa: E402
from neuronx_distributed_inference.models.llama.modeling_llama import (LlamaInferenceConfig,  # noqa: E402
                                                                       NeuronLlamaForCausalLM, NeuronLlamaModel)
from neuronx_distributed_inference.modules.generation.sampling import prepare_sampling_params  # noqa: E402

from kimi_k2_neuron.checkpoint.draft import (ARCHITECTURES, MLA, facts, mapped_vocabulary,  # noqa: E402
                                             neuron_tensors, read_config, read_draft)
from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402

from . import moe_paths, vllm_request  # noqa: E402
from .draft_vocab import MAPPED, DraftVocabMap, draft_lm_head, draft_rows  # noqa: E402
from .spec import DraftSpec, Sampling  # noqa: E402

logger = logging.getLogger(__name__)

# The target's NeuronConfig fields the draft's takes as they are: one graph runs both at one TP, batch and cache
# length (NXDI_CONTRACT.md: draft-tp), with one sampler's settings (the draft's forced greedy by NxDI).
SHARED_FIELDS = ("tp_degree", "seq_len", "max_context_length", "batch_size", "ctx_batch_size", "tkg_batch_size",
                 "max_batch_size", "kv_cache_batch_size", "padding_side", "torch_dtype", "cast_type", "output_logits",
                 "is_continuous_batching", "logical_nc_config", "on_cpu", "save_sharded_checkpoint",
                 "speculation_length", "disable_argmax_kernel", "rpl_reduce_dtype")
# Every module of NxDI's Llama draft: bf16, never quantized when the target's experts are (NXDI_CONTRACT.md:
# fused-quantize)
DRAFT_MODULES = ["embed_tokens", "lm_head", "layers.", "fc", "fc_norm", "norm"]
FUSED_TAG = "fused_speculation_model"
DRAFT_PREFIX, TARGET_PREFIX = "draft_model.", "target_model."


# -- the draft ------------------------------------------------------------------------------------------------------

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


# -- the configs ----------------------------------------------------------------------------------------------------

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


def draft_config(target_nc, path: str):
    """NxDI's config of the draft folder `path` (Llama's, or the MLA draft's): config.json's fields as plain JSON (as
    the target's, KimiK2InferenceConfig.from_core), pad_token_id defaulted as transformers' LlamaConfig does, and
    whether its vocabulary is mapped (draft_vocab.MAPPED)."""
    raw = json_of(Path(path) / "config.json")
    attrs = {"pad_token_id": None, "output_attentions": False, "output_hidden_states": False, "return_dict": True,
             **{k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "auto_map")},
             MAPPED: mapped_vocabulary(path)}

    def load_config(self):
        self.__dict__.update(attrs)

    return config_class(raw)(draft_neuron_config(target_nc), load_config=load_config)


def is_mla(raw: dict) -> bool:
    arch = raw.get("architectures")
    return isinstance(arch, list) and len(arch) == 1 and ARCHITECTURES.get(arch[0]) == MLA


def config_class(raw: dict):
    from .eagle3_mla import Eagle3MlaInferenceConfig

    return Eagle3MlaInferenceConfig if is_mla(raw) else LlamaInferenceConfig


def draft_class(raw: dict):
    from .eagle3_mla import Eagle3MlaDraftForCausalLM

    return Eagle3MlaDraftForCausalLM if is_mla(raw) else Eagle3DraftForCausalLM


def fused_spec_config(target_nc, path: str) -> FusedSpecNeuronConfig:
    """worker_cls: Kimi's model; draft_model_cls: NxDI's Llama or the MLA draft, whose _model_cls builds the draft."""
    from .modeling import NeuronKimiK2Model

    config = draft_config(target_nc, path)
    return FusedSpecNeuronConfig(NeuronKimiK2Model, draft_config=config, draft_model_path=path,
                                 draft_model_cls=draft_class(vars(config)))


def of_spec(target_nc, draft: DraftSpec | None) -> FusedSpecNeuronConfig | None:
    """The FusedSpecNeuronConfig a run spec's draft asks for; none without a draft or before its folder is known (a
    vLLM request: complete() takes vllm-neuron's)."""
    return fused_spec_config(target_nc, draft.path) if draft and draft.path else None


def complete(app) -> None:
    """Before the application builds its submodels: a fused NeuronConfig gets its draft. vllm-neuron attaches a
    FusedSpecNeuronConfig without a draft class, built with the target's config class (NXDI_CONTRACT.md:
    vllm-spec-config): it is replaced by ours, from the same draft folder."""
    config = app.config
    nc, fused = config.neuron_config, getattr(config, "fused_spec_config", None)
    if not getattr(nc, "enable_fused_speculation", False):
        return
    if fused is None or not fused.draft_model_path:
        raise KimiInputError("speculative decoding needs an EAGLE3 draft: --draft DIR (vLLM: --speculative-config "
                             "with \"model\")")
    if fused.draft_model_cls is not draft_class(json_of(Path(fused.draft_model_path) / "config.json")):
        read_config(fused.draft_model_path, config.core_config())
        config.fused_spec_config = app.fused_spec_config = fused_spec_config(nc, fused.draft_model_path)
    # a reload's NeuronConfig sets it again with enable_eagle_speculation; the target fuses, not the draft
    config.fused_spec_config.draft_config.neuron_config.enable_fused_speculation = False


def draft_of(config) -> DraftSpec | None:
    """The DraftSpec a (reloaded) config holds: the draft's facts from its draft_config, not its folder, which a
    host loading pre-sharded weights need not have."""
    nc = config.neuron_config
    if not (getattr(nc, "speculation_length", 0) or getattr(nc, "enable_fused_speculation", False)):
        return None
    fused = getattr(config, "fused_spec_config", None)
    path = getattr(fused, "draft_model_path", None)
    dc = getattr(fused, "draft_config", None)
    checkpoint = None
    if dc is not None and getattr(dc, "architectures", None):
        values = {k: v for k, v in vars(dc).items() if k not in ("neuron_config", "fused_spec_config", "metadata")}
        try:
            checkpoint = replace(facts(str(path), values), mapped=bool(values.get(MAPPED)))
        except KimiInputError:  # a config of other fields (vllm-neuron's, before complete() replaces it): no facts
            checkpoint = None
    return DraftSpec(path=path, speculation_length=nc.speculation_length, checkpoint=checkpoint)


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


# -- the model ------------------------------------------------------------------------------------------------------

def target_output(model, output, kwargs):
    """NeuronKimiK2Model.get_model_output's result for the EAGLE3 target's context encoding: the last real position of
    the [B, S, 4H] capture gathered whole, and sliced_hidden set, where NxDI gathers H wide and leaves lm_head an
    empty slice (NXDI_CONTRACT.md: eagle3-cte-gather)."""
    hidden, cache = output
    nc = model.config.neuron_config
    if not (kwargs.get("is_for_context_encoding") and nc.is_eagle3 and not nc.is_eagle_draft
            and hidden.shape[-1] == 4 * model.hidden_size and hidden.shape[1] > 1):
        return output
    index = torch.max(kwargs["position_ids"], dim=1, keepdim=True).indices
    hidden = torch.gather(hidden, 1, index.unsqueeze(1).expand(hidden.shape[0], 1, hidden.shape[-1]))
    model.sliced_hidden = True
    return hidden, cache


def verify_blockwise(nc):
    """The fused graph's MoE config: its verify call runs batch x speculation_length tokens, which NxD would send to
    the blockwise prefill kernel from 48 tokens at Kimi's shapes; all-experts reads no more there (48 x 8 = 384 = E)
    and needs no kernel (NXDI_CONTRACT.md: verify-moe-path)."""
    bmm = nc.blockwise_matmul_config
    if nc.is_prefill_stage or not nc.speculation_length:
        return bmm
    return BlockwiseMatmulConfig.from_kwargs(logical_nc_config=bmm.logical_nc_config,
                                             **moe_paths.MODES["all-experts"].blockwise)


def state_dict(app, target: dict) -> dict:
    """checkpoint_loader_fn's state dict: the target's, or fused, its tensors under target_model., the draft's (checked
    again as read: names, shapes, dtypes, finite; its vocabulary map) under draft_model. in its class's names (NxDI
    Llama's, or the MLA draft's). NxDI's own loader would prefix through class attributes it never resets
    (NXDI_CONTRACT.md: fused-checkpoint-prefix)."""
    if not app.neuron_config.enable_fused_speculation:
        return target
    fused = app.config.fused_spec_config
    draft = read_draft(fused.draft_model_path, app.config.core_config())
    checkpoint = app.neuron_config.quantized_checkpoints_path or app.model_path
    tensors = neuron_tensors(draft, checkpoint)
    if draft.kind == MLA:
        from .eagle3_mla import neuron_state_dict

        tensors = neuron_state_dict(tensors, app.neuron_config.tp_degree)
    else:
        tensors = NeuronLlamaForCausalLM.convert_hf_to_neuron_state_dict(tensors, fused.draft_config)
    return {**{DRAFT_PREFIX + k: v for k, v in tensors.items()}, **{TARGET_PREFIX + k: v for k, v in target.items()}}


# -- generation -------------------------------------------------------------------------------------------------------

def generate_fused(app, rows: list[list[int]], max_new_tokens: int, sampling: Sampling, stopped, on_step=None):
    """New tokens per row (rows fill the compiled batch), a fused call per step until every row is `stopped(tokens)`
    or has max_new_tokens; -> (tokens per row, tokens each step emitted per live row). The tokens are what NxDI's
    acceptance keeps (NXDI_CONTRACT.md: fused-acceptance). NxDI's HF adapter runs batch 1 only and stops short
    (NXDI_CONTRACT.md: fused-adapter). `on_step(tokens)` after each call."""
    batch, width = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as NxDI's HF adapter pads
    seq_ids = torch.arange(batch, dtype=torch.int32)
    params = prepare_sampling_params(batch_size=batch, top_k=[sampling.top_k], top_p=[sampling.top_p],
                                     temperature=[sampling.temperature])
    with torch.no_grad():
        out = app(input_ids=ids, attention_mask=mask, position_ids=positions, seq_ids=seq_ids,
                  sampling_params=params).fused_outputs
    new = [[int(out[0][r, 0])] for r in range(batch)]
    live = [not stopped(t) and len(t) < max_new_tokens for t in new]
    steps = []
    while any(live):
        if on_step:
            on_step(new)
        position = out[3]
        with torch.no_grad():  # the mask inferred from the positions (NXDI_CONTRACT.md: fused-step)
            out = app(input_ids=out[1], attention_mask=None, position_ids=position, seq_ids=seq_ids,
                      sampling_params=params).fused_outputs
        emitted = (out[3] - position).view(-1).tolist()
        steps.append([emitted[r] for r in range(batch) if live[r]])
        for r in range(batch):
            if live[r]:
                new[r] += out[0][r, :emitted[r]].tolist()
                live[r] = not stopped(new[r]) and len(new[r]) < max_new_tokens
    if on_step:
        on_step(new)
    return [t[:max_new_tokens] for t in new], steps


def accept_summary(steps: list[list[int]], speculation_length: int) -> str:
    """One line: the mean tokens a fused step emitted per row (the accept length), 1 .. speculation_length."""
    flat = [n for step in steps for n in step]
    if not flat:
        return f"speculation (--speculation-length {speculation_length}): no fused step ran (prefill alone)"
    return (f"speculation (--speculation-length {speculation_length}): {len(steps)} fused steps, accept length "
            f"{sum(flat) / len(flat):.2f} tokens per step per row (min {min(flat)}, max {max(flat)})")
