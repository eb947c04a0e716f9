"""checkpoint_loader_fn's body: the converted checkpoint as the Neuron model's state dict, memory-mapped.

NxDI's default loader reads every shard whole into one dict; for a ~1 TB checkpoint that is ~1 TB of anonymous
memory per call, and without pre-sharding the call repeats at every load (NXDI_CONTRACT.md: default-loader). Here each
tensor is a read-only view of its memory-mapped shard: NxD's sharder slices one rank's part at a time, so the bytes
come through the page cache; most slices are views, gate_up's (stride 2) are copies, which NxD holds for every rank
of a pass (hence NeuronKimiK2ForCausalLM.shard_weights's passes of contract.SHARD_RANKS_PER_PASS ranks).
Pre-sharding (save_sharded_checkpoint, set by contract.neuron_config_kwargs) means this runs once per pass, inside
compile(). NxDI's load() then reads each rank's pre-sharded file whole: ~18 GB per rank for Kimi-K2 at TP=64, ~1.2 TB
of host RAM on a trn2.48xlarge (2 TiB) (NXDI_CONTRACT.md: presharded-load).

The converted layout is kimi_k2_neuron.formats (keys keep the HF `model.` prefix, fused experts, FP8 with `.scale`,
float32 router); contract.to_neuron_state_dict maps and checks it strictly. This file needs no SDK.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from pathlib import Path

import torch

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint, TensorInfo, read_shard_header
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.scheme import ExpertScheme

from . import contract

logger = logging.getLogger(__name__)

def load_neuron_state_dict(path: str | Path, config) -> dict[str, torch.Tensor]:
    """`config` is a KimiK2InferenceConfig (core_config(), neuron_config). The checkpoint must be converted in the
    expert format the NeuronConfig describes: to_neuron_state_dict checks every tensor's name, shape and dtype
    against it (a raw checkpoint, or one converted with another scheme or block, is refused there, naming the
    tensors; the entry points convert a raw one first, once)."""
    nc = config.neuron_config
    if not ExpertScheme.from_nxd(vars(nc)).quantized:
        raise KimiInputError("unquantized (bf16) experts: the converter writes FP8 experts only; compile with "
                             "--experts fp8-per-channel or fp8-blockwise")
    t0 = time.monotonic()
    tensors = mmap_checkpoint(path)
    state = contract.to_neuron_state_dict(tensors, config.core_config(), nc, where=str(path))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    logger.info("mapped %d tensors (%.1f GiB) from %s in %.1f s", len(state), nbytes / 2**30, path,
                time.monotonic() - t0)
    return state


# Parameters no checkpoint holds: each layer's KV cache (NxD's StateInitializer zero-fills it on device), written by
# the model itself.
RUNTIME_STATE_PREFIX = "kv_mgr.past_key_values."


def unloaded_parameters(model, missing_keys, state) -> list[str]:
    """Of load_state_dict's missing keys, those that are really unloaded: not the KV cache, and not a second name
    of a parameter loaded under another one (kv_mgr.global_rank is the model's rank_util, NXDI_CONTRACT.md:
    shared-rank-util; state_dict lists a shared parameter under every name)."""
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[k]) for k in state if k in params}
    return sorted(k for k in missing_keys if not k.startswith(RUNTIME_STATE_PREFIX) and id(params[k]) not in loaded)


def read_presharded(folder: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """One rank's pre-sharded weights as NxD writes them and NxDI's load() reads them (NXDI_CONTRACT.md:
    presharded-load)."""
    file = Path(folder) / f"tp{rank}_sharded_checkpoint.safetensors"
    if not file.is_file():
        raise KimiInputError(f"{file}: not found (a folder of NxD's pre-sharded weights has one such file per rank)")
    return _mmap_shard(file, read_shard_header(file).values())


def mmap_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (index or single file) as a read-only view of its mapped shard.
    The core's ShardedCheckpoint validates index and headers first (sizes, offsets, missing shards)."""
    ckpt = ShardedCheckpoint(path)
    out: dict[str, torch.Tensor] = {}
    for shard in ckpt.shard_names():
        out.update(_mmap_shard(Path(path) / shard, [ckpt.info(k) for k in ckpt.keys_in_shard(shard)]))
    return out


def _mmap_shard(file: Path, infos) -> dict[str, torch.Tensor]:
    """The tensors `infos` (TensorInfo of `file`'s validated header) as read-only views of the mapped file."""
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": nothing writes into these views
        for info in infos:
            out[info.name] = _view(mapped, info)
    return out


def _view(mapped: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
    return flat.view(info.dtype).view(info.shape)
