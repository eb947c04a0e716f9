"""Command-line plumbing shared by `kimi-k2-neuron` and the trn2 scripts: one-line argument errors, help that shows
every default, checked numbers, output paths checked before any work, and the generation flags.

Stdlib only (no torch, no Neuron SDK), so every script parses and validates its arguments, and answers --help, in
a fraction of a second on any machine. Argument errors read `error: <flag or path>: <what was expected>` on one
line and exit with code 2, like every other bad input (kimi_k2_neuron.errors.KimiInputError).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from .cache import cache_dir  # noqa: F401 (the CLI's and scripts' name for it)
from .errors import KimiInputError, MissingConfig, broken_link, special_file


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `error: <flag>: <message>`, with no usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        # argparse says "argument --x: ..."; drop its "argument " so the line starts with the flag.
        self.exit(2, f"error: {message.removeprefix('argument ')}\n")


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: ...)" to every option's help unless the help already states its default. Flags print
    "off" rather than False. "None" says nothing, so an option without a default value must say in its own words
    what happens without it (or be one of a required choice of options)."""

    def _get_help_string(self, action):
        text = action.help or ""
        says_default = "default" in text.lower()
        unset = action.default is None or action.default is argparse.SUPPRESS
        if says_default or unset or action.required or not action.option_strings:
            return text
        shown = "off" if action.default is False else "%(default)s"
        return f"{text} (default: {shown})".strip()


# -- checked numbers (argparse type= functions) -------------------------------------------------------------------


def integer(lo: int, hi: int | None = None):
    """type= for an integer >= lo (and <= hi)."""
    expected = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected.removeprefix("an ")  # "integer >= lo[ and <= hi]": what argparse and tests read
    return parse


def path(text: str) -> str:
    """type= for every path argument: an empty one (an unset shell variable, `--out "$OUT"`) is refused, naming the
    flag, where it would otherwise mean the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (an unset shell variable?)")
    return text


def checkpoint_folder(text: str) -> str:
    """type= for a checkpoint folder a command reads: a file (its config.json, a shard) is refused here, naming the
    flag; a missing path is left to the reader, which says what it expected there."""
    path(text)
    if Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: is a file; expected a checkpoint folder (the one holding "
                                         f"config.json)")
    return text


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed


def integers(lo: int):
    """type= for comma-separated integers, each >= lo."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(c) for c in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < lo:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {lo}, got {text!r}")
        return values

    parse.__name__ = f"integers >= {lo}"
    return parse


def number(lo: float, hi: float = math.inf, lo_open: bool = False):
    """type= for a finite number in [lo, hi] ((lo, hi] with lo_open); NaN and inf are refused."""
    expected = f"a finite number {'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected
    return parse


# -- output paths, checked before any work so a bad path never throws away hours of compute -----------------------


