"""Start-up shared by the trn2 scripts and test fixtures: argument parsing, logging and the FP8 environment.
Imports neither the SDK nor torch until start(), so every script answers --help on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from .cache import converted_root
from .arguments import (Parser, add_kv_layout_args, add_spec_args, add_weight_sharding_args, checkpoint_folder, fail,
                        integer, kv_group_of, sampling_values)
from .formats import DEFAULT_SCHEME, SCHEMES
from .errors import KimiInputError

def script_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the script docstring's first line and whose epilog is the rest; its argument
    errors are one line and its help shows the defaults, as the kimi-k2-neuron command's."""
    lines = doc.splitlines()
    return Parser(description=lines[0], epilog="\n".join(lines[2:]))


def add_compiled_args(p: argparse.ArgumentParser) -> None:
    """--compiled / --model, for the scripts that load what compile_and_save.py wrote, and --cpu: the same script on
    the NxDI model in NxD's CPU mode, built from --model (kimi_k2_neuron.nxdi_cpu.backend)."""
    p.add_argument("--compiled", metavar="DIR",
                   help="folder written by scripts/compile_and_save.py (no default: required unless --cpu)")
    p.add_argument("--model", default=None, type=checkpoint_folder, metavar="DIR",
                   help="checkpoint folder (default: the one --compiled was compiled from; with --cpu: required, raw "
                        "or converted)")
    p.add_argument("--cpu", action="store_true",
                   help="run the NxDI model in NxD's CPU mode instead of a compiled one (needs NxD/NxDI importable; "
                        "docs/nxdi_on_cpu.md); no trn2 number comes out of it")
    p.add_argument("--tp", type=integer(1), default=1, metavar="N", help="with --cpu: tensor-parallel CPU ranks")
    p.add_argument("--experts", choices=SCHEMES, default=None,
                   help=f"with --cpu: the scheme a raw --model is converted to (default: {DEFAULT_SCHEME})")
    layout = p.add_argument_group("with --cpu, the long-context layout (a compiled folder has its own)")
    add_kv_layout_args(layout)
    add_weight_sharding_args(layout)
    add_spec_args(p.add_argument_group("with --cpu, speculative decoding (a compiled folder has its own draft)"),
                  "draft")


def check_compiled_args(args: argparse.Namespace) -> None:
    """--compiled for a compiled model, or --cpu with --model (whose config.json must split --tp ways: checked here,
    before the SDK is imported); the --cpu flags only with --cpu."""
    if args.cpu:
        if args.compiled or not args.model:
            raise KimiInputError("--cpu: needs --model DIR and no --compiled (it builds the model from the checkpoint)")
        from .nxdi_cpu.options import check_layout

        check_layout_flags(args)
        o = cpu_options(args)
        check_layout(o, o.config)
        return
    if not args.compiled:
        raise KimiInputError("--compiled: required (or --cpu with --model)")
    if not os.path.isdir(args.compiled):
        raise KimiInputError(f"--compiled {args.compiled}: expected a folder written by scripts/compile_and_save.py")
    if args.model:  # a checkpoint other than the compiled one's: its config.json (raw, converted or unfinished)
        from .config import KimiK2Config

        KimiK2Config.from_file(args.model)
    given = layout_flags_given(args)
    if given:
        raise KimiInputError(f"{' '.join(given)}: only with --cpu (a compiled folder has its own layout)")
    for flag, given in (("--tp", args.tp != 1), ("--experts", args.experts is not None),
                        ("--draft", args.draft is not None), ("--speculation-length", args.speculation_length)):
        if given:
            raise KimiInputError(f"{flag}: only with --cpu (a compiled folder has its own)")


def check_layout_flags(args: argparse.Namespace) -> None:
    """The layout flags' rules that --tp decides, before any work: the KV group divides it, and a weight split needs
    two ranks or more."""
    from .parallel import check_kv_group

    check_kv_group(args.tp, kv_group_of(args))
    for flag in ("--shard-attn-a", "--shard-router"):
        if getattr(args, flag[2:].replace("-", "_"), False) and args.tp == 1:
            raise KimiInputError(f"{flag}: splits a layer across ranks; give --tp 2 or more")


