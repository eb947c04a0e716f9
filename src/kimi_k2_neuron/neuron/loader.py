"""checkpoint_loader_fn's body: the converted checkpoint memory-mapped, where NxDI's default loader reads ~1 TB whole
(NXDI_CONTRACT.md: default-loader). NxD's sharder copies gate_up's stride-2 slices for every rank of a pass, hence
shard_weights's passes; NxDI's load() reads each rank's file whole (NXDI_CONTRACT.md: presharded-load). No SDK."""

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
    """`config`: a KimiK2InferenceConfig; to_neuron_state_dict refuses tensors not in its expert format by name."""
    if not ExpertScheme.from_nxd(vars(config.neuron_config)).quantized:
        raise KimiInputError("unquantized (bf16) experts: the converter writes FP8 experts only; compile with "
                             "--experts fp8-per-channel or fp8-blockwise")
    t0 = time.monotonic()
    state = model_state_dict(mmap_checkpoint(path), config, where=str(path))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    logger.info("mapped %d tensors (%.1f GiB) from %s in %.1f s", len(state), nbytes / 2**30, path,
                time.monotonic() - t0)
    return state


def model_state_dict(tensors: dict[str, torch.Tensor], config, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Tensors under the converted checkpoint's names -> the model's state dict in NxD's names (checked strictly),
    fitted to the config's layout (contract.for_layout). `config`: a KimiK2InferenceConfig."""
    cfg = config.core_config()
    state = contract.to_neuron_state_dict(tensors, cfg, config.neuron_config, where=where)
    return contract.for_layout(state, cfg, contract.layout_of(config))


# The KV cache: no checkpoint holds it (NxD's StateInitializer zero-fills it on device).
RUNTIME_STATE_PREFIX = "kv_mgr.past_key_values."


def unloaded_parameters(model, missing_keys, state) -> list[str]:
    """Missing keys but the KV cache and second names of loaded parameters (NXDI_CONTRACT.md: shared-rank-util)."""
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[k]) for k in state if k in params}
    return sorted(k for k in missing_keys if not k.startswith(RUNTIME_STATE_PREFIX) and id(params[k]) not in loaded)


def read_presharded(folder: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """One rank's pre-sharded weights as NxDI's load() reads them (NXDI_CONTRACT.md: presharded-load)."""
    file = Path(folder) / f"tp{rank}_sharded_checkpoint.safetensors"
    if not file.is_file():
        raise KimiInputError(f"{file}: not found (a folder of NxD's pre-sharded weights has one such file per rank)")
    return _mmap_shard(file, read_shard_header(file).values())


def mmap_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor as a read-only view of its mapped shard, after ShardedCheckpoint validates the headers."""
    ckpt = ShardedCheckpoint(path)
    out: dict[str, torch.Tensor] = {}
    for shard in ckpt.shard_names():
        out.update(_mmap_shard(Path(path) / shard, [ckpt.info(k) for k in ckpt.keys_in_shard(shard)]))
    return out


def _mmap_shard(file: Path, infos) -> dict[str, torch.Tensor]:
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
