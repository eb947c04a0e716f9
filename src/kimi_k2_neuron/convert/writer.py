"""A safetensors file written strictly front to back by a thread of its own, hashed as it is written, published by
an atomic rename.

The header is known before any data, so fused expert tensors stream one slab at a time and never exist whole; the
bytes written are the bytes hashed, nothing is read back. Bulk slabs go out with O_DIRECT from page-aligned buffers
(a tenth of the CPU of a buffered write here), up to two at once on the file's I/O threads while the file's thread
hashes them (hashing after each write had made that thread the conversion's bottleneck: 3.9 s writing + 1.8 s
hashing of a 5.1 s conversion); the rest through the page cache, with writeback started early.
BLAKE3: ~5 GB/s per core here against ~1.3 for sha256; older manifests' sha256 is still verified.

KIMI_K2_NEURON_CONVERT_DIE_AFTER_BYTES=N: os._exit(75) after N bytes of tensor data, like a SIGKILL there (tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import blake3
import torch

from ..checkpoint.direct import PAGE, aligned_empty, is_aligned, open_direct_file, pwrite_fully
from ..checkpoint.shards import SAFETENSORS_DTYPES
from ..errors import KimiInputError
from ..interrupts import fsync_path, is_disk_full, partial_path, write_error

DIE_ENV = "KIMI_K2_NEURON_CONVERT_DIE_AFTER_BYTES"
HASH = "blake3"  # what new manifest records hold
HASHES = ("blake3", "sha256")  # what a manifest record may hold (sha256: manifest_version 1)
_ST_DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_QUEUED = 4  # slabs queued per file (a Kimi gate_up slab is 29 MB): enough to ride out a slow write
_IN_FLIGHT = 2  # O_DIRECT slab writes outstanding per file; each slab is hashed while it is written
_COMMIT, _ABORT = object(), object()
_FADVISE = hasattr(os, "posix_fadvise")
_WRITEBACK_STEP = 64 << 20  # file bytes between writeback kicks (without O_DIRECT)
_STAGE = 8 << 20  # bytes gathered from unaligned pieces per O_DIRECT write
_written_in_process = 0
_die_lock = threading.Lock()


def header_bytes(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(header padded with spaces so data starts on a page boundary, for O_DIRECT; each tensor's [begin, end))."""
    head: dict = {"__metadata__": {"format": "pt"}}
    spans, pos = {}, 0
    for name, dtype, shape in entries:
        n = dtype.itemsize
        for d in shape:
            n *= d
        spans[name] = (pos, pos + n)
        head[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % PAGE)
    return len(raw).to_bytes(8, "little") + raw, spans


def _write_bytes(f, buf, offset: int | None = None) -> None:
    """The one place data reaches a file (tests monkeypatch it to simulate a full disk); `f` is unbuffered, and
    written at `offset` when given (the shard files, whose page-aligned slabs go through an O_DIRECT descriptor)."""
    if offset is not None:
        pwrite_fully(f.fileno(), buf, offset)
        return
    view = memoryview(buf).cast("B")
    while view:
        view = view[f.write(view):]


def _maybe_die(n: int) -> None:
    global _written_in_process
    limit = os.environ.get(DIE_ENV)
    if limit is None:
        return
    with _die_lock:  # two files' threads may write at once
        _written_in_process += n
        if _written_in_process >= int(limit):
            os._exit(75)


def new_hash(algo: str = HASH):
    """A fresh hasher; BLAKE3 single-threaded: the conversion's workers already own the cores."""
    return blake3.blake3() if algo == "blake3" else hashlib.sha256()


def file_digest(path: Path, algo: str) -> str:
    """Hex digest of a whole file (for --verify, where nothing else runs: BLAKE3 may take every core)."""
    if algo == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()
    h = new_hash(algo)
    with open(path, "rb", buffering=0) as f:
        while buf := f.read(16 << 20):
            h.update(buf)
    return h.hexdigest()


