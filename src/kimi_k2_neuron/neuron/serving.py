"""Compile, load and generate: what the scripts and the trn2 tests share.

A compiled folder holds NxDI's model.pt, neuron_config.json and weights/tp{rank}_sharded_checkpoint.safetensors,
plus `kimi_k2_neuron.json` recording which checkpoint it was compiled from and how (so run/bench find the tokenizer
and the options without repeating them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from neuronx_distributed_inference.models.config import MoENeuronConfig
from transformers import AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError

from . import contract
from .config import KimiK2InferenceConfig
from .modeling import NeuronKimiK2ForCausalLM

logger = logging.getLogger(__name__)
RECORD = "kimi_k2_neuron.json"
# Kimi's two end tokens: [EOS] (config.json eos_token_id) and <|im_end|>, which ends every chat turn.
STOP_TOKENS = ("[EOS]", "<|im_end|>")


def compile_model(checkpoint: str | Path, out: str | Path, options: contract.ServeOptions,
                  plan_summary: str | None = None) -> NeuronKimiK2ForCausalLM:
    cfg = KimiK2Config.from_file(checkpoint)
    kwargs = contract.neuron_config_kwargs(cfg, options)
    config = KimiK2InferenceConfig.from_checkpoint(checkpoint, MoENeuronConfig(**kwargs))
    app = NeuronKimiK2ForCausalLM(str(checkpoint), config)
    t0 = time.monotonic()
    app.compile(str(out))  # traces CTE + TKG, saves model.pt, then pre-shards the weights (application_base.py:292)
    seconds = time.monotonic() - t0
    record = {"checkpoint": str(Path(checkpoint).resolve()), "options": dataclasses.asdict(options),
              "plan": plan_summary, "compile_and_shard_seconds": round(seconds, 1)}
    (Path(out) / RECORD).write_text(json.dumps(record, indent=2))
    logger.info("compiled and pre-sharded in %.1f min -> %s", seconds / 60, out)
    return app


def read_record(compiled: str | Path) -> dict:
    path = Path(compiled) / RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{compiled} is not a folder written by scripts/compile_and_save.py (no {RECORD})")
    return json.loads(path.read_text())


def load_compiled(compiled: str | Path, checkpoint: str | Path | None = None) -> NeuronKimiK2ForCausalLM:
    """The compiled model, loaded onto the Neuron cores. `checkpoint` defaults to the one it was compiled from."""
    checkpoint = checkpoint or read_record(compiled)["checkpoint"]
    config = KimiK2InferenceConfig.load(str(compiled))
    app = NeuronKimiK2ForCausalLM(str(checkpoint), config)
    t0 = time.monotonic()
    app.load(str(compiled))
    logger.info("loaded in %.1f s", time.monotonic() - t0)
    return app


def load_tokenizer(checkpoint: str | Path):
    # Kimi's tokenizer is checkpoint code (tiktoken-based tokenization_kimi.py): trust_remote_code.
    return AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=True)


def stop_token_ids(tokenizer, cfg: KimiK2Config) -> list[int]:
    """config.json's eos_token_id(s) plus the ids of [EOS] and <|im_end|> (163585 and 163586 for Kimi-K2)."""
    ids = set(cfg.eos_token_ids)
    for tok in STOP_TOKENS:
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(ids)


class _Stream(StoppingCriteria):
    """Prints row 0's new text as it is generated. NxDI's generation adapter calls the stopping criteria once per
    step (hf_adapter.py:247) and has no `streamer` support, so streaming rides on this hook; it never stops."""

    def __init__(self, tokenizer, prompt_len: int, write):
        self.tok, self.start, self.write, self.shown = tokenizer, prompt_len, write, ""

    def __call__(self, input_ids, scores, **kwargs):
        text = self.tok.decode(input_ids[0, self.start:], skip_special_tokens=True)
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(app, tokenizer, prompts: list[str], cfg: KimiK2Config, *, chat: bool = True, max_new_tokens: int = 128,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0,
             stream=None, system: str | None = None, stop=()) -> list[list[int]]:
    """Generate for a batch of prompts through NxDI's HuggingFaceGenerationAdapter (right padding, decode mask over
    [0, pos), on-device sampling when compiled with it). Returns the new token ids per prompt, cut after the first
    stop token. `system` opens each chat with a system message; a row also ends once its text holds a string of
    `stop` (the caller cuts the text there: runtime.chat.cut_at_stop)."""
    from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter

    from kimi_k2_neuron.runtime.chat import StopStrings, chat_messages

    if chat:
        prompts = [tokenizer.apply_chat_template(chat_messages(p, system), tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    n, batch = len(prompts), app.neuron_config.max_batch_size
    if n > batch:
        raise KimiInputError(f"{len(prompts)} prompts, but the model was compiled for batch {batch}")
    prompts = prompts + [prompts[-1]] * (batch - len(prompts))  # fill the compiled batch
    enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    contract.check_prompt_lengths([len(e) for e in enc])
    width = max(len(e) for e in enc)
    nc = app.neuron_config
    # The prompt must fit the CTE bucket (model_wrapper.py:771-778 raises otherwise), and every decode step must write
    # inside the cache: the step at position p scatters at p and sends a [0, p) mask padded to max_length
    # (kv_cache_manager.py:577-586, model_wrapper.py:813-826). The last fed token sits at width + new - 2, so
    # new <= seq_len - width keeps it in range; beyond that the scatter leaves the cache and the next step raises.
    if width > nc.max_context_length:
        raise KimiInputError(f"prompt of {width} tokens exceeds the compiled context length {nc.max_context_length}")
    limit = max(nc.seq_len - width, 1)  # the first new token comes from prefill alone
    if max_new_tokens > limit:
        logger.warning("max_new_tokens %d cut to %d: the compiled KV cache holds %d positions", max_new_tokens,
                       limit, nc.seq_len)
        max_new_tokens = limit
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([e + [pad] * (width - len(e)) for e in enc])
    attention_mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in enc])
    stops = stop_token_ids(tokenizer, cfg)
    gen_cfg = GenerationConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                               max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad)
    criteria = StoppingCriteriaList([_Stream(tokenizer, width, stream)] if stream else [])
    if stop:
        criteria.append(StopStrings(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop, start=width))
    out = HuggingFaceGenerationAdapter(app).generate(input_ids, attention_mask=attention_mask,
                                                     generation_config=gen_cfg, stopping_criteria=criteria)
    rows = []
    for row in out[:n].tolist():
        new = row[width:]
        cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
        rows.append(new[:cut])
    return rows
