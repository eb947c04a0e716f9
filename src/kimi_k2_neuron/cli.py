"""The `kimi-k2-neuron` command: make-tiny, logits, generate, convert, plan, demo, trace-cpu.

Bad input (files, tensors, config fields, arguments) ends with a one-line `error: ...` and exit code 2, checked
before any model is loaded wherever config.json alone can tell.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path


# Stdlib-only imports here: main() installs the Ctrl-C/SIGTERM handling before anything imports torch.
from . import __version__
from .arguments import (SEED_MAX, Parser, add_generation_args, add_spec_args, apply_sampling_defaults, cache_dir,
                        check_generation_args, check_out_dir, check_out_file, check_spec_flags, checkpoint_folder,
                        fail, integer, path, sampling_values)
from .errors import KimiInputError
from .interrupts import Interrupted, run_command, save_safetensors
from .launch import check_layout_flags, cpu_backend, cpu_generate, cpu_options, layout_options
from .formats import DEFAULT_SCHEME, SCHEMES
from .runtime import DTYPE_NAMES
from .runtime.ranks import RanksError
from .neuron.spec import CORE, CORE_RANKS, CPU, TRACE
from .plan_command import add_plan_parser
from .tiny import DRAFT_LAYOUTS, TINY_LAYOUTS


def _rows(text: str) -> list[list[int]]:
    """type= for --input-ids: "1,2,3;4,5,6" -> [[1, 2, 3], [4, 5, 6]]; every row and every token non-empty (an empty
    one is a typo, not a token to skip)."""
    rows = [row.split(",") for row in text.split(";")]
    for i, row in enumerate(rows, 1):
        where = f"row {i} is empty" if row == [""] or not "".join(row).strip() else next(
            (f"row {i} has an empty token" if not t.strip() else f"row {i} has {t.strip()!r}"
             for t in row if not t.strip().lstrip("-").isdigit()), None)
        if where:
            raise argparse.ArgumentTypeError(f'expected comma-separated integers, rows separated by ";" ({where}), '
                                             f'got {text!r}')
    return [[int(t) for t in row] for row in rows]


def cmd_make_tiny(a) -> int:
    from .tiny.checkpoint import LAYOUTS, make_tiny

    check_out_dir(a.out, "OUT")
    if a.draft_for is not None:  # '' too (an unset shell variable): refused as a draft's target, not a target made
        return _make_tiny_draft(a)
    if a.draft_layout != "eagle3":
        raise KimiInputError(f"--draft-layout {a.draft_layout}: only with --draft-for TARGET (it writes a draft)")
    layers = {"num_hidden_layers": a.layers} if a.layers else None
    out = make_tiny(a.out, quant=a.quant, shards=a.shards, seed=a.seed, config_overrides=layers, layout=a.layout)
    print(f"wrote a tiny {a.layout} checkpoint ({a.quant or LAYOUTS[a.layout].quant}) to {out}")
    return 0


def _make_tiny_draft(a) -> int:
    from .tiny.draft_checkpoint import make_tiny_draft

    given = [f for f, on in (("--quant", a.quant), ("--layout", a.layout != "k2"), ("--shards", a.shards != 3),
                             ("--layers", a.layers)) if on]
    if given:
        raise KimiInputError(f"{given[0]}: not with --draft-for (the draft's shape is its --draft-layout's)")
    out = make_tiny_draft(a.out, a.draft_for, seed=a.seed, layout=a.draft_layout)
    print(f"wrote tiny EAGLE3 draft ({a.draft_layout}) for {a.draft_for} to {out}")
    return 0


def cmd_logits(a) -> int:
    from .config import KimiK2Config
    from .runtime.runner import DTYPES, CpuRunner, check_logits_request

    # Everything that can be wrong is checked before loading: on the 1T model the logits take hours.
    check_out_file(a.out, "--out", apart_from={"--model": a.model})
    cfg = KimiK2Config.from_file(a.model)
    check_logits_request(cfg, a.input_ids, a.prefill_len)
    _check_backend(a)
    if a.backend == NXDI_CPU:
        from .nxdi_cpu.options import check_request

        o = cpu_options(a, cfg=cfg)
        check_request(o, max(len(r) for r in a.input_ids), len(a.input_ids), cfg=cfg)  # before NxD's import
        logits, paths = _nxdi_cpu().logits(o, a.input_ids, a.prefill_len)
        print(paths, file=sys.stderr)
    elif a.tp == 1:
        _bound_prefill(a, cfg, a.input_ids, a.prefill_len)
        runner = CpuRunner(a.model, dtype=DTYPES[a.dtype], layer_streamed=a.layer_streamed, progress=True, cfg=cfg,
                           prefill_chunk=a.prefill_chunk)
        logits = runner.logits(a.input_ids, a.prefill_len)
    else:
        from .parallel import check_tp_divides, check_weight_sharding
        from .runtime.tp import tp_logits

        check_tp_divides(cfg, a.tp)
        check_weight_sharding(cfg, a.tp, a.shard_attn_a, a.shard_router)
        _bound_prefill(a, cfg, a.input_ids, a.prefill_len)
        logits = tp_logits(a.model, a.input_ids, a.prefill_len, a.tp, DTYPES[a.dtype], a.layer_streamed,
                           layout_options(a))
    save_safetensors({"logits": logits.contiguous()}, a.out, "--out")
    print(f"wrote logits {list(logits.shape)} to {a.out}")
    return 0


NXDI_CPU = CPU  # --backend nxdi-cpu: the NxDI model in NxD's CPU mode


def _bound_prefill(a, cfg, rows: list[list[int]], prefill_len: int | None = None, together: bool = True) -> None:
    """a.prefill_chunk set so that one prefill call's attention fits the memory available (runtime/memory.py), with
    a note when it chunks; `together`: rows of one length prefill as one batch (logits), else one at a time."""
    from .runtime.memory import prefill_chunk

    longest = max(len(r) for r in rows)
    tokens = longest if prefill_len is None else min(prefill_len, longest)
    batch = len(rows) if together and len({len(r) for r in rows}) == 1 else 1
    plan = prefill_chunk(cfg.num_attention_heads, batch, tokens, a.prefill_chunk, ranks=a.tp)
    if plan.note:
        print(plan.note, file=sys.stderr)
    a.prefill_chunk = plan.chunk


def _check_backend(a) -> None:
    """Flags that belong to one backend only (neuron/spec.py FLAGS: where each is taken), and the KV group's rules,
    refused before any work."""
    core = CORE_RANKS if a.fn is cmd_logits else CORE
    check_spec_flags(a, NXDI_CPU if a.backend == NXDI_CPU else core, _backends(a.fn))
    check_layout_flags(a)
    if a.backend == NXDI_CPU:
        if a.layer_streamed:
            raise KimiInputError("--layer-streamed: only with --backend core (NxDI builds the whole model)")
        if getattr(a, "prefill_len", None) == 0:
            raise KimiInputError("--prefill-len 0: --backend nxdi-cpu prefills at least one token per row "
                                 "(NxDI's context-encoding submodel)")


def _backends(fn) -> dict[str, str]:
    """{backend: the flag that selects it} of logits or generate: the core runner (over TP ranks for logits) or the
    NxDI model in NxD's CPU mode."""
    return {CORE_RANKS if fn is cmd_logits else CORE: "--backend core", NXDI_CPU: f"--backend {NXDI_CPU}"}