def _probe_writable(folder: Path, what: str) -> None:
    """Create and delete a file in `folder`: the only reliable test (os.access says yes to root on /proc)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".kimi-k2-neuron-probe-", dir=folder)
    except OSError as e:
        raise KimiInputError(f"{what}: expected a writable folder, but {folder} refuses new files ({e.strerror})")
    os.close(fd)
    os.unlink(probe)


def check_out_file(path: str | Path, what: str, apart_from: dict[str, str | Path] | None = None) -> None:
    """`path` can be written as a file: not a directory, in an existing writable folder, and outside every input
    folder of `apart_from` ({flag: folder}): no command writes into the checkpoint it reads."""
    path = Path(path)
    if path.is_dir():
        raise KimiInputError(f"{what} {path}: is a directory, expected a file path")
    node = special_file(path)
    if node:  # the atomic write's rename would replace it (as root, /dev/null for the whole machine)
        raise KimiInputError(f"{what} {path}: is {node}; expected a regular file path (the output is written "
                             f"beside it and renamed into place, which would replace the {node.split()[-1]})")
    folder = path.parent
    if not folder.is_dir():
        why = broken_link(folder) or "not a folder"
        raise KimiInputError(f"{what} {path}: expected a file in an existing folder, but {folder} is {why}")
    _probe_writable(folder, f"{what} {path}")
    _check_apart(path, what, apart_from)


def _check_apart(path: Path, what: str, apart_from: dict[str, str | Path] | None) -> None:
    """`path` is not inside any input folder of `apart_from` ({flag: folder}), nor one of them."""
    for flag, folder in (apart_from or {}).items():
        if folder is None or broken_link(folder):  # (refused where the folder is read)
            continue
        inside, out = Path(folder).resolve(), Path(path).resolve()
        if inside in out.parents or inside == out:
            how = "is" if inside == out else "is inside"
            raise KimiInputError(f"{what} {path}: {how} {flag} {folder}, which this command reads; expected a path "
                                 f"outside it")


def check_out_dir(path: str | Path, what: str, apart_from: dict[str, str | Path] | None = None) -> None:
    """`path` is a writable folder, or one that can be made: its nearest existing ancestor is a writable folder; and
    outside every input folder of `apart_from` ({flag: folder})."""
    path = Path(path).absolute()
    for p in (path, *path.parents):  # a link to nothing is no folder to write into, nor one to make
        broken = broken_link(p)
        if broken:
            raise KimiInputError(f"{what} {path}: {p} is {broken}; expected a folder, or a path where one can be made")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise KimiInputError(f"{what} {path}: expected a folder, but {existing} is "
                             f"{special_file(existing) or 'a file'}")
    _probe_writable(existing, f"{what} {path}")
    _check_apart(path, what, apart_from)


# -- generation flags, the same on CPU (`kimi-k2-neuron generate`) and trn2 (scripts/run_inference.py) -------------


def add_generation_args(p: argparse.ArgumentParser, max_new_tokens: int, top_k: int, prompts=None) -> None:
    """--prompt (repeatable), --no-chat, --system, --stop, --max-new-tokens and the sampling flags. `top_k` is the
    top-k used with --temperature > 0 when --top-k is not given. --prompt is required, unless `prompts` is given: a
    required mutually exclusive group that offers it beside another input flag."""
    (prompts or p).add_argument("--prompt", action="append", metavar="TEXT", required=prompts is None,
                   help="prompt text; repeat for several prompts, generated as one batch")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--no-chat", dest="chat", action="store_false",
                      help="send the prompt as is (default: wrapped in the checkpoint's chat template)")
    chat.add_argument("--chat", dest="chat", action="store_true",
                      help="the default; kept so older command lines still work")
    p.set_defaults(chat=True)
    p.add_argument("--system", metavar="TEXT", help="a system message before the prompt in the chat (default: none)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="repeatable: end a row once its text contains STR, and cut the text there; on top of the "
                        "end-of-turn tokens (default: none)")
    p.add_argument("--max-new-tokens", type=integer(1), default=max_new_tokens, metavar="N",
                   help="tokens to generate per prompt, at most")
    p.add_argument("--greedy", action="store_true",
                   help="always pick the most likely token (the default when --temperature is not given, unless "
                        "the checkpoint's generation_config.json sets do_sample)")
    p.add_argument("--temperature", type=number(0.0), default=None, metavar="T",
                   help="sample with this temperature; 0 is greedy (default: the checkpoint's generation_config.json "
                        "when it sets do_sample, as Kimi-K2.7-Code's does, else greedy)")
    p.add_argument("--top-k", type=integer(0), default=None, metavar="K",
                   help=f"with --temperature > 0: sample among the k most likely tokens; 0 = all (NxDI's on-device "
                        f"sampler: its compiled global top-k) (default: {top_k})")
    p.add_argument("--top-p", type=number(0.0, 1.0, lo_open=True), default=None, metavar="P",
                   help="with --temperature > 0: sample within this probability mass (default: 1, all)")
    p.add_argument("--seed", type=integer(0, SEED_MAX), default=0, metavar="S",
                   help="seeds the sampling random generator (only --temperature > 0 draws from it)")
    p.set_defaults(default_top_k=top_k)  # for sampling_values, so the backend's default is written once


def check_generation_args(a: argparse.Namespace) -> None:
    """Combinations argparse cannot refuse on its own; run right after parsing, before any loading."""
    sampling = [f for f, v in (("--temperature", a.temperature), ("--top-k", a.top_k), ("--top-p", a.top_p))
                if v is not None]
    if a.greedy and sampling:
        raise KimiInputError(f"{sampling[0]}: not allowed with --greedy (greedy decoding does not sample)")
    for flag, value in (("--top-k", a.top_k), ("--top-p", a.top_p)):
        if value is not None and not (a.temperature or 0) > 0:
            raise KimiInputError(f"{flag}: needs --temperature > 0 (once a sampling flag is given, the checkpoint's "
                                 f"generation_config.json sampling no longer applies, and without --temperature "
                                 f"decoding is greedy and ignores {flag})")
    if a.system is not None and not a.chat:
        raise KimiInputError("--system: not allowed with --no-chat (the system message goes into the chat template)")
    if "" in a.stop:
        raise KimiInputError("--stop '': expected a non-empty string (every text contains the empty one)")


def apply_sampling_defaults(a: argparse.Namespace, defaults: dict) -> None:
    """No sampling flag given: sample as the checkpoint's generation config asks (runtime.chat.generation_defaults),
    saying so on stderr; --greedy or any sampling flag keeps the flags' meaning."""
    if not defaults or a.greedy or any(v is not None for v in (a.temperature, a.top_k, a.top_p)):
        return
    a.temperature, a.top_k, a.top_p = defaults.get("temperature", 1.0), defaults.get("top_k"), defaults.get("top_p")
    if a.temperature > 0:
        shown = ", ".join(f"{k} {v}" for k, v in defaults.items())
        print(f"note: sampling as the checkpoint's generation_config.json asks ({shown}); --greedy for greedy "
              f"decoding", file=sys.stderr)


