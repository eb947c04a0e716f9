"""Speculative decoding with an EAGLE3 draft through NxDI's fused speculation (NXDI_CONTRACT.md: fused-spec): the
context encoding and one fused graph (draft steps, one target verify of speculation_length tokens, NxDI's acceptance),
no plain token-generation graph. The target is Kimi's own model, unchanged but for the 4H-wide gather of its captured
hidden states (NXDI_CONTRACT.md: eagle3-cte-gather); the draft and its configs are draft_config.py's (the MLA draft's
model eagle3_mla.py's), its weights read and checked by checkpoint/draft.py. Here: the parts the model and the
application are built with (Eagle3Target, FusedSpeculation), the FusedSpecNeuronConfig completed before the submodels
are built, the fused state dict and the per-step generation loop."""

from __future__ import annotations

import logging
from pathlib import Path

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM  # noqa: E402
from neuronx_distributed_inference.modules.generation.sampling import prepare_sampling_params  # noqa: E402

from kimi_k2_neuron.checkpoint.draft import MLA, neuron_tensors, read_config, read_draft  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402

from .base import add_compiler_args  # noqa: E402
from .contract import run_spec  # noqa: E402
from .draft_config import Eagle3DraftForCausalLM, fused_spec_config, is_mla, json_of  # noqa: E402
from .eagle3_mla import Eagle3MlaDraftForCausalLM, neuron_state_dict  # noqa: E402
from .spec import Sampling  # noqa: E402

logger = logging.getLogger(__name__)

FUSED_TAG = "fused_speculation_model"
DRAFT_PREFIX, TARGET_PREFIX = "draft_model.", "target_model."


def complete(app) -> None:
    """Before the application builds its submodels: a fused NeuronConfig gets its draft, from the run spec's draft
    folder. vllm-neuron attaches a FusedSpecNeuronConfig without a draft class, built with the target's config class
    (NXDI_CONTRACT.md: vllm-spec-config): it is replaced by ours, from the same draft folder."""
    config = app.config
    nc, fused = config.neuron_config, config.fused_spec_config
    if not nc.enable_fused_speculation:
        return
    draft = run_spec(config).draft
    path = fused.draft_model_path if fused is not None else draft.path if draft else None
    if not path:
        raise KimiInputError("speculative decoding needs an EAGLE3 draft: --draft DIR (vLLM: --speculative-config "
                             "with \"model\")")
    draft_cls = draft_class(path)
    if fused is None or fused.draft_model_cls is not draft_cls:
        read_config(path, config.core_config())
        # the class's own model, not the fused one NxDI's __init__ put on the instance
        config.fused_spec_config = app.fused_spec_config = fused_spec_config(nc, path, type(app)._model_cls,
                                                                             draft_cls)
    # a reload's NeuronConfig sets it again with enable_eagle_speculation; the target fuses, not the draft
    config.fused_spec_config.draft_config.neuron_config.enable_fused_speculation = False


def draft_class(path) -> type:
    """The draft_model_cls of the draft folder `path`: NxDI's Llama draft, or the MLA draft (eagle3_mla.py)."""
    return Eagle3MlaDraftForCausalLM if is_mla(json_of(Path(path) / "config.json")) else Eagle3DraftForCausalLM


# -- the parts of the model and the application (modeling.py composes them) ----------------------------------------

class Eagle3Target:
    """The model's part: EAGLE3's capture gathered 4H wide (NXDI_CONTRACT.md: eagle3-cte-gather)."""

    def get_model_output(self, *args, **kwargs):
        return target_output(self, super().get_model_output(*args, **kwargs), kwargs)


class FusedSpeculation:
    """The application's part: the draft completed first thing NxDI's __init__ builds (NXDI_CONTRACT.md: fused-spec),
    the fused graph compiled with Kimi's arguments, its state dict fused."""

    def enable_context_encoding(self, **model_init_kwargs):
        complete(self)
        super().enable_context_encoding(**model_init_kwargs)

    def enable_fused_spec(self):
        super().enable_fused_spec()
        add_compiler_args(self.fused_spec_model)

    def checkpoint_loader_fn(self, mmap: bool = False):
        return state_dict(self, super().checkpoint_loader_fn(mmap))


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
