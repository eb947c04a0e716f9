"""Tensor parallelism on CPU: one gloo process per rank, each holding its slice as a Neuron rank does. KV groups
are adjacent ranks; every rank creates every group in the same order, as NxD's CPU mode does."""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..parallel import ParallelContext

from ..placement import Layout, check_kv_group, chunk_meshes
from .ranks import run_ranks


@dataclass(frozen=True)
class _Job:
    """What every rank runs: CpuRunner.logits of `rows` over `tp` ranks laid out by `layout`."""

    model_dir: str
    rows: list[list[int]]
    prefill_len: int | None
    tp: int
    dtype: torch.dtype
    layer_streamed: bool
    layout: Layout


def _rank_main(rank: int, job: _Job, out_path: str):
    from .runner import CpuRunner

    # Only rank 0 shows progress, so tqdm needs no multiprocessing lock: a rank killed while holding one leaves it
    # to the resource tracker, which then warns on the user's terminal after the one-line error.
    tqdm.set_lock(threading.RLock())
    tp = job.tp
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # ranks share the host's cores
    dist.init_process_group("gloo", rank=rank, world_size=tp)  # address and port from run_ranks' environment
    try:
        ctx = cpu_context(tp, rank, job.layout)
        runner = CpuRunner(job.model_dir, dtype=job.dtype, layer_streamed=job.layer_streamed, progress=rank == 0,
                           ctx=ctx, prefill_chunk=job.layout.prefill_chunk)
        logits = runner.logits(job.rows, job.prefill_len)
        if rank == 0:
            save_file({"logits": logits.contiguous()}, out_path)
    finally:
        dist.destroy_process_group()


def cpu_context(tp: int, rank: int, layout: Layout) -> ParallelContext:
    """This rank's ParallelContext over gloo groups: the KV groups (adjacent ranks, as NxD's), then the chunk's."""
    g = layout.kv_group
    if g == 1:
        return ParallelContext(tp, rank, layout)
    kv = gloo_group([list(range(s, s + g)) for s in range(0, tp, g)], rank)
    return ParallelContext(tp, rank, layout, kv, chunk_process_groups(tp, layout, rank))


def chunk_process_groups(tp: int, layout: Layout, rank: int) -> dict:
    """{(Gc, which): this rank's gloo group} for each merge group a prefill chunk may use
    (Layout.chunk_group_candidates): 0 its adjacent ranks, 1 the strided ranks whose caches it pools
    (placement.chunk_meshes); the core's context and the CPU harness's NxD one both take them."""
    return {(c, which): gloo_group(mesh, rank) for c in layout.chunk_group_candidates()
            for which, mesh in enumerate(chunk_meshes(tp, layout.kv_group, c)) if mesh}


def gloo_group(mesh: list[list[int]], rank: int):
    """Every group of `mesh` created, in order, as gloo needs every rank to create every group -> `rank`'s."""
    made = [dist.new_group(ranks) for ranks in mesh]
    return next(group for group, ranks in zip(made, mesh) if rank in ranks)


def tp_logits(model_dir, rows, prefill_len=None, tp=2, dtype=torch.float32, layer_streamed=False,
              layout: Layout = Layout()) -> torch.Tensor:
    """CpuRunner.logits computed by `tp` ranks -> rank 0's [B, S, V] float32 logits. layout.prefill_chunk is the
    caller's decision (cli._bound_prefill: once, for all ranks, which must agree on their collectives); None: each
    prefill in one call."""
    check_kv_group(tp, layout.kv_group)
    job = _Job(str(model_dir), rows, prefill_len, tp, dtype, layer_streamed, layout)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "logits.safetensors")
        run_ranks(_rank_main, tp, args=(job, out))
        return load_file(out)["logits"]
