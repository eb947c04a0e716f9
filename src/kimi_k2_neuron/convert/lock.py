"""One conversion at a time into a DST: a run holds an exclusive lock on DST/.conversion.lock (flock, which the kernel
releases when the process ends however it ends, so no lock outlives its run), and a second run is refused with one
line naming the first (pid, host, start). Two runs into one folder would otherwise rename, hash and delete each
other's files, and could leave a config.json (looks finished) beside a manifest saying incomplete."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import KimiInputError

LOCK_NAME = ".conversion.lock"


@contextmanager
def dst_lock(dst: Path):
    """Held while a conversion reads and writes `dst` (made here if absent; removed again if the run leaves it empty).
    The lock file goes when the run ends."""
    made = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    path = dst / LOCK_NAME
    fd = _acquire(path, dst)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a run that opens it after this makes a new file
        os.close(fd)
        if made:
            try:
                dst.rmdir()  # only if nothing was written: a refusal leaves no trace
            except OSError:
                pass


def _acquire(path: Path, dst: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise KimiInputError(f"DST {dst}: another conversion is writing it ({_holder(path)}); wait for it to "
                                 f"finish (a second run would then find it done) or stop it") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # locked a file the previous holder had just removed: take the new one


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text())
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid and host not written yet"
