"""checkpoint_loader_fn's body: the converted checkpoint memory-mapped, where NxDI's default loader reads ~1 TB whole
(NXDI_CONTRACT.md: default-loader). NxD's sharder copies gate_up's stride-2 slices for every rank of a pass, hence
shard_weights's passes; NxDI's load() reads each rank's file whole (NXDI_CONTRACT.md: presharded-load). No SDK."""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from pathlib import Path
from typing import Mapping

import torch

from kimi_k2_neuron.checkpoint.shards import ShardedCheckpoint, TensorInfo, read_shard_header
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.placement import Layout

from .contract import run_spec

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
    state = to_neuron_state_dict(tensors, cfg, config.neuron_config, where=where)
    return for_layout(state, cfg, run_spec(config).layout)


# -- the converted checkpoint's names -> NxD's ------------------------------------------------------------------------

def expected_keys(cfg: KimiK2Config, scheme: ExpertScheme, options: Layout = Layout()) -> set[str]:
    """No spmd_rank tensor: NxD generates it (NXDI_CONTRACT.md: spmd-rank)."""
    return set(layout.neuron_tensors(cfg, scheme, options.shard_attn_a, options.shard_router))


def to_neuron_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: KimiK2Config, nc,
                         where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Strict both ways, unlike NxD (NXDI_CONTRACT.md: sharding-not-strict); shapes and FP8 dtypes checked before NxD
    shards or casts them (NXDI_CONTRACT.md: checkpoint-dtype-cast). The replicated layout's keys: see
    for_layout."""
    scheme = ExpertScheme.from_nxd(vars(nc))
    experts = scheme.name
    want = layout.neuron_tensors(cfg, scheme)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if layout.is_ignored(key):
            continue
        nk = layout.module_key(key)
        if nk in out:
            raise KimiInputError(f"{where}: two tensors load into {nk} (the second is {key})")
        out[nk] = tensor
    unexpected, missing = sorted(set(out) - set(want)), sorted(set(want) - set(out))
    if unexpected:
        per_expert = any(layout.is_routed_expert(k) for k in unexpected)
        hint = ("; per-expert HF tensors: a raw checkpoint, to convert first (kimi-k2-neuron convert SRC DST "
                f"--experts {experts})") if per_expert else ""
        raise KimiInputError(f"{where}: {len(unexpected)} tensor(s) the model has no place for (experts={experts}): "
                             f"{listing(unexpected)}{hint}")
    if missing:
        raise KimiInputError(f"{where}: {len(missing)} tensor(s) missing for experts={experts}: {listing(missing)}")
    for name, (dtype, shape) in want.items():
        _check_tensor(out[name], name, dtype, shape, scheme.quantized, where, experts)
    out["rank_util.rank"] = torch.arange(nc.tp_degree, dtype=torch.int32)
    return out


def for_layout(state: dict[str, torch.Tensor], cfg: KimiK2Config, options: Layout) -> dict[str, torch.Tensor]:
    """to_neuron_state_dict's tensors in the layers the sharded weights build (NXDI_CONTRACT.md: gathered-linear):
    q_a_proj | kv_a_proj_with_mqa concatenated by rows (bf16 both, unquantized: only the routed experts are FP8, so
    there is no scale to fuse), the router weight under its linear. In place; the converted checkpoint is unchanged."""
    for i in range(cfg.num_hidden_layers):
        if options.shard_attn_a:
            state[layout.fused_attention_a_key(i)] = torch.cat([state.pop(k) for k in layout.attention_a_keys(i)])
        if options.shard_router and cfg.is_moe_layer(i):
            state[layout.router_weight_key(i, linear=True)] = state.pop(layout.router_weight_key(i))
    return state


def _check_tensor(t: torch.Tensor, name: str, dtype, shape, fp8: bool, where: str, experts: str) -> None:
    if tuple(t.shape) != shape:
        raise KimiInputError(f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
    expert = ".expert_mlps." in name
    if expert and fp8 and t.dtype != dtype:
        raise KimiInputError(f"{where}: tensor {name} is {t.dtype}, expected {dtype} for experts={experts}")
    if not expert and t.dtype == torch.float8_e4m3fn:
        raise KimiInputError(f"{where}: tensor {name} is FP8; only routed experts may be (dequantize the rest)")


# -- pre-sharding -----------------------------------------------------------------------------------------------------

# NxD holds every rank's ~10 GB shard until the last is written; passes of 8 bound it at ~85 GB
# (NXDI_CONTRACT.md: presharding-memory).
SHARD_RANKS_PER_PASS = 8
# transforms every rank after sharding, so one pass (NXDI_CONTRACT.md: layout-transformation)
LAYOUT_TRANSFORM_ENV = "NXD_LAYOUT_TRANSFORMATION_OPTIONS"


def rank_passes(start: int, size: int, env: Mapping[str, str],
                per_pass: int = SHARD_RANKS_PER_PASS) -> list[tuple[int, int]]:
    """(start_rank_id, local_ranks_size) windows covering [start, start + size)."""
    if LAYOUT_TRANSFORM_ENV in env:
        return [(start, size)]
    return [(s, min(per_pass, start + size - s)) for s in range(start, start + size, per_pass)]


# The KV cache: no checkpoint holds it (NxD's StateInitializer zero-fills it on device); under fused speculation the
# draft's and the target's (draft_model., target_model.) and the EAGLE hidden-state buffer.
RUNTIME_STATE_PREFIX = "kv_mgr.past_key_values."
RUNTIME_STATE = (RUNTIME_STATE_PREFIX, "hidden_state_rolling_buffer.")


def unloaded_parameters(model, missing_keys, state) -> list[str]:
    """Missing keys but the runtime state and second names of loaded parameters (NXDI_CONTRACT.md:
    shared-rank-util)."""
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[k]) for k in state if k in params}
    runtime = [k for k in missing_keys if any(k.split(".", 1)[-1].startswith(p) or k.startswith(p)
                                              for p in RUNTIME_STATE)]
    return sorted(k for k in missing_keys if k not in runtime and id(params[k]) not in loaded)


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
