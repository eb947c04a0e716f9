"""How a run places the latent cache and the small layers over its ranks (Layout), and the rank arithmetic of that
placement that needs no tensors: a rank's slots, a chunk's meshes, the KV group's rule. Torch-free, so the run spec
(neuron/spec.py) and the argument parsers read it without importing torch; the tensor side of the position map is
parallel.py's."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import KimiInputError


@dataclass(frozen=True)
class Layout:
    """How a run lays the long context over its ranks; the default replicates the cache and the small layers on every
    rank and prefills a prompt in one call."""

    # G adjacent ranks share each sequence's latent cache by the position map below; 1: every rank holds all of it
    kv_group: int = 1
    prefill_chunk: int | None = None  # tokens per prefill call (one row a call); None: the prompt in one call
    shard_attn_a: bool = False  # q_a_proj + kv_a_proj_with_mqa split by output rows and all-gathered
    shard_router: bool = False  # the router's experts split across the ranks, its float32 logits all-gathered
    # A prefill chunk's attention over the sequence-sharded cache merges over this many adjacent ranks, after each
    # gathers the cache of the G / chunk_group ranks holding the rest of its positions (model/mla.py attend_chunk);
    # None: chunk_group_candidates' cheapest at the call's shapes
    chunk_group: int | None = None

    def __post_init__(self):
        c = self.chunk_group
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1 or self.kv_group % c):
            raise KimiInputError(f"chunk_group {c!r}: must be an integer dividing the KV group {self.kv_group} (None: "
                                 f"the cheaper of its candidates)")

    @property
    def sequence_sharded(self) -> bool:
        return self.kv_group > 1

    @property
    def laid_out_chunk_groups(self) -> tuple[int, ...]:
        """The merge groups NxD has meshes for: the whole KV group, or a quarter of it, each rank gathering the cache
        of 3 others (the replica-group meshes NxD's own 3-stage top-k lays out at TP=64 on trn2: consecutive, and
        strided within a block, operators/topk.py)."""
        g = self.kv_group
        return (g, g // 4) if g % 4 == 0 else (g,)

    def chunk_group_candidates(self) -> tuple[int, ...]:
        """The merge groups a chunk may use: a set chunk_group, else laid_out_chunk_groups."""
        return (self.chunk_group,) if self.chunk_group is not None else self.laid_out_chunk_groups


def chunk_meshes(tp: int, group: int, chunk_group: int) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """(the chunk groups: Gc adjacent ranks; the pools: the G / Gc ranks r % Gc + Gc k of each KV group of G adjacent
    ranks), each as all its groups of ranks; None where it is a single rank or, for the chunk groups, the KV group
    itself."""
    merge = [list(range(s, s + chunk_group)) for s in range(0, tp, chunk_group)] if 1 < chunk_group < group else None
    pool = ([list(range(s + j, s + group, chunk_group)) for s in range(0, tp, group) for j in range(chunk_group)]
            if chunk_group < group else None)
    return merge, pool


def slots_for(positions: int, group: int) -> int:
    """Slots a rank needs to hold its share of `positions` positions."""
    return -(-positions // group)


def check_kv_group(tp: int, kv_group: int) -> None:
    """A KV group is kv_group adjacent ranks of the tp ranks (NxD's initialize_kv_group asserts the same)."""
    if kv_group < 1 or tp % kv_group:
        raise KimiInputError(f"--kv-group {kv_group}: must divide --tp {tp} (a KV group is G adjacent ranks)")