def _nxdi_cpu():
    """kimi_k2_neuron.nxdi_cpu.backend, or a one-line error naming what is missing."""
    return cpu_backend(f"--backend {NXDI_CPU}")


def cmd_generate(a) -> int:
    from .config import KimiK2Config
    from .runtime.chat import GenerationOutput, StopStrings, generation_defaults, prompt_ids, reply_text
    from .runtime.runner import DTYPES, CpuRunner, check_generate_request
    from .runtime.sampling import SamplingParams
    from .runtime.tokenizer import KimiTokenizer

    _check_generate_args(a)
    _check_backend(a)
    cfg = KimiK2Config.from_file(a.model)
    apply_sampling_defaults(a, generation_defaults(a.model))
    tok = KimiTokenizer.from_dir(a.model) if a.prompt or (Path(a.model) / "tiktoken.model").exists() else None
    prompts = prompt_ids(tok, a.prompt, a.chat, a.system) if a.prompt else a.input_ids
    check_generate_request(cfg, prompts, a.max_new_tokens)
    stop_ids = tok.stop_ids(list(cfg.eos_token_ids)) if tok else set(cfg.eos_token_ids)
    out = GenerationOutput(tok, prompts, a.prompt, a.stop, a.json)  # streams one row; see its docstring
    if a.backend == NXDI_CPU:
        return _generate_nxdi_cpu(a, prompts, stop_ids, tok, out, cfg)
    _bound_prefill(a, cfg, prompts, together=False)  # each prompt is prefilled on its own
    # the tokens streaming to a terminal are the progress; a bar on the same screen would overwrite them
    bar = not (out.streams and sys.stdout.isatty())
    runner = CpuRunner(a.model, dtype=DTYPES[a.dtype], layer_streamed=a.layer_streamed, progress=bar, cfg=cfg,
                       prefill_chunk=a.prefill_chunk)
    stop_when = StopStrings(partial(reply_text, tok), a.stop).done if a.stop else None
    try:
        res = runner.generate(prompts, a.max_new_tokens, SamplingParams(*sampling_values(a)), stop_ids=stop_ids,
                              seed=a.seed, stop_when=stop_when, on_token=out.token)
    except KeyboardInterrupt:  # what was generated is printed, then run_command's one line
        out.interrupted(a.backend)
        raise
    out.done(res.tokens, {"prefill_seconds": res.prefill_seconds,
                          "decode_tokens_per_second": res.decode_tokens_per_second}, a.backend)
    print(f"prefill {res.prefill_seconds * 1e3:.1f} ms, decode {res.decode_tokens_per_second:.1f} tokens/s",
          file=sys.stderr)
    return 0


