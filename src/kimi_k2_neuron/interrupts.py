"""How a run ends when it is cut short, and what it leaves: Ctrl-C, SIGTERM and SIGHUP end a command with one line and
exit code 130 / 143 / 129 (run_command; SIGHUP not under nohup); output files and folders appear under their name only
when complete (atomic_output, write_atomically, save_safetensors: temp file, fsync, rename, with the mode a plain write
gets; atomic_folder: a hidden folder, renamed), and a write that fails (a full disk) is one line naming the file,
stdout's too (a full disk, an encoding that lacks a character: replaced). (A conversion that did not finish is the
converter's to recognise: convert/resume.py.)

Stdlib only at import: every command and script installs its signal handling before importing torch.
"""

from __future__ import annotations

import errno
import io
import os
import select
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import KimiInputError, special_file

# SIGHUP (the terminal that started the command closed) stops a command as SIGTERM does: one line (if stderr is still
# there), exit 129, the same clean-up; unless the command was started ignoring it (nohup), which it keeps.
STOPPING = (signal.SIGINT, signal.SIGTERM) + (() if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else
                                              (signal.SIGHUP,))
# One stop can arrive twice within milliseconds (timeout(1) signals its child, then the child's process group): a
# second signal inside this window is the same stop, not a request to skip the clean-up.
REPEAT_WINDOW_S = 1.0
_first_signal_at: float | None = None
PARTIAL_SUFFIX = ".partial"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# what a writer killed by SIGPIPE exits with; a command whose stdout's reader left (`plan | head -1`) ends with it
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so that clean-up (finally blocks, context managers) runs; str()
    is one line, `exit_code` 128 + the signal number. A command may add a `hint` (what was kept, how to resume)."""

    def __init__(self, signum: int, hint: str = ""):
        super().__init__(signum)
        self.signum, self.hint = signum, hint
        self.exit_code = 128 + signum

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}" + (f"; {self.hint}" if self.hint else "")


def run_command(main, argv=None) -> int:
    """main(argv) with SIGINT, SIGTERM and SIGHUP (STOPPING) raising Interrupted; an interrupt ends with one `error:
    interrupted by SIG...` line on stderr and exit code 130 / 143 / 129, no traceback. A second signal while the first
    one's clean-up runs ends the process at once (still one line). argv None means the process's own command line: the
    handlers then stay until the process is gone (a signal after main returned ends it at once, with main's exit code's
    output already flushed); otherwise (tests calling main in-process) the previous handlers come back. A reader of
    stdout that leaves early (`| head`) ends it quietly: exit code 141 if main was still writing, else main's.
    For the process's own command line, stdout is guarded (guard_stdout): text its encoding cannot write is
    replaced, and a write that fails (`> /dev/full`, a full disk) ends with one `error: stdout: ...` line and
    exit code 2, as a failed --out does."""
    handlers = _install() if threading.current_thread() is threading.main_thread() else None
    if argv is None:
        guard_stdout()
    try:
        code = main(argv)
        if argv is None:
            _flush(sys.stdout)  # main's last output: its failure is main's (a StdoutError), not the interpreter's
        return code
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):  # another pipe (a rank's, a child's): not ours to hush
            raise
        _silence(sys.stdout)
        return BROKEN_PIPE_EXIT
    except StdoutError as e:
        _silence(sys.stdout)  # what it still buffers would fail again at the interpreter's exit
        print(f"error: stdout: cannot write ({write_error(e)})", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:  # Interrupted, or the default SIGINT handler's before ours was installed
        e = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        if handlers is not None:
            if argv is None:
                for stream in (sys.stdout, sys.stderr):
                    _flush(stream)
                # After a stop, the rest is the interpreter's exit: a repeat of the stop must not kill it with the
                # default action (Python restores SIG_DFL while finalizing, but leaves SIG_IGN alone).
                after = signal.SIG_IGN if _first_signal_at is not None else _exit_now
                for s in STOPPING:
                    signal.signal(s, after)
            else:
                for s, h in handlers.items():
                    signal.signal(s, h)


def _install() -> dict:
    return {s: signal.signal(s, _raise_interrupted) for s in STOPPING}


def _raise_interrupted(signum, frame):
    global _first_signal_at
    _first_signal_at = time.monotonic()
    for s in STOPPING:  # the clean-up this exception runs may take a moment: a second signal stops it short
        signal.signal(s, _exit_now)
    raise Interrupted(signum)


def _exit_now(signum, frame):
    if _first_signal_at is not None and time.monotonic() - _first_signal_at < REPEAT_WINDOW_S:
        return
    again = " again; stopped without cleaning up" if _first_signal_at is not None else ""
    os.write(2, f"error: interrupted by {signal.Signals(signum).name}{again}\n".encode())
    os._exit(128 + signum)


def _flush(stream) -> None:
    try:
        stream.flush()
    except BrokenPipeError:
        _silence(stream)
    except StdoutError:
        raise
    except (OSError, ValueError, AttributeError):
        pass


class StdoutError(Exception):
    """A write to the guarded stdout failed (a full disk, /dev/full, a descriptor not open for writing): run_command
    ends with one line. A broken pipe stays a BrokenPipeError (its reader left: quiet). Not an OSError, which
    argparse's help printing swallows (a long --help into /dev/full would exit 0)."""

    def __init__(self, errno: int | None, strerror: str | None):
        super().__init__(errno, strerror)
        self.errno, self.strerror = errno, strerror


