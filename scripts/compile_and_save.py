"""Compile Kimi-K2 for one trn2 configuration and pre-shard its weights: converted checkpoint -> compiled folder.

The folder gets NxDI's model.pt (context-encoding and token-generation NEFFs), neuron_config.json, one
weights/tp{rank}_sharded_checkpoint.safetensors per rank, and kimi_k2_neuron.json (the checkpoint and options).
The configuration is checked against the fit planner first and refused if it does not fit, unless --force, and so is
the host: free disk in --out for the pre-sharded weights, and host RAM for NxDI's load(), which reads every rank's
file whole. --dry-run prints the NeuronConfig it would compile and the weight layout saved beside it
(--shard-attn-a, --shard-router), the MoE path of each submodel and the planner's verdict as JSON, and touches
nothing (it needs NxDI importable, not the Neuron compiler).
A raw HF checkpoint is first converted, once, into $KIMI_K2_NEURON_CACHE/converted/<name>-neuron-<experts>-<tag>
(kimi_k2_neuron.convert, where every tool finds it; an estimated 10-35 min for the 1T model on a trn2.48xlarge, not
measured; a progress bar shows the ETA and the time taken is printed at the end).

Token generation runs the MoE path the planner's time model says is fastest at --batch and --ep (selective loading or
every local expert, through NxD's public methods; --moe-decode to choose), printed and saved with the config.

--for-vllm compiles what vllm-neuron loads from NEURON_COMPILED_ARTIFACTS (docs/vllm.md): NxDI's
continuous batching at batch = vLLM's --max-num-seqs (one sequence per prefill call), dynamic on-device sampling
with the logits returned too (output_logits, for the steps a grammar constrains), or with --no-on-device-sampling
vLLM's sampler on the host, pre-sharded weights; it prints the `vllm serve` command line that loads the folder.

--for-vllm --prefix-caching compiles the latent cache in NxDI's block layout for vLLM's prefix caching (docs/vllm.md):
a pool of --num-blocks blocks of --block-size positions, and the context-encoding graphs in 2D buckets (a prefill
bucket by a prefix bucket), so a request whose first blocks are cached prefills only what follows them; its printed
command serves with --enable-prefix-caching and reports the cached tokens of each reply.

--draft DIR --speculation-length K compiles NxDI's fused EAGLE3 speculation (docs/speculative.md): the context encoding
(the draft's prefill inside) and one fused graph of K - 1 draft steps and a K-token target verify, in place of the
token-generation graph; the draft's weights are pre-sharded beside the target's. With --for-vllm the printed command
carries --speculative-config '{"method": "eagle", "model": DIR, "num_speculative_tokens": K}'.

Example (trn2.48xlarge, LNC=2 -> 64 logical cores):
  python scripts/compile_and_save.py --model /data/kimi-k2-neuron-fp8 --out /data/compiled/tp64-s1024-b1 \\
      --tp 64 --lnc 2 --seq-len 1024 --batch 1

Arguments are parsed before the Neuron SDK is imported, so --help works without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

# Stdlib-only imports here: the Ctrl-C/SIGTERM handling (run_command) comes before torch's import, and the FP8
# environment (set_fp8_env, start) before anything can import torch-xla, which reads it then.
from kimi_k2_neuron.arguments import add_spec_args, check_out_dir, checkpoint_folder, fail, integer, path
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import atomic_folder, run_command
from kimi_k2_neuron.launch import (add_verbose, check_host_resources, check_layout_flags, run_spec, script_parser,
                                  sdk_missing, set_fp8_env, start)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--model", required=True, type=checkpoint_folder, metavar="DIR",
                   help="converted checkpoint folder (kimi_k2_neuron.convert output); a raw HF folder is converted "
                        "first, once, into $KIMI_K2_NEURON_CACHE/converted, where every tool finds it (said, with its "
                        "size, before it starts)")
    p.add_argument("--out", required=True, type=path,
                   help="compiled folder to write: absent, empty, or an earlier compile, replaced once the new one is "
                        "complete")
    add_spec_args(p, "parallel", "shape", "experts", lnc=dict(choices=(1, 2)),
                  batch=dict(help="batch compiled into both the prefill and decode graphs"))
    p.add_argument("--convert-workers", type=integer(1), default=8, help="converter threads, when --model is raw")
    add_spec_args(p, "sampler", "moe", "layout", "cache", "draft")
    p.add_argument("--for-vllm", action="store_true",
                   help="compile for vllm-neuron's NEURON_COMPILED_ARTIFACTS: continuous batching (--batch = vLLM's "
                        "--max-num-seqs, one sequence per prefill), dynamic on-device sampling returning the logits "
                        "too (for grammars; --no-on-device-sampling: vLLM samples on the host), pre-sharded weights; "
                        "prints the matching `vllm serve` command")
    p.add_argument("--force", action="store_true", help="compile even if the fit planner says it does not fit, or "
                                                        "the host lacks the disk or RAM it estimates")
    p.add_argument("--dry-run", action="store_true",
                   help="print, as JSON, the NeuronConfig that would be compiled (NxDI's neuron_config.json), the "
                        "MoE path of each submodel and the planner's verdict; write nothing, convert nothing")
    add_verbose(p)
    return p


def main(argv=None) -> int:
    set_fp8_env()  # the parser imports the planner's tables, and torch with them
    args = build_parser().parse_args(argv)
    start(args)  # logging, and the FP8 environment torch-xla reads when the SDK is imported below

    # Everything up to the fit check needs only the core.
    from kimi_k2_neuron.config import KimiK2Config
    from kimi_k2_neuron.formats.record import ConversionRecord
    from kimi_k2_neuron.neuron.fit import plan
    from kimi_k2_neuron.neuron.layout_search import fallback_advice, prefill_fallbacks
    from kimi_k2_neuron.neuron.plan_report import format_plan

    try:
        check_layout_flags(args)
        check_for_vllm(args)
        if not args.dry_run:
            check_out_dir(args.out, "--out", apart_from={"--model": args.model})  # before hours of work
        cfg = KimiK2Config.from_file(args.model)
        record = ConversionRecord.of(cfg)
        # the experts as convert writes them, for a raw checkpoint; as vllm-neuron asks when --max-num-seqs > 1
        spec = run_spec(args, cfg, record, checkpoint=str(Path(args.model).resolve()),
                        continuous_batching=args.for_vllm and args.batch > 1)
        if args.for_vllm:
            from kimi_k2_neuron.neuron.vllm_request import for_vllm

            spec = for_vllm(spec)
        check_vllm_draft(args, spec)
        spec, why = choose_layout(args, cfg, spec)
        # The planner applies the shell's rules (rules.py) before the SDK is imported or a raw checkpoint converted.
        p = plan(cfg, spec)
        spec, decode_why = choose_decode(cfg, spec, p)
        if args.dry_run:
            return _dry_run(args, cfg, record, spec, p, why, decode_why)
        print(f"layout: {why}")
        print(f"MoE decode: {decode_why}")
        print(p.summary())
        if not p.fits and not args.force:
            print(format_plan(p), file=sys.stderr)
            raise KimiInputError("this configuration does not fit (see above); pass --force to compile anyway")
        if not args.force:
            check_host_resources(p, args.out)
        advice = fallback_advice(prefill_fallbacks(cfg, spec), spec.moe_prefill)
    except KimiInputError as e:
        return fail(e)

    try:
        from kimi_k2_neuron.convert import ensure_converted
        from kimi_k2_neuron.neuron.serving import RECORD, compile_model
    except ImportError as e:
        return sdk_missing(e)

    try:
        check_replaceable(Path(args.out), RECORD)
        t0 = time.monotonic()
        checkpoint = Path(args.model)
        if record is None:  # once, up front
            checkpoint, record = ensure_converted(args.model, spec.scheme.name, workers=args.convert_workers)
            cfg = KimiK2Config.from_file(checkpoint)  # the converted checkpoint's, a new file
            spec = dataclasses.replace(spec, scheme=record.scheme, checkpoint=str(Path(checkpoint).resolve()))
        # Compiled beside --out and renamed once complete: an interrupted or failed compile leaves the earlier
        # folder (or none), never NEFFs and a partial set of pre-sharded weights that vllm-neuron would try to load.
        with atomic_folder(args.out) as folder:
            _compile(compile_model, cfg, checkpoint, folder, spec, p.summary(), advice)
    except KimiInputError as e:
        return fail(e)
    except _CompileFailed:
        return 1
    print(f"compiled to {args.out} in {(time.monotonic() - t0) / 60:.1f} min")
    if args.for_vllm:
        from kimi_k2_neuron.neuron.serving import vllm_serve_command

        print("serve it with vLLM (docs/vllm.md):\n" + vllm_serve_command(checkpoint, args.out, spec))
    return 0


def choose_layout(args, cfg, spec):
    """(spec at the layout to compile, why it is that one). With no layout flag given (and not --for-vllm, whose
    request carries none), the layout that fits with the lowest modelled TPOT, then TTFT (`plan --best`, at
    --moe-prefill); else the flags'."""
    from kimi_k2_neuron.launch import layout_flags_given
    from kimi_k2_neuron.neuron.layout_search import best_layout
    from kimi_k2_neuron.neuron.spec import layout_flags

    given = layout_flags_given(args)
    if given or args.for_vllm:
        return spec, f"{' '.join(given) or 'replicated cache, one-shot prefill'}, as given" + (
            " (--for-vllm: vllm-neuron's request carries no layout)" if args.for_vllm and not given else "")
    best, fitting = best_layout(cfg, spec, modes=(spec.moe_prefill,))
    if best is None:
        return spec, "replicated cache, one-shot prefill: no layout fits by the planner (see below)"
    flags = " ".join(layout_flags(best.layout)) or "replicated cache, one-shot prefill"
    return (dataclasses.replace(spec, layout=best.layout),
            f"{flags}, the planner's choice: the lowest modelled TPOT ({best.decode.total_s * 1e3:.2f} ms, an "
            f"estimate) of the {len(fitting)} layouts that fit at --moe-prefill {spec.prefill_mode(cfg)} (plan --best searches "
            f"every mode); give a layout flag to choose another")


