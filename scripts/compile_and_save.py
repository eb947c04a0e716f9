"""Compile Kimi-K2 for one trn2 configuration and pre-shard its weights: converted checkpoint -> compiled folder.

The folder gets NxDI's model.pt (context-encoding and token-generation NEFFs), neuron_config.json, one
weights/tp{rank}_sharded_checkpoint.safetensors per rank, and kimi_k2_neuron.json (the checkpoint and options).
The configuration is checked against the fit planner first and refused if it does not fit, unless --force.
A raw HF checkpoint is first converted, once, into a sibling folder <model>-neuron-<experts> (kimi_k2_neuron.convert;
an estimated 10-35 min for the 1T model on a trn2.48xlarge, not measured; a progress bar shows the ETA and the time
taken is printed at the end).

Example (trn2.48xlarge, LNC=2 -> 64 logical cores):
  python scripts/compile_and_save.py --model /data/kimi-k2-neuron-fp8 --out /data/compiled/tp64-s1024-b1 \\
      --tp 64 --lnc 2 --seq-len 1024 --batch 1

Arguments are parsed before the Neuron SDK is imported, so --help works without it.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from kimi_k2_neuron.formats import DEFAULT_SCHEME, SCHEMES
from kimi_k2_neuron.launch import add_verbose, script_parser, sdk_missing, set_fp8_env, start

# The planner imports torch; the FP8 environment must be set before anything can import torch-xla, which reads it
# then. start() sets it again, with logging.
set_fp8_env()
from kimi_k2_neuron.arguments import check_out_dir, fail, integer  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402
from kimi_k2_neuron.plan import MOE_PREFILL_FALLBACK, MOE_PREFILL_MODES, experts_for, format_plan, plan  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--model", required=True, help="converted checkpoint folder (kimi_k2_neuron.convert output); a raw "
                                                  "HF folder is converted first, once, into <model>-neuron-<experts>")
    p.add_argument("--out", required=True, help="compiled folder to write")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree (logical cores per model replica)")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism inside the --tp ranks (NxDI moe_ep_degree; "
                                                     "experts split ep ways, each tp/ep ways): 4, 16 or 64 at --tp "
                                                     "64 --lnc 2, with batch >= n_routed_experts / top_k")
    p.add_argument("--lnc", type=int, default=2, choices=(1, 2), help="logical NeuronCore config (trn2 default 2)")
    p.add_argument("--seq-len", type=int, default=1024, help="KV cache length (prompt + generated tokens)")
    p.add_argument("--max-context-length", type=int, default=None, help="prefill bucket (default: --seq-len)")
    p.add_argument("--batch", type=int, default=1, help="batch compiled into both the prefill and decode graphs")
    p.add_argument("--experts", choices=SCHEMES, default=None,
                   help=f"expert format (default: what a converted checkpoint holds; {DEFAULT_SCHEME}, exact from FP8 "
                        "and INT4 sources, for a raw one)")
    p.add_argument("--convert-workers", type=integer(1), default=8, help="converter threads, when --model is raw")
    p.add_argument("--no-on-device-sampling", action="store_true", help="return logits to the host instead")
    p.add_argument("--output-logits", action="store_true", help="also return logits with on-device sampling "
                                                                "(needed by the logit-parity test)")
    p.add_argument("--global-topk", type=integer(1), default=256, help="on-device sampling's top-k pre-selection")
    p.add_argument("--moe-prefill", choices=MOE_PREFILL_MODES, default="kernel",
                   help="how prefill runs the routed experts: kernel = NxD's blockwise NKI kernel (NxD itself takes "
                        "its torch path where the kernel does not apply), torch = that torch blockwise path, "
                        "all-experts = every token through every expert. " + MOE_PREFILL_FALLBACK)
    p.add_argument("--force", action="store_true", help="compile even if the fit planner says it does not fit")
    add_verbose(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start(args)  # logging, and the FP8 environment torch-xla reads when the SDK is imported below

    # Everything up to the fit check needs only the core.
    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.formats.record import ConversionRecord

    try:
        check_out_dir(args.out, "--out")  # before hours of conversion and compilation
        cfg = KimiK2Config.from_file(args.model)
        record = ConversionRecord.read(args.model)
        experts = experts_for(record, args.experts)
        # The planner refuses what the shell's check_serve_options refuses (plan.check_compile_options), before the
        # SDK is imported or a raw checkpoint converted.
        p = plan(cfg, args.tp, args.ep, args.lnc, args.seq_len, args.batch, experts, kv_slots=1,
                 context_len=args.max_context_length, moe_prefill=args.moe_prefill, record=record)
        print(p.summary())
        if not p.fits and not args.force:
            print(format_plan(p), file=sys.stderr)
            raise KimiInputError("this configuration does not fit (see above); pass --force to compile anyway")
    except KimiInputError as e:
        return fail(e)

    try:
        from kimi_k2_neuron.neuron import contract
        from kimi_k2_neuron.neuron.loader import ensure_converted
        from kimi_k2_neuron.neuron.serving import compile_model
    except ImportError as e:
        return sdk_missing(e)

    try:
        t0 = time.monotonic()
        checkpoint = ensure_converted(args.model, experts, workers=args.convert_workers)  # once, if raw
        options = contract.ServeOptions(
            tp=args.tp, ep=args.ep, lnc=args.lnc, seq_len=args.seq_len, max_context_length=args.max_context_length,
            batch=args.batch, experts=experts, checkpoint=str(Path(checkpoint).resolve()),
            on_device_sampling=not args.no_on_device_sampling, global_topk=args.global_topk,
            output_logits=args.output_logits, moe_prefill=args.moe_prefill,
            quant_record=ConversionRecord.read(checkpoint).nxd)
        if not _compile(compile_model, checkpoint, args.out, options, p.summary()):
            return 1
    except KimiInputError as e:
        return fail(e)
    print(f"compiled to {args.out} in {(time.monotonic() - t0) / 60:.1f} min")
    return 0


def _compile(compile_model, checkpoint, out, options, summary) -> bool:
    """compile_model; when it fails with the default MoE prefill, NxDI's traceback and then the fallback to try."""
    try:
        compile_model(checkpoint, out, options, plan_summary=summary)
    except KimiInputError:
        raise
    except Exception:
        if options.moe_prefill != "kernel":
            raise
        traceback.print_exc()
        print(f"error: compiling with --moe-prefill kernel failed (traceback above); {MOE_PREFILL_FALLBACK}",
              file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
