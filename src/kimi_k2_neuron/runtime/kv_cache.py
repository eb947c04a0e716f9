"""The MLA latent KV cache: per layer one [batch, slots, kv_lora_rank + rope_dim] tensor, nothing per head.
Sharded over G ranks, a rank holds its share by parallel.py's position map, as NxDI's flash decoding does.
"""

from __future__ import annotations

import torch

from ..config import KimiK2Config
from ..parallel import slot_positions
from ..placement import slots_for


class LatentCache:
    def __init__(self, cfg: KimiK2Config, batch: int, max_len: int, dtype: torch.dtype, group: int = 1,
                 rank: int = 0):
        if not 0 <= rank < group:
            raise ValueError(f"rank {rank} is not an index in a KV group of {group}")
        self.max_len, self.group, self.rank = max_len, group, rank
        self.slots = slots_for(max_len, group)
        self.layers = [torch.zeros(batch, self.slots, cfg.latent_dim, dtype=dtype)
                       for _ in range(cfg.num_hidden_layers)]

    def rows(self, start: int, stop: int) -> list[torch.Tensor]:
        """Views of rows [start, stop) of every layer; writes through them land in this cache."""
        return [t[start:stop] for t in self.layers]

    def slot_positions(self) -> torch.Tensor:
        """The position each slot holds [slots]; past max_len for the last slot of some ranks, never written."""
        return slot_positions(self.slots, self.group, self.rank)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