def choose_decode(cfg, spec, p):
    """(spec with its token-generation MoE path fixed, why that one): --moe-decode as given, else the path the
    planner's time model says is fastest at this batch and EP (p's: neuron/moe_decode.py)."""
    from kimi_k2_neuron.neuron import moe_decode
    from kimi_k2_neuron.neuron.moe_paths import nxd_decode_path

    if spec.moe_decode is not None:
        return spec, f"{spec.moe_decode}, as given (--moe-decode)"
    times = moe_decode.modelled(cfg, dataclasses.replace(spec, moe_decode=None))
    shown = ", ".join(f"{path} {t * 1e3:.1f} ms" for path, t in times.items())
    nxd = nxd_decode_path(cfg, spec.batch)
    differs = "" if nxd == p.decode_path else f"; NxD's own threshold would take {nxd}"
    return (dataclasses.replace(spec, moe_decode=p.decode_path),
            f"{p.decode_path}, the planner's choice: the lowest modelled decode step that fits ({shown}, estimates)"
            f"{differs}; give --moe-decode to choose another")


def check_for_vllm(args) -> None:
    """What vllm-neuron's request cannot match: it prefills up to --max-model-len tokens in one call (unless
    --prefix-caching, whose 2D buckets chunk a prefill). --prefix-caching serves through vLLM only (its block tables)."""
    if not args.for_vllm:
        if args.prefix_caching:
            raise KimiInputError("--prefix-caching: only with --for-vllm (the block tables come from vLLM's "
                                 "scheduler)")
        return
    if args.max_context_length not in (None, args.seq_len) and not args.prefix_caching:
        raise KimiInputError("--max-context-length: not with --for-vllm (vllm-neuron prefills up to --max-model-len "
                             "tokens in one call)")
    from kimi_k2_neuron.launch import layout_options
    from kimi_k2_neuron.neuron.spec import layout_flags

    layout = layout_options(args)
    if args.prefix_caching:  # the chunks run behind vLLM's prefill of a whole prompt (neuron/prefix_caching.py)
        layout = dataclasses.replace(layout, prefill_chunk=None)
    given = layout_flags(layout)
    if given:
        raise KimiInputError(f"{' '.join(given)}: not with --for-vllm (vllm-neuron builds the model from its own "
                             f"request, which carries no layout, and drives the prefills itself)")


