"""HBM per trn2 logical core, as the code builds it: the instance's constants, each weight row of the converted
checkpoint per rank, the MoE layers' and a prefill chunk's temporaries, and the runtime allowance (estimates,
calibrated on the AWS DeepSeek-V3 contrib). The fit planner (fit.py) adds them up."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.layout import converted_tensors
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, ExpertScheme
from kimi_k2_neuron.model.mla import CHUNK_QUERY_TILE, HeadDims, chunk_group_for
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.block_cache import key_tile_for, key_width

from . import moe_paths
from .spec import RunSpec

GiB = 2**30
MiB = 2**20

# trn2.48xlarge (aws-neuron-sdk docs, as summarised in shared/reference/peers_and_users.md §3.1).
TRN2_CHIPS = 16                   # trn2-arch.rst: 16 Trainium2 chips per instance
TRN2_PHYSICAL_CORES_PER_CHIP = 8  # trainium2.rst: 8 NeuronCore-v3 per chip
TRN2_HBM_PER_CHIP = 96 * GiB      # trainium2.rst: 96 GiB per chip, 4 banks of 24 GiB, one per LNC=2 logical core
TRN2_HBM_BW_PER_CHIP = 2.9e12     # trainium2.rst: 2.9 TB/s per chip, shared by the chip's logical cores

# Runtime allowance, from the AWS DeepSeek-V3 contrib README (NxDI contrib/models/DeepSeek-V3, 2026-04-03; its "GB"
# are GiB: its ~21.4 per-rank weight files match this module's count with a bf16 router). At TP=64 BF16,
# seq_len 1024, "the TKG model consumes ~23.1GB": minus 21.4 of weights and 0.13 of KV cache leaves ~1.55 GiB of
# NEFF code (with 96 MiB micro-code per physical core, device-memory.rst), DMA rings, I/O tensors, collectives
# buffers and the decode scratchpad. Treated as fixed per core.
RUNTIME_FIXED_BYTES = int(1.55 * GiB)
# Same README: the prefill (CTE) scratchpad is 512 MB at batch*seq = 1024 tokens with hidden 7168. Scaled here
# per token and per hidden unit (about 37 bf16 copies of the hidden state per token).
CTE_SCRATCH_BYTES_PER_TOKEN_PER_HIDDEN = 512 * MiB / (1024 * 7168)
# The runtime allocates shared scratchpad in pages of 512 MiB by default (device-memory.rst).
SCRATCHPAD_PAGE_BYTES = 512 * MiB
# Not all of a logical core's 24 GiB is available to the model. The same contrib loads at seq_len 512 and runs out
# of HBM at seq_len 1024; with the accounting above (its bf16 router, NxDI's stock K+V cache) those need 23.54 and
# 23.60 GiB, so the runtime keeps between 0.40 and 0.46 GiB of the core's HBM for itself (device-memory.rst lists
# such runtime-owned memory: micro-code, collectives, profile buffers). The middle of that 67 MiB bracket:
RUNTIME_RESERVED_BYTES = int(0.43 * GiB)

BF16, FP8, FP32 = 2, 1, 4  # bytes per element


@dataclass(frozen=True)
class Row:
    kind: str  # as it prints
    dtype: str
    bytes: int
    part: "Part | None" = None  # a weight row's part of the model



def div(n: int, parts: int) -> int:
    """One rank's share of n split `parts` ways, rounded up as NxD pads; exact for every plan, since
    the rules refuse splits that do not divide."""
    return -(-n // parts)


def logical_cores(lnc: int) -> int:
    return TRN2_CHIPS * TRN2_PHYSICAL_CORES_PER_CHIP // lnc


def expert_scale_bytes(cfg: KimiK2Config, tp: int, ep: int, scheme: ExpertScheme) -> int:
    """Scale bytes of one MoE layer's routed experts on one rank: E/ep experts (expert parallelism inside the tp
    ranks, NxDI moe_ep_degree), each scaling its gate_up [H, 2I/(tp/ep)] and down [I/(tp/ep), H] slices."""
    h, e_local, i_local = cfg.hidden_size, cfg.n_routed_experts // ep, div(cfg.moe_intermediate_size, tp // ep)
    if not scheme.quantized:
        return 0
    if scheme.block is None:  # scales [E,1,2I] sharded like the weight, [E,1,H] replicated (§3.6)
        return e_local * (2 * i_local + h) * FP32
    # NxD sizes a rank's scale from its local weight shape / block, a dim below the block collapsing to 1 (§3.6).
    b1, b2 = scheme.block
    gate_up = div(h, b1) * div(2 * i_local, b2)
    down = div(i_local, b1) * div(h, b2)
    return e_local * (gate_up + down) * FP32


class Part(str, enum.Enum):
    """What a weight row holds, in the order the rows print; the value is its name where nothing is split that the
    NxDI design replicates (_row_name)."""

    ATTENTION_A = "attention q_a+kv_a"
    ATTENTION_B = "attention q_b+kv_b+o (TP)"
    NORMS = "norms (replicated)"
    EMBEDDING = "embedding (TP)"
    LM_HEAD = "lm_head (TP)"
    DENSE_MLP = "dense MLP (TP)"
    SHARED_EXPERTS = "shared experts (TP)"
    ROUTER = "router + bias"
    ROUTED_EXPERTS = "routed experts (E/ep, I/(tp/ep))"
    EXPERT_SCALES = "routed expert scales"


# The first key fragments of the converted checkpoint's tensors each part holds (formats.layout.converted_tensors);
# the dense MLP is what is left: the first_k_dense_replace layers' mlp.{gate,up,down}_proj. q_a_proj and
# kv_a_proj_with_mqa are plain nn.Linear on every rank in the NxDI design (§5.1); q_b/kv_b/o split by heads; the
# embedding along its embedding dim, lm_head along the vocab.
_KEYS = {
    Part.ATTENTION_A: ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa."),
    Part.ATTENTION_B: ("self_attn.q_b_proj.", "self_attn.kv_b_proj.", "self_attn.o_proj."),
    Part.NORMS: ("layernorm.", "model.norm."),
    Part.EMBEDDING: ("embed_tokens.",),
    Part.LM_HEAD: ("lm_head.",),
    Part.SHARED_EXPERTS: ("shared_experts.",),
    Part.ROUTER: ("mlp.gate.",),
    Part.ROUTED_EXPERTS: ("mlp.expert_mlps.",),
}
_ROUTER_BIAS = "e_score_correction_bias"


def _row_name(part: Part, layout: Layout, scheme: ExpertScheme) -> str:
    """A row's printed name under this layout: what is whole on every rank says replicated. q_a/kv_a and the router
    are whole on every rank unless the layout splits them (Layout.shard_attn_a / shard_router): then each rank holds
    1/tp of the output rows and gathers the output; the router's bias [E] stays whole (selection reads all of it)."""
    if part is Part.ATTENTION_A:
        return f"{part.value} ({'TP, gathered' if layout.shard_attn_a else 'replicated'})"
    if part is Part.ROUTER:
        return "router (TP, gathered) + bias (replicated)" if layout.shard_router else "router + bias (replicated)"
    if part is Part.EXPERT_SCALES:
        return f"{part.value} ({scheme.name[4:]})"
    return part.value


