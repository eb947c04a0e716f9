"""The seam between the model and tensor parallelism: plain torch layers here (gloo across CPU ranks), NxD's in the
Neuron shell. Sharding follows the Neuron build. Gathered layers (shard_attn_a / shard_router) compute each output
element as one whole dot product on one rank, so their output is the replicated layer's. Each layer keeps its
`shard_dim` slice of the full checkpoint tensor the loader hands it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import KimiK2Config
from .errors import KimiInputError
from .placement import Layout, check_kv_group, chunk_meshes, slots_for  # noqa: F401 (the seam's own use)


# -- the sequence-sharded cache's one position map: position p lives on group rank p % G, at slot p // G --------------
# (round-robin, as NxDI's flash decoding lays it: every rank holds ~1/G of every row at every length)

def owner_of(positions: torch.Tensor, group: int) -> torch.Tensor:
    """The group rank holding each position."""
    return positions % group


def slot_of(positions: torch.Tensor, group: int) -> torch.Tensor:
    """The cache slot of each position on its owner."""
    return positions // group


def slot_positions(slots: int, group: int, rank, device=None) -> torch.Tensor:
    """[slots]: the position each of a group rank's slots holds; `rank` an int or a one-element tensor."""
    return torch.arange(slots, device=device) * group + rank


def stripe(n: int, group: int, rank, device=None) -> torch.Tensor:
    """[n / G]: the indices of the entries a group rank keeps of n new positions starting at a multiple of G."""
    return torch.arange(0, n, group, dtype=torch.int64, device=device) + rank


def chunk_key_positions(slots: int, group: int, chunk_group: int, rank, device=None) -> torch.Tensor:
    """[G / Gc x slots]: the positions of the cache a rank holds after gathering its chunk cache group (the group
    ranks r % Gc + Gc k, k = 0 .. G / Gc - 1, in that order; ParallelContext.gather_chunk_cache): those p with
    p % Gc == r % Gc."""
    members = torch.remainder(torch.as_tensor(rank, device=device), chunk_group) + chunk_group * torch.arange(
        group // chunk_group, device=device)
    return (torch.arange(slots, device=device)[None, :] * group + members.reshape(-1, 1)).reshape(-1)


@dataclass(frozen=True)
class ParallelContext:
    """The model asks this for its layers, never for a class, so the Neuron shell swaps in NxD's by subclassing."""

    tp_size: int = 1
    rank: int = 0
    layout: Layout = Layout()
    kv_process_group: Any = field(default=None, compare=False)
    # {(Gc, 0): the Gc adjacent ranks a chunk merges over, (Gc, 1): the G / Gc ranks whose caches it gathers}
    # (runtime/tp.chunk_process_groups)
    chunk_process_groups: Any = field(default=None, compare=False)

    @property
    def kv_group(self) -> int:
        return self.layout.kv_group

    # -- layer factory: plain torch here ------------------------------------------------------------------
    def replicated(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return ReplicatedLinear(in_features, out_features, dtype, self)

    def gathered(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return GatheredLinear(in_features, out_features, dtype, self)

    def attention_a(self, hidden: int, q_lora_rank: int, latent_dim: int, dtype: torch.dtype) -> dict[str, nn.Module]:
        """q_a_proj and kv_a_proj_with_mqa by name, in output order; the Neuron shell fuses them into one layer and
        one all-gather (NXDI_CONTRACT.md: gathered-linear)."""
        make = self.gathered if self.layout.shard_attn_a else self.replicated
        return {"q_a_proj": make(hidden, q_lora_rank, dtype), "kv_a_proj_with_mqa": make(hidden, latent_dim, dtype)}

    def column(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, dtype, self)

    def row(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return RowParallelLinear(in_features, out_features, dtype, self)

    def embedding(self, vocab: int, dim: int, dtype: torch.dtype) -> nn.Module:
        return ParallelEmbedding(vocab, dim, dtype, self)

    def lm_head(self, dim: int, vocab: int, dtype: torch.dtype) -> nn.Module:
        return GatheredLinear(dim, vocab, dtype, self)

    def moe(self, cfg: KimiK2Config, dtype: torch.dtype) -> nn.Module | None:
        """A MoE layer's routed + shared experts from the backend, or None for the core's own (model.moe.MoE, which
        the decoder layer builds: the seam does not import the model)."""
        return None

    # -- sharding and collectives -------------------------------------------------------------------------

    def shard(self, full: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's contiguous slice of `full` along `dim` (None = replicated)."""
        if dim is None or self.tp_size == 1:
            return full
        size = full.shape[dim] // self.tp_size
        return full.narrow(dim, self.rank * size, size)

    def local(self, n: int, what: str) -> int:
        if n % self.tp_size:
            raise ValueError(f"{what}={n} is not divisible by tp={self.tp_size}")
        return n // self.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    # -- the KV group of the sequence-sharded cache: identities at kv_group 1 -------------------------------------

    def kv_rank(self):
        """This rank's index in its KV group (the position map's group rank)."""
        return self.rank % self.kv_group

    def gather_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, h, ...] per rank -> [B, h x kv_group, ...]: the group's heads, in rank order."""
        if self.kv_group == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.kv_group)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.kv_process_group)
        return torch.cat(parts, dim=1)

    def max_over_kv_group(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_group == 1:
            return x
        x = x.clone()
        torch.distributed.all_reduce(x, torch.distributed.ReduceOp.MAX, group=self.kv_process_group)
        return x

    def reduce_scatter_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, h x kv_group, ...] partial sums per rank -> the group's sum of this rank's h heads [B, h, ...]
        (gloo has no reduce-scatter: an all-reduce, then this rank's slice)."""
        if self.kv_group == 1:
            return x
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=self.kv_process_group)
        h = x.shape[1] // self.kv_group
        return x.narrow(1, self.kv_rank() * h, h)

    # -- a prefill chunk's groups (Layout.chunk_group): Gc adjacent ranks merge; the G / Gc ranks holding positions
    # equal modulo Gc pool their caches -------------------------------------------------------------------------------

    def gather_chunk_heads(self, x: torch.Tensor, chunk_group: int, dim: int = 1) -> torch.Tensor:
        """Along `dim` over the Gc adjacent ranks, in rank order."""
        return self._gather(x, chunk_group, chunk_group, 0, dim)

    def gather_chunk_cache(self, x: torch.Tensor, chunk_group: int) -> torch.Tensor:
        """[B, T, latent] -> [B, G / Gc x T, latent]: the caches of the group ranks r % Gc + Gc k, in k order."""
        return self._gather(x, self.kv_group // chunk_group, chunk_group, 1, 1)

    def max_over_chunk_group(self, x: torch.Tensor, chunk_group: int) -> torch.Tensor:
        if chunk_group == 1:
            return x
        x = x.clone()
        torch.distributed.all_reduce(x, torch.distributed.ReduceOp.MAX, group=self._chunk_group(chunk_group, 0))
        return x

    def reduce_scatter_chunk_heads(self, x: torch.Tensor, chunk_group: int) -> torch.Tensor:
        """[B, h x Gc, ...] partial sums -> the Gc ranks' sum of this rank's h heads (gloo: all-reduce, slice)."""
        if chunk_group == 1:
            return x
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=self._chunk_group(chunk_group, 0))
        h = x.shape[1] // chunk_group
        return x.narrow(1, self.rank % chunk_group * h, h)

    def _chunk_group(self, chunk_group: int, which: int):
        if chunk_group == self.kv_group and which == 0:
            return self.kv_process_group
        return self.chunk_process_groups[(chunk_group, which)]

    def _gather(self, x: torch.Tensor, size: int, chunk_group: int, which: int, dim: int) -> torch.Tensor:
        if size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self._chunk_group(chunk_group, which))
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()


def check_tp_divides(cfg: KimiK2Config, tp: int, split_embedding_dim: bool = False) -> None:
    """Every split dimension must divide (vocab too: no padded logits to mask)."""
    dims = {"num_attention_heads": cfg.num_attention_heads,
            **({"hidden_size": cfg.hidden_size} if split_embedding_dim else {}),
            "vocab_size": cfg.vocab_size, "intermediate_size": cfg.intermediate_size,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "moe_intermediate_size x n_shared_experts": cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1)}
    for name, n in dims.items():
        if n % tp:
            raise KimiInputError(f"--tp {tp}: config.json field {name}={n} is not divisible by {tp}")


