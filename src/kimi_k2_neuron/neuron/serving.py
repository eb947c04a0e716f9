"""Compile, load and generate: what the scripts and the trn2 tests share.

A compiled folder's `kimi_k2_neuron.json` records the checkpoint and options, so run/bench need not repeat them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import write_atomically

from . import rules
from .contract import run_spec
from .modeling import KimiK2InferenceConfig, NeuronKimiK2ForCausalLM
from .spec import GREEDY, RunSpec, Sampling, speculation_overrun
from .vllm_request import (COMPILED_ARTIFACTS_ENV, HOST_SAMPLING_CONFIG, STRUCTURED_OUTPUTS_CONFIG, WORKER_CLS,
                           cache_flags)

logger = logging.getLogger(__name__)
RECORD = "kimi_k2_neuron.json"


def compile_model(cfg: KimiK2Config, checkpoint: str | Path, out: str | Path, spec: RunSpec,
                  plan_summary: str | None = None) -> NeuronKimiK2ForCausalLM:
    config = KimiK2InferenceConfig.for_serving(cfg, spec)
    app = NeuronKimiK2ForCausalLM(str(checkpoint), config)
    t0 = time.monotonic()
    app.compile(str(out))  # traces CTE + TKG, saves model.pt, then pre-shards (NXDI_CONTRACT.md: compile-steps)
    seconds = time.monotonic() - t0
    record = {"checkpoint": str(Path(checkpoint).resolve()), "spec": dataclasses.asdict(spec),
              "plan": plan_summary, "compile_and_shard_seconds": round(seconds, 1)}
    write_atomically(Path(out) / RECORD, json.dumps(record, indent=2))  # last: marks the folder finished
    logger.info("compiled and pre-sharded in %.1f min -> %s", seconds / 60, out)
    return app


def read_compiled_record(compiled: str | Path) -> dict:
    path = Path(compiled) / RECORD
    if not path.is_file():
        raise KimiInputError(f"--compiled {compiled}: not a folder written by scripts/compile_and_save.py "
                             f"(no {RECORD} in it)")
    return json.loads(path.read_text())


def load_compiled(compiled: str | Path, checkpoint: str | Path | None = None) -> NeuronKimiK2ForCausalLM:
    """The compiled model, loaded onto the Neuron cores. `checkpoint` defaults to the one it was compiled from."""
    record = read_compiled_record(compiled)  # also refuses a folder compile_and_save.py did not finish
    checkpoint = checkpoint or record["checkpoint"]
    config = KimiK2InferenceConfig.load(str(compiled))
    if config.neuron_config.is_prefix_caching:  # NxDI's generation adapter passes no block tables
        raise KimiInputError(f"--compiled {compiled}: compiled with --prefix-caching (the block KV layout), whose "
                             f"block tables come from vLLM's scheduler; serve it with vllm serve (docs/vllm.md)")
    app = NeuronKimiK2ForCausalLM(str(checkpoint), config)
    t0 = time.monotonic()
    app.load(str(compiled))
    logger.info("loaded in %.1f s", time.monotonic() - t0)
    return app


def vllm_serve_command(checkpoint: str | Path, compiled: str | Path, spec: RunSpec,
                       tokenizer_dir: str | Path | None = None) -> str:
    """The `vllm serve` line whose request is the one compiled (vllm_request.compiled_mismatches). Its chat template
    is read from tokenizer_dir (default: checkpoint; a dry run's raw folder, not yet converted: convert copies its
    tokenizer files as they are)."""
    from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

    parsers = shlex.quote(str(Path(__file__).with_name("vllm_parsers.py")))
    flags = [f"--tensor-parallel-size {spec.tp} --max-num-seqs {spec.batch} --max-model-len {spec.seq_len}",
             "--dtype bfloat16 " + " ".join(cache_flags(spec)),
             "--trust-remote-code --enable-auto-tool-choice",
             f"--tool-parser-plugin {parsers} --tool-call-parser kimi_k2_neuron",
             # Kimi's API contract (docs/vllm.md); message content as strings, as Kimi's templates render it
             "--middleware kimi_k2_neuron.neuron.vllm_api.KimiApi --chat-template-content-format string",
             # replies held to a schema (docs/vllm.md, "Structured outputs"): the worker that applies the grammar
             f"--worker-cls {WORKER_CLS} --structured-outputs-config "
             f"{shlex.quote(json.dumps(STRUCTURED_OUTPUTS_CONFIG))}"]
    if "<think>" in (KimiTokenizer.from_dir(tokenizer_dir or checkpoint).chat_template or ""):
        flags.append(f"--reasoning-parser-plugin {parsers} --reasoning-parser kimi_k2_neuron")
    if not spec.sampling.on_device:  # compiled to return logits: vLLM's sampler on the host
        flags.append(f"--additional-config {shlex.quote(json.dumps(HOST_SAMPLING_CONFIG))}")
    if spec.draft:  # "eagle": vLLM 0.13 refuses "eagle3" for kimi_k2 (NXDI_CONTRACT.md: vllm-spec-config)
        config = {"method": "eagle", "model": str(Path(spec.draft.path).resolve()),
                  "num_speculative_tokens": spec.draft.speculation_length}
        flags.append(f"--speculative-config {shlex.quote(json.dumps(config))}")
    env = f"{COMPILED_ARTIFACTS_ENV}={shlex.quote(str(Path(compiled).resolve()))}"
    return " \\\n    ".join([f"{env} vllm serve {shlex.quote(str(Path(checkpoint).resolve()))}", *flags])


class _Stream(StoppingCriteria):
    """Streams row 0 from the stopping-criteria hook: the adapter has no `streamer` (NXDI_CONTRACT.md:
    adapter-stopping-criteria). Never stops."""

    def __init__(self, decode, prompt_len: int, write):
        self.decode, self.start, self.write, self.shown = decode, prompt_len, write, ""

    def __call__(self, input_ids, scores, **kwargs):
        text = self.decode(input_ids[0, self.start:].tolist())
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass(frozen=True)
class Decoding:
    """What one generation asks beyond its prompts: how long, how to sample, where to stop (the text)."""

    max_new_tokens: int = 128
    sampling: Sampling = GREEDY
    stop: tuple[str, ...] = ()  # the caller cuts the text at one (runtime.chat.cut_at_stop)


def generate(app, tokenizer, prompts: list[str], decoding: Decoding = Decoding(), chat: bool = True,
             system: str | None = None, stream=None) -> list[list[int]]:
    """Text prompts (through the chat template unless not `chat`) -> generate_ids, stopping on the config's eos ids
    and Kimi's end-of-turn tokens."""
    from kimi_k2_neuron.runtime.chat import prompt_ids, reply_text

    stop_ids = tokenizer.stop_ids(app.config.core_config().eos_token_ids)
    return generate_ids(app, prompt_ids(tokenizer, prompts, chat, system), stop_ids, decoding,
                        decode=partial(reply_text, tokenizer), stream=stream)