def _split(part: Part, key: str, layout: Layout) -> bool:
    """Whether a tensor of this part is split across the tp ranks."""
    if part is Part.NORMS:
        return False
    if part is Part.ATTENTION_A:
        return layout.shard_attn_a
    if part is Part.ROUTER:
        return layout.shard_router and not key.endswith(_ROUTER_BIAS)
    return True


def _part_of(key: str) -> Part:
    return next((part for part, frags in _KEYS.items() if any(f in key for f in frags)), Part.DENSE_MLP)


def weight_rows(cfg: KimiK2Config, tp: int, ep: int, scheme: ExpertScheme, router_dtype: str = "fp32",
                layout: Layout = Layout()) -> list[Row]:
    """Per rank: each tensor of the converted checkpoint, whole where replicated, else 1/tp of it (the routed
    experts too: E/ep experts of I/(tp/ep) each). MTP layers (num_nextn_predict_layers) are not loaded."""
    return list(_weight_rows(cfg, tp, ep, scheme, router_dtype, layout))


@functools.lru_cache(maxsize=512)  # every argument is frozen; the planner's searches ask for the same rows often
def _weight_rows(cfg: KimiK2Config, tp: int, ep: int, scheme: ExpertScheme, router_dtype: str,
                 layout: Layout) -> tuple[Row, ...]:
    dtypes = {part: "bf16" for part in Part} | {Part.ROUTER: router_dtype, Part.EXPERT_SCALES: "fp32",
                                                Part.ROUTED_EXPERTS: "fp8" if scheme.quantized else "bf16"}
    size = {"bf16": BF16, "fp32": FP32, "fp8": FP8}
    total = dict.fromkeys(Part, 0)
    for key, (_, shape) in converted_tensors(cfg, BF16_EXPERTS).items():
        part = _part_of(key)
        total[part] += math.prod(shape) // (tp if _split(part, key, layout) else 1) * size[dtypes[part]]
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    total[Part.EXPERT_SCALES] = n_moe * expert_scale_bytes(cfg, tp, ep, scheme)
    return tuple(Row(_row_name(part, layout, scheme), dtypes[part], total[part], part) for part in Part
                 if part is not Part.EXPERT_SCALES or total[part])


