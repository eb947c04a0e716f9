"""Generate with a compiled Kimi-K2 on trn2 (NxDI runner), streaming the text as it is produced.

The tokenizer and chat template come from the checkpoint (trust_remote_code); generation stops at [EOS] (163585)
or <|im_end|> (163586). Several --prompt run as one batch (up to the compiled batch size).

Example:
  python scripts/run_inference.py --compiled /data/compiled/tp64-s1024-b1 --prompt "What is the capital of France?"

Arguments are parsed before the Neuron SDK is imported, so --help works without it.
"""

from __future__ import annotations

import argparse
import sys
import time

from kimi_k2_neuron.launch import add_compiled_args, add_verbose, script_parser, sdk_missing, start


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    add_compiled_args(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="(the default unless --temperature > 0 is given)")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0 samples; on-device sampling applies it")
    p.add_argument("--top-k", type=int, default=50, help="with --temperature > 0 (<= the compiled global top-k)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    p.add_argument("--seed", type=int, default=0)
    add_verbose(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start(args)
    sample = args.temperature > 0 and not args.greedy

    import torch

    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.errors import KimiInputError

    try:
        from kimi_k2_neuron.neuron.serving import generate, load_compiled, load_tokenizer, read_record
    except ImportError as e:
        return sdk_missing(e)

    torch.manual_seed(args.seed)
    checkpoint = args.model or read_record(args.compiled)["checkpoint"]
    cfg = KimiK2Config.from_file(checkpoint)
    app = load_compiled(args.compiled, checkpoint)
    tok = load_tokenizer(checkpoint)
    stream = (lambda s: print(s, end="", flush=True)) if len(args.prompt) == 1 else None
    t0 = time.monotonic()
    try:
        rows = generate(app, tok, args.prompt, cfg, chat=not args.no_chat, max_new_tokens=args.max_new_tokens,
                        do_sample=sample, temperature=args.temperature if sample else 1.0,
                        top_k=args.top_k if sample else 1, top_p=args.top_p if sample else 1.0, stream=stream)
    except KimiInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - t0
    if stream:
        print()
    else:
        for prompt, row in zip(args.prompt, rows):
            print(f"### {prompt}\n{tok.decode(row, skip_special_tokens=True)}\n")
    n = sum(len(r) for r in rows)
    # Wall time of the whole call (prefill included): not a TPOT; scripts/bench_tpot.py measures decode alone.
    print(f"[{n} tokens in {seconds:.2f} s wall, prefill included; use scripts/bench_tpot.py for TPOT]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
