"""A converted checkpoint where one is needed (scripts/compile_and_save.py, the NxDI model on CPU): the one given, or a
raw one converted once into one place, the package's cache (cache.converted_root: $KIMI_K2_NEURON_CACHE/converted),
one folder per source path and expert scheme, so that every tool finds and reuses the same conversion. Where it goes,
how big it gets and the room there are said before it starts (~1 TB for the real model), and it is refused up front
if the room is not there."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from ..cache import ENV, converted_root
from ..errors import KimiInputError
from ..formats.record import ConversionRecord
from .converter import convert, planned_bytes


def converted_dir_for(raw: str | Path, experts: str, root: str | Path | None = None) -> Path:
    """The folder `raw` is converted into: under `root` (default: converted_root()), named after it and the scheme,
    with a hash of its resolved path, so that another checkpoint of the same name does not find it."""
    raw = Path(raw).resolve()
    tag = hashlib.sha256(str(raw).encode()).hexdigest()[:10]
    return Path(root if root is not None else converted_root()) / f"{raw.name}-neuron-{experts}-{tag}"


def ensure_converted(path: str | Path, experts: str, workers: int = 8, root: str | Path | None = None,
                     flag: str = "--model") -> tuple[Path, ConversionRecord]:
    """(folder, record), converting a raw `path` once (resumable) into converted_dir_for(path, experts, root): for the
    real checkpoint ~1 TB each way, an estimated 10-35 min on a trn2.48xlarge (not measured)."""
    path = Path(path)
    record = ConversionRecord.read(path)
    if record is not None:
        return path, record
    dst = converted_dir_for(path, experts, root)
    if ConversionRecord.read(dst) is not None:
        # Done before: the converter's resume checks it is this source's conversion (config, index and shard sizes;
        # a checkpoint since put at the same path is refused) and finds every file there, in about a second.
        convert(path, dst, experts, workers=workers, progress=False)
        return dst, ConversionRecord.read(dst)
    need = planned_bytes(path, experts) - _bytes_in(dst)  # a resumed conversion has some of it already
    where = next(p for p in (dst, *dst.parents) if p.exists())
    free = shutil.disk_usage(where).free
    yourself = f"kimi-k2-neuron convert {path} DST --experts {experts}"
    if free < need:
        raise KimiInputError(f"{flag} {path}: a raw checkpoint, to be converted once into {dst}: that needs "
                             f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free there; set {ENV} to a folder on a disk "
                             f"with room, or convert it yourself ({yourself}) and give {flag} DST")
    print(f"note: {flag} {path} is a raw checkpoint: converting it once ({experts} experts, {need / 1e9:.1f} GB of "
          f"{free / 1e9:.1f} GB free) into {dst}, which every later run reuses; {ENV} moves that folder, or convert "
          f"it yourself ({yourself}) and give {flag} DST. The bar shows the ETA.", file=sys.stderr, flush=True)
    res = convert(path, dst, experts, workers=workers)
    print(f"note: converted {res.bytes_read / 1e9:.1f} GB in {res.seconds / 60:.1f} min: {res.summary}",
          file=sys.stderr, flush=True)
    return dst, ConversionRecord.read(dst)


def _bytes_in(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.is_dir() else 0
