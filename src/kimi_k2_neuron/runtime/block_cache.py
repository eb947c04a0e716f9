"""The latent KV cache in blocks, as vLLM's block manager hands them out and NxDI's BlockKVCacheManager lays them out
(neuron/latent_cache.py): per layer one pool of blocks of block_size positions, [blocks + 1, block_size, latent], the
last block taking padded writes (slot -1); a sequence finds position p in block table[p // block_size] at offset
p % block_size. Blocks are shared: two sequences whose tables name the same block read the same entries. The core's
reference for the shell's block layout: the slots, the write and the gather here, the attention over the gathered
positions in model/mla.py (attend_positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KimiK2Config
from ..model.mla import BLOCK_KEY_TILE

PAD_SLOT = -1  # vllm-neuron's slot of a padded position (NxDI writes it into the reserved last block)


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, S]: the pool slot (block x block_size + offset) of each position through the rows' block tables [B, n]."""
    block = torch.gather(table, 1, positions // block_size)
    return block * block_size + positions % block_size


def write(pool: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    """pool [blocks + 1, block_size, latent] at slots [B, S] = entries [B, S, latent], in place; PAD_SLOT into the
    last block."""
    flat = pool.view(-1, pool.shape[-1])
    reserve = (pool.shape[0] - 1) * pool.shape[1]
    index = torch.where(slots == PAD_SLOT, reserve, slots).reshape(-1)
    flat[index] = entries.reshape(-1, entries.shape[-1]).to(pool.dtype)


def gather(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, n x block_size, latent]: each row's blocks in table order, so position p is at index p."""
    b, n = table.shape
    return pool.index_select(0, table.reshape(-1)).view(b, n * pool.shape[1], pool.shape[-1])


def key_tile_for(seq_len: int) -> int:
    """A model's key tile: BLOCK_KEY_TILE, or its cache length where that is smaller (tiny models); not the prefill
    bucket, so a build prefilling in chunks tiles as one prefilling in one call does."""
    return min(BLOCK_KEY_TILE, seq_len)


def key_width(positions: int, key_tile: int) -> int:
    """Keys of a call over `positions` positions: whole key tiles (attend_positions)."""
    return -(-positions // key_tile) * key_tile


@dataclass
class BlockView:
    """One layer's pool seen through a batch's block tables [B, n]: what MLAttention.forward writes and attends."""

    pool: torch.Tensor
    table: torch.Tensor
    key_tile: int

    def write(self, positions: torch.Tensor, entries: torch.Tensor) -> None:
        write(self.pool, slots_of(self.table, positions, self.pool.shape[1]), entries)

    def keys(self) -> torch.Tensor:
        """[B, W, latent], position k at index k, zero-padded to whole key tiles."""
        keys = gather(self.pool, self.table)
        width = key_width(keys.shape[1], self.key_tile)
        return torch.nn.functional.pad(keys, (0, 0, 0, width - keys.shape[1]))


class BlockLatentCache:
    """Per layer a pool of `blocks` blocks (+ the reserve); layers(table) are its views through a batch's tables."""

    def __init__(self, cfg: KimiK2Config, blocks: int, block_size: int, dtype: torch.dtype,
                 key_tile: int = BLOCK_KEY_TILE):
        if min(blocks, block_size, key_tile) < 1:
            raise ValueError(f"{blocks} blocks of {block_size} positions, key tile {key_tile}: expected >= 1 of each")
        self.block_size, self.key_tile = block_size, key_tile
        self.pools = [torch.zeros(blocks + 1, block_size, cfg.latent_dim, dtype=dtype)
                      for _ in range(cfg.num_hidden_layers)]

    def layers(self, table: torch.Tensor) -> list[BlockView]:
        if int(table.max()) >= self.pools[0].shape[0] - 1 or int(table.min()) < 0:
            raise ValueError(f"block table names blocks {int(table.min())}..{int(table.max())}; the pool has "
                             f"0..{self.pools[0].shape[0] - 2}")
        return [BlockView(p, table, self.key_tile) for p in self.pools]