def run_spec(args: argparse.Namespace, cfg=None, record=None, **fixed):
    """The RunSpec the run-spec flags a command has ask for (arguments.add_spec_args; absent ones are the spec's
    defaults). With `cfg`, the routed experts' format: a converted checkpoint's (`record`), else --experts or what
    convert writes. `fixed`: fields the command decides itself."""
    from .neuron.spec import RunSpec, Sampling

    given = vars(args)
    kw = {f: given[f] for f in ("tp", "ep", "lnc", "seq_len", "max_context_length", "batch", "moe_prefill",
                                "output_logits") if given.get(f) is not None}
    if "global_topk" in given or "no_on_device_sampling" in given:
        kw["sampling"] = Sampling(on_device=not given.get("no_on_device_sampling", False),
                                  global_topk=given.get("global_topk", Sampling.global_topk))
    if cfg is not None and "experts" in given:
        from .formats.record import expert_scheme

        kw["scheme"] = expert_scheme(cfg, record, args.experts)
    if "draft" not in fixed:
        kw["draft"] = draft_spec(args, cfg)
    kw.update(cache_spec(args))
    return RunSpec(**{**kw, "layout": layout_options(args), **fixed})


def cache_spec(args: argparse.Namespace) -> dict:
    """--prefix-caching, --block-size and --num-blocks as RunSpec fields (none where the command lacks them); the
    last two only with the first."""
    if "prefix_caching" not in vars(args):
        return {}
    given = {k: v for k, v in (("block_size", args.block_size), ("num_blocks", args.num_blocks)) if v is not None}
    if not args.prefix_caching:
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise KimiInputError(f"{flag}: only with --prefix-caching (the contiguous cache has no blocks)")
        return {}
    return dict(prefix_caching=True, **given)


def draft_spec(args: argparse.Namespace, cfg, finite: bool = True):
    """--draft and --speculation-length as a DraftSpec (None without --draft), the draft folder read and checked
    against the target's config (checkpoint/draft.py: every tensor's name, shape, dtype, and with `finite` its
    values) before any work."""
    path, k = getattr(args, "draft", None), getattr(args, "speculation_length", None)
    if path is None:
        if k is not None:
            raise KimiInputError(f"--speculation-length {k}: needs --draft (the draft proposes the tokens)")
        return None
    from .checkpoint.draft import read_draft
    from .config import KimiK2Config
    from .neuron.spec import DraftSpec

    cfg = cfg or KimiK2Config.from_file(args.model)
    return DraftSpec(path=str(Path(path).resolve()), speculation_length=4 if k is None else k,
                     checkpoint=read_draft(path, cfg, finite=finite))


def cpu_options(args: argparse.Namespace, one_rank_group: bool = False, cfg=None):
    """The NxD CPU-mode flags (--model, --experts, --tp, and --ep/--dtype where a command has them) as
    kimi_k2_neuron.nxdi_cpu.options.CpuOptions (a raw checkpoint is converted into the cache when it runs). No SDK.
    one_rank_group: --kv-shard sequence at one rank is NxDI's flash-decoding graph at a group of 1 (trace-cpu).
    `cfg`: --model's config.json as the caller read it (else read when checked)."""
    from .neuron.spec import RunSpec
    from .nxdi_cpu.options import CpuOptions

    one_rank = one_rank_group and getattr(args, "kv_shard", "none") == "sequence" and kv_group_of(args, True) == 1
    spec = RunSpec(tp=args.tp, ep=getattr(args, "ep", 1), lnc=None, moe_prefill=None,
                   layout=layout_options(args, one_rank_group), draft=draft_spec(args, cfg))
    return CpuOptions(model=args.model, spec=spec, experts=args.experts, dtype=getattr(args, "dtype", "float32"),
                      cache_dir=str(converted_root()), flash_decoding_one_rank=one_rank, config=cfg)


def layout_options(args: argparse.Namespace, one_rank_group: bool = False):
    """The long-context flags (arguments.add_kv_layout_args, add_weight_sharding_args; absent ones are their
    defaults) as parallel.Layout. Refuses --kv-group without --kv-shard sequence, and a KV group of 1 unless
    one_rank_group (arguments.kv_group_of)."""
    from .parallel import Layout

    return Layout(kv_group=kv_group_of(args, one_rank_group), prefill_chunk=getattr(args, "prefill_chunk", None),
                  shard_attn_a=getattr(args, "shard_attn_a", False), shard_router=getattr(args, "shard_router", False))