def _generate_nxdi_cpu(a, prompts, stop_ids, tok, out, cfg) -> int:
    """The same request through NxDI's generation adapter and on-device sampler in NxD's CPU mode (row 0's text
    streams at one rank)."""
    stream = out.text if out.streams and a.prompt else None
    try:
        tokens = cpu_generate(a, prompts, stop_ids, a.model if tok else None, stream=stream,
                              flag=f"--backend {NXDI_CPU}", cfg=cfg)
    except KeyboardInterrupt:
        out.interrupted(a.backend)
        raise
    out.done(tokens, backend=a.backend)
    return 0


def _check_generate_args(a) -> None:
    check_generation_args(a)
    for flag, given in (("--system", a.system is not None), ("--stop", bool(a.stop))):
        if given and not a.prompt:
            raise KimiInputError(f"{flag}: needs --prompt (--input-ids are token ids: no chat and no text)")


def cmd_demo(a) -> int:
    from .tiny.checkpoint import make_tiny
    from .runtime.chat import prompt_ids
    from .runtime.runner import CpuRunner
    from .runtime.sampling import SamplingParams
    from .runtime.tokenizer import KimiTokenizer

    model_dir = cache_dir() / "tiny-fp8"
    if not (model_dir / "config.json").exists():
        check_out_dir(model_dir, "demo folder (KIMI_K2_NEURON_CACHE)")
        if model_dir.exists():  # ours, left unfinished (make-tiny stopped part way): not the user's to explain
            raise KimiInputError(f"{model_dir}: the demo's cached checkpoint is incomplete (no config.json): delete "
                                 f"that folder and the demo makes it again")
        make_tiny(model_dir, quant="fp8")
        print(f"made a tiny FP8 Kimi-K2-format checkpoint in {model_dir}")
    try:
        runner = CpuRunner(model_dir)
        tok = KimiTokenizer.from_dir(model_dir)
    except KimiInputError as e:  # the cache is ours: a damaged file there is no fault of the user's input
        raise KimiInputError(f"{e} (the demo's cached checkpoint {model_dir} is damaged: delete that folder and "
                             f"the demo makes it again)") from None
    ids = prompt_ids(tok, ["Hello, Kimi!"])[0]
    res = runner.generate([ids], a.max_new_tokens, SamplingParams(), stop_ids=tok.stop_ids(runner.cfg.eos_token_ids))
    print(f"prompt: {len(ids)} tokens; generated {len(res.tokens[0])} tokens (random weights, so no sense): "
          f"{res.tokens[0]}")
    print(f"CPU float32: prefill {res.prefill_seconds * 1e3:.1f} ms, decode {res.decode_tokens_per_second:.1f} "
          f"tokens/s")
    rows = [ids + res.tokens[0]]
    t0 = time.perf_counter()
    ours = runner.logits(rows, prefill_len=len(ids))
    try:
        from .tiny.transformers_oracle import hf_logits, hf_model
    except ImportError as e:
        print(f"skipped the transformers comparison ({e.name} missing): pip install 'kimi-k2-neuron[test]'")
        return 0
    ref = hf_logits(hf_model(model_dir), rows, prefill_len=len(ids))
    diff = (ours - ref).abs().max().item()
    print(f"max |logit difference| vs transformers DeepseekV3ForCausalLM over {ref.shape[1]} positions "
          f"(prefill + teacher-forced decode): {diff:.3e} (max |logit| {ref.abs().max().item():.2f}; "
          f"{time.perf_counter() - t0:.1f} s)")
    return 0


