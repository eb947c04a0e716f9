"""run_ranks(target, nprocs, args): `target(rank, *args)` in `nprocs` spawned processes with the torch.distributed
environment set, and no rank left behind. A failing rank stops the others and raises KimiInputError with its message
(so the CLI prints one `error:` line) or RankFailed; a rank that dies while exiting, after its target returned, is a
note on stderr, not a failure. SIGTERM/SIGINT/SIGHUP stop every rank and raise RanksInterrupted; if the parent dies
anyhow, Linux sends each rank SIGTERM (PR_SET_PDEATHSIG). `target` and `args` must be picklable. No torch
import: a rank pays only for what its target imports."""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
import threading
import traceback
from contextlib import contextmanager
from multiprocessing.connection import wait

from ..errors import KimiInputError
from ..interrupts import STOPPING

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_GRACE_SECONDS = 5  # how long a terminated rank may take before it is killed


class RanksError(RuntimeError):
    """A run of ranks that did not finish; str() is one line, `exit_code` what a command should exit with."""

    exit_code = 1


class RankFailed(RanksError):
    """A rank raised an unexpected exception or died."""


class RanksInterrupted(RanksError):
    """The parent got SIGTERM, SIGINT or SIGHUP; every rank was terminated."""

    def __init__(self, signum: int):
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}; terminated every rank")
        self.exit_code = 128 + signum


def run_ranks(target, nprocs: int, args: tuple = ()) -> None:
    """Run target(rank, *args) in `nprocs` spawned processes; see the module docstring for the guarantees."""
    if nprocs < 1:
        raise KimiInputError(f"nprocs {nprocs}: expected at least 1 rank")
    ctx = multiprocessing.get_context("spawn")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nprocs)}
    procs, reports = [], []
    # A signal inside start() would leave a rank that _stop() cannot see. Blocking it (_deferred) holds it back only
    # from this thread: another thread (torch's, pytest's) may take it, and Python then runs the handler in this
    # thread at its next bytecode, inside start() too. So the handler only notes a signal while a rank starts.
    starting, pending = [False], []

    def on_signal(signum, frame):
        if starting[0]:
            pending.append(signum)
            return
        raise RanksInterrupted(signum)

    try:
        with _signals(on_signal):
            for rank in range(nprocs):
                read, write = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_rank_main, args=(target, rank, env, os.getpid(), write, args),
                                name=f"rank-{rank}")
                with _deferred(_STOPPING), _rank_environment():
                    starting[0] = True
                    try:
                        p.start()
                        procs.append(p)
                    finally:
                        starting[0] = False
                if pending:
                    raise RanksInterrupted(pending[0])
                reports.append(read)
                write.close()  # only the rank keeps a write end
            _supervise(procs, reports)
    finally:
        with _signals(signal.SIG_IGN):  # a second Ctrl-C must not cut the clean-up short (it ends within seconds)
            _stop(procs)


@contextmanager
def _rank_environment():
    """What a rank must have in its environment from its start (torch reads it when the rank unpickles its target):
    c10's log level ERROR unless set. When the ranks are stopped, one still blocked in a store or gloo call (where its
    Python handler cannot run) sees its peer gone and logs a C++ warning with a stack dump; errors still print."""
    before = os.environ.get(_LOG_LEVEL)
    os.environ[_LOG_LEVEL] = before or "ERROR"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_LOG_LEVEL]


_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the MASTER_PORT of a fresh process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STOPPING = STOPPING  # SIGINT, SIGTERM and (unless ignored: nohup) SIGHUP


@contextmanager
def _deferred(signums):
    """Hold `signums` back inside the block; one that arrived meanwhile is delivered (its handler runs) after it.
    A rank inherits the mask and lifts it first thing (_rank_main)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def _signals(handler):
    """The stopping signals go to `handler` inside the block, from the main thread only, where handlers can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in _STOPPING}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _supervise(procs, reports) -> None:
    running = dict(zip((p.sentinel for p in procs), range(len(procs))))
    while running:
        for sentinel in wait(list(running)):
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode == 0:
                continue
            kind, message = _report(reports[rank])
            how = _how(procs[rank].exitcode)
            if kind == "done":
                # Its target returned (rank 0 had written its result): the crash is in the interpreter's or a
                # library's teardown (torch_xla's atexit hook, a process group never destroyed), not in the work.
                print(f"note: rank {rank} finished its work, then died from {how} while exiting", file=sys.stderr,
                      flush=True)
                continue
            if kind == "input":
                raise KimiInputError(message)
            raise RankFailed(f"rank {rank}: {message or f'died from {how} without reporting an error'}")


def _report(report) -> tuple[str, str | None]:
    """What the rank said last: ("done" | "input" | "error", message), or ("died", None) if it said nothing."""
    try:
        return report.recv() if report.poll() else ("died", None)
    except EOFError:  # poll() is also true at end of file: the rank closed its end without a word
        return "died", None


def _how(exitcode: int) -> str:
    return f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(_GRACE_SECONDS)
        if p.is_alive():
            p.kill()
            p.join()


# -- in the rank process ------------------------------------------------------------------------------------------


def _rank_main(target, rank: int, env: dict, parent_pid: int, report, args: tuple) -> None:
    # SIGTERM (from the parent, or PDEATHSIG) exits through the interpreter's shutdown, which releases what the rank
    # holds; killed outright, it would leave e.g. tqdm's multiprocessing lock for the resource tracker to warn about.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for s in _STOPPING:  # Ctrl-C and a hangup reach the whole group; the parent stops the ranks
        if s != signal.SIGTERM:
            signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)  # blocked while the parent started this rank (_deferred)
    _die_with_parent(parent_pid)
    faulthandler.enable()  # a crash in native code (SIGABRT, SIGSEGV) prints the Python stack of every thread
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        target(rank, *args)
        report.send(("done", None))  # a death after this is in the interpreter's or a library's teardown
    except SystemExit:
        raise
    except KimiInputError as e:
        _report_and_exit(report, "input", str(e))
    except BaseException as e:
        traceback.print_exc()
        _report_and_exit(report, "error", f"{type(e).__name__}: {_first_line(e)}")


def _report_and_exit(report, kind: str, message: str) -> None:
    report.send((kind, message))
    report.close()
    sys.exit(1)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "(no message)"


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent dies; exit now if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # no usable libc prctl: run without the safety net
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
