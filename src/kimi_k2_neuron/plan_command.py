"""The `kimi-k2-neuron plan` command: will a run spec fit on a trn2.48xlarge, and how fast (estimates). Its modes: a
plan, --max-seq-len, --max-batch, --best (the layouts by modelled time), --port (a published port at its own
configuration) and --serve (a workload's output tokens per second per box at a latency bound); the planner itself is
neuron/fit.py (its searches layout_search.py, its report plan_report.py; the serving view workload.py and
serve_report.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .arguments import add_spec_args, checkpoint_folder, integer, integers, number, path
from .errors import KimiInputError
from .formats import DEFAULT_SCHEME, EXPERT_FORMATS
from .launch import draft_spec, layout_flags_given, layout_options, run_spec


def cmd_plan(a) -> int:
    from .config import KimiK2Config
    from .formats.record import ConversionRecord
    from .neuron.fit import plan
    from .neuron.layout_search import max_batch, max_seq_len
    from .neuron.plan_report import format_plan, plan_json
    from .neuron.timing import Port
    from .parallel import check_tp_divides

    _check_plan_modes(a)
    layout_options(a)  # the layout flags' own refusals, before config.json
    cfg = KimiK2Config.from_file(Path(a.model) / "config.json" if a.model else a.config)
    if a.tp is not None and (a.serve or a.best):  # the searches drop what the rules refuse: this none would pass
        check_tp_divides(cfg, a.tp, split_embedding_dim=True)
    if a.port:
        return _plan_published(a, cfg)
    if a.serve:
        return _plan_serve(a, cfg)
    # a converted checkpoint's scheme (through --model or --config), else what convert would write from this one
    spec = run_spec(a, cfg, ConversionRecord.of(cfg), checkpoint=a.model,
                    draft=draft_spec(a, cfg, finite=False))  # the draft's headers: no tensor read to plan
    model = dict(port=Port(kv_slots=a.kv_slots, router_dtype=a.router_dtype))
    if a.best:
        return _plan_best(a, cfg, spec, model["port"])
    if a.max_batch:
        p = max_batch(cfg, spec, **model)
        found = p.batch if p.fits else None
        print(plan_json(p, max_batch=found) if a.json else f"{_max_batch_line(p, found)}\n{format_plan(p)}")
        return 0 if p.fits else 1
    if not a.max_seq_len:
        p = plan(cfg, spec, **model, turn=_turn(a))
        print(plan_json(p) if a.json else format_plan(p))
        return 0 if p.fits else 1
    p = max_seq_len(cfg, spec, **model)
    found = p.seq_len if p.fits else None
    print(plan_json(p, max_seq_len=found) if a.json else f"{_max_seq_len_line(cfg, p, found)}\n{format_plan(p)}")
    return 0 if p.fits else 1


def _turn(a) -> tuple[int, int] | None:
    if a.turn is None:
        return None
    if not a.prefix_caching or len(a.turn) != 2 or a.turn[1] < 1:
        raise KimiInputError(f"--turn {','.join(map(str, a.turn))}: expected CACHED,NEW (NEW >= 1), with "
                             f"--prefix-caching")
    return a.turn[0], a.turn[1]


def _check_plan_modes(a) -> None:
    """plan's modes, one at a time: a plan, --max-seq-len, --max-batch, --best, --port, --serve."""
    serving = [f for f, on in (("--input-tokens", a.input_tokens is not None), ("--output-tokens",
                                                                                a.output_tokens is not None),
                               ("--tpot-ms", a.tpot_ms is not None), ("--ttft-s", a.ttft_s is not None),
                               ("--prefix-reuse", a.prefix_reuse)) if on]
    if serving and not a.serve:
        raise KimiInputError(f"{serving[0]}: only with --serve (a workload's rate at a latency bound)")
    if a.serve:
        given = [f for f, on in (("--seq-len", a.seq_len is not None), ("--batch", a.batch is not None),
                                 ("--best", a.best), ("--max-batch", a.max_batch), ("--max-seq-len", a.max_seq_len),
                                 ("--port", a.port is not None), ("--draft", getattr(a, "draft", None) is not None))
                 if on]
        if given:
            raise KimiInputError(f"--serve: searches the batch, layout and decode path for the workload itself; leave "
                                 f"out {', '.join(given)}")
        if a.tp is None:
            raise KimiInputError("--tp: required (--serve searches the layouts at this TP)")
        if a.prefix_reuse and a.serve != "agentic":
            raise KimiInputError("--prefix-reuse: only with --serve agentic (a chat request has no earlier turn)")
        cache = [f for f, on in (("--prefix-caching", a.prefix_caching), ("--num-blocks", a.num_blocks is not None),
                                 ("--turn", a.turn is not None)) if on]
        if cache:
            raise KimiInputError(f"{cache[0]}: not with --serve (--serve agentic --prefix-reuse searches "
                                 f"--prefix-caching builds, the pool following the batch)")
        from .neuron.spec import RunSpec

        if a.block_size != RunSpec.block_size and not a.prefix_reuse:
            raise KimiInputError(f"--block-size {a.block_size}: with --serve only with --prefix-reuse (the contiguous "
                                 f"cache has no blocks)")
        if a.serve == "agentic" and (a.input_tokens is not None or a.output_tokens is not None):
            raise KimiInputError("--input-tokens/--output-tokens: for --serve chat; the agentic workload's turns are "
                                 "fixed (docs/planner.md, \"Serving many users\")")
        return
    if a.max_batch and (a.seq_len is None or a.batch is not None):
        raise KimiInputError("--max-batch: searches the batch at --seq-len; give --seq-len and leave out --batch and "
                             "--max-seq-len")
    if a.best and (a.max_seq_len or a.max_batch):
        raise KimiInputError("--best: searches the layouts at one --seq-len and --batch; not with --max-seq-len or "
                             "--max-batch")
    if a.port:
        given = [f for f, on in (("--tp", a.tp is not None), ("--best", a.best), ("--max-batch", a.max_batch),
                                 ("--max-seq-len", a.max_seq_len), ("--seq-len", a.seq_len is not None))
                 if on]
        if given:
            raise KimiInputError(f"--port {a.port}: plans that port at its own published configuration; leave out "
                                 f"{', '.join(given)}")
    elif a.tp is None:
        raise KimiInputError("--tp: required (or --port NAME, a published port at its own configuration)")
    elif a.seq_len is None and not a.max_seq_len:
        raise KimiInputError("--seq-len: required (or --max-seq-len)")


