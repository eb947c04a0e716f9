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
from .arguments import (Parser, add_spec_args, check_spec_flags, checkpoint_folder, fail, kv_group_of, path,
                        sampling_values)
from .errors import KimiInputError
from .placement import Layout, check_kv_group

def script_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the script docstring's first line and whose epilog is the rest; its argument
    errors are one line and its help shows the defaults, as the kimi-k2-neuron command's."""
    lines = doc.splitlines()
    return Parser(description=lines[0], epilog="\n".join(lines[2:]))


# A script on a compiled folder takes no run-spec flag (the folder has its own); with --cpu, the NxDI model's.
SCRIPT_BACKENDS = {"nxdi-cpu": "--cpu"}  # neuron.spec.CPU
COMPILED = "compiled"


def add_compiled_args(p: argparse.ArgumentParser) -> None:
    """--compiled / --model, for the scripts that load what compile_and_save.py wrote, and --cpu: the same script on
    the NxDI model in NxD's CPU mode, built from --model (kimi_k2_neuron.nxdi_cpu.backend), with the run-spec flags
    that take."""
    p.add_argument("--compiled", metavar="DIR", type=path,
                   help="folder written by scripts/compile_and_save.py (no default: required unless --cpu)")
    p.add_argument("--model", default=None, type=checkpoint_folder, metavar="DIR",
                   help="checkpoint folder (default: the one --compiled was compiled from; with --cpu: required, raw "
                        "or converted)")
    p.add_argument("--cpu", action="store_true",
                   help="run the NxDI model in NxD's CPU mode instead of a compiled one (needs NxD/NxDI importable; "
                        "docs/nxdi_on_cpu.md); no trn2 number comes out of it")
    add_spec_args(p.add_argument_group("with --cpu, the run's settings (a compiled folder has its own)"),
                  where=SCRIPT_BACKENDS)


def check_compiled_args(args: argparse.Namespace) -> None:
    """--compiled for a compiled model, or --cpu with --model (whose config.json must split --tp ways: checked here,
    before the SDK is imported); the run-spec flags only with --cpu."""
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
    check_spec_flags(args, COMPILED, SCRIPT_BACKENDS, "a compiled folder has its own", strict=True)


def check_layout_flags(args: argparse.Namespace) -> None:
    """The layout flags' rules that --tp decides, before any work: the KV group divides it, and a weight split needs
    two ranks or more."""
    check_kv_group(args.tp, kv_group_of(args))
    for flag in ("--shard-attn-a", "--shard-router"):
        if getattr(args, flag[2:].replace("-", "_"), False) and args.tp == 1:
            raise KimiInputError(f"{flag}: splits a layer across ranks; give --tp 2 or more")


def run_spec(args: argparse.Namespace, cfg=None, record=None, one_rank_group: bool = False, **fixed):
    """The RunSpec the run-spec flags a command has ask for (arguments.add_spec_args; absent ones are the spec's
    defaults), each flag setting the field neuron/spec.py's FLAGS names. With `cfg`, the routed experts' format: a
    converted checkpoint's (`record`), else --experts or what convert writes. one_rank_group: --kv-shard sequence at
    one rank is NxDI's flash-decoding graph at a group of 1 (trace-cpu). `fixed`: fields the command decides itself."""
    from .neuron.spec import RunSpec, Sampling

    given = vars(args)
    top, sampling = _fields(args, ""), _fields(args, "sampling.")
    if given.get("no_on_device_sampling"):
        sampling["on_device"] = False
    kw = {**top, "layout": layout_options(args, one_rank_group), "sampling": Sampling(**sampling)}
    if cfg is not None and "experts" in given:
        from .formats.record import expert_scheme

        kw["scheme"] = expert_scheme(cfg, record, args.experts)
    if "draft" not in fixed:
        kw["draft"] = draft_spec(args, cfg)
    kw = {**kw, **fixed}
    if cfg is not None and "moe_prefill" not in kw:  # no --moe-prefill: the kernel's mode where it runs these shapes
        kw["moe_prefill"] = RunSpec(**kw, moe_prefill=None).prefill_mode(cfg)
    return RunSpec(**kw)


def layout_options(args: argparse.Namespace, one_rank_group: bool = False) -> Layout:
    """The layout flags as placement.Layout (absent ones are its defaults). Refuses --kv-group without --kv-shard
    sequence, and a KV group of 1 unless one_rank_group (arguments.kv_group_of)."""
    return Layout(**_fields(args, "layout."), kv_group=kv_group_of(args, one_rank_group))


# Fields whose flags run_spec reads in its own way: the checkpoint's record, kv_group_of, the draft folder
SPECIAL_FIELDS = ("scheme", "layout.kv_group", "draft.path", "draft.speculation_length")


def _fields(args: argparse.Namespace, prefix: str) -> dict:
    """{field: value} of the flags given (not None) that set fields `prefix` holds directly ("" the RunSpec's own,
    "layout." a Layout's), by FLAGS' field names."""
    from .neuron.spec import FLAGS

    out = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if flag.field is None or value is None or flag.field in SPECIAL_FIELDS or not flag.field.startswith(prefix):
            continue
        name = flag.field[len(prefix):]
        if "." not in name:
            out[name] = value
    return out


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
    length = {} if k is None else {"speculation_length": k}  # else DraftSpec's default
    return DraftSpec(path=str(Path(path).resolve()), checkpoint=read_draft(path, cfg, finite=finite), **length)


def cpu_options(args: argparse.Namespace, one_rank_group: bool = False, cfg=None):
    """The NxD CPU-mode flags (--model, --experts, --tp, and --ep/--dtype where a command has them) as
    kimi_k2_neuron.nxdi_cpu.options.CpuOptions (a raw checkpoint is converted into the cache when it runs). No SDK.
    one_rank_group: as run_spec's. `cfg`: --model's config.json as the caller read it (else read when checked)."""
    from .nxdi_cpu.options import CpuOptions

    one_rank = one_rank_group and getattr(args, "kv_shard", "none") == "sequence" and kv_group_of(args, True) == 1
    spec = run_spec(args, cfg, one_rank_group=one_rank_group, lnc=None, moe_prefill=None)
    return CpuOptions(model=args.model, spec=spec, experts=args.experts, dtype=getattr(args, "dtype", "float32"),
                      cache_dir=str(converted_root()), flash_decoding_one_rank=one_rank, config=cfg)


def layout_flags_given(args: argparse.Namespace) -> list[str]:
    """The layout flags given, whatever their values (--kv-shard none too)."""
    from .neuron.spec import FLAGS

    return [flag.name if flag.kind == "switch" else f"{flag.name} {getattr(args, flag.dest)}" for flag in FLAGS
            if flag.group == "layout" and getattr(args, flag.dest, flag.default) != flag.default]


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