def check_vllm_draft(args, spec) -> None:
    """vLLM 0.13 builds the draft's model config from its own registry, which has no MLA EAGLE3 draft: it would refuse
    the printed command at start-up, before vllm-neuron sees the request."""
    from kimi_k2_neuron.checkpoint.draft import MLA

    if args.for_vllm and spec.draft and spec.draft.checkpoint and spec.draft.checkpoint.kind == MLA:
        raise KimiInputError(f"--draft {args.draft}: an MLA EAGLE3 draft, which vLLM 0.13 does not take (its model "
                             f"registry has no Eagle3DeepseekV2ForCausalLM); compile it without --for-vllm and run it "
                             f"with scripts/run_inference.py (docs/speculative.md)")


def _dry_run(args, cfg, record, spec, p, why: str, decode_why: str) -> int:
    """The NeuronConfig compile() would trace, as NxDI writes it to neuron_config.json, with the weight layout saved
    beside it there, the MoE path of each submodel and the plan, as JSON on stdout. A raw checkpoint is planned as
    `convert` would write it."""
    try:
        from kimi_k2_neuron.convert import converted_dir_for
        from kimi_k2_neuron.neuron import moe_paths
        from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig, NeuronKimiK2ForCausalLM
        from kimi_k2_neuron.neuron.spec import RUN_SPEC_KEY
    except ImportError as e:
        return sdk_missing(e)
    checkpoint = args.model if record else converted_dir_for(args.model, spec.scheme.name)
    spec = dataclasses.replace(spec, checkpoint=str(Path(checkpoint).resolve()))
    try:
        config = KimiK2InferenceConfig.for_serving(cfg, spec)
        app = NeuronKimiK2ForCausalLM(str(checkpoint), config)  # its submodels' wrappers, nothing traced
    except KimiInputError as e:
        return fail(e)
    tokens = spec.prefill_tokens
    prefill = moe_paths.prefill_path(cfg, tokens, spec.prefill_mode(cfg))
    kernel = moe_paths.MODES[prefill].kernel if prefill in moe_paths.MODES else None
    decode = spec.moe_decode  # choose_decode's: through nxd_moe.KimiExpertMLPs, where NxD's forward picks by a threshold
    step = spec.batch * (spec.draft.speculation_length if spec.draft else 1)
    if spec.draft:  # the fused graph's verify of batch x K tokens
        decode = moe_paths.verify_path(cfg, step)
    saved = json.loads(config.to_json_string())
    report = {
        "neuron_config": saved["neuron_config"], RUN_SPEC_KEY: saved[RUN_SPEC_KEY], "layout_choice": why,
        "moe_decode_choice": decode_why,
        "checkpoint": str(checkpoint), "converted": record is not None,
        "moe_paths": {"context_encoding": {"tokens": tokens, "path": prefill, "nki_kernel": kernel},
                      ("fused_speculation" if spec.draft else "token_generation"): {"tokens": step, "path": decode}},
        "compiler_args": {wrapper.tag: wrapper.compiler_args for wrapper in app.models},
        "plan": p.to_dict()}
    from kimi_k2_neuron.neuron import kernels  # the NKI kernels each graph calls or not, each with why

    report["kernels"] = kernels.report(cfg, spec)
    if args.for_vllm:
        from kimi_k2_neuron.neuron.serving import vllm_serve_command

        report["vllm_serve"] = vllm_serve_command(checkpoint, args.out, spec, tokenizer_dir=args.model)
    print(json.dumps(report, indent=2, default=str))
    return 0


class _CompileFailed(Exception):
    """Compiling failed and has said why (a traceback and the planner's advice)."""


def check_replaceable(out: Path, record: str) -> None:
    """--out is absent, empty or an earlier compile (holding `record`), which a finished compile replaces."""
    if out.is_dir() and any(out.iterdir()) and not (out / record).is_file():
        raise KimiInputError(f"--out {out}: not empty and not a finished compile (no {record} in it); give a new or "
                             f"empty folder (the compile is written beside it and renamed once complete)")


def _compile(compile_model, cfg, checkpoint, out, spec, summary: str, advice: str) -> None:
    """compile_model; when a kernel prefill mode fails, NxDI's traceback and then the planner's fallback advice."""
    from kimi_k2_neuron.neuron import moe_paths

    try:
        compile_model(cfg, checkpoint, out, spec, plan_summary=summary)
    except KimiInputError:
        raise
    except Exception:
        if moe_paths.MODES[spec.moe_prefill].kernel is None:
            raise
        traceback.print_exc()
        print(f"error: compiling with --moe-prefill {spec.moe_prefill} failed (traceback above)\n{advice}",
              file=sys.stderr)
        raise _CompileFailed() from None


if __name__ == "__main__":
    sys.exit(run_command(main))