def layout_flags_given(args: argparse.Namespace) -> list[str]:
    """The layout flags given, whatever their values (--kv-shard none too)."""
    group, chunk = getattr(args, "kv_group", None), getattr(args, "prefill_chunk", None)
    shard = getattr(args, "kv_shard", None)  # None: not given (--kv-shard none is a choice of the layout)
    given = ((f"--kv-shard {shard}", shard is not None),
             (f"--kv-group {group}", group is not None), (f"--prefill-chunk {chunk}", chunk is not None),
             ("--shard-attn-a", getattr(args, "shard_attn_a", False)),
             ("--shard-router", getattr(args, "shard_router", False)))
    return [flag for flag, on in given if on]


def cpu_backend(flag: str = "--cpu"):
    """kimi_k2_neuron.nxdi_cpu.backend (NxD and NxDI imported), or a one-line error naming what is missing."""
    try:
        from .nxdi_cpu import backend
    except ImportError as e:
        raise KimiInputError(f"{flag}: {e}") from None
    return backend


def cpu_generate(args: argparse.Namespace, rows: list[list[int]], stop_ids, tokenizer_dir: str | None,
                 stream=None, flag: str = "--cpu", cfg=None) -> list[list[int]]:
    """New tokens per row from nxdi_cpu.backend.generate, refused before the SDK is imported where the flags say.
    `cfg`: --model's config.json as the caller read it."""
    from .neuron.spec import Sampling
    from .nxdi_cpu.options import Generation, check_request

    g = Generation(rows=rows, stop_ids=tuple(sorted(stop_ids)), max_new_tokens=args.max_new_tokens,
                   sampling=Sampling.of(*sampling_values(args)), seed=args.seed, stop=tuple(args.stop),
                   tokenizer_dir=tokenizer_dir)
    o = cpu_options(args, cfg=cfg)
    o = dataclasses.replace(o, config=check_request(o, g.seq_len, len(g.rows), g.sampling, g.rows, cfg=o.config))
    tokens, paths = cpu_backend(flag).generate(o, g, stream)
    print(paths, file=sys.stderr)
    return tokens


# NEFFs and model.pt beside the pre-sharded weights: not known before compiling (NxD keeps the weights out of the
# NEFFs), so the disk check keeps this fraction of the weights on top.
NEFF_MARGIN = 0.1


def check_host_resources(p, out: str) -> None:
    """Before hours of work: free disk under --out and host RAM for NxDI's load(), which reads every file whole."""
    import shutil
    from pathlib import Path

    gib = 2**30
    need_disk = int(p.presharded_bytes * (1 + NEFF_MARGIN))
    where = next(d for d in Path(out).resolve().parents if d.exists()) if not Path(out).exists() else Path(out)
    free = shutil.disk_usage(where).free
    if free < need_disk:
        raise KimiInputError(f"--out {out}: {free / gib:.1f} GiB free on its disk, the pre-sharded weights need "
                             f"{need_disk / gib:.1f} GiB ({p.tp} rank files of {p.weight_bytes / gib:.2f} GiB, plus "
                             f"{NEFF_MARGIN:.0%} for the NEFFs); free space, or pass --force")
    available = host_memory_available()
    if available is not None and available < p.presharded_bytes:
        raise KimiInputError(f"host RAM: {available / gib:.1f} GiB available, NxDI's load() reads all {p.tp} rank "
                             f"files whole: {p.presharded_bytes / gib:.1f} GiB; use a bigger host, or pass --force")


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="log what is being done (INFO level)")


def begin(args: argparse.Namespace, *checks) -> int | None:
    """Each check(args), start(), then the SDK; the exit code (2) of a one-line error, or None to go on."""
    try:
        for check in checks:
            check(args)
    except KimiInputError as e:
        return fail(e)
    start(args)
    try:
        from .neuron import modeling  # noqa: F401 -- its ImportError names the missing Neuron packages
    except ImportError as e:
        return sdk_missing(e)
    return None


def start(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    set_fp8_env()


def set_fp8_env() -> None:
    """Before anything imports torch-xla, which reads it then."""
    from .neuron.contract import FP8_ENV

    os.environ.update(FP8_ENV)


def sdk_missing(e: ImportError) -> int:
    return fail(e)


__all__ = ["add_compiled_args", "add_verbose", "begin", "check_compiled_args", "check_host_resources", "cpu_backend",
           "cpu_generate", "cpu_options", "draft_spec", "host_memory_available", "run_spec", "script_parser", "sdk_missing",
           "set_fp8_env", "start"]
