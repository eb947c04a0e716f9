"""Multi-head Latent Attention (MLA) over a latent KV cache: per token one entry [c_kv (normed) | k_pe (roped)],
576 wide for Kimi-K2, shared by all heads. naive (prefill) expands c_kv into per-head K and V: with an S x T score
matrix the 128+64-wide space is 3x cheaper than the 512+64 latent one. absorbed (decode) folds W_UK into the query and
W_UV into the output, so nothing per-head is materialized for the T cached tokens (scripts/bench_mla_decode.py).
Sharded over a KV group, attend_sharded merges the ranks' scores by log-sum-exp (decode and speculative verification
differ only in the segments and masks they pass); a prefill chunk's attend_chunk merges over a chunk group after
pooling caches, which moves a fifth of the bytes at Kimi's shapes (issue 27). Through a block table (vLLM's prefix
caching) a prefill reads the positions before it from cached blocks: attend_positions, over keys laid out by position
(positional_keys) in tiles of a fixed width, so a prefill from a cached prefix computes each of its queries exactly as
a prefill of the whole prompt does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import KimiK2Config
from ..parallel import ParallelContext, chunk_key_positions, owner_of, slot_of, slot_positions, stripe
from .norm import RMSNorm
from .rope import apply_interleaved_rope, softmax_scale

# Queries per score block of a prefill chunk (attend_chunk): bounds its [heads x Gc, tile, keys] float32 scores, which
# the fit planner counts (neuron/hbm.py).
CHUNK_QUERY_TILE = 128
# Keys per score tile of a prefill through a block table (attend_positions): fixed for a model, tiles starting at
# position 0, so a query's float operations do not depend on how many keys the call holds after its own.
BLOCK_KEY_TILE = 2048
# modeling_deepseek.py (and transformers) build q_a/kv_a_layernorm with the default eps, not rms_norm_eps (1e-5 in
# Kimi-K2-Thinking and K2.5).
LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: KimiK2Config, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__()
        h, d = cfg.hidden_size, cfg.qk_head_dim
        self.ctx = ctx
        self.n_heads = ctx.local(cfg.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = softmax_scale(cfg)
        self.dims = HeadDims.of(cfg, ctx.tp_size)
        heads = cfg.num_attention_heads
        # two layers or the Neuron shell's fused one, registered in the checkpoint's order (formats.layout)
        attention_a = ctx.attention_a(h, cfg.q_lora_rank, cfg.latent_dim, dtype)
        self._attention_a_names = tuple(attention_a)
        self.q_lora_rank, self.latent_dim = cfg.q_lora_rank, cfg.latent_dim
        self.add_module(self._attention_a_names[0], attention_a[self._attention_a_names[0]])
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype)
        self.q_b_proj = ctx.column(cfg.q_lora_rank, heads * d, dtype)
        for name in self._attention_a_names[1:]:
            self.add_module(name, attention_a[name])
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = ctx.column(cfg.kv_lora_rank, heads * (self.nope + self.v_dim), dtype)
        self.o_proj = ctx.row(heads * self.v_dim, h, dtype)

    def forward(self, x, positions, rope, latent_cache, absorbed: bool | None = None):
        """x [B, S, hidden]; positions [B, S]; latent_cache [B, T_max, latent], written in place at `positions`.
        Sharded (kv_group G > 1): slot j holds position j * G + rank % G, and `absorbed` is ignored. A block cache
        (runtime/block_cache.py BlockView: write(positions, entries), keys() by position) is written, then attended
        through its block table (attend_positions); `absorbed` is ignored."""
        q_nope, q_pe, entries = self.project(x, rope)
        if not torch.is_tensor(latent_cache):
            latent_cache.write(positions, entries)
            return self.attend_positions(q_nope, q_pe, latent_cache.keys(), positions, latent_cache.key_tile)
        if self.ctx.kv_group > 1:
            return self._forward_sharded(q_nope, q_pe, entries, positions, latent_cache)
        _write_cache(latent_cache, positions, entries)
        t = int(positions.max()) + 1
        mask = torch.arange(t)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, T]
        return self.attend(q_nope, q_pe, latent_cache[:, :t], mask, absorbed)

    def _forward_sharded(self, q_nope, q_pe, entries, positions, latent_cache):
        g, r = self.ctx.kv_group, self.ctx.kv_rank()
        t = int(slot_of(positions.max(), g)) + 1  # slots that can hold a position <= the latest query's
        if positions.shape[1] > 1:  # a prefill call: the cache before it, then its own entries (attend_chunk)
            out = self.attend_chunk(q_nope, q_pe, latent_cache[:, :t], entries, positions)
            _write_cache(latent_cache, slot_of(positions, g), entries, owner_of(positions, g) == r)
            return out
        _write_cache(latent_cache, slot_of(positions, g), entries, owner_of(positions, g) == r)
        keys = slot_positions(t, g, r)
        mask = keys[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, t]; all written by now
        return self.attend_sharded(q_nope, q_pe, [latent_cache[:, :t]], [mask])

    def project(self, x, rope):
        """-> (q_nope, q_pe) per local head and the new cache entries [B, S, latent]."""
        b, s, _ = x.shape
        cos, sin = rope
        q_a, kv_a = self._attention_a(x)
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(b, s, self.n_heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_interleaved_rope(q_pe, cos, sin)
        c_kv, k_pe = kv_a.split([self.rank, self.rope], dim=-1)
        k_pe = apply_interleaved_rope(k_pe[:, None], cos, sin)[:, 0]
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def _attention_a(self, x):
        outs = [getattr(self, name)(x) for name in self._attention_a_names]
        return outs[0].split([self.q_lora_rank, self.latent_dim], dim=-1) if len(outs) == 1 else outs

    def attend(self, q_nope, q_pe, cache, mask, absorbed: bool | None = None):
        """cache [B, T, latent], mask [B, 1, S, T] (True = visible). absorbed=None: absorbed for S == 1."""
        b, _, s, _ = q_nope.shape
        if absorbed is None:
            absorbed = s == 1
        attend = self._attend_absorbed if absorbed else self._attend_naive
        out = attend(q_nope, q_pe, cache, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend_split(self, q_nope, q_pe, prior, prior_mask, active, active_mask):
        """attend(absorbed=True) over prior + active unconcatenated: Neuron decode reads the cache in place."""
        b, _, s, _ = q_nope.shape
        out = self._absorbed(q_nope, q_pe, [prior, active], [prior_mask, active_mask])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend_sharded(self, q_nope, q_pe, segments, masks, query_tile: int | None = None):
        """masks [B, 1, k, T_i] must make every key visible on exactly one rank of the KV group. Merge in float32;
        query_tile bounds the [heads x G, tile, T] score block."""
        b, _, s, _ = q_nope.shape
        w_uk, w_uv = self._kv_b_halves()
        q = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk), q_pe.to(q_nope.dtype)], dim=-1)
        q = self.ctx.gather_kv_heads(q)  # [B, heads x G, k, latent]
        masks = [m.to(torch.bool) for m in masks]
        tile = s if query_tile is None else query_tile
        parts = [self._merge(q[:, :, i:i + tile], segments, [m[:, :, i:i + tile] for m in masks])
                 for i in range(0, s, tile)]
        ctx_lat = _cat_queries(parts)  # [B, heads, k, rank] float32
        out = torch.einsum("bhsr,hvr->bhsv", ctx_lat.to(q_nope.dtype), w_uv)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend_chunk(self, q_nope, q_pe, past, entries, positions, query_tile: int | None = None):
        """A multi-token call over the sequence-sharded cache (a prefill chunk): past [B, T, latent] this rank's slots
        (their positions before the call's first, positions[:, 0], visible), entries [B, S, latent] all of the call's
        own, positions [B, S]. Its collectives are Kimi's per-layer chunk cost (issue 27), so the chunk group Gc
        (chunk_group) trades them: each rank first pools the cache of the G / Gc ranks holding positions equal to
        its own modulo Gc, then Gc adjacent ranks share their heads' kv_b and un-absorbed queries (192 wide, not
        576), and merge W_UV's output (128 wide, not 512) with the softmax sum, in float32."""
        b, _, s, _ = q_nope.shape
        g, gc = self.ctx.kv_group, self.chunk_group(past.shape[1], s)
        r = self.ctx.kv_rank()
        key_pos = chunk_key_positions(past.shape[1], g, gc, r, past.device)
        past = self.ctx.gather_chunk_cache(past, gc)
        j = torch.remainder(torch.as_tensor(r, device=entries.device), gc)
        if s % gc == 0:  # the call's entries at indices equal to this rank's modulo Gc, each seen on one rank
            own = stripe(s, gc, j, entries.device)
            active, active_pos = torch.index_select(entries, 1, own), torch.index_select(positions, 1, own)
            causal = active_pos[:, None, :] <= positions[:, :, None]
        else:  # the core runner's uneven calls: all of them, the others masked
            active, active_pos = entries, positions
            causal = (active_pos[:, None, :] <= positions[:, :, None]) & (torch.arange(s, device=entries.device) % gc
                                                                          == j)
        masks = [(key_pos[None, :] < positions[:, :1])[:, None, None, :].expand(b, 1, s, key_pos.shape[0]),
                 causal[:, None]]
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        w = self.ctx.gather_chunk_heads(w, gc, dim=0)  # [Gc x heads, nope + v_dim, rank]
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q = self.ctx.gather_chunk_heads(torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1), gc)
        segments = [past, active.to(past.dtype)]
        tile = s if query_tile is None else query_tile
        hg = q.shape[1]
        # every tile's [W_UV context | sum] and max, merged once after the last: each tile under this rank's own max
        acc = torch.empty(b, hg, s, self.v_dim + 1, dtype=torch.float32, device=q.device)
        tops = torch.empty(b, hg, s, 1, dtype=torch.float32, device=q.device)
        for i in range(0, s, tile):
            qt = q[:, :, i:i + tile]
            q_lat = torch.cat([torch.einsum("bhsn,hnr->bhsr", qt[..., : self.nope], w_uk), qt[..., self.nope :]], -1)
            top, total, context = self._partial(q_lat, segments, [m[:, :, i:i + tile] for m in masks])
            # W_UV in float32 per tile, after the scores are freed: kept whole, it would sit on the peak
            acc[:, :, i:i + tile, : self.v_dim] = torch.einsum("bhsr,hvr->bhsv", context, w_uv.float())
            acc[:, :, i:i + tile, self.v_dim :] = total
            tops[:, :, i:i + tile] = top
            del q_lat, top, total, context  # before the next tile's blocks (hbm.py counts one tile's)
        acc.mul_(torch.exp(tops - self.ctx.max_over_chunk_group(tops, gc)))  # 0 where this rank saw no key
        merged = self.ctx.reduce_scatter_chunk_heads(acc, gc)  # [B, heads, S, v_dim + 1]
        out = (merged[..., : self.v_dim] / merged[..., self.v_dim :]).to(q_nope.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend_positions(self, q_nope, q_pe, keys, positions, key_tile: int,
                         query_tile: int = CHUNK_QUERY_TILE):
        """keys [B, W, latent] with position k's entry at index k (positional_keys; W a multiple of key_tile), each
        query attending the keys at positions up to its own. Naive per key tile (kv_b_proj expands the tile's c_kv:
        a prefill's many queries make that cheaper than the absorbed form), one softmax per query row under the row's
        max over every tile, summed tile by tile from position 0, in float32: the keys after a query's position add
        exact zeros, so its result depends neither on W nor on where the call starts (a prefill after cached blocks
        gives the cold prefill's numbers, given matmuls whose rows do not depend on their neighbours). Queries in
        tiles of query_tile bound the float32 scores at query_tile x W per head."""
        b, _, s, _ = q_nope.shape
        if keys.shape[1] % key_tile:
            raise ValueError(f"{keys.shape[1]} keys: not a whole number of {key_tile}-key tiles")
        low = torch.finfo(torch.float32).min
        tiles = []  # per key tile: k_nope [B, h, T, nope], k_pe [B, 1, T, rope], v [B, h, T, v_dim], positions [T]
        for start in range(0, keys.shape[1], key_tile):
            c_kv, k_pe = keys[:, start:start + key_tile].to(q_nope.dtype).split([self.rank, self.rope], dim=-1)
            kv = self.kv_b_proj(c_kv).view(b, key_tile, self.n_heads, -1).transpose(1, 2)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            tiles.append((k_nope, k_pe[:, None], v, torch.arange(start, start + key_tile, device=keys.device)))
        out = []
        for i in range(0, s, query_tile):
            qn, qp, pos = q_nope[:, :, i:i + query_tile], q_pe[:, :, i:i + query_tile], positions[:, i:i + query_tile]
            masks = [(kpos[None, None, :] <= pos[:, :, None])[:, None] for *_, kpos in tiles]  # [B, 1, q, T]
            scores = [(qn @ k_nope.transpose(-1, -2) + qp @ k_pe.transpose(-1, -2)).to(torch.float32, copy=True)
                      .mul_(self.scale).masked_fill_(~m, low) for (k_nope, k_pe, _, _), m in zip(tiles, masks)]
            top = torch.stack([sc.amax(-1) for sc in scores]).amax(0)[..., None]
            total = context = None
            for sc, m, (_, _, v, _) in zip(scores, masks, tiles):
                p = sc.sub_(top).exp_().mul_(m)
                part = p.sum(-1, keepdim=True), (p.to(v.dtype) @ v).float()
                total, context = part if total is None else (total.add_(part[0]), context.add_(part[1]))
            out.append((context / total).to(q_nope.dtype))
        o = _cat_queries(out)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))

    def chunk_group(self, slots: int, queries: int) -> int:
        return chunk_group_for(self.ctx.layout, self.dims, slots, queries)

    def _partial(self, q, segments, masks, group_max=None):
        """-> (the max [B, h, tile, 1], the softmax sum, the latent context [.., rank]) over this rank's segments,
        float32, under the group's max (group_max), else this rank's own."""
        low = torch.finfo(torch.float32).min
        # in place past the first float32 copy: one float32 score block per segment (hbm.py counts it so)
        scores = [_shared_kv_matmul(q, seg.to(q.dtype).transpose(-1, -2)).to(torch.float32, copy=True)
                  .mul_(self.scale).masked_fill_(~m, low) for seg, m in zip(segments, masks)]
        top = torch.stack([sc.amax(-1) for sc in scores]).amax(0)[..., None]
        top = top if group_max is None else group_max(top)
        total = context = None
        for sc, m, seg in zip(scores, masks, segments):
            p = sc.sub_(top).exp_().mul_(m)  # keys masked here add exactly 0, even where a rank sees none
            part = p.sum(-1, keepdim=True), _shared_kv_matmul(p.to(q.dtype), seg[..., :self.rank].to(q.dtype)).float()
            total, context = part if total is None else (total.add_(part[0]), context.add_(part[1]))
        return top, total, context

    def _merge(self, q, segments, masks):
        """-> this rank's heads' latent context [B, heads, tile, rank], float32."""
        _, total, context = self._partial(q, segments, masks, self.ctx.max_over_kv_group)
        merged = self.ctx.reduce_scatter_kv_heads(torch.cat([context, total], dim=-1))
        return merged[..., :self.rank] / merged[..., self.rank:]

    def _kv_b_halves(self):
        """kv_b_proj as per-head W_UK [heads, nope, rank] and W_UV [heads, v_dim, rank]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _attend_naive(self, q_nope, q_pe, cache, mask):
        c_kv, k_pe = cache.split([self.rank, self.rope], dim=-1)
        b, t, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe[:, None].transpose(-1, -2)
        return _softmax(scores * self.scale, mask) @ v

    def _attend_absorbed(self, q_nope, q_pe, cache, mask):
        return self._absorbed(q_nope, q_pe, [cache], [mask])

    def _absorbed(self, q_nope, q_pe, segments, masks):
        """-> [B, heads, S, v_dim], one softmax over all segments."""
        w_uk, w_uv = self._kv_b_halves()
        q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)
        parts = [seg.split([self.rank, self.rope], dim=-1) for seg in segments]
        scores = _cat([_shared_kv_matmul(q_lat, c_kv.transpose(-1, -2))
                       + _shared_kv_matmul(q_pe, k_pe.transpose(-1, -2)) for c_kv, k_pe in parts])
        probs = _softmax(scores * self.scale, _cat(masks))
        ctx_lat = None  # [B, heads, S, rank]
        for p, (c_kv, _) in zip(probs.split([c.shape[1] for c, _ in parts], dim=-1), parts):
            ctx = _shared_kv_matmul(p, c_kv)
            ctx_lat = ctx if ctx_lat is None else ctx_lat + ctx
        return torch.einsum("bhsr,hvr->bhsv", ctx_lat, w_uv)


@dataclass(frozen=True)
class HeadDims:
    """One rank's attention heads and their widths: what a chunk's collectives scale with."""

    heads: int
    nope: int
    rope: int
    v_dim: int
    rank: int  # kv_lora_rank

    @classmethod
    def of(cls, cfg: KimiK2Config, tp: int) -> "HeadDims":
        return cls(cfg.num_attention_heads // tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.kv_lora_rank)


def chunk_group_for(layout, dims: HeadDims, slots: int, queries: int) -> int:
    """A chunk's merge group: the Layout's, else the candidate moving the fewest bytes at these shapes (the larger
    on a tie: fewer collectives)."""
    def moved(c):
        return sum(n * size for _, n, _, size in chunk_collectives(dims, layout.kv_group, c, slots, queries))
    return min(layout.chunk_group_candidates(), key=lambda c: (moved(c), -c))


def chunk_collectives(dims: HeadDims, group: int, chunk_group: int, slots: int, queries: int, rows: int = 1,
                      elem: int = 2) -> list[tuple[str, int, int, int]]:
    """What attend_chunk moves per layer for `rows` x `queries` tokens over `slots` cache slots a rank, with
    `elem`-byte weights, cache and queries: (what, count, ranks, bytes each: an all-gather's output, a
    reduce-scatter's input); the planner times them (neuron/timing.py)."""
    gc, pool = chunk_group, group // chunk_group
    hg, nope, rope, v_dim, rank = dims.heads * gc, dims.nope, dims.rope, dims.v_dim, dims.rank
    out = []
    if pool > 1:
        out.append((f"cache all-gather ({pool} strided ranks)", 1, pool, rows * pool * slots * (rank + rope) * elem))
    if gc > 1:
        out += [("kv_b all-gather (chunk group)", 1, gc, hg * (nope + v_dim) * rank * elem),
                ("un-absorbed Q all-gather (chunk group)", 1, gc, rows * hg * queries * (nope + rope) * elem),
                ("softmax max all-reduce (chunk group), fp32", 1, gc, rows * hg * queries * 4),
                ("[W_UV context | sum] reduce-scatter (chunk group), fp32", 1, gc,
                 rows * hg * queries * (v_dim + 1) * 4)]
    return out


def positional_keys(prefix: torch.Tensor, entries: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, latent]: position k's entry at index k, for attend_positions: prefix[:, k] (the positions read from
    cached blocks) where k < start, a call's entries[:, k - start] from there, zeros after them. prefix [B, P, latent]
    (P may be 0), entries [B, S, latent] of the positions start .. start + S - 1 (padding after the real ones),
    start [B, 1]; width >= P and >= the call's last position + 1."""
    b, s, d = entries.shape
    k = torch.arange(width, device=entries.device)[None, :]
    index = (k - start).clamp(0, s - 1)
    keys = torch.gather(entries, 1, index[..., None].expand(b, width, d))
    if prefix.shape[1]:
        prefix = torch.nn.functional.pad(prefix.to(keys.dtype), (0, 0, 0, width - prefix.shape[1]))
        keys = torch.where((k < start)[..., None], prefix, keys)
    return keys.masked_fill((k >= start + s)[..., None], 0)


def _shared_kv_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, heads, S, K] @ b [B, K, N] -> [B, heads, S, N] as one GEMM: broadcasting b over heads reads the
    cache once per head (30x slower at 32K context on CPU)."""
    bsz, heads, s, k = a.shape
    return (a.reshape(bsz, heads * s, k) @ b).view(bsz, heads, s, b.shape[-1])


def _cat_queries(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Along the key axis; a single part as is (torch.cat would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Softmax in float32 as modeling_deepseek.py does (it upcasts attention weights), then back to the compute dtype.
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return probs.to(scores.dtype)


def _write_cache(cache: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor,
                 owned: torch.Tensor | None = None) -> None:
    """cache[b, slots[b, s]] = entries[b, s] where `owned` [B, S] (default all)."""
    if int(slots.max()) >= cache.shape[1]:
        raise ValueError(f"slot {int(slots.max())} is beyond the KV cache length {cache.shape[1]}")
    rows = torch.arange(cache.shape[0])[:, None].expand_as(slots)
    if owned is None:
        cache[rows, slots] = entries.to(cache.dtype)
    else:
        cache[rows[owned], slots[owned]] = entries[owned].to(cache.dtype)
