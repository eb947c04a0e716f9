"""Generate with a compiled Kimi-K2 on trn2 (NxDI runner), streaming the text as it is produced.

The tokenizer and chat template come from the checkpoint (tiktoken.model, read as the CPU runner reads it);
generation stops at [EOS] (163585)
or <|im_end|> (163586), and at any --stop string. Prompts go through the chat template unless --no-chat. Several
--prompt run as one batch (up to the compiled batch size). The flags mean what they mean for
`kimi-k2-neuron generate` on CPU.

Example:
  python scripts/run_inference.py --compiled /data/compiled/tp64-s1024-b1 --prompt "What is the capital of France?"

Arguments are parsed and checked before the Neuron SDK is imported, so --help and bad flags answer without it.
"""

from __future__ import annotations

import argparse
import sys
import time

from kimi_k2_neuron.arguments import add_generation_args, check_generation_args, fail, sampling_values
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.launch import add_compiled_args, add_verbose, script_parser, sdk_missing, start


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    add_compiled_args(p)
    # NxDI's on-device sampling needs a top-k (<= the compiled global top-k): 50 unless --top-k says otherwise.
    add_generation_args(p, max_new_tokens=256, top_k=50)
    add_verbose(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_generation_args(args)
    except KimiInputError as e:
        return fail(e)
    start(args)
    temperature, top_k, top_p = sampling_values(args)
    sample = temperature > 0

    import torch

    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.runtime.chat import cut_at_stop, print_rows

    try:
        from kimi_k2_neuron.neuron.serving import generate, load_compiled, load_tokenizer, read_record
    except ImportError as e:
        return sdk_missing(e)

    torch.manual_seed(args.seed)
    checkpoint = args.model or read_record(args.compiled)["checkpoint"]
    cfg = KimiK2Config.from_file(checkpoint)
    app = load_compiled(args.compiled, checkpoint)
    tok = load_tokenizer(checkpoint)
    # Streaming shows row 0 as it comes; not with --stop, whose string must never be shown.
    stream = (lambda s: print(s, end="", flush=True)) if len(args.prompt) == 1 and not args.stop else None
    t0 = time.monotonic()
    try:
        rows = generate(app, tok, args.prompt, cfg, chat=args.chat, max_new_tokens=args.max_new_tokens,
                        do_sample=sample, temperature=temperature if sample else 1.0, top_k=top_k if sample else 1,
                        top_p=top_p,
                        stream=stream, system=args.system, stop=args.stop)
    except KimiInputError as e:
        return fail(e)
    seconds = time.monotonic() - t0
    if stream:
        print()
    else:
        print_rows(args.prompt, [cut_at_stop(tok.decode(r, skip_special=True), args.stop) for r in rows])
    n = sum(len(r) for r in rows)
    # Wall time of the whole call (prefill included): not a TPOT; scripts/bench_tpot.py measures decode alone.
    print(f"[{n} tokens in {seconds:.2f} s wall, prefill included; use scripts/bench_tpot.py for TPOT]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