# -- what the MoE layers allocate while they run ---------------------------------------------------------------------
#
# Estimates from NxD's code (NXDI_CONTRACT.md: moe-temporaries): kernel paths dequantize every local expert to bf16
# (activations are in the calibrated scratchpad); torch paths dequantize/gather each expert they compute and keep
# bf16 matmul outputs. Counted: those, one layer at a time. Not counted (Plan.unfused_fp32_bytes): fp32 x scale
# products, assumed fused, as the GLM-5.2 contrib's all-experts prefill shows: unfused, its down projection alone
# would take 12.9 GB beside ~15 GB of weights (NXDI_CONTRACT.md: glm5-all-experts).

def moe_temporaries(cfg: KimiK2Config, path: str, tokens: int, tp: int, ep: int,
                    scheme: ExpertScheme) -> tuple[int, int]:
    """(counted bf16 bytes, fp32 bytes assumed fused) for one MoE layer on one rank (see the comment above)."""
    h, e_local, i_local = cfg.hidden_size, cfg.n_routed_experts // ep, moe_paths.local_intermediate(cfg, tp, ep)
    kernel = path in moe_paths.KERNEL_MODES
    # (experts dequantized or gathered at once, rows each one computes)
    n, rows = ((e_local, 0) if kernel else
               {"all-experts": (e_local, tokens), "torch": (1, moe_paths.MODES["torch"].block_size),
                "selective": (cfg.num_experts_per_tok, 1)}[path])
    weights = n * 3 * h * i_local  # gate_up [H, 2I/tp] + down [I/tp, H] elements
    copied = scheme.quantized or path in ("torch", "selective")  # dequantized, or gathered by index
    counted = ((weights if copied else 0) + n * rows * (3 * i_local + h)) * BF16
    # weight x scale: blockwise weights, and per-channel ones on the kernel paths
    fp32_weights = weights if scheme.name == "fp8-blockwise" or (kernel and scheme.quantized) else 0
    # output x scale: per-channel gate_up and down outputs on the torch paths
    fp32_outputs = n * rows * (2 * i_local + h) if scheme.name == "fp8-per-channel" and not kernel else 0
    return counted, (fp32_weights + fp32_outputs) * FP32


def moe_runs(cfg: KimiK2Config, spec: RunSpec) -> dict:
    """Selective-loading decode (~11 MB at TP=64) is in the calibrated runtime allowance; all-experts is counted."""
    tp, ep, batch, scheme, tokens = spec.tp, spec.ep, spec.batch, spec.scheme, spec.prefill_tokens
    path = moe_paths.prefill_path(cfg, tokens, spec.prefill_mode(cfg))
    decode = spec.decode_path(cfg)
    prefill_bytes, prefill_fp32 = moe_temporaries(cfg, path, tokens, tp, ep, scheme)
    decode_bytes, decode_fp32 = (moe_temporaries(cfg, decode, batch, tp, ep, scheme) if decode == "all-experts"
                                 else (0, 0))
    return dict(prefill_path=path, decode_path=decode, prefill_bytes=prefill_bytes, decode_bytes=decode_bytes,
                prefill_blocks=(moe_paths.blockwise_blocks(cfg, tokens, ep, moe_paths.MODES[path].block_size)
                                if path in moe_paths.MODES and path != "all-experts" else None),
                unfused_fp32_bytes=prefill_fp32 + decode_fp32)