def generate_ids(app, rows: list[list[int]], stop_ids, decoding: Decoding = Decoding(), decode=None,
                 stream=None, accepted: list | None = None) -> list[list[int]]:
    """New token ids per row from NxDI's HF adapter, or with a draft our fused-speculation loop (fused_spec.py), cut
    after the first stop. `decode`: ids -> text (for `stream`, row 0's text as it grows, and the stop strings).
    `accepted` receives the tokens each fused step emitted per live row."""
    from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter

    from kimi_k2_neuron.runtime.chat import StopStrings

    n, batch = len(rows), app.neuron_config.max_batch_size
    if n > batch:
        raise KimiInputError(f"{n} prompts, but the model was compiled for batch {batch}")
    enc = rows + [rows[-1]] * (batch - n)  # fill the compiled batch
    rules.check_prompt_lengths([len(e) for e in enc])
    width = max(len(e) for e in enc)
    nc = app.neuron_config
    # The prompt must fit the CTE bucket, and every decode step must write inside the cache: the step at position p
    # scatters at p and sends a [0, p) mask padded to max_length (NXDI_CONTRACT.md: generation-limits). The last fed
    # token sits at width + new - 2, so new <= seq_len - width keeps it in range; beyond that the scatter leaves the
    # cache and the next step raises.
    # chunked (chunked_prefill.py), a prompt may fill the cache
    longest = nc.seq_len if run_spec(app.config).layout.prefill_chunk else nc.max_context_length
    if width > longest:
        raise KimiInputError(f"prompt of {width} tokens exceeds the compiled context length {longest}")
    # the first new token comes from prefill alone
    limit = max(nc.seq_len - width - speculation_overrun(nc.speculation_length), 1)
    max_new_tokens = decoding.max_new_tokens
    if max_new_tokens > limit:
        logger.warning("max_new_tokens %d cut to %d: the compiled KV cache holds %d positions", max_new_tokens,
                       limit, nc.seq_len)
        max_new_tokens = limit
    strings = StopStrings(decode, decoding.stop, start=width) if decoding.stop else None
    if nc.enable_fused_speculation:
        from .fused_spec import generate_fused

        stream_row = _Stream(decode, 0, stream) if stream else None
        on_step = (lambda new: stream_row(torch.tensor(new[:1]), None)) if stream_row else None
        new, steps = generate_fused(app, enc, max_new_tokens, decoding.sampling,
                                    lambda t: _finished(t, stop_ids, strings) != t, on_step)
        if accepted is not None:
            accepted.extend(steps)
        return [_finished(row, stop_ids, strings) for row in new[:n]]
    pad = 0  # pad slots are masked out; any id will do
    input_ids = torch.tensor([e + [pad] * (width - len(e)) for e in enc])
    attention_mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in enc])
    stops = sorted(stop_ids)
    gen_cfg = GenerationConfig(**decoding.sampling.settings, max_new_tokens=max_new_tokens, eos_token_id=stops,
                               pad_token_id=pad)
    criteria = StoppingCriteriaList([_Stream(decode, width, stream)] if stream else [])
    if strings:
        criteria.append(strings)
    out = HuggingFaceGenerationAdapter(app).generate(input_ids, attention_mask=attention_mask,
                                                     generation_config=gen_cfg, stopping_criteria=criteria)
    # The adapter pads a finished row while others go on: cut each row where it finished, as the CPU runner does.
    return [_finished(row[width:], stop_ids, strings) for row in out[:n].tolist()]


def _finished(new: list[int], stop_ids, strings) -> list[int]:
    """`new` up to and including the token that ended it: a stop id, or the one that completed a --stop string."""
    for i, t in enumerate(new):
        if t in stop_ids or (strings and strings.done(new[:i + 1])):
            return new[:i + 1]
    return new