class _StdoutFile(io.FileIO):
    def write(self, b):
        try:
            return super().write(b)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None


def stdout_over(fd: int, like) -> io.TextIOWrapper:
    """A text stream writing to descriptor `fd` (not closed with it) as `like` does (encoding, line buffering), whose
    failed writes raise StdoutError and which replaces what its encoding cannot write (PYTHONIOENCODING=ascii and a
    non-ASCII reply: '?', not a UnicodeEncodeError) unless `like` names another non-strict handler."""
    errors = getattr(like, "errors", None)
    return io.TextIOWrapper(io.BufferedWriter(_StdoutFile(fd, "w", closefd=False)),
                            encoding=getattr(like, "encoding", None),
                            errors="replace" if errors in (None, "strict") else errors,
                            line_buffering=getattr(like, "line_buffering", False))


def guard_stdout() -> None:
    """sys.stdout, the process's own, rebuilt by stdout_over on its descriptor (nothing to do without one)."""
    stream = sys.stdout
    if stream is None or stream is not sys.__stdout__:
        return
    try:
        fd = stream.fileno()
        stream.flush()
    except (OSError, ValueError, AttributeError):
        return
    sys.stdout = stdout_over(fd, stream)


def _reader_gone(stream) -> bool:
    """Whether `stream` is a pipe whose reading end is closed (poll reports POLLERR on its writing end)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence(stream) -> None:
    """Point a stream whose reader has gone at /dev/null, so the interpreter's last flush of what it still buffers
    does not print an `Exception ignored ... BrokenPipeError` and exit 120 (Python's signal docs, "Note on
    SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


# -- output files: complete under their name, or absent ------------------------------------------------------------


def partial_path(final: Path) -> Path:
    """Where a file is written before it is renamed to `final`: hidden, beside it, marked partial."""
    return final.with_name(f".{final.name}{PARTIAL_SUFFIX}")


@contextmanager
def atomic_output(path: str | Path):
    """Yields a temporary path beside `path` to write to; once the block ends without an error the file is fsynced
    and renamed to `path` (an existing file is replaced), else removed. An interrupted run therefore leaves either
    the old file or none, never a file that looks complete and is not. A device node, FIFO or socket at `path` is
    refused (one line), never replaced: the entry points refuse it before any work (arguments.check_out_file)."""
    path = Path(path)
    node = special_file(path)
    if node:
        raise KimiInputError(f"{path}: is {node}; expected a regular file path (writing would replace the "
                             f"{node.split()[-1]})")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{PARTIAL_SUFFIX}")
    open(tmp, "wb").close()  # the umask's mode, as a plain write of `path` would have (mkstemp's 0600 would stay)
    mode = tmp.stat().st_mode & 0o777
    try:
        yield tmp
        os.chmod(tmp, mode)  # a writer that replaced the file (safetensors' save_file makes it 0600) gets it back
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_folder(dest: str | Path):
    """Yields a new hidden folder beside `dest` to fill; once the block ends without an error it takes `dest`'s
    name (an earlier `dest` is removed, or put back if the rename fails), else it is removed. An interrupted run
    therefore leaves the earlier folder or none, never one that looks complete and is not. Anything else at `dest`
    (a file, a device node, a FIFO) is refused, never replaced."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise KimiInputError(f"{dest}: is {special_file(dest) or 'a file'}; expected a folder, or a path where one "
                             f"can be made")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    old = tmp.with_name(tmp.name + ".old")
    for stale in (tmp, old):  # left by a killed process of the same id
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()  # the umask's mode, as a plain mkdir of `dest` would have (mkdtemp's 0700 would stay)
    try:
        yield tmp
        if dest.exists():
            os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            if old.exists() and not dest.exists():
                os.replace(old, dest)
            raise
        fsync_path(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_atomically(path: str | Path, data: bytes | str) -> None:
    """Replace `path` with `data` atomically (temp file, fsync, rename); a write error is one line naming the file."""
    try:
        with atomic_output(path) as tmp, open(tmp, "wb") as f:
            view = memoryview(data.encode() if isinstance(data, str) else data)
            while view:
                view = view[f.write(view):]
    except OSError as e:
        raise KimiInputError(f"{path}: cannot write ({write_error(e)})") from None


def save_safetensors(tensors: dict, path: str | Path, what: str = "", metadata: dict | None = None,
                     shown: str | Path | None = None) -> None:
    """safetensors' save_file through atomic_output (complete or absent, the umask's mode); a full disk or another
    write error is one line naming `what` (a flag) and the file (or `shown`, the output a hidden file is part of).
    safetensors reports its own I/O errors as a SafetensorError ending in "(os error N)", not an OSError."""
    import re

    from safetensors.torch import save_file

    name = str(shown) if shown is not None else f"{what} {path}" if what else str(path)
    try:
        with atomic_output(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    except OSError as e:
        raise KimiInputError(f"{name}: cannot write ({write_error(e)})") from None
    except Exception as e:
        code = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
        if code is None:
            raise
        errno_ = int(code[1])
        raise KimiInputError(f"{name}: cannot write ({write_error(OSError(errno_, os.strerror(errno_)))})") from None


def write_error(e: OSError) -> str:
    """What went wrong in a write, in a few words ("disk full" for ENOSPC and EDQUOT)."""
    return "disk full" if is_disk_full(e) else (e.strerror or str(e))


def is_disk_full(e: OSError) -> bool:
    return e.errno in _DISK_FULL


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (after a rename in it, so that the rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