def allowance_rows(cfg: KimiK2Config, tokens: int, moe: dict, chunked: bool = False) -> list[Row]:
    act, temp = int(tokens * cfg.hidden_size * CTE_SCRATCH_BYTES_PER_TOKEN_PER_HIDDEN), moe["prefill_bytes"]
    pages = max(1, math.ceil((act + temp) / SCRATCHPAD_PAGE_BYTES))
    rows = [Row("runtime: NEFF code, DMA rings, I/O, CC, decode scratch", "-", RUNTIME_FIXED_BYTES),
            Row(f"prefill activations (calibrated, {'1 row x chunk' if chunked else 'batch x context'})", "bf16",
                act),
            Row(f"prefill MoE temporaries ({moe['prefill_path']} path, 1 layer)", "bf16", temp),
            Row(f"prefill scratchpad: rest of {pages} x 512 MiB page{'s' * (pages > 1)}", "-",
                pages * SCRATCHPAD_PAGE_BYTES - act - temp)]
    if moe["decode_bytes"]:
        rows.append(Row("decode MoE temporaries (all-experts path, 1 layer)", "bf16", moe["decode_bytes"]))
    return rows


# -- the long-context layout (issue 17): the chunk's attention temporaries ------------------------------------------
#
# A chunk attends in tiles of the shell's CHUNK_QUERY_TILE queries (model/mla.py attend_chunk, as the decoder layer
# calls it) over Gc adjacent ranks' heads (mla.chunk_group_for), each rank holding its KV group's G / Gc pooled
# caches; the merge is in float32.

def chunk_attention_row(cfg: KimiK2Config, tp: int, slots: int, layout: Layout) -> Row | None:
    """One layer's chunk attention temporaries as attend_chunk builds them; None unchunked (the calibrated
    scratchpad holds that)."""
    n = layout.prefill_chunk
    if n is None:
        return None
    dims, g = HeadDims.of(cfg, tp), layout.kv_group
    h, nope, rope, v, r = dims.heads, dims.nope, dims.rope, dims.v_dim, dims.rank
    c = chunk_group_for(layout, dims, slots, n)
    hg, pool, tile = h * c, g // c, min(CHUNK_QUERY_TILE, n)
    kv_b = hg * (nope + v) * r * BF16 if c > 1 else 0  # the gathered kv_b (at Gc = 1 the rank's own)
    cache = pool * slots * cfg.latent_dim * BF16 if pool > 1 else 0
    queries = hg * n * (nope + rope) * BF16 + hg * tile * cfg.latent_dim * BF16  # gathered; a tile absorbed
    active = n // c * cfg.latent_dim * BF16 + n * (n // c)  # the chunk entries this rank attends, their bool mask
    scores = hg * tile * (pool * slots + n // c) * FP32  # made float32 once, then exponentiated in place
    # then, one segment at a time: the cache's probabilities in bf16 and their matmul's output; or a latent context
    # summed in float32 with the next part and its bf16 matmul output
    segment = hg * tile * max(pool * slots * BF16 + r * BF16, r * (2 * FP32 + BF16))
    merged = hg * n * (v + 2) * FP32  # every tile's [W_UV context | sum] and max, merged after the last tile
    pooled = f", {pool} caches pooled" if pool > 1 else ""
    return Row(f"prefill chunk attention ({hg} heads, {tile}-query tiles{pooled})", "mixed",
               kv_b + cache + active + queries + scores + segment + merged)


# -- prefix caching: the block pool and the prefill's attention over it ---------------------------------------------

def block_bytes(cfg: KimiK2Config, block_size: int) -> int:
    """One block of every layer on one rank: the latent in K, the 1-wide V (LatentBlockKVCacheManager)."""
    return cfg.num_hidden_layers * block_size * (cfg.latent_dim + 1) * BF16


def block_pool_row(cfg: KimiK2Config, spec: RunSpec) -> Row:
    """vLLM's blocks, its null block 0 and NxDI's reserve for padded writes, whole on every rank."""
    n = spec.pool_blocks
    return Row(f"KV cache: block pool ({n} + 2 blocks x {spec.block_size}, latent + 1-wide V)", "bf16",
               (n + 2) * block_bytes(cfg, spec.block_size))


def block_attention_row(cfg: KimiK2Config, spec: RunSpec) -> Row:
    """One layer's prefill attention over blocks as MLAttention.attend_positions builds it for the largest call: the
    keys laid out by position (the prefix bucket padded, the call's entries gathered, their merge), every key's kv_b
    expansion, and one query tile's float32 scores over all of them."""
    dims, ctx = HeadDims.of(cfg, spec.tp), spec.context_length
    w = key_width(spec.seq_len + ctx, key_tile_for(spec.seq_len))
    q = min(CHUNK_QUERY_TILE, ctx)
    total = 3 * w * cfg.latent_dim * BF16 + dims.heads * w * (dims.nope + dims.v_dim) * BF16 + dims.heads * q * w * FP32
    return Row(f"prefill attention over blocks ({w} keys, {q}-query tiles)", "mixed", total)