def check_weight_sharding(cfg: KimiK2Config, tp: int, attn_a: bool, router: bool) -> None:
    """--shard-attn-a splits q_a_proj and kv_a_proj_with_mqa by output rows, --shard-router the router's experts:
    each split must be even (NxD would pad a remainder, which neither the planner nor the fused split models)."""
    dims = {}
    if attn_a:
        dims["--shard-attn-a"] = {"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank + qk_rope_head_dim": cfg.latent_dim}
    if router:
        dims["--shard-router"] = {"n_routed_experts": cfg.n_routed_experts}
    for flag, fields in dims.items():
        for name, n in fields.items():
            if n % tp:
                raise KimiInputError(f"{flag} --tp {tp}: config.json field {name}={n} is not divisible by {tp}")


class _ShardedLinear(nn.Module):
    """A bias-free linear holding this rank's slice of a [out, in] checkpoint weight."""

    shard_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.full_shape = (out_features, in_features)
        shape = list(self.full_shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] = ctx.local(shape[self.shard_dim], "linear dim")
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class ReplicatedLinear(_ShardedLinear):
    shard_dim = None

    def forward(self, x):
        return F.linear(x, self.weight)


class ColumnParallelLinear(_ShardedLinear):
    """Output features split across ranks; the output stays split (heads / intermediate columns)."""

    shard_dim = 0

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(_ShardedLinear):
    """Input features split across ranks; partial products are summed over ranks."""

    shard_dim = 1

    def forward(self, x):
        return self.ctx.all_reduce(F.linear(x, self.weight))


class ParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks; each rank embeds the ids it owns and the ranks sum."""

    shard_dim = 0

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        self.ctx, self.full_shape = ctx, (vocab, dim)
        self.weight = nn.Parameter(torch.empty(ctx.local(vocab, "vocab_size"), dim, dtype=dtype), requires_grad=False)

    def forward(self, ids):
        n = self.weight.shape[0]
        local = ids - self.ctx.rank * n
        owned = (local >= 0) & (local < n)
        out = F.embedding(local.clamp(0, n - 1), self.weight) * owned[..., None].to(self.weight.dtype)
        return self.ctx.all_reduce(out)


class GatheredLinear(ColumnParallelLinear):
    """Output features split across ranks and all-gathered, so every rank sees the whole output: lm_head's
    vocabulary, and the sharded q_a/kv_a projections."""

    def forward(self, x):
        return self.ctx.all_gather_last(F.linear(x, self.weight))
