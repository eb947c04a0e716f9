"""Checkpoint keys -> the Neuron model's state dict, strict both ways, with the keys, shapes and dtypes of the
format (kimi_k2_neuron.formats.layout); no SDK needed.

Line references: NxDI = aws-neuron/neuronx-distributed-inference @4bcdc54, src/neuronx_distributed_inference/;
NxD = aws-neuron/neuronx-distributed @fbac349 (Release 2.29), src/neuronx_distributed/.
"""

from __future__ import annotations

from typing import Mapping

import torch

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError, listing
from kimi_k2_neuron.formats import layout
from kimi_k2_neuron.formats.scheme import ExpertScheme, scheme_for


def experts_format(nc) -> str:
    """The expert storage format a NeuronConfig describes."""
    scheme = ExpertScheme.from_nxd(vars(nc))
    return "bf16" if scheme is None else scheme.name


def expected_keys(cfg: KimiK2Config, experts: str) -> set[str]:
    """Every tensor the loader must deliver for the Neuron model (NxD generates the spmd_rank tensors itself,
    expert_mlps_v2.py:197-207; the loader adds rank_util.rank)."""
    scheme = None if experts == "bf16" else scheme_for(experts, "fp8")  # any block: the keys are the same
    return set(layout.neuron_tensors(cfg, scheme))


def to_neuron_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: KimiK2Config, nc,
                         where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the Neuron model's state dict, strict both ways (NxD would drop an unexpected key with a
    warning and skip a missing one, trace.py:640-644, 773-774). Shapes of full tensors are checked here, before
    NxD shards them; FP8 expert weights must be float8_e4m3fn and their scales float32 (NxD would silently cast,
    model_builder.py:801-815). Adds rank_util.rank, the per-rank index NeuronBaseModel's SPMDRank reads."""
    scheme = ExpertScheme.from_nxd(vars(nc))
    experts = "bf16" if scheme is None else scheme.name
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
        hint = ("; per-expert HF tensors must be converted to the fused expert_mlps layout first "
                "(kimi_k2_neuron.convert)") if per_expert else ""
        raise KimiInputError(f"{where}: {len(unexpected)} tensor(s) the model has no place for (experts={experts}): "
                             f"{listing(unexpected)}{hint}")
    if missing:
        raise KimiInputError(f"{where}: {len(missing)} tensor(s) missing for experts={experts}: {listing(missing)}")
    for name, (dtype, shape) in want.items():
        t = out[name]
        if tuple(t.shape) != shape:
            raise KimiInputError(f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        if ".expert_mlps." in name and scheme is not None and t.dtype != dtype:
            raise KimiInputError(f"{where}: tensor {name} is {t.dtype}, expected {dtype} for experts={experts}")
        if ".expert_mlps." not in name and t.dtype == torch.float8_e4m3fn:
            raise KimiInputError(f"{where}: tensor {name} is FP8; only routed experts may be (dequantize the rest)")
    out["rank_util.rank"] = torch.arange(nc.tp_degree, dtype=torch.int32)
    return out
