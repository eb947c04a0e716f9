"""Decode latency (TPOT) and prefill latency (TTFT) of a compiled Kimi-K2, measured the way NxDI does.

Runs NxDI's benchmark_sampling (NXDI_CONTRACT.md: benchmark-sampling): end-to-end generations with latency hooks on the
context-encoding and token-generation submodels. TPOT is the per-call latency of the token-generation model (one
decode step for the whole batch) and TTFT the per-call latency of the context-encoding model, each as p50/p90/p99
(with --prefill-chunk that call is a row's first chunk: the sweep below times every prefill call). Nothing here
divides a total time by a token count. Writes a JSON report.

--context-lengths L,L,... measures decode latency at each filled context length instead: per L, one generation of
--decode-steps tokens after a prefill of L tokens, timed with the same NxDI latency hooks on the submodels (one warm-up
generation first, as benchmark_sampling does); the report holds one entry per L, with prefill_ms, the sum of every
prefill call (context encoding and, with --prefill-chunk, each chunk: the time to the first token).
benchmark_sampling itself cannot do this: it takes its prompt length from the config (max_context_length, or half of
it).

--cpu runs the same benchmark on the NxDI model in NxD's CPU mode, built from --model for --seq-len and --batch: it
exercises the runner end to end, and its report says `"device": "cpu"`; its latencies say nothing about trn2.

With a draft (a folder compiled with --draft, or --cpu --draft DIR): the per-length run times every call of NxDI's
fused speculation submodel (a step: K - 1 draft tokens and the target's verify) and counts the tokens each emitted;
the report's tpot_ms is the step over the measured accept length (the time per emitted token), beside the step and
the accept length. Without --context-lengths it runs at half the prefill bucket (NxDI's benchmark_sampling drives
fused speculation through its HF adapter, batch 1 only, and hooks no fused submodel).

Examples:
  python scripts/bench_tpot.py --compiled /data/compiled/tp64-s1024-b1 --num-runs 20 --report tpot.json
  python scripts/bench_tpot.py --compiled /data/compiled/tp64-s262144 --context-lengths 1024,8192,32768,131072
  python scripts/bench_tpot.py --cpu --model ~/.cache/kimi-k2-neuron/tiny-fp8 --seq-len 64 --num-runs 3

Arguments are parsed and checked before the Neuron SDK is imported, so --help and bad flags answer without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kimi_k2_neuron.arguments import add_spec_args, check_out_file, fail, integer, integers, path
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command, write_atomically
from kimi_k2_neuron.launch import add_compiled_args, add_verbose, begin, check_compiled_args, cpu_options, script_parser
from kimi_k2_neuron.neuron.spec import speculation_overrun
from kimi_k2_neuron.runtime.ranks import RanksError


DEFAULT_NUM_RUNS, DEFAULT_DECODE_STEPS = 20, 32
FUSED = "fused_speculation_model"  # NxDI's tag of the fused speculation submodel



def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    add_compiled_args(p)
    p.add_argument("--num-runs", type=integer(1), default=None,
                   help=f"measured generations after one warm-up (default: {DEFAULT_NUM_RUNS}; not with "
                        f"--context-lengths)")
    p.add_argument("--context-lengths", type=integers(2), default=None, metavar="L,L,...",
                   help="decode latency at each filled context length: per L a prefill of L tokens, then "
                        "--decode-steps timed decode steps; each L <= the prefill bucket and <= seq_len - steps - 1 "
                        "(default: off, NxDI's benchmark_sampling at the config's prompt length)")
    p.add_argument("--decode-steps", type=integer(1), default=None,
                   help=f"with --context-lengths: decode steps timed at each length (default: {DEFAULT_DECODE_STEPS})")
    p.add_argument("--report", default="bench_tpot.json", type=path, help="JSON report path")
    add_spec_args(p, "--seq-len", "--batch",
                  seq_len=dict(type=integer(2), default=None, help="with --cpu: KV cache length (default: 128)"),
                  batch=dict(default=None, help="with --cpu: sequences per call (default: 1)"))
    add_verbose(p)
    return p


def summarize(nxdi_report: dict, batch: int, meta: dict) -> dict:
    """Our report from benchmark_sampling's: {submodel: {latency_ms_p50, ...}}
    (NXDI_CONTRACT.md: benchmark-sampling)."""
    def pct(entry):
        if not entry:
            return None
        return {k: entry[f"latency_ms_{k}"] for k in ("p50", "p90", "p99")} | {"avg": entry["latency_ms_avg"]}

    tpot = pct(nxdi_report.get("token_generation_model"))
    step, accept = pct(nxdi_report.get(FUSED)), nxdi_report.get("accept_length")
    if step and accept:  # a fused step emits accept_length tokens a row on average: the time per token
        tpot = {k: v / accept for k, v in step.items()}
    out = {
        "tpot_ms": tpot,  # one decode step (batch rows, one token each)
        # one context-encoding call: with --prefill-chunk, a row's first chunk (the sweep adds prefill_ms, all calls)
        "ttft_ms": pct(nxdi_report.get("context_encoding_model")),
        "chunk_ms": pct(nxdi_report.get("chunked_prefill_model")),  # one further chunk of one row
        "prefill_ms": nxdi_report.get("prefill_ms"),
        "decode_tokens_per_s_per_sequence_p50": 1000 / tpot["p50"] if tpot else None,
        "decode_tokens_per_s_p50": batch * 1000 / tpot["p50"] if tpot else None,
        "e2e_generation_ms": pct(nxdi_report.get("e2e_model")),
        **({"fused_step_ms": step, "accept_length": accept} if step else {}),
        "method": "NxDI benchmark_sampling(target='all'): per-call latency hooks on the submodels",
        **meta,
    }
    return out


def _check_flags(args: argparse.Namespace) -> None:
    if not args.cpu and (args.seq_len or args.batch):
        raise KimiInputError("--seq-len/--batch: only with --cpu (a compiled folder has its own)")
    if args.context_lengths is None and args.decode_steps is not None:
        raise KimiInputError("--decode-steps: only with --context-lengths")
    if args.context_lengths is not None and args.num_runs is not None:
        raise KimiInputError("--num-runs: not with --context-lengths (each length times --decode-steps decode steps "
                             "after one prefill)")
    # before the benchmark, not after it; never over the checkpoint or compiled folder it reads
    check_out_file(args.report, "--report", apart_from={"--model": args.model, "--compiled": args.compiled})
    if args.cpu:  # what config.json decides for this length and batch, before NxD is imported
        from kimi_k2_neuron.nxdi_cpu.options import check_request

        seq_len, batch = _cpu_shape(args)
        o = cpu_options(args)
        if o.spec.draft and args.context_lengths is None:
            args.context_lengths = [_default_length(seq_len, seq_len, o.spec.draft.speculation_length)]
        # a CPU run prefills up to seq_len: one bucket of seq_len, or chunks (kimi_k2_neuron.nxdi_cpu.backend)
        _check_lengths(args, seq_len, seq_len, f"--seq-len {seq_len}",
                       o.spec.draft.speculation_length if o.spec.draft else 0)
        check_request(o, seq_len, batch, cfg=o.config)


def _check_lengths(args: argparse.Namespace, seq_len: int, context_len: int, source: str, k: int = 0) -> None:
    """Each --context-lengths L prefilled (L <= context_len: the prefill bucket, or seq_len with chunks) and followed
    by --decode-steps steps inside the cache: the first new token comes from the prefill, so L + steps + 1 <= seq_len
    (with a draft, spec.speculation_overrun fewer: the last fused step writes K positions)."""
    if args.context_lengths is None:
        return
    steps = _decode_steps(args)
    seq_len -= speculation_overrun(k)
    for n in args.context_lengths:
        if n > context_len:
            raise KimiInputError(f"--context-lengths {n}: above the prefill bucket of {context_len} tokens "
                                 f"({source}); a one-shot prefill holds at most {context_len} (compile with "
                                 f"--prefill-chunk for longer prompts)")
        if n + steps + 1 > seq_len:
            raise KimiInputError(f"--context-lengths {n}: with --decode-steps {steps} at most {seq_len - steps - 1} "
                                 f"(seq_len {seq_len}, {source}, holds the prompt, the prefill's token and the steps)")


def _decode_steps(args: argparse.Namespace) -> int:
    return args.decode_steps or DEFAULT_DECODE_STEPS


def _default_length(seq_len: int, context_len: int, k: int) -> int:
    """A draft run's prompt without --context-lengths: half the prefill bucket, within the cache's room."""
    return max(2, min(context_len // 2, seq_len - DEFAULT_DECODE_STEPS - 1 - speculation_overrun(k)))


def _cpu_shape(args: argparse.Namespace) -> tuple[int, int]:
    """--seq-len and --batch of a --cpu run, with their defaults."""
    return args.seq_len or 128, args.batch or 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    code = begin(args, check_compiled_args, _check_flags)
    if code is not None:
        return code
    try:
        raw, meta = _cpu(args) if args.cpu else _compiled(args)
    except KimiInputError as e:
        return fail(e)
    except RanksError as e:
        return fail(e, e.exit_code)
    where = " in NxD's CPU mode, not a trn2 number" if args.cpu else ""
    if args.context_lengths is None:
        report = summarize(raw, meta["batch"], {**meta, "num_runs": args.num_runs or DEFAULT_NUM_RUNS,
                                                "nxdi_report": raw})
        lines = [_line(report, meta["batch"], where)] if report["tpot_ms"] else []
    else:
        per_length = [summarize(r, meta["batch"], {"context_length": n, "decode_steps": _decode_steps(args),
                                                   "method": SWEEP_METHOD, "nxdi_report": r})
                      for n, r in zip(args.context_lengths, raw)]
        report = {**meta, "method": SWEEP_METHOD, "decode_steps": _decode_steps(args), "context_lengths": per_length}
        lines = [f"context {e['context_length']}: " + _line(e, meta["batch"], where) for e in per_length]
    write_atomically(args.report, json.dumps(report, indent=2, default=float))
    for line in lines:
        print(f"{line} -> {args.report}")
    return 0


def _line(report: dict, batch: int, where: str) -> str:
    t = report["tpot_ms"]
    first = (f"prefill {report['prefill_ms']:.1f} ms" if report.get("prefill_ms") is not None else
             f"TTFT p50 {report['ttft_ms']['p50']:.1f} ms")
    per = (f" per emitted token: fused step p50 {report['fused_step_ms']['p50']:.2f} ms / accept length "
           f"{report['accept_length']:.2f}" if report.get("accept_length") else "")
    return (f"TPOT p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f} ms, p99 {t['p99']:.2f} ms (batch {batch}{per}); "
            f"{first}{where}")


SWEEP_METHOD = ("per context length: one generation of a prefill and --decode-steps decode steps, NxDI's latency hooks "
                "on the submodels (utils.benchmark's register_latency_collectors and generate_report)")


def sweep(app, lengths: list[int], steps: int, progress: bool = True) -> list[dict]:
    """NxDI's per-submodel latency reports ({submodel: generate_report(...)}, and timed_calls: {submodel: calls}) of
    one generation at each prompt length: a prefill of n random token ids (the batch's rows different, seeded) and
    `steps` decode steps, greedy, no stop token. One generation first at the shortest length, untimed
    (benchmark_sampling's warm-up); the hooks are NxDI's own, registered after it."""
    import torch
    from neuronx_distributed_inference.utils.benchmark import (LatencyCollector, create_submodule_latency_collectors,
                                                               register_forward_latency_collector,
                                                               register_latency_collectors)
    from kimi_k2_neuron.progress import bar as bar_of

    from kimi_k2_neuron.neuron.serving import Decoding, generate_ids

    batch, vocab = app.neuron_config.max_batch_size, app.config.vocab_size
    ids = torch.Generator().manual_seed(0)
    accepted: list = []  # with a draft: the tokens each fused step emitted per live row

    def generate(n: int, new: int) -> list[list[int]]:
        app.reset()  # a new batch: prefill again (benchmark_sampling's preprocess_func)
        rows = torch.randint(0, vocab, (batch, n), generator=ids).tolist()
        accepted.clear()
        return generate_ids(app, rows, set(), Decoding(max_new_tokens=new), accepted=accepted)

    generate(min(lengths), 2)
    collectors = create_submodule_latency_collectors(app)
    register_latency_collectors(collectors, app)
    for extra in (getattr(app, "chunked_prefill_model", None), getattr(app, "fused_spec_model", None)):
        if extra is not None:  # NxDI's collectors know only its own submodels
            collectors[extra.tag] = LatencyCollector()
            register_forward_latency_collector(collectors[extra.tag], extra)
    with bar_of(lengths, desc="context lengths", unit="length", disable=not progress) as bar:
        try:
            return [_timed(generate, collectors, n, steps, batch, accepted) for n in bar]
        except BaseException:
            bar.leave = False  # the stop's (or error's) one line takes the bar's place
            raise


def _timed(generate, collectors: dict, n: int, steps: int, batch: int, accepted: list) -> dict:
    """One generation at prompt length n, timed by the submodels' collectors and end to end; with a draft, the
    accept length of its fused steps."""
    from neuronx_distributed_inference.utils.benchmark import LatencyCollector, generate_report

    for c in collectors.values():
        c.latency_list.clear()
    e2e = LatencyCollector()
    e2e.pre_hook()
    out = generate(n, steps + 1)  # the prefill gives the first new token, each decode step one more
    e2e.hook()
    if any(len(row) != steps + 1 for row in out):
        raise RuntimeError(f"context {n}: generated {[len(r) for r in out]} tokens, expected {steps + 1} per row")
    tokens = {"context_encoding_model": n, "token_generation_model": steps, FUSED: steps}
    report = {k: generate_report(c.latency_list, tokens.get(k, 0), batch, n_runs=1) for k, c in collectors.items()}
    emitted = [t for step in accepted for t in step]
    if emitted:
        report["accept_length"] = sum(emitted) / len(emitted)
    report["e2e_model"] = generate_report(e2e.latency_list, n + steps + 1, batch, n_runs=1)
    # the time to the first token: every prefill call, the chunk submodel's too (one row a call with chunks)
    prefill = [t for k, c in collectors.items() if k not in ("token_generation_model", FUSED) for t in c.latency_list]
    report["prefill_ms"] = 1000 * sum(prefill)
    report["timed_calls"] = {k: len(c.latency_list) for k, c in collectors.items()}
    return report


def _compiled(args) -> tuple[dict | list[dict], dict]:
    from neuronx_distributed_inference.utils.benchmark import benchmark_sampling
    from transformers import GenerationConfig

    from kimi_k2_neuron.neuron.serving import load_compiled, read_compiled_record

    from kimi_k2_neuron.neuron.inference_config import compiled_run_spec

    record = read_compiled_record(args.compiled)
    spec, _ = compiled_run_spec(args.compiled)  # its lengths, before the load
    # with chunks a prompt up to seq_len is prefilled, N tokens a call
    longest = spec.seq_len if spec.layout.prefill_chunk else spec.context_length
    k = spec.draft.speculation_length if spec.draft else 0
    if k and args.context_lengths is None:
        args.context_lengths = [_default_length(spec.seq_len, longest, k)]
    _check_lengths(args, spec.seq_len, longest, f"the compiled {args.compiled}", k)
    app = load_compiled(args.compiled, args.model)
    nc = app.neuron_config
    if args.context_lengths is not None:
        raw = sweep(app, args.context_lengths, _decode_steps(args))
    else:
        # Greedy, no EOS: every run decodes to max_length (benchmark_sampling drops EOS itself only with on-device
        # sampling, NXDI_CONTRACT.md: benchmark-sampling).
        gen = GenerationConfig(do_sample=False, top_k=1, top_p=1.0, temperature=1.0, eos_token_id=[], pad_token_id=0)
        with tempfile.TemporaryDirectory() as d:
            raw = benchmark_sampling(app, None, gen, target="all", num_runs=args.num_runs or DEFAULT_NUM_RUNS,
                                     benchmark_report_path=str(Path(d) / "nxdi.json"))
    return raw, {"device": "trn2", "compiled": str(args.compiled), "spec": record.get("spec"),
                 "tp": nc.tp_degree, "batch": nc.max_batch_size, "seq_len": nc.seq_len,
                 "max_context_length": nc.max_context_length, "modelled": modelled_times(app.config)}


def modelled_times(config) -> dict:
    """The planner's modelled TPOT and TTFT of this compiled configuration (the run spec saved with it), beside what
    the benchmark measures: the first trn2 run tests the time model."""
    from kimi_k2_neuron.neuron.contract import run_spec
    from kimi_k2_neuron.neuron.fit import modelled

    return modelled(config.core_config(), run_spec(config))


def _cpu(args) -> tuple[dict, dict]:
    from kimi_k2_neuron.nxdi_cpu import backend

    seq_len, batch = _cpu_shape(args)
    if args.context_lengths is not None:
        o = backend.prepare(cpu_options(args), seq_len, batch, backend.BENCH_SAMPLING)
        raw = backend.run(o, _sweep_job, seq_len, batch, args.context_lengths, _decode_steps(args))
    else:
        raw = backend.benchmark(cpu_options(args), seq_len, batch, args.num_runs or DEFAULT_NUM_RUNS)
    return raw, {"device": "cpu", "note": "NxD's CPU mode on this host: exercises the runner, not a trn2 latency",
                 "model": str(args.model), "tp": args.tp, "batch": batch, "seq_len": seq_len,
                 "max_context_length": args.prefill_chunk or seq_len}


def _sweep_job(rank: int, o, seq_len: int, batch: int, lengths: list[int], steps: int) -> list[dict]:
    """sweep() on the NxDI model in NxD's CPU mode, at one rank (backend.run spawns the others at --tp > 1)."""
    from kimi_k2_neuron.nxdi_cpu import backend

    app = backend.build(o, seq_len=seq_len, batch=batch, sampling=backend.BENCH_SAMPLING)
    return sweep(app, lengths, steps, progress=rank == 0)


if __name__ == "__main__":
    sys.exit(run_command(main))
