"""Decode latency (TPOT) and prefill latency (TTFT) of a compiled Kimi-K2, measured the way NxDI does.

Runs NxDI's benchmark_sampling (NXDI_CONTRACT.md: benchmark-sampling): end-to-end generations with latency hooks on the
context-encoding and token-generation submodels. TPOT is the per-call latency of the token-generation model (one
decode step for the whole batch) and TTFT the per-call latency of the context-encoding model, each as p50/p90/p99.
Nothing here divides a total time by a token count. Writes a JSON report.

--cpu runs the same benchmark on the NxDI model in NxD's CPU mode, built from --model for --seq-len and --batch: it
exercises the runner end to end, and its report says `"device": "cpu"`; its latencies say nothing about trn2.

Examples:
  python scripts/bench_tpot.py --compiled /data/compiled/tp64-s1024-b1 --num-runs 20 --report tpot.json
  python scripts/bench_tpot.py --cpu --model ~/.cache/kimi-k2-neuron/tiny-fp8 --seq-len 64 --num-runs 3

Arguments are parsed and checked before the Neuron SDK is imported, so --help and bad flags answer without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kimi_k2_neuron.arguments import check_out_file, fail, integer
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command, write_atomically
from kimi_k2_neuron.launch import add_compiled_args, add_verbose, begin, check_compiled_args, cpu_options, script_parser
from kimi_k2_neuron.runtime.ranks import RanksError


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    add_compiled_args(p)
    p.add_argument("--num-runs", type=integer(1), default=20, help="measured generations after one warm-up")
    p.add_argument("--report", default="bench_tpot.json", help="JSON report path")
    p.add_argument("--seq-len", type=integer(2), default=None, help="with --cpu: KV cache length (default: 128)")
    p.add_argument("--batch", type=integer(1), default=None, help="with --cpu: sequences per call (default: 1)")
    add_verbose(p)
    return p


def summarize(nxdi_report: dict, batch: int, meta: dict) -> dict:
    """Our report from benchmark_sampling's: {submodel: {latency_ms_p50, ...}} (NXDI_CONTRACT.md: benchmark-sampling)."""
    def pct(entry):
        if not entry:
            return None
        return {k: entry[f"latency_ms_{k}"] for k in ("p50", "p90", "p99")} | {"avg": entry["latency_ms_avg"]}

    tpot = pct(nxdi_report.get("token_generation_model"))
    out = {
        "tpot_ms": tpot,  # one decode step (batch rows, one token each)
        "ttft_ms": pct(nxdi_report.get("context_encoding_model")),  # one prefill call
        "decode_tokens_per_s_per_sequence_p50": 1000 / tpot["p50"] if tpot else None,
        "decode_tokens_per_s_p50": batch * 1000 / tpot["p50"] if tpot else None,
        "e2e_generation_ms": pct(nxdi_report.get("e2e_model")),
        "method": "NxDI benchmark_sampling(target='all'): per-call latency hooks on the submodels",
        **meta,
    }
    return out


def _check_flags(args: argparse.Namespace) -> None:
    if not args.cpu and (args.seq_len or args.batch):
        raise KimiInputError("--seq-len/--batch: only with --cpu (a compiled folder has its own)")
    check_out_file(args.report, "--report")  # before the benchmark, not after it
    if args.cpu:  # what config.json decides for this length and batch, before NxD is imported
        from kimi_k2_neuron.nxdi_cpu.options import check_request

        check_request(cpu_options(args), *_cpu_shape(args))


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
    report = summarize(raw, meta["batch"], {**meta, "num_runs": args.num_runs, "nxdi_report": raw})
    write_atomically(args.report, json.dumps(report, indent=2, default=float))
    t = report["tpot_ms"]
    if t:
        where = " in NxD's CPU mode, not a trn2 number" if args.cpu else ""
        print(f"TPOT p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f} ms, p99 {t['p99']:.2f} ms (batch {meta['batch']}); "
              f"TTFT p50 {report['ttft_ms']['p50']:.1f} ms{where} -> {args.report}")
    return 0


def _compiled(args) -> tuple[dict, dict]:
    from neuronx_distributed_inference.utils.benchmark import benchmark_sampling
    from transformers import GenerationConfig

    from kimi_k2_neuron.neuron.serving import load_compiled, read_compiled_record

    record = read_compiled_record(args.compiled)
    app = load_compiled(args.compiled, args.model)
    nc = app.neuron_config
    # Greedy, no EOS: every run decodes to max_length (benchmark_sampling drops EOS itself only with on-device
    # sampling, NXDI_CONTRACT.md: benchmark-sampling).
    gen = GenerationConfig(do_sample=False, top_k=1, top_p=1.0, temperature=1.0, eos_token_id=[], pad_token_id=0)
    with tempfile.TemporaryDirectory() as d:
        raw = benchmark_sampling(app, None, gen, target="all", num_runs=args.num_runs,
                                 benchmark_report_path=str(Path(d) / "nxdi.json"))
    return raw, {"device": "trn2", "compiled": str(args.compiled), "options": record.get("options"),
                 "tp": nc.tp_degree, "batch": nc.max_batch_size, "seq_len": nc.seq_len,
                 "max_context_length": nc.max_context_length}


def _cpu(args) -> tuple[dict, dict]:
    from kimi_k2_neuron.nxdi_cpu import backend

    seq_len, batch = _cpu_shape(args)
    raw = backend.benchmark(cpu_options(args), seq_len, batch, args.num_runs)
    return raw, {"device": "cpu", "note": "NxD's CPU mode on this host: exercises the runner, not a trn2 latency",
                 "model": str(args.model), "tp": args.tp, "batch": batch, "seq_len": seq_len,
                 "max_context_length": seq_len}


if __name__ == "__main__":
    sys.exit(run_command(main))