def load_converter():
    """The convert command's start-up: its imports, the fixed cost that scripts/bench_convert.py measures apart."""
    import gc
    import os

    if "numpy" not in sys.modules:  # (a process that already has it, e.g. a test run, keeps its environment)
        # numpy's OpenBLAS thread pool, unused here, spins ~0.15 CPU-s at start-up
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from .convert import convert

    gc.collect()
    gc.freeze()  # torch's ~10^5 import-time objects out of the collector's full passes (~5% of a conversion's CPU)
    return convert


def cmd_convert(a) -> int:
    check_out_dir(a.dst, "DST")
    convert = load_converter()
    from .runtime.tokenizer import CONFIG_NAME, VOCAB_NAME

    missing = [n for n in (VOCAB_NAME, CONFIG_NAME) if not (Path(a.src) / n).is_file()]
    if missing and (Path(a.src) / "config.json").is_file():  # told now, not after the hours a real convert takes
        print(f"note: {a.src} has no {' or '.join(missing)}: generate and vLLM need Kimi's tokenizer files beside "
              f"the converted weights; put them in {a.dst} (convert copies what {a.src} holds)", file=sys.stderr)
    try:
        res = convert(a.src, a.dst, experts=a.experts, workers=a.workers, verify=a.verify)
    except Interrupted as e:
        from .convert.resume import resume_hint

        e.hint = resume_hint(a.dst, a.verify)
        raise
    print(res.summary)
    return 0


