"""Lazy, validated access to tensors spread over safetensors shards.

A Kimi-K2 checkpoint is ~1 TB in 62 shards, so opening it must never touch tensor data: we parse every shard's
header ourselves (8-byte little-endian length, then JSON) and check it against the file size and the index.
That catches truncated downloads, missing shards and stale indexes at open time, with a one-line message,
instead of as a crash deep inside a load an hour later. Tensor data is read one tensor at a time through
``safetensors.safe_open``, which memory-maps the shard.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kimi_k2_neuron.errors import KimiInputError

from .direct import open_direct, pread_into

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# The safetensors reference implementation refuses headers above 100 MB; a bigger length means garbage.
_MAX_HEADER_BYTES = 100_000_000

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, taken from its shard's header."""

    name: str
    shard: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    # Where its bytes start in the shard file (None: a tensor computed on demand); part of where, not of what.
    offset: int | None = field(default=None, compare=False)


def _json_error(e: json.JSONDecodeError) -> str:
    # str(e) can embed the document; msg/line/column is always one line.
    return f"{e.msg} at line {e.lineno} column {e.colno}"


def _read_index(index_path: Path) -> dict[str, str]:
    """Return the index's weight_map (tensor name -> shard file name), checking its shape."""
    fname = index_path.name
    try:
        doc = json.loads(index_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise KimiInputError(f"{fname} is not valid JSON: {_json_error(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KimiInputError(f"{fname} cannot be read as UTF-8 text: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise KimiInputError(
            f"{fname}: expected a JSON object with a 'weight_map' object of tensor name -> shard file"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise KimiInputError(
                f"{fname}: weight_map entry for {name} must be a shard file name string, got {shard!r}"
            )
        # Shards must sit next to the index; a path would let the index point anywhere on disk.
        if Path(shard).name != shard:
            raise KimiInputError(f"{fname}: weight_map entry for {name} is {shard!r}, expected a bare file name")
    return weight_map


def _read_header_json(path: Path) -> tuple[dict, int, int]:
    """Return (header dict, header length, file size), reading only the header bytes."""
    fname = path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(9)
        if len(prefix) < 9:
            raise KimiInputError(f"{fname} is truncated: a safetensors file needs at least 9 bytes, file has {size}")
        (header_len,) = struct.unpack("<Q", prefix[:8])
        # Every safetensors header is a JSON object, so a first byte other than '{' means the length is garbage too.
        if prefix[8:9] != b"{" or header_len < 2 or header_len > _MAX_HEADER_BYTES:
            raise KimiInputError(
                f"{fname} has a corrupt header: expected an 8-byte little-endian length (2..{_MAX_HEADER_BYTES}) "
                f"then a JSON object, got length {header_len}"
            )
        if 8 + header_len > size:
            raise KimiInputError(f"{fname} is truncated inside its header: the header is {8 + header_len} bytes, "
                                  f"the file has {size} (an interrupted download?)")
        raw = prefix[8:] + f.read(header_len - 1)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = _json_error(e) if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise KimiInputError(f"{fname} has a corrupt header: expected a JSON object ({why})") from None
    if not isinstance(header, dict):
        raise KimiInputError(f"{fname} has a corrupt header: expected a JSON object, got {type(header).__name__}")
    return header, header_len, size


def _is_int_list(value: object, length: int | None = None) -> bool:
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    return ok and (length is None or len(value) == length)


def _parse_entry(fname: str, name: str, entry: object) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """Validate one header entry; return (dtype, shape, begin, end) with offsets relative to the data section."""
    if not isinstance(entry, dict):
        raise KimiInputError(f"{fname} has a corrupt header: entry for tensor {name} is not a JSON object")
    dtype_str = entry.get("dtype")
    if dtype_str not in SAFETENSORS_DTYPES:
        raise KimiInputError(
            f"{fname}: tensor {name} has unknown dtype {dtype_str!r}, expected one of {', '.join(SAFETENSORS_DTYPES)}"
        )
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _is_int_list(shape) or not _is_int_list(offsets, 2) or offsets[0] > offsets[1]:
        raise KimiInputError(
            f"{fname} has a corrupt header: tensor {name} needs a 'shape' of non-negative ints and "
            f"'data_offsets' [begin, end] with begin <= end, got shape={shape!r} data_offsets={offsets!r}"
        )
    dtype = SAFETENSORS_DTYPES[dtype_str]
    numel = 1
    for d in shape:
        numel *= d
    begin, end = offsets
    # A size mismatch means safe_open would later misread or reject the tensor; report it now instead.
    if end - begin != numel * dtype.itemsize:
        raise KimiInputError(
            f"{fname} has a corrupt header: tensor {name} ({dtype_str} {shape}) needs {numel * dtype.itemsize} bytes, "
            f"data_offsets span {end - begin}"
        )
    return dtype, tuple(shape), begin, end


def read_shard_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one shard's header against its file size; return its tensors by name."""
    header, header_len, size = _read_header_json(path)
    infos: dict[str, TensorInfo] = {}
    max_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _parse_entry(path.name, name, entry)
        infos[name] = TensorInfo(name, path.name, dtype, shape, end - begin, 8 + header_len + begin)
        max_end = max(max_end, end)
    needed = 8 + header_len + max_end
    if needed > size:
        raise KimiInputError(f"{path.name} is truncated: its header lays out {needed} bytes (header and tensors), "
                              f"the file has {size} (an interrupted download?)")
    return infos


class ShardedCheckpoint:
    """Tensors of a (possibly sharded) safetensors checkpoint, validated at open and loaded one at a time.

    The index is authoritative: tensors that a shard holds but the index does not assign to it are listed in
    ``unindexed`` and not exposed.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        weight_map = self._weight_map()
        self._infos: dict[str, TensorInfo] = {}
        self.unindexed: list[str] = []
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard in sorted(by_shard):
            self._load_shard_infos(shard, by_shard[shard], weight_map)
        self.unindexed.sort()
        self._handles: dict[str, object] = {}
        self._read_fds: dict[str, tuple[int, int | None]] = {}
        self._opening = threading.Lock()  # the converter's workers open shards concurrently: each opened once

    def _weight_map(self) -> dict[str, str]:
        if not self.model_dir.is_dir():
            raise KimiInputError(f"{self.model_dir} is not a directory: expected a checkpoint directory")
        index_path = self.model_dir / INDEX_NAME
        if index_path.is_file():
            return _read_index(index_path)
        single = self.model_dir / SINGLE_NAME
        if single.is_file():
            # No index: the single file's own header is the whole truth.
            return {name: SINGLE_NAME for name in read_shard_header(single)}
        raise KimiInputError(f"no checkpoint in {self.model_dir}: expected {INDEX_NAME} or {SINGLE_NAME}")

    def _load_shard_infos(self, shard: str, names: list[str], weight_map: dict[str, str]) -> None:
        path = self.model_dir / shard
        if not path.is_file():
            raise KimiInputError(
                f"{INDEX_NAME} names shard {shard} for {sorted(names)[0]}, but that file does not exist"
            )
        infos = read_shard_header(path)
        for name in sorted(names):
            if name not in infos:
                raise KimiInputError(f"{shard}: tensor {name} listed in {INDEX_NAME} is not in the shard")
            self._infos[name] = infos[name]
        self.unindexed.extend(n for n in infos if weight_map.get(n) != shard)

    def keys(self) -> list[str]:
        return sorted(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KimiInputError(f"tensor {name} is not in the checkpoint at {self.model_dir}") from None

    def shard_names(self) -> list[str]:
        return sorted({i.shard for i in self._infos.values()})

    def keys_in_shard(self, shard: str) -> list[str]:
        return sorted(n for n, i in self._infos.items() if i.shard == shard)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor; its shard is memory-mapped on first use and kept open until close()."""
        info = self.info(name)
        try:
            return self._handle(info.shard).get_tensor(name)
        except KimiInputError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError/OSError types
            msg = str(e).replace("\n", " ")
            raise KimiInputError(f"{info.shard}: cannot load tensor {name}: {msg}") from None

    def read_bytes(self, names: list[str], buf: torch.Tensor) -> torch.Tensor:
        """The stored bytes of tensors `names`, one after another, as an 8-byte-aligned uint8 view into `buf` (the
        caller's reusable page-aligned buffer, at least their size + 2 pages). Tensors stored back to back in one
        shard (as safetensors lays out a projection's neighbours: gate then up) are read in one O_DIRECT read that
        bypasses the page cache (checkpoint.direct); others one by one, through it."""
        infos = [self.info(n) for n in names]
        total = sum(i.nbytes for i in infos)
        try:
            if all(b.shard == a.shard and b.offset == a.offset + a.nbytes for a, b in zip(infos, infos[1:])):
                return pread_into(*self._fds(infos[0].shard), infos[0].offset, total, buf)
            out, pos = buf[:total], 0
            for i in infos:
                pread_into(self._fds(i.shard)[0], None, i.offset, i.nbytes, out[pos: pos + i.nbytes])
                pos += i.nbytes
            return out
        except OSError as e:
            raise KimiInputError(f"{infos[0].shard}: cannot read tensor {names[0]}: {e.strerror or e}") from None

    def _fds(self, shard: str) -> tuple[int, int | None]:
        """(buffered, O_DIRECT or None) read descriptors of a shard, opened on first use and kept until close()."""
        fds = self._read_fds.get(shard)
        if fds is None:
            with self._opening:
                fds = self._read_fds.get(shard)
                if fds is None:
                    path = self.model_dir / shard
                    fds = self._read_fds[shard] = (os.open(path, os.O_RDONLY), open_direct(path, os.O_RDONLY))
        return fds

    def get_slice(self, name: str):
        """safetensors' lazy slice of one tensor from the same mapped shard: indexing it reads only those rows."""
        return self._handle(self.info(name).shard).get_slice(name)

    def _handle(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            with self._opening:
                handle = self._handles.get(shard)
                if handle is None:
                    handle = safe_open(str(self.model_dir / shard), framework="pt")
                    handle.__enter__()  # entered so that close() can release the mmap deterministically (__exit__)
                    self._handles[shard] = handle
        return handle

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)
        fds, self._read_fds = self._read_fds, {}
        for fd in (fd for pair in fds.values() for fd in pair if fd is not None):
            os.close(fd)

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        n_tensors, n_shards = len(self._infos), len(self.shard_names())
        return f"ShardedCheckpoint({str(self.model_dir)!r}, {n_tensors} tensors, {n_shards} shards)"
