"""Tensor parallelism on CPU: one gloo process per rank, each holding its slice as a Neuron rank does. KV groups
are adjacent ranks; every rank creates every group in the same order, as NxD's CPU mode does."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..config import KimiK2Config
from ..parallel import ParallelContext, check_kv_group
from . import memory
from .ranks import run_ranks


def _rank_main(rank, tp, model_dir, rows, prefill_len, dtype, layer_streamed, out_path, kv_group, prefill_chunk,
               sharding):
    from .runner import CpuRunner

    # Only rank 0 shows progress, so tqdm needs no multiprocessing lock: a rank killed while holding one leaves it
    # to the resource tracker, which then warns on the user's terminal after the one-line error.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # ranks share the host's cores
    dist.init_process_group("gloo", rank=rank, world_size=tp)  # address and port from run_ranks' environment
    try:
        groups = [dist.new_group(list(range(g, g + kv_group))) for g in range(0, tp, kv_group)] if kv_group > 1 else []
        ctx = ParallelContext(tp, rank, kv_group, groups[rank // kv_group] if groups else None, **sharding)
        runner = CpuRunner(model_dir, dtype=dtype, layer_streamed=layer_streamed, progress=rank == 0, ctx=ctx,
                           prefill_chunk=prefill_chunk)
        logits = runner.logits(rows, prefill_len)
        if rank == 0:
            save_file({"logits": logits.contiguous()}, out_path)
    finally:
        dist.destroy_process_group()


def tp_logits(model_dir, rows, prefill_len=None, tp=2, dtype=torch.float32, layer_streamed=False, kv_group=1,
              prefill_chunk=None, shard_attn_a=False, shard_router=False) -> torch.Tensor:
    """CpuRunner.logits computed by `tp` ranks -> rank 0's [B, S, V] float32 logits."""
    check_kv_group(tp, kv_group)
    if prefill_chunk is None:  # decided here, once: ranks that chose apart could disagree on their collectives
        longest = max(map(len, rows))
        tokens = longest if prefill_len is None else min(prefill_len, longest)
        batch = len(rows) if len(set(map(len, rows))) == 1 else 1
        heads = KimiK2Config.from_file(model_dir).num_attention_heads
        prefill_chunk = memory.prefill_chunk(heads, batch, tokens, None, ranks=tp).chunk
    sharding = dict(shard_attn_a=shard_attn_a, shard_router=shard_router)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "logits.safetensors")
        run_ranks(_rank_main, tp, args=(tp, str(model_dir), rows, prefill_len, dtype, layer_streamed, out, kv_group,
                                        prefill_chunk, sharding))
        return load_file(out)["logits"]
