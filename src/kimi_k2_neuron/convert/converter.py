"""`kimi-k2-neuron convert SRC DST`: a Kimi-K2 checkpoint -> the Neuron-ready layout of kimi_k2_neuron.formats, once.

Streaming: source tensors are read one at a time through ShardedCheckpoint (a layer's experts are gathered by
name, wherever the shards cut them; their FP8 codes with O_DIRECT into each worker's reused buffer, the rest
through the shards' mmaps), each output file is written front to back one expert slab at a time from reused
page-aligned buffers, and the source mmaps are released every ~256 MB per worker, so memory stays at a few
experts per worker plus the largest non-expert tensor. Reading, converting, writing and hashing overlap: `workers`
threads convert experts in parallel while each output file's own thread writes and hashes the slabs already done,
and fsyncs the file while the next one is converted (torch, reads, writes, fsync and BLAKE3 release the GIL).

Resumable and deterministic: every finished file is renamed into place and recorded with its BLAKE3 hash in
`conversion_manifest.json`; a rerun skips recorded files whose size matches (`verify` re-hashes them, with sha256
for the records of a version-1 manifest), so a run killed at any moment and rerun produces the same bytes as an
uninterrupted one. config.json is written last (and removed first when a rerun has files to redo): until it exists,
DST does not look like a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..checkpoint.direct import PAGE, BufferPool, aligned_empty
from ..checkpoint.shards import INDEX_NAME, SINGLE_NAME
from ..checkpoint.source import WeightSource
from ..config import pop_quantization_config
from ..errors import KimiInputError, broken_link
from ..formats import layout
from ..formats.record import CONVERSION_KEY, ConversionRecord, record_json
from ..formats.scheme import ExpertScheme, converted_scheme
from ..progress import bar as progress_bar
from ..quant import check_finite, nxd_fp8
from ..quant.fp8 import check_fp8_weight
from ..quant.nxd_fp8 import Stats
from . import schedule
from .lock import LOCK_NAME, dst_lock
from ..interrupts import PARTIAL_SUFFIX, write_atomically
from .writer import HASH, HASHES, ShardWriter, file_digest
from .resume import MANIFEST

# 2: file records hold "blake3" (version 1 held "sha256"; such a manifest is resumed, its records verified with
# sha256, and saved as version 2).
MANIFEST_VERSION = 2
_READS_MANIFESTS = (1, 2)
# Source bytes between releases of the shard mmaps (their touched pages count as RSS); per worker, so that the
# drain at each release costs little parallelism.
_RELEASE_PER_WORKER = 256 << 20
_NOT_COPIED = {INDEX_NAME, SINGLE_NAME, "config.json", MANIFEST}


@dataclass
class Result:
    files: int = 0
    skipped: int = 0
    redone: list[str] = field(default_factory=list)  # recorded files that failed --verify and were rewritten
    bytes_read: int = 0
    seconds: float = 0.0
    stats: Stats = field(default_factory=Stats)
    summary: str = ""


def convert(src: str | Path, dst: str | Path, experts: str, workers: int = 1, verify: bool = False,
            progress: bool = True) -> Result:
    src, dst = Path(src), Path(dst)
    if workers < 1:
        raise KimiInputError(f"--workers {workers}: expected at least 1")
    for what, path in (("SRC", src), ("DST", dst)):
        broken = broken_link(path)
        if broken:
            raise KimiInputError(f"{what} {path}: {broken}; expected a folder")
    _check_apart(src, dst)
    if ConversionRecord.read(src) is not None:
        raise KimiInputError(f"{src}: already a converted checkpoint (config.json has {CONVERSION_KEY})")
    source = WeightSource(src)
    try:
        scheme = converted_scheme(source.cfg, experts)
        units = schedule.build(source, scheme)  # every input check that needs no tensor data happens here
        if progress and source.format == "fp8" and scheme.block is not None and not nxd_fp8.KERNEL_BUILT:
            print(f"note: {nxd_fp8.NO_KERNEL}", file=sys.stderr, flush=True)  # before a long run, not after
        job = _Job(source, scheme, dst, workers, verify, progress)
        with dst_lock(dst):
            return job.run(units)
    finally:
        source.close()


def planned_bytes(src: str | Path, experts: str) -> int:
    """The bytes of tensor data convert(src, ..., experts) will write, from the source's headers alone (the schedule
    decides every output tensor before any data is read; safetensors headers add a few KB a file)."""
    source = WeightSource(Path(src))
    try:
        units = schedule.build(source, converted_scheme(source.cfg, experts))
    finally:
        source.close()
    return sum(math.prod(shape) * dtype.itemsize for u in units for _, dtype, shape in u.entries)


def _check_apart(src: Path, dst: Path) -> None:
    """DST must be neither SRC, nor inside it, nor around it: the conversion would write among the files it reads
    (or, resumed or redone, delete them)."""
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        how = "is SRC" if d == s else "is inside SRC" if s in d.parents else "holds SRC"
        raise KimiInputError(f"DST {dst}: {how} ({src}); expected a folder apart from the checkpoint it converts")


class _Job:
    def __init__(self, source: WeightSource, scheme: ExpertScheme, dst: Path, workers: int, verify: bool,
                 progress: bool):
        self.src, self.scheme, self.dst, self.workers, self.verify = source, scheme, dst, workers, verify
        self.cfg, self.progress = source.cfg, progress
        self.fingerprint = _fingerprint(source)
        self.result = Result()
        self._slabs = BufferPool()  # expert slabs, back from the writer once written (page-aligned: O_DIRECT)
        self._local = threading.local()  # each worker's read buffer
        self._since_release = 0  # source bytes read since the shard mmaps were last released

    # -- the run --------------------------------------------------------------------------------------------------
    def run(self, units: list[schedule.Unit]) -> Result:
        t0 = time.perf_counter()
        manifest = self._open_dst(len(units))
        finished = (self.dst / "config.json").is_file()
        if not finished:
            self._save_manifest(manifest)  # first thing in DST: marks it as a conversion in progress
        todo = [u for u in units if not self._done(u, manifest)]  # --verify re-hashes here
        self.result.skipped = len(units) - len(todo)
        if todo:  # a finished DST being redone in part (a file lost, --verify) must not look finished meanwhile
            for f in ("config.json", INDEX_NAME):  # the last two written, first to go
                (self.dst / f).unlink(missing_ok=True)
            self._save_manifest(manifest)
        # (a finished DST re-hashed by --verify and found whole stays marked finished throughout: a stop mid-way
        # leaves it as it was)
        bar = progress_bar(total=sum(u.src_bytes for u in todo), unit="B", unit_scale=True, desc="converting",
                           disable=not self.progress)
        with bar, _torch_threads(), ThreadPoolExecutor(self.workers) as pool:
            self.bar, self.pool = bar, pool
            pending = deque()  # committed files whose writes, hash and fsync may still be running
            try:
                for u in todo:
                    pending.append((u, *self._convert_unit(u)))
                    while len(pending) > 1:  # one file's finishing overlaps the next file's conversion
                        self._record_file(manifest, *pending.popleft())
            except BaseException:
                bar.leave = False  # the error's one line replaces the bar on screen
                raise
            finally:  # also on errors: files already renamed into place are kept for a resume
                self._settle(manifest, pending)
        self.result.files = len(units)
        for u in units:
            self.result.stats.merge(Stats.from_json(manifest["files"][u.file]["stats"]))
        self._finish(units, manifest)
        self.result.seconds = time.perf_counter() - t0
        self.result.summary = self._summary()
        return self.result

    def _open_dst(self, files_total: int) -> dict:
        # source_dir, workers and files_total let a command that finds DST unfinished say how to resume it
        # (resume.unfinished_conversion)
        resume = {"source_dir": str(self.src.dir.resolve()), "workers": self.workers, "files_total": files_total}
        fresh = {"manifest_version": MANIFEST_VERSION, "tool_version": __version__, "source": self.fingerprint,
                 "experts": self.scheme.name, "hash": HASH, "files": {}, "complete": False, **resume}
        if not self.dst.exists():
            self.dst.mkdir(parents=True)
            return fresh
        path = self.dst / MANIFEST
        if not path.is_file():
            if any(p.name != LOCK_NAME for p in self.dst.iterdir()):
                raise KimiInputError(f"{self.dst}: exists, is not empty and holds no {MANIFEST}; "
                                     f"expected a new or empty directory or an interrupted conversion")
            return fresh
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise KimiInputError(f"{path}: unreadable ({e}); delete DST to start over") from None
        if not isinstance(old, dict) or old.get("manifest_version") not in _READS_MANIFESTS:
            version = old.get("manifest_version") if isinstance(old, dict) else None
            raise KimiInputError(f"{path}: manifest_version {version!r}, expected one of "
                                 f"{list(_READS_MANIFESTS)} (from another kimi-k2-neuron version?); delete DST to "
                                 f"start over")
        for k in ("source", "experts"):
            if old.get(k) != fresh[k]:
                raise KimiInputError(f"{path}: field {k} is {old.get(k)!r}, this run needs {fresh[k]!r}; DST holds "
                                     f"another conversion: use a new DST or delete this one")
        for stale in self.dst.glob(f".*{PARTIAL_SUFFIX}"):  # left by a killed run
            stale.unlink()
        # Records keep the hash they were made with; new ones get BLAKE3, under the current manifest version.
        return {**old, "manifest_version": MANIFEST_VERSION, "hash": HASH, "files": old.get("files") or {},
                "complete": False, **resume}

    def _done(self, u: schedule.Unit, manifest: dict) -> bool:
        rec = manifest["files"].get(u.file)
        path = self.dst / u.file
        algo = _record_hash(rec)
        if algo is None or not path.is_file() or path.stat().st_size != rec.get("bytes"):
            manifest["files"].pop(u.file, None)
            return False
        if self.verify and file_digest(path, algo) != rec[algo]:
            self.result.redone.append(u.file)
            manifest["files"].pop(u.file)
            return False
        return True

    def _record_file(self, manifest: dict, u: schedule.Unit, w: ShardWriter, stats: Stats) -> None:
        digest, size = w.result()  # waits for the file's writes, hash, fsync and rename
        manifest["files"][u.file] = {HASH: digest, "bytes": size, "stats": stats.to_json()}
        self._save_manifest(manifest)

    def _settle(self, manifest: dict, pending: deque) -> None:
        """Record the files still finishing, in order; after an error, stop the rest and remove their partial
        files (a file already renamed into place stays for a resume)."""
        try:
            while pending:
                self._record_file(manifest, *pending[0])
                pending.popleft()
        finally:
            for _, w, _ in pending:
                w.abort()

    def _save_manifest(self, manifest: dict) -> None:
        write_atomically(self.dst / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())

    # -- one output file ------------------------------------------------------------------------------------------
    def _convert_unit(self, u: schedule.Unit) -> tuple[ShardWriter, Stats]:
        w = ShardWriter(self.dst / u.file, u.entries)  # interrupted while it opens, it removes its file itself
        try:
            stats = Stats()
            if u.moe_layer is not None:  # first: their big slabs start page-aligned (O_DIRECT)
                stats = self._experts(w, u.moe_layer)
            fp32 = [n for n in u.plain if layout.converted_dtype(n) == layout.F32]
            for n in fp32 + [n for n in u.plain if n not in fp32]:  # schedule's order: fp32, then bf16
                self._plain(w, n)
            w.commit()
        except BaseException:
            w.abort()
            raise
        finally:
            self.src.ckpt.close()
        return w, stats

    def _plain(self, w: ShardWriter, name: str) -> None:
        t = self.src.get(name, layout.converted_dtype(name))
        w.add(name, t)
        self._consumed(name)

    def _consumed(self, *names: str) -> None:
        n = sum(self.src.ckpt.info(r).nbytes for name in names for r in self.src.weights[name].raw)
        self.result.bytes_read += n
        self.bar.update(n)
        self._since_release += n

    def _experts(self, w: ShardWriter, layer: int) -> Stats:
        """gate_up slabs for every expert, then down slabs, then both scales (held back: they are small)."""
        stats = Stats()
        e_count, h, i = self.cfg.n_routed_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        scales = {}
        for key, projs, shape in ((layout.gate_up_key(layer), ("gate_proj", "up_proj"), (h, 2 * i)),
                                  (layout.down_key(layer), ("down_proj",), (i, h))):
            scales[key] = []
            for e, (codes, scale, st) in self._ordered(lambda e, p=projs, s=shape: self._expert(layer, e, p, s),
                                                       range(e_count)):
                w.add(key, codes, release=lambda c=codes: self._slabs.give(c.view(-1)))
                scales[key].append(scale)
                stats.merge(st)
                self._consumed(*(layout.expert_name(layer, e, p) for p in projs))
        for key, parts in scales.items():
            w.add(layout.scale_key(key), torch.stack(parts))
        return stats

    def _ordered(self, fn, items):
        """Yield (item, fn(item)) in order while up to 2*workers run ahead; every ~256 MB of source per worker,
        let the in-flight work finish and release the shard mmaps."""
        pending = deque()
        try:
            for it in items:
                pending.append((it, self.pool.submit(fn, it)))
                if len(pending) > 2 * self.workers:
                    yield self._pop(pending)
                if self._since_release >= _RELEASE_PER_WORKER * self.workers:
                    while pending:
                        yield self._pop(pending)
                    self.src.ckpt.close()
                    self._since_release = 0
            while pending:
                yield self._pop(pending)
        finally:
            # On an error, let the work still in flight stop before the caller closes the shard mmaps under it
            # (closing a safetensors handle another thread is reading from raises "Already borrowed").
            for _, fut in pending:
                fut.cancel()
            wait([fut for _, fut in pending])

    @staticmethod
    def _pop(pending):
        it, fut = pending.popleft()
        return it, fut.result()  # on an error _ordered's finally stops the rest

    def _expert(self, layer: int, e: int, projs: tuple[str, ...], shape: tuple[int, int]):
        """One expert's [in, out] codes (gate and up side by side for gate_up) and its scale."""
        names = [layout.expert_name(layer, e, p) for p in projs]
        if self.scheme.block is not None and all(self.src.weights[n].kind == "fp8" for n in names):
            return self._fp8_expert(names, shape)
        codes = self._slabs.take(shape[0] * shape[1]).view(shape)
        width = shape[1] // len(projs)
        scales, stats = [], Stats()
        for k, proj in enumerate(projs):
            s, st = self._proj(layout.expert_name(layer, e, proj), codes[:, k * width:(k + 1) * width])
            scales.append(s)
            stats.merge(st)
        return codes, torch.cat(scales, dim=1), stats

    def _fp8_expert(self, names: list[str], shape: tuple[int, int]):
        """FP8 source codes kept: the projections' [out, in] codes read one after another along out (gate then up)
        into this worker's own buffer, then rescaled and laid side by side in one transposed copy."""
        ckpt, q, block = self.src.ckpt, self.cfg.quant, self.scheme.block
        raw = [self.src.weights[n].raw for n in names]
        infos = [ckpt.info(w) for w, _ in raw]
        for n, i in zip(names, infos):
            check_fp8_weight(torch.empty(i.shape, dtype=i.dtype, device="meta"), self.src.described(n))
        nbytes = sum(i.nbytes for i in infos)
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes + 2 * PAGE:
            buf = self._local.buf = aligned_empty(nbytes + 2 * PAGE)
        codes = ckpt.read_bytes([w for w, _ in raw], buf)
        rows = [i.shape[0] for i in infos]
        codes = codes.view(sum(rows), infos[0].shape[1])
        dst = self._slabs.take(shape[0] * shape[1]).view(shape)
        try:
            flag, inexact = nxd_fp8.rescale_transposed(dst, codes, block[::-1], "")
        except KimiInputError:  # NaN codes: say in which projection
            self._slabs.give(dst.view(-1))
            for n, part in zip(names, codes.view(-1).split([r * infos[0].shape[1] for r in rows])):
                check_finite(part.view(torch.float8_e4m3fn), f"{self.src.described(n)}.weight")
            raise
        scale = torch.cat([nxd_fp8.blockwise_scale(ckpt.get(s), tuple(i.shape), q.weight_block_size, block, f,
                                                   self.src.described(n))
                           for n, (_, s), i, f in zip(names, raw, infos, flag.split([r // block[1] for r in rows]))],
                          dim=1)
        return dst, scale, Stats(blocks=flag.numel(), rescaled=int(flag.sum()), inexact=inexact)

    def _proj(self, name: str, dst: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        w = self.src.weights[name]
        base = self.src.described(name)
        q = self.cfg.quant
        if self.scheme.block is not None and w.kind == "int4":  # straight from the codes, exact (FP8: _fp8_expert)
            codes, scale = (self.src.ckpt.get(r) for r in w.raw[:2])
            return nxd_fp8.int4_to_blockwise(codes, scale, tuple(dst.shape[::-1]), q.group_size, dst, base)
        ref = self.src.get(name, torch.float32)  # the exact value, whatever the storage
        return nxd_fp8.quantize(ref.t().contiguous(), self.scheme.block, dst, base)

    # -- the end ----------------------------------------------------------------------------------------------------
    def _finish(self, units: list[schedule.Unit], manifest: dict) -> None:
        weight_map = {name: u.file for u in units for name, _, _ in u.entries}
        total = sum(manifest["files"][u.file]["bytes"] for u in units)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _put(self.dst / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        self._copy_aux()
        manifest["complete"] = True
        self._save_manifest(manifest)
        _put(self.dst / "config.json", (json.dumps(self._config(), indent=2) + "\n").encode())

    def _copy_aux(self) -> None:
        """Tokenizer, generation config, chat template, ...: every other top-level file of the source."""
        for f in sorted(self.src.dir.iterdir()):
            if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
                _put(self.dst / f.name, f.read_bytes())

    def _config(self) -> dict:
        raw = json.loads((self.src.dir / "config.json").read_text())
        source_q = pop_quantization_config(raw)
        raw[CONVERSION_KEY] = record_json(self.scheme, self.src.format, self.cfg.moe_intermediate_size, source_q,
                                          _stats_record(self.result.stats), len(self.src.ignored))
        return raw

    def _summary(self) -> str:
        r, s = self.result, self.result.stats
        gb = r.bytes_read / 1e9
        rate = f"{gb / r.seconds:.2f} GB/s" if r.seconds > 0 and gb else "-"
        rec = _stats_record(s)
        if s.sq_ref:  # requantized from dequantized values: measured against them
            err = (f"; re-rounding error rms {rec['relative_rms_error']:.3g}, max {rec['relative_max_error']:.3g} "
                   f"(relative to the source weights)")
        elif s.inexact:  # rescaled codes: exact but for the halved subnormals that lost their last bit
            err = "; experts exact but for those codes (the subnormal tail, rounded to nearest even)"
        else:
            err = "; experts exact"
        redo = f", {len(r.redone)} rewritten after failing --verify" if r.redone else ""
        return (f"converted {self.src.format} -> {self.scheme.name} into {self.dst}: {r.files} files "
                f"({r.skipped} already done{redo}), {gb:.2f} GB read in {r.seconds:.1f} s ({rate}); "
                f"FP8 scales raised to fit +-240: {s.rescaled}/{s.blocks}, inexact codes {s.inexact}{err}; "
                f"{len(self.src.ignored)} source tensors ignored by name")


def _put(target: Path, data: bytes) -> None:
    """Write a small file unless it already holds `data` (a rerun over a finished DST changes nothing)."""
    if not (target.is_file() and target.read_bytes() == data):
        write_atomically(target, data)


def _stats_record(s: Stats) -> dict:
    rel_rms = (s.sq_err / s.sq_ref) ** 0.5 if s.sq_ref else 0.0
    rel_max = s.max_err / s.max_ref if s.max_ref else 0.0
    return {"scales": s.blocks, "scales_raised_for_240": s.rescaled, "inexact_codes": s.inexact,
            "relative_rms_error": float(f"{rel_rms:.4g}"), "relative_max_error": float(f"{rel_max:.4g}")}


def _record_hash(rec) -> str | None:
    """The hash a manifest file record holds (None: no usable record)."""
    if not isinstance(rec, dict):
        return None
    return next((algo for algo in HASHES if isinstance(rec.get(algo), str)), None)


def _fingerprint(source: WeightSource) -> str:
    """Identifies the source: config, index and shard sizes (content hashes of 1 TB would take too long)."""
    h = hashlib.sha256()
    for name in ("config.json", INDEX_NAME):
        p = source.dir / name
        h.update(p.read_bytes() if p.is_file() else b"-")
    for shard in source.ckpt.shard_names():
        h.update(f"{shard}:{(source.dir / shard).stat().st_size};".encode())
    return h.hexdigest()


@contextmanager
def _torch_threads():
    """Single-threaded torch ops in each worker: the writer threads (write() and BLAKE3) need a share of the
    cores, and `workers` is the knob for parallel conversion."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["MANIFEST", "Result", "convert"]