def sampling_values(a: argparse.Namespace) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) the flags ask for; temperature 0 means greedy (and no filters)."""
    if not (a.temperature or 0) > 0:
        return 0.0, 0, 1.0
    return a.temperature, a.default_top_k if a.top_k is None else a.top_k, 1.0 if a.top_p is None else a.top_p


# -- the run spec's flags: built from neuron/spec.py's FLAGS, each defined once, with the spec's own defaults --------


def add_spec_args(p, *names: str, where: dict[str, str] | None = None, **overrides: dict) -> None:
    """The run spec's flags on p (a parser or an argument group), in FLAGS' order: those `names` asks for (a flag, or
    a group: parallel, shape, experts, moe, layout, cache, sampler, draft; none: all). `where`: for a command with
    several backends, {backend (spec.CPU, ...): the flag that selects it}: only the flags one of them takes, each one's help
    naming the backends that take it where not all do (check_spec_flags refuses the rest). overrides: {dest:
    add_argument keywords to change}, where a flag means something else in a command."""
    from .neuron.spec import FLAGS

    for flag in FLAGS:
        if names and flag.name not in names and flag.group not in names:
            continue
        takers = [how for backend, how in (where or {}).items() if backend in flag.taken]
        if where and not takers:
            continue
        kw = _argparse_keywords(flag)
        if where and len(takers) < len(where):
            kw["help"] += f" ({' or '.join(takers)} only)"
        p.add_argument(flag.name, **{**kw, **overrides.get(flag.dest, {})})


def _argparse_keywords(flag) -> dict:
    help_ = flag.help
    if flag.default is None and flag.spec_default is not None and "default" not in help_:
        help_ += f" (default: {flag.spec_default})"  # not the parser's: not given differs from given as that
    if flag.kind == "switch":
        return dict(action="store_true", help=help_)
    kw = dict(default=flag.default, help=help_, metavar=flag.metavar)
    if flag.kind == "count":
        kw["type"] = integer(flag.least)
    elif flag.kind == "choice":
        kw["choices"] = list(flag.choices)
    elif flag.kind == "path":
        kw["type"] = path
    return kw


def check_spec_flags(a: argparse.Namespace, backend: str, where: dict[str, str], why: str = "",
                     strict: bool = False) -> None:
    """Refuses, in one line, a run-spec flag given that `backend` does not take (spec.Flag.taken), naming the backends
    that do (`where`, as add_spec_args) and why not this one (`why`, else the flag's why_not). strict: any value but
    the parser's default counts as given (a compiled folder's own settings are unknown here); else a value that asks
    for nothing the backend lacks (the spec's default, --kv-shard none) passes."""
    from .neuron.spec import FLAGS

    for flag in FLAGS:
        takers = " or ".join(how for b, how in where.items() if b in flag.taken)
        if not takers:  # not a flag add_spec_args gave this command (it may have one of that name of its own)
            continue
        value = getattr(a, flag.dest, flag.default)
        neutral = (flag.default,) if strict else (flag.default, flag.spec_default, *flag.neutral)
        if backend in flag.taken or value in neutral:
            continue
        shown = flag.name if flag.kind == "switch" else f"{flag.name} {value}"
        raise KimiInputError(f"{shown}: only with {takers} ({why or flag.why_not})")


def kv_group_of(a: argparse.Namespace, one_rank: bool = False) -> int:
    """The KV group size the long-context flags ask for: 1 with --kv-shard none (every rank holds the whole cache),
    else --kv-group, or every rank (--tp). Whether it divides --tp is placement.check_kv_group's rule. one_rank: a
    group of 1 is what is asked for (trace-cpu traces one rank of the sharded graph), not a mistake."""
    if getattr(a, "kv_shard", "none") != "sequence":
        if getattr(a, "kv_group", None) is not None:
            raise KimiInputError(f"--kv-group {a.kv_group}: only with --kv-shard sequence (a replicated cache has no "
                                 f"KV group)")
        return 1
    group = a.tp if a.kv_group is None else a.kv_group
    if group == 1 and not one_rank:
        raise KimiInputError("--kv-shard sequence: a KV group of 1 rank holds the whole cache; give --tp (and "
                             "--kv-group) of 2 or more, or --kv-shard none")
    return group


def fail(e: Exception, exit_code: int = 2) -> int:
    """Print an error on one line and give the exit code (2: bad input). A missing config.json in a folder an
    interrupted conversion left says so, with the command that resumes it."""
    message = str(e)
    if isinstance(e, MissingConfig) and e.folder is not None:
        from .convert.resume import unfinished_conversion

        message = unfinished_conversion(e.folder) or message
    print(f"error: {message}", file=sys.stderr)
    return exit_code