def _plan_serve(a, cfg) -> int:
    """The workload's best configuration by modelled output tokens per second within the bounds (exit 0 if one meets
    them all, 1 if none does)."""
    from .formats.record import ConversionRecord
    from .neuron import workload
    from .neuron.serve_report import format_serving, serving_json

    bounds = dict(tpot_s=(a.tpot_ms if a.tpot_ms is not None else 50.0) / 1e3,
                  ttft_p90_s=a.ttft_s if a.ttft_s is not None else 5.0)
    w = (workload.agentic(prefix_reuse=a.prefix_reuse, **bounds) if a.serve == "agentic" else
         workload.chat(a.input_tokens or 8192, a.output_tokens or 1024, **bounds))
    if w.seq_len > cfg.max_position_embeddings:
        raise KimiInputError(f"--input-tokens + --output-tokens = {w.seq_len}: exceeds config.json field "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
    base = run_spec(a, cfg, ConversionRecord.of(cfg), checkpoint=a.model or "(planned)", draft=None)
    best, found = workload.best_serving(cfg, base, w)
    today = workload.vllm_today(found)
    print(serving_json(w, best, found, today) if a.json else format_serving(w, best, found, today))
    return 0 if best is not None and best.meets else 1


def _plan_published(a, cfg) -> int:
    """A published port at its own configuration: the modelled TPOT and TTFT beside what it published."""
    from .neuron.fit import plan
    from .neuron.layout_search import published_spec
    from .neuron.plan_report import format_plan, plan_json
    from .neuron.timing import PUBLISHED_BY_NAME

    spec, port = published_spec(cfg, a.port)
    p, pub = plan(cfg, spec, port), PUBLISHED_BY_NAME[a.port]
    tpot, ttft = p.decode.total_s * 1e3, p.ttft_s * 1e3
    line = (f"{a.port} ({pub.source}): published TPOT {pub.tpot_ms} ms, modelled {tpot:.2f} ms "
            f"({tpot / pub.tpot_ms - 1:+.1%}); published TTFT {pub.ttft_ms} ms, modelled {ttft:.0f} ms "
            f"({ttft / pub.ttft_ms - 1:+.1%}); estimates")
    print(plan_json(p, published=dict(tpot_ms=pub.tpot_ms, ttft_ms=pub.ttft_ms, source=pub.source)) if a.json
          else f"{line}\n{format_plan(p)}")
    return 0


def _plan_best(a, cfg, spec, port) -> int:
    """The layouts that fit at --seq-len and --batch, fastest modelled decode first; the plan of the best."""
    from .neuron.layout_search import best_layout
    from .neuron.plan_report import format_plan, plan_json
    from .neuron.spec import layout_flags

    replaced = layout_flags_given(a) + ([f"--moe-prefill {a.moe_prefill}"] if a.moe_prefill else [])
    if replaced:
        print(f"note: --best searches the layout and the MoE prefill itself: {', '.join(replaced)} given, not used "
              f"(--max-context-length, --seq-len and --batch are kept)", file=sys.stderr)
    best, fitting = best_layout(cfg, spec, port=port)
    if a.json:
        print(plan_json(best, best_flags=layout_flags(best.layout), fitting=len(fitting)) if best
              else json.dumps({"best": None, "fitting": 0}))
        return 0 if best else 1
    if best is None:
        print(f"no layout fits {spec.seq_len} x {spec.batch} at --tp {spec.tp} by the planner (estimates)")
        return 1
    lines = [f"best layout by modelled TPOT (estimates; {len(fitting)} layouts fit): "
             f"{' '.join(layout_flags(best.layout)) or 'replicated cache, one-shot prefill'} "
             f"--moe-prefill {best.moe_prefill}"]
    rows = [(f"{' '.join(layout_flags(p.layout)) or '(replicated)'} --moe-prefill {p.moe_prefill}", p)
            for p in fitting[:6]]
    w = max(len(flags) for flags, _ in rows) + 2
    lines.append(f"  {'layout':<{w}}{'TPOT ms':>9}{'TTFT s':>9}")
    lines += [f"  {flags:<{w}}{p.decode.total_s * 1e3:>9.2f}{p.ttft_s:>9.1f}" for flags, p in rows]
    print("\n".join(lines) + "\n" + format_plan(best))
    return 0


def _max_batch_line(p, found: int | None) -> str:
    from .neuron.hbm import GiB

    if found is None:
        return (f"max batch: none fits at seq_len {p.seq_len} (batch {p.batch} needs {p.total_bytes / GiB:.2f} GiB); "
                f"the plan at it:")
    return f"max batch at seq_len {p.seq_len}: {found}; the plan at it:"


def _max_seq_len_line(cfg, p, found: int | None) -> str:
    from .neuron.hbm import GiB

    top = cfg.max_position_embeddings
    if found is None:
        return (f"max seq_len: none fits (searched up to max_position_embeddings {top}; the smallest tried, "
                f"{p.seq_len}, needs {p.total_bytes / GiB:.2f} GiB); the plan at it:")
    from .placement import Layout
    from .neuron.layout_search import seq_len_step

    step = seq_len_step(p)
    taken_by = "the shard-on-block kernel takes" if p.layout == Layout() else "these options take"
    beyond = ("= max_position_embeddings" if found == top else f"{found + 1} does not fit" if step == 1 else
              f"the next {taken_by}, {found + step}, does not fit")
    return f"max seq_len: {found} ({beyond}; searched up to max_position_embeddings {top}); the plan at it:"


def add_plan_parser(sub, command) -> None:
    """`plan` under `sub`, made by `command` (cli._command: the help line is the description's)."""
    from .neuron.timing import PUBLISHED_BY_NAME

    s = command(sub, "plan", "will it fit, and how fast? HBM per logical core on trn2.48xlarge and the modelled decode "
                              "and prefill time, estimates (exit 0 fits, 1 does not)", cmd_plan)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=checkpoint_folder, metavar="DIR",
                     help="checkpoint directory (reads DIR/config.json)")
    src.add_argument("--config", type=path, help="a config.json file")
    add_spec_args(s, "parallel", tp=dict(required=False, default=None,
                                         help="tensor-parallel degree (logical cores per model replica; no "
                                              "default: required unless --port)"))
    seq = s.add_mutually_exclusive_group()
    add_spec_args(seq, "--seq-len", seq_len=dict(default=None, help="KV cache length (prompt + generated tokens); "
                                                                     "no default: required unless --max-seq-len or "
                                                                     "--port"))
    seq.add_argument("--max-seq-len", action="store_true",
                     help="search the largest seq_len that fits (up to max_position_embeddings) and plan it; "
                          "--json adds max_seq_len (null if none fits)")
    add_spec_args(s, "--max-context-length", "--batch", batch=dict(default=None,
                                                                     help="sequences decoded together (default 1)"))
    s.add_argument("--max-batch", action="store_true",
                   help="search the largest batch that fits at --seq-len and plan it; --json adds max_batch (null if "
                        "none fits)")
    s.add_argument("--best", action="store_true",
                   help="search the layouts that fit at --seq-len, --batch and any --max-context-length (KV group, "
                        "--prefill-chunk, the --shard-* options, --moe-prefill; the ones given are not used, with a "
                        "note saying so) and plan the one with the "
                        "lowest modelled TPOT, then TTFT (scripts/compile_and_save.py compiles that choice when given "
                        "no layout flag)")
    s.add_argument("--serve", nargs="?", const="chat", choices=["chat", "agentic"], default=None,
                   help="a workload served through vLLM's continuous batching: search the batch, layout, EP, MoE "
                        "decode path and prefill chunking for the most output tokens per second per box with the TPOT "
                        "and p90 TTFT bounds met, prefill and decode counted as vllm-neuron interleaves them "
                        "(docs/planner.md, \"Serving many users\"); chat: --input-tokens / --output-tokens a "
                        "request; agentic: 12 turns from a 16,384-token history, each adding 3,072 tokens and "
                        "generating 512; exit 0 if a configuration meets every bound, 1 if none does (default: off; --serve alone: "
                        "chat)")
    s.add_argument("--input-tokens", type=integer(1), default=None, help="--serve chat: prompt tokens a request "
                                                                          "(default: 8192)")
    s.add_argument("--output-tokens", type=integer(2), default=None, help="--serve chat: tokens a request generates "
                                                                           "(default: 1024)")
    s.add_argument("--tpot-ms", type=number(0, lo_open=True), default=None,
                   help="--serve: vLLM's mean TPOT (prefill stalls included) at most this (default: 50)")
    s.add_argument("--ttft-s", type=number(0, lo_open=True), default=None,
                   help="--serve: the 90th percentile of TTFT at most this (default: 5)")
    s.add_argument("--prefix-reuse", action="store_true",
                   help="--serve agentic: each turn finds its history in vLLM's prefix cache: the search takes "
                        "--prefix-caching builds only (--block-size, default 32; the pool every row's full sequence; "
                        "not the sequence-sharded cache, which the block layout refuses), each turn prefilling what "
                        "follows the history's whole blocks as NxDI's 2D buckets call it")
    s.add_argument("--port", choices=sorted(PUBLISHED_BY_NAME), default=None,
                   help="plan a published trn2 port at its own configuration and build (its seq_len, batch, experts, "
                        "KV cache, router, sampler) beside the TPOT and TTFT it published, with --config of the model "
                        "it serves (docs/planner.md; default: this project's build, as the flags give it)")
    add_spec_args(s, "experts", "moe", experts=dict(
        choices=EXPERT_FORMATS, help="routed-expert storage on device (default: what a converted --model holds, which "
                                     f"is the only value accepted for it; else {DEFAULT_SCHEME}, as "
                                     "scripts/compile_and_save.py)"))
    s.add_argument("--kv-slots", type=integer(1), default=1,
                   help="1: a cache of the latent entries alone (ours, the default); 2: the same beside an unused "
                        "slot of the same width per entry (NxDI's stock KVCacheManager)")
    s.add_argument("--router-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32: this port's router (default); bf16 models ports that cast it (the DeepSeek-V3 contrib)")
    add_spec_args(s, "layout")
    cache = s.add_argument_group("prefix caching")
    add_spec_args(cache, "cache")
    cache.add_argument("--turn", type=integers(0), default=None, metavar="CACHED,NEW",
                       help="with --prefix-caching: the turn whose prefill is modelled warm (CACHED positions in "
                            "blocks, NEW to prefill) and cold (default: 65536,2048, an agent's long history and a tool "
                            "result; cut to --seq-len)")
    add_spec_args(s.add_argument_group("speculative decoding"), "draft")
    s.add_argument("--json", action="store_true", help="print the plan as JSON (every time component in ms)")