def cmd_trace_cpu(a) -> int:
    """One NxDI submodel traced with torch_xla on its CPU device (nxdi_cpu/xla_trace.py); exit 0 clean, 1 not."""
    from .nxdi_cpu.options import check_request, check_submodel

    check_submodel(a.submodel, a.seq_len, a.prefill_chunk)
    # one rank traces here: --kv-shard sequence is a KV group of 1, NxDI's flash-decoding graph without a collective
    options = cpu_options(a, one_rank_group=True)
    check_request(options, a.seq_len, a.batch)  # what config.json decides, before NxD and torch_xla
    try:
        import torch_xla  # noqa: F401

        from .nxdi_cpu import backend, xla_trace
    except ImportError as e:
        raise KimiInputError(f"trace-cpu needs NxD, NxDI and torch_xla importable: {str(e).splitlines()[0]}; "
                             f"torch_xla loads only with the torch it was built for (2.9): run trace-cpu in the "
                             f"nxdi-cpu venv, which `bash scripts/build_nxdi_cpu_tier.sh VENV` builds from a clone of "
                             f"this repository (docs/nxdi_on_cpu.md)")
    with backend.library_output_to_stderr():
        report = xla_trace.trace(xla_trace.TraceOptions(options, a.submodel, a.seq_len, a.batch))
    print(report.to_json() if a.json else report.format())
    return 0 if report.clean else 1


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kimi-k2-neuron", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_make_tiny_parser, _logits_parser, _generate_parser, _convert_parser, _demo_parser,
                partial(add_plan_parser, command=_command), _trace_cpu_parser):
        add(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # what a missing command's error names (not `cmd`)
    return p


def _command(sub, name: str, what: str, fn) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with the same line the command list shows."""
    s = sub.add_parser(name, help=what, description=what)
    s.set_defaults(fn=fn)
    return s


def _make_tiny_parser(sub) -> None:
    s = _command(sub, "make-tiny", "write a tiny random checkpoint in a real Kimi-K2 storage format", cmd_make_tiny)
    s.add_argument("out", metavar="OUT", type=path, help="the new folder to write")
    s.add_argument("--layout", choices=TINY_LAYOUTS, default="k2",
                   help="the release whose checkpoint layout, chat template, end-of-turn id and generation config "
                        "it copies: Kimi-K2-Instruct/-0905, -Thinking, K2.5, K2.6 or K2.7-Code (the last three: "
                        "text_config, language_model. tensors, a vision tower)")
    s.add_argument("--quant", choices=["fp8", "int4", "bf16"], default=None,
                   help="storage format: FP8 blockwise (Instruct), INT4 experts (Thinking, K2.5+) or BF16 "
                        "(default: what the --layout release ships, fp8 for k2, int4 for the others)")
    s.add_argument("--shards", type=integer(1), default=3, metavar="N", help="number of safetensors files")
    s.add_argument("--seed", type=integer(0, SEED_MAX), default=0, metavar="S", help="seeds the random weights")
    s.add_argument("--layers", type=integer(1), default=None, metavar="N",
                   help="decoder layers (default: 3); an EAGLE3 target needs 7 (three distinct captured layers)")
    s.add_argument("--draft-for", metavar="TARGET", default=None, type=path,
                   help="write a tiny EAGLE3 draft for the checkpoint TARGET instead, in a public draft layout "
                        "that --draft takes (default: write a target)")
    s.add_argument("--draft-layout", choices=DRAFT_LAYOUTS, default="eagle3",
                   help="with --draft-for: the public layout it copies: eagle3 (Llama, the target's vocabulary), "
                        "eagle3-d2t (Llama, a reduced vocabulary with d2t/t2d), eagle3.1-mla (MLA, fc_norm, "
                        "norm_output) (docs/speculative.md)")


def _logits_parser(sub) -> None:
    s = _command(sub, "logits", "logits at every position (prefill, then teacher-forced decode)", cmd_logits)
    s.add_argument("--model", required=True, type=checkpoint_folder, metavar="DIR", help="checkpoint folder")
    s.add_argument("--input-ids", type=_rows, required=True, metavar="IDS",
                   help='e.g. "1,2,3;4,5,6" (rows separated by ;)')
    s.add_argument("--prefill-len", type=integer(0), default=None, metavar="K",
                   help="positions below K come from one prefill pass, the rest one token at a time through the "
                        "decode path (default: all of them from one prefill)")
    s.add_argument("--out", required=True, metavar="FILE", type=path,
                   help="output .safetensors with `logits` float32 [B, S, V]")
    _model_opts(s, cmd_logits)


def _generate_parser(sub) -> None:
    s = _command(sub, "generate", "generate on CPU; several --prompt decode as one batch", cmd_generate)
    s.add_argument("--model", required=True, type=checkpoint_folder, metavar="DIR", help="checkpoint folder")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-ids", type=_rows, metavar="IDS",
                     help='token ids instead of --prompt, e.g. "1,2,3;4,5" (rows separated by ;)')
    add_generation_args(s, max_new_tokens=32, top_k=0, prompts=src)
    s.add_argument("--json", action="store_true", help="print one JSON object: tokens, text and timings")
    _model_opts(s, cmd_generate)


def _convert_parser(sub) -> None:
    s = _command(sub, "convert", "convert a Kimi-K2 checkpoint once into the Neuron-ready FP8 expert layout",
                 cmd_convert)
    s.add_argument("src", type=checkpoint_folder, metavar="SRC",
                   help="FP8 blockwise, compressed-tensors INT4 or BF16 Kimi-K2 checkpoint directory")
    s.add_argument("dst", metavar="DST", type=path,
                   help="output directory (new, empty, or an interrupted conversion to resume)")
    s.add_argument("--experts", required=True, choices=SCHEMES,
                   help=f"how the routed experts' FP8 scales are laid out, as NxD reads them ({DEFAULT_SCHEME} is "
                        f"recommended: exact from FP8 and INT4 sources)")
    s.add_argument("--workers", type=integer(1), default=1, metavar="N", help="threads converting experts in parallel")
    s.add_argument("--verify", action="store_true", help="re-hash finished files (and redo any that differ)")


def _demo_parser(sub) -> None:
    s = _command(sub, "demo", "make a tiny FP8 checkpoint, generate from it, compare with transformers", cmd_demo)
    s.add_argument("--max-new-tokens", type=integer(1), default=16, metavar="N", help="tokens to generate")


def _trace_cpu_parser(sub) -> None:
    s = _command(sub, "trace-cpu", "trace one NxDI submodel with torch_xla on the XLA CPU device, as NxD traces it "
                                   "for neuronx-cc (exit 0: one clean graph, 1: not)", cmd_trace_cpu)
    s.add_argument("--model", required=True, type=checkpoint_folder, metavar="DIR",
                   help="checkpoint folder (a raw one is converted once into $KIMI_K2_NEURON_CACHE/converted)")
    s.add_argument("--submodel", required=True, choices=["context", "token", "chunk"],
                   help="which graph to trace (chunk: the chunked-prefill submodel, with --prefill-chunk)")
    # --kv-shard sequence at the one rank traced here: NxDI's flash-decoding graph at G = 1
    add_spec_args(s, where={TRACE: ""}, tp=dict(help="ranks (only 1 traces here)"),
                  seq_len=dict(type=integer(2), default=16, help="KV cache length"),
                  batch=dict(metavar="B", help="rows per call"))
    s.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="compute dtype (bfloat16: the device's)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")


def _model_opts(s, fn):
    """The model flags of logits and generate (`fn`): the backend, the dtype, and the run-spec flags either backend
    takes, each one's help naming the backend where only one does."""
    s.add_argument("--backend", choices=["core", NXDI_CPU], default="core",
                   help="core: this package's CPU model; nxdi-cpu: the NxDI model (NeuronKimiK2ForCausalLM) run by the "
                        "real NxD/NxDI in NxD's CPU mode, needs them importable (docs/nxdi_on_cpu.md)")
    s.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="compute dtype (nxdi-cpu: bfloat16 only "
                                                                           "at --tp 1)")
    s.add_argument("--layer-streamed", action="store_true",
                   help="load one decoder layer at a time (a checkpoint larger than RAM); shows a progress bar")
    names = () if fn is cmd_generate else ("parallel", "experts", "layout")  # no draft: logits are teacher-forced
    add_spec_args(s.add_argument_group("the run's settings"), *names, where=_backends(fn))


def main(argv=None) -> int:
    """The command line `argv` (default: the process's own) -> exit code: 0, 1 (a check said no: plan, trace-cpu),
    2 (bad input, one line), 130 / 143 / 129 (Ctrl-C / SIGTERM / SIGHUP, one line)."""
    return run_command(_main, argv)


def _main(argv) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or --version (0), or an argument error already printed on one line (2)
        return e.code
    try:
        return args.fn(args)
    except KimiInputError as e:
        return fail(e)
    except RanksError as e:  # a rank failed or the ranks were interrupted: one line, and its own exit code
        return fail(e, e.exit_code)


if __name__ == "__main__":
    sys.exit(main())
