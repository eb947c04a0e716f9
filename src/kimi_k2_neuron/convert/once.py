"""A converted checkpoint where one is needed: the one given, or a raw one converted once into a sibling folder."""

from __future__ import annotations

import logging
from pathlib import Path

from ..formats.record import ConversionRecord
from .converter import convert

logger = logging.getLogger(__name__)


def converted_dir_for(raw: str | Path, experts: str) -> Path:
    raw = Path(raw).resolve()
    return raw.with_name(f"{raw.name}-neuron-{experts}")


def ensure_converted(path: str | Path, experts: str, workers: int = 8,
                     dst: str | Path | None = None) -> tuple[Path, ConversionRecord]:
    """(folder, record), converting a raw `path` once (resumable) into `dst`: for the real checkpoint ~1 TB each way,
    an estimated 10-35 min on a trn2.48xlarge (not measured)."""
    path = Path(path)
    record = ConversionRecord.read(path)
    if record is not None:
        return path, record
    dst = Path(dst) if dst is not None else converted_dir_for(path, experts)
    if ConversionRecord.read(dst) is not None:
        # Done before: the converter's resume checks it is this source's conversion (config, index and shard sizes;
        # a checkpoint since put at the same path is refused) and finds every file there, in about a second.
        convert(path, dst, experts, workers=workers, progress=False)
        return dst, ConversionRecord.read(dst)
    logger.warning("%s is a raw checkpoint; converting it (experts=%s) into %s. This reads the whole checkpoint "
                   "once: an estimated 10-35 min for the 1T model on a trn2.48xlarge, not measured (the progress "
                   "bar shows the ETA).", path, experts, dst)
    res = convert(path, dst, experts, workers=workers)
    logger.warning("converted %.1f GB in %.1f min (%.0f MB/s): %s", res.bytes_read / 1e9, res.seconds / 60,
                   res.bytes_read / 1e6 / max(res.seconds, 1e-9), res.summary)
    return dst, ConversionRecord.read(dst)
