"""Start-up shared by the trn2 scripts (scripts/compile_and_save.py, run_inference.py, bench_tpot.py) and the trn2
test fixtures: argument parsing, logging and the FP8 environment.

It imports nothing of the Neuron SDK (kimi_k2_neuron.neuron checks for the SDK on import), so every script parses
its arguments, and answers --help, on any machine before it reaches for the SDK.
"""

from __future__ import annotations

import argparse
import logging
import os

from .arguments import Parser, fail

# The e4m3 reinterpretation NxDI asks for with FP8 weights (inference_demo.py:465-467); read when torch-xla is
# imported, so it must be set before. NxDI adds the matching compiler flag itself (model_wrapper.py:148-157).
FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the script docstring's first line and whose epilog is the rest; its argument
    errors are one line and its help shows the defaults, as the kimi-k2-neuron command's."""
    lines = doc.splitlines()
    return Parser(description=lines[0], epilog="\n".join(lines[2:]))


def add_compiled_args(p: argparse.ArgumentParser) -> None:
    """--compiled / --model, for the scripts that load what compile_and_save.py wrote."""
    p.add_argument("--compiled", required=True, help="folder written by scripts/compile_and_save.py")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the one it was compiled from)")


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="log what is being done (INFO level)")


def start(args: argparse.Namespace) -> None:
    """Logging as --verbose asks, and the FP8 environment (before anything imports torch-xla)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    set_fp8_env()


def set_fp8_env() -> None:
    os.environ.update(FP8_ENV)


def sdk_missing(e: ImportError) -> int:
    """Report a missing Neuron SDK (kimi_k2_neuron.neuron's message names the packages) and give the exit code."""
    return fail(e)


__all__ = ["FP8_ENV", "add_compiled_args", "add_verbose", "script_parser", "sdk_missing", "set_fp8_env", "start"]
