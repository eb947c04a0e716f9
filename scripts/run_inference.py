"""Generate with a compiled Kimi-K2 on trn2 (NxDI runner), streaming the text as it is produced.

The tokenizer and chat template come from the checkpoint (tiktoken.model, read as the CPU runner reads it);
generation stops at [EOS] (163585) or <|im_end|> (163586), and at any --stop string. Prompts go through the chat
template unless --no-chat. Several --prompt run as one batch (up to the compiled batch size). The flags mean what
they mean for `kimi-k2-neuron generate` on CPU.

--cpu runs this same runner (NxDI's generation adapter and on-device sampler, our application class) on the NxDI
model in NxD's CPU mode, built from --model at --tp ranks, compiled for this batch and length; nothing is traced or
compiled, and its timing says nothing about trn2.

A folder compiled with --draft (compile_and_save.py) speculates with its EAGLE3 draft: NxDI's fused speculation, the
target verifying --speculation-length tokens a step; the tokens are the target's greedy ones (sampling: NxDI's
acceptance rule, docs/speculative.md), and the accept length is printed on stderr. With --cpu, --draft DIR and
--speculation-length K build the same.

Examples:
  python scripts/run_inference.py --compiled /data/compiled/tp64-s1024-b1 --prompt "What is the capital of France?"
  python scripts/run_inference.py --cpu --model ~/.cache/kimi-k2-neuron/tiny-fp8 --prompt "Hello, Kimi!"
  python scripts/run_inference.py --cpu --model tiny7 --draft tiny7-draft --speculation-length 4 --prompt "Hi"

Arguments are parsed and checked before the Neuron SDK is imported, so --help and bad flags answer without it.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

from kimi_k2_neuron.arguments import (add_generation_args, apply_sampling_defaults, check_generation_args, fail,
                                      sampling_values)
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command
from kimi_k2_neuron.launch import (add_compiled_args, add_verbose, begin, check_compiled_args, cpu_generate,
                                   script_parser)
from kimi_k2_neuron.runtime.ranks import RanksError


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    add_compiled_args(p)
    # generate's defaults: --top-k 0 (no filter) becomes NxDI's on-device sampler's compiled global top-k, the widest
    # it draws from (spec.Sampling.of)
    add_generation_args(p, max_new_tokens=32, top_k=0)
    add_verbose(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    code = begin(args, check_generation_args, check_compiled_args)
    if code is not None:
        return code

    import torch

    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.neuron.serving import read_compiled_record
    from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
    from kimi_k2_neuron.runtime.chat import ReplyPrinter, generation_defaults, print_rows, prompt_ids, reply_texts

    torch.manual_seed(args.seed)
    # Streaming shows row 0 as it comes, its markers in words and never a --stop string; not from CPU ranks.
    streams = len(args.prompt) == 1 and not (args.cpu and args.tp > 1)
    streamed = []  # the reply's text so far: an interrupt ends the line it is on before the interrupt's own line
    printer = ReplyPrinter(lambda s: print(s, end="", flush=True), args.stop)

    def show(text: str) -> None:
        streamed.append(text)
        printer.update("".join(streamed))

    stream = show if streams else None
    t0 = time.monotonic()
    try:
        checkpoint = args.model or read_compiled_record(args.compiled)["checkpoint"]
        cfg = KimiK2Config.from_file(checkpoint)
        apply_sampling_defaults(args, generation_defaults(checkpoint))
        tok = KimiTokenizer.from_dir(checkpoint)
        rows = _generate(args, prompt_ids(tok, args.prompt, args.chat, args.system), tok, cfg, checkpoint, stream)
    except KimiInputError as e:
        return fail(e)
    except RanksError as e:
        return fail(e, e.exit_code)
    except KeyboardInterrupt:
        if streamed:
            printer.update("".join(streamed), final=True)
            print(flush=True)
        raise
    seconds = time.monotonic() - t0
    if stream:
        printer.update("".join(streamed), final=True)
        print()
    else:
        print_rows(args.prompt, reply_texts(tok, rows, args.stop))
    n = sum(len(r) for r in rows)
    # Wall time of the whole call (prefill included): not a TPOT; scripts/bench_tpot.py measures decode alone.
    where = "NxD CPU mode, model build included; not a trn2 time" if args.cpu else "prefill included"
    print(f"[{n} tokens in {seconds:.2f} s wall, {where}; use scripts/bench_tpot.py for TPOT]", file=sys.stderr)
    return 0


def _generate(args, rows, tok, cfg, checkpoint, stream) -> list[list[int]]:
    """New tokens per prompt: the compiled model on trn2, or the NxDI model in NxD's CPU mode with --cpu."""
    from kimi_k2_neuron.runtime.chat import reply_text

    stops = tok.stop_ids(cfg.eos_token_ids)
    if args.cpu:
        return cpu_generate(args, rows, stops, str(checkpoint), stream, cfg=cfg)
    from kimi_k2_neuron.neuron import rules
    from kimi_k2_neuron.neuron.serving import Decoding, generate_ids, load_compiled
    from kimi_k2_neuron.neuron.spec import Sampling

    rules.check_prompt_lengths([len(r) for r in rows])  # before the minutes of loading, not after
    sampling = Sampling.of(*sampling_values(args))
    rules.check_temperature(sampling)
    app = load_compiled(args.compiled, checkpoint)
    decoding = Decoding(args.max_new_tokens, sampling, tuple(args.stop))
    accepted: list = []
    out = generate_ids(app, rows, stops, decoding, decode=partial(reply_text, tok), stream=stream, accepted=accepted)
    if app.neuron_config.enable_fused_speculation:  # compiled with --draft
        from kimi_k2_neuron.neuron.fused_spec import accept_summary

        print(accept_summary(accepted, app.neuron_config.speculation_length), file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(run_command(main))