class ShardWriter:
    """Bytes must arrive in file order (several `add`s per tensor allowed); the thread's errors surface at the next
    `add` or at `result()`."""

    def __init__(self, final: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.final, self.tmp = Path(final), partial_path(Path(final))
        header, self.spans = header_bytes(entries)
        self.order = [name for name, _, _ in entries]
        self.size = len(header) + (max(e for _, e in self.spans.values()) if self.spans else 0)
        self._cur, self._pos = 0, 0  # index into order, data bytes queued so far
        self._written = self._flushed = 0  # file bytes taken / handed to writeback (the file's thread)
        self._f = self._direct = None
        self._stage: torch.Tensor | None = None  # pages gathered from unaligned pieces, for the O_DIRECT descriptor
        self._staged = self._stage_at = 0
        self._queue: queue.Queue = queue.Queue(_QUEUED)
        self._error: Exception | None = None
        self._digest: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"write {self.final.name}", daemon=True)
        try:  # a Ctrl-C in here must not leave the partial file behind
            self._f = open(self.tmp, "wb", buffering=0)
            self._direct = open_direct_file(self.tmp, "r+b")  # same file, whole pages from page-aligned memory
            self._thread.start()
            self._queue.put((memoryview(header), False, None, False))  # a whole number of pages, staged
        except BaseException:
            self.abort()
            raise

    def add(self, name: str, data: torch.Tensor, release=None) -> None:
        """Queue `data` (a tensor whose bytes continue tensor `name`); it must not be modified afterwards, until
        the file's thread calls release() (when given), once the bytes are written and hashed."""
        aligned = data.is_contiguous() and is_aligned(data)
        b = data.contiguous().view(torch.uint8).reshape(-1).numpy()
        while self._cur < len(self.order) and self._pos >= self.spans[self.order[self._cur]][1]:
            self._cur += 1
        if self._cur >= len(self.order) or self.order[self._cur] != name:
            expected = self.order[self._cur] if self._cur < len(self.order) else "<end of file>"
            raise RuntimeError(f"{self.final.name}: got bytes of {name} while writing {expected}")
        if self._pos + b.nbytes > self.spans[name][1]:
            raise RuntimeError(f"{self.final.name}: {name} overflows its {self.spans[name]} span")
        self._raise_if_failed()
        self._queue.put((memoryview(b), aligned, release, True))
        self._pos += b.nbytes

    def commit(self) -> "ShardWriter":
        """Queue the end of the file: fsync and rename into place happen in the file's thread; `result()` waits."""
        end = max((e for _, e in self.spans.values()), default=0)
        if self._pos != end:
            raise RuntimeError(f"{self.final.name}: wrote {self._pos} of {end} data bytes")
        self._raise_if_failed()
        self._queue.put(_COMMIT)
        return self

    def result(self) -> tuple[str, int]:
        """(hex hash, size) once the file is in place under its final name."""
        self._thread.join()
        self._raise_if_failed()
        return self._digest, self.size

    def abort(self) -> None:
        """Stop the thread and remove the partial file (also after an error; a committed file is kept)."""
        if self._thread.is_alive():
            self._queue.put(_ABORT)
            self._thread.join()
        self._close()
        if self._digest is None:
            self.tmp.unlink(missing_ok=True)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the file's thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        h = new_hash()
        inflight: deque = deque()  # (write future or None, n, release, counted), oldest first
        with ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix=f"write {self.final.name}") as io:
            try:
                while True:
                    item = self._queue.get()
                    if item is _ABORT:
                        return
                    if self._error is not None:  # keep taking items so that a producer blocked in put() wakes up
                        if item is _COMMIT:
                            return
                        continue
                    try:
                        if item is _COMMIT:
                            while inflight:
                                self._finish(inflight.popleft())
                            self._publish()
                            self._digest = h.hexdigest()
                            return
                        buf, aligned, release, counted = item
                        item = None
                        fut = self._write(buf, aligned, io)
                        h.update(buf)  # while the write runs
                        inflight.append((fut, len(buf), release, counted))
                        del buf  # the future holds the slab until it is written; then its owner may reuse it
                        while len(inflight) >= _IN_FLIGHT:
                            self._finish(inflight.popleft())
                        self._start_writeback()
                    except Exception as e:  # noqa: BLE001 -- re-raised in the caller's thread
                        self._error = e
                        wait([f for f, *_ in inflight if f is not None])  # nothing may write after the close
                        inflight.clear()
                        self._close()
                        self.tmp.unlink(missing_ok=True)
                        if item is _COMMIT:  # the last item: result() waits for this thread (it hung here)
                            return
            finally:
                wait([f for f, *_ in inflight if f is not None])

    @staticmethod
    def _finish(done: tuple) -> None:
        """Wait for one slab's write (raising its error), then hand the slab back."""
        fut, n, release, counted = done
        if fut is not None:
            fut.result()
        if release is not None:
            release()
        if counted:
            _maybe_die(n)

    def _write(self, buf, aligned: bool, io: ThreadPoolExecutor):
        """With O_DIRECT: straight from buf when page-aligned whole pages at a page boundary (on an `io` thread: the
        future is returned), else via the stage (here, like every write without O_DIRECT: None is returned)."""
        at, fut = self._written, None
        self._written += len(buf)
        try:
            if self._direct is None:
                _write_bytes(self._f, buf, at)
            elif aligned and self._staged % PAGE == 0:
                self._flush_stage()
                fut = io.submit(self._write_direct, buf, at)
            else:
                self._to_stage(memoryview(buf).cast("B"), at)
        except OSError as e:
            raise self._write_error(e) from None
        return fut

    def _write_direct(self, buf, at: int) -> None:
        try:
            _write_bytes(self._direct, buf, at)
        except OSError as e:
            raise self._write_error(e) from None

    def _to_stage(self, view: memoryview, at: int) -> None:
        """at: the file offset of view's first byte."""
        if self._stage is None:
            self._stage = aligned_empty(_STAGE)
        stage = self._stage.numpy()
        while view:
            if not self._staged:
                self._stage_at = at
            k = min(len(view), _STAGE - self._staged)
            stage[self._staged: self._staged + k] = view[:k]
            self._staged += k
            view, at = view[k:], at + k
            if self._staged == _STAGE:
                self._flush_stage()

    def _flush_stage(self, last: bool = False) -> None:
        """Whole pages with O_DIRECT; at the end, the last partial page through the page cache."""
        if not self._staged:
            return
        at = self._stage_at
        if at % PAGE:
            raise RuntimeError(f"{self.tmp.name}: stage at offset {at}, not on a page boundary")
        whole = self._staged - self._staged % PAGE
        stage = self._stage.numpy()
        if whole:
            _write_bytes(self._direct, stage[:whole], at)
        if self._staged > whole:
            if not last:
                raise RuntimeError("a partial page can only end the file")
            _write_bytes(self._f, stage[whole: self._staged], at + whole)
        self._staged = 0

    def _write_error(self, e: OSError) -> KimiInputError:
        if is_disk_full(e):
            return KimiInputError(f"{self.final.parent}: disk full while writing {self.final.name} "
                                  f"({os.strerror(e.errno)}); free space and rerun to resume")
        return KimiInputError(f"{self.tmp}: cannot write ({e.strerror or e})")

    def _start_writeback(self) -> None:
        """Start writeback now and drop written pages, so a 1 TB conversion does not evict the source's read-ahead
        (POSIX_FADV_DONTNEED is advice: errors are ignored)."""
        if self._direct is None and _FADVISE and self._written - self._flushed >= _WRITEBACK_STEP:
            try:
                os.posix_fadvise(self._f.fileno(), 0, self._written, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            self._flushed = self._written

    def _publish(self) -> None:
        try:
            if self._direct is not None:
                self._flush_stage(last=True)
            os.fsync(self._f.fileno())  # the file's, whichever descriptor wrote: O_DIRECT data too
            self._close()
            os.replace(self.tmp, self.final)
            fsync_path(self.final.parent)
        except OSError as e:
            if is_disk_full(e):
                raise self._write_error(e) from None
            raise KimiInputError(f"{self.final}: cannot finish writing ({write_error(e)})") from None

    def _close(self) -> None:
        for f in (self._f, self._direct):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

