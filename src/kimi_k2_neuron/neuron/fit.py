"""Fit planner: does a configuration fit in one trn2.48xlarge logical core's HBM, and how fast could decode be?

Per rank: weights, the MLA KV cache, the MoE layers' temporaries and a stated runtime allowance, against the HBM the
runtime leaves; plus a roofline bound on decode time. Sharding follows the NxDI design (shared/reference/
nxdi_contracts.md §1.4, §3.4, §3.6, §5.1) or issue 17's layout. It plans a RunSpec and refuses what compile_and_save
refuses (both apply rules.py). These are estimates.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass

from dataclasses import replace

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.layout import converted_tensors
from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, ExpertScheme
from kimi_k2_neuron.model.mla import CHUNK_QUERY_TILE, HeadDims, chunk_group_for
from kimi_k2_neuron.parallel import Layout

from . import moe_paths, rules, timing
from .moe_paths import decodes_all_experts
from .rules import check_counts
from .spec import FD_RESERVED_SLOTS, RunSpec
from .timing import (THIS_PORT, Collective, Port, PrefillWork, Timing, chunk_merge, decode_time, experts_read,
                     layout_collectives, moe_prefill_work, prefill_time)

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


@dataclass(frozen=True)
class Plan:
    model: str
    tp: int
    ep: int
    lnc: int
    seq_len: int
    batch: int
    experts: str
    context_len: int  # tokens per sequence in one prefill call (the CTE bucket, NxDI max_context_length)
    prefill_rows: int  # sequences in one prefill call
    moe_prefill: str  # moe_paths.MODES
    prefill_path: str  # what NxD runs for that prefill: prefill_path()
    prefill_blocks: int | None  # blocks per MoE layer on the blockwise paths (the torch path unrolls them)
    decode_path: str  # "all-experts" or "selective" (decodes_all_experts)
    port: Port  # the build modelled: this port's, or a published one's (kv_slots, router dtype, ...)
    layout: Layout
    cache_slots_per_rank: int  # latent cache positions one rank holds per sequence (RunSpec.cache_slots)
    logical_cores: int
    capacity_bytes: int  # the logical core's HBM
    usable_bytes: int  # what the runtime leaves to the model (RUNTIME_RESERVED_BYTES less)
    weights: tuple[Row, ...]
    kv_cache: Row
    allowance: tuple[Row, ...]
    collectives: tuple[Collective, ...]  # what the layout adds to a decode step (among decode.collectives)
    total_bytes: int
    fits: bool
    unfused_fp32_bytes: int  # fp32 dequantization products not in total_bytes (assumed fused; moe_temporaries)
    experts_read_per_layer: int  # routed experts one decode step reads per MoE layer on this core (timing.experts_read)
    bytes_per_token: int
    hbm_bytes_per_s: float
    tpot_lower_bound_s: float  # the byte roofline: bytes_per_token / hbm_bytes_per_s
    decode: Timing  # the modelled decode step (an estimate: timing.py)
    prefill: Timing  # the modelled first prefill call (the context bucket; with chunks, the CTE's chunk 0)
    ttft_s: float  # the modelled prefill of the longest prompt: one bucket, or seq_len tokens in chunks
    assumptions: tuple[str, ...]
    speculation: "Speculation | None" = None  # with an EAGLE3 draft: its HBM (in total_bytes) and the fused step
    chunk: Timing | None = None  # the modelled last prefill chunk (the chunk submodel's call); None unchunked
    # what one chunk's attention moves per layer and rank (timing.chunk_merge); None unchunked or unsharded
    chunk_merge_bytes: int | None = None

    @property
    def kv_slots(self) -> int:
        return self.port.kv_slots

    @property
    def weight_bytes(self) -> int:
        return sum(r.bytes for r in self.weights)

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.total_bytes

    @property
    def presharded_bytes(self) -> int:
        """Also the host RAM: NxDI's load() reads every rank's file whole (NXDI_CONTRACT.md: presharded-load)."""
        return self.weight_bytes * self.tp

    def summary(self) -> str:
        return (f"{self.model}: TP={self.tp} EP={self.ep} LNC={self.lnc} seq_len={self.seq_len} batch={self.batch} "
                f"experts={self.experts} prefill={self.prefill_path} needs {self.total_bytes / GiB:.2f} GiB per "
                f"logical core of "
                f"{self.usable_bytes / GiB:.2f} GiB usable ({'fits' if self.fits else 'does not fit'})")

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("weights", "allowance"):
            d[key] = [{**r, "gib": r["bytes"] / GiB} for r in d[key]]
        d["kv_cache"]["gib"] = self.kv_cache.bytes / GiB
        for key in ("decode", "prefill", "chunk"):
            d[key] = _timing_dict(getattr(self, key)) if getattr(self, key) is not None else None
        if self.speculation is not None:
            d["speculation"] = {**{k: v for k, v in d["speculation"].items() if k != "verify"},
                                "verify": _timing_dict(self.speculation.verify),
                                "effective_tpot_ms": {str(a): self.speculation.tpot_s(a) * 1e3
                                                      for a in ACCEPT_LENGTHS}}
        d.update(tpot_ms=self.decode.total_s * 1e3, ttft_ms=self.ttft_s * 1e3, weight_bytes=self.weight_bytes, headroom_bytes=self.headroom_bytes,
                 presharded_bytes=self.presharded_bytes, presharded_gib=self.presharded_bytes / GiB,
                 total_gib=self.total_bytes / GiB, capacity_gib=self.capacity_bytes / GiB,
                 usable_gib=self.usable_bytes / GiB, unfused_fp32_gib=self.unfused_fp32_bytes / GiB,
                 headroom_gib=self.headroom_bytes / GiB, tpot_lower_bound_ms=self.tpot_lower_bound_s * 1e3)
        return d


def _timing_dict(t: Timing) -> dict:
    """A Timing in ms by component, each collective with its count, group and bytes."""
    return {"total_ms": t.total_s * 1e3, "bytes": t.bytes, "bytes_ms": t.bytes_s * 1e3, "flops_ms": t.flops_s * 1e3,
            "collectives_ms": t.collectives_s * 1e3, "fixed_ms": t.fixed_s * 1e3, "batch_ms": t.batch_s * 1e3,
            "collective_count": t.collective_count,
            "collectives": [{**asdict(c), "ms": c.seconds() * 1e3} for c in t.collectives]}


def _div(n: int, parts: int) -> int:
    """One rank's share of n split `parts` ways, rounded up as NxD pads; exact for every plan, since
    the rules refuse splits that do not divide."""
    return -(-n // parts)


def _check(cfg: KimiK2Config, spec: RunSpec, port: Port) -> None:
    """The shell's rules, and what only a plan can refuse."""
    if port.kv_slots not in (1, 2):
        raise KimiInputError(f"--kv-slots {port.kv_slots!r}: expected 1 (latent only) or 2 (stock KVCacheManager K+V)")
    if port.router_dtype not in ("fp32", "bf16"):
        raise KimiInputError(f"--router-dtype {port.router_dtype!r}: expected fp32 (this port) or bf16")
    if spec.lnc is None:
        raise KimiInputError("--lnc None: the planner needs 1 or 2")
    if spec.layout.sequence_sharded and port.kv_slots != 1:
        raise KimiInputError(f"--kv-slots {port.kv_slots}: the sequence-sharded cache is our latent-only manager's "
                             f"(1)")
    rules.check_shapes(cfg, spec)
    if spec.tp > _logical_cores(spec.lnc):
        raise KimiInputError(f"--tp {spec.tp}: exceeds the {_logical_cores(spec.lnc)} logical cores of a "
                             f"trn2.48xlarge at --lnc {spec.lnc}")
    rules.check_experts(cfg, spec)


def _logical_cores(lnc: int) -> int:
    return TRN2_CHIPS * TRN2_PHYSICAL_CORES_PER_CHIP // lnc


def _expert_scale_bytes(cfg: KimiK2Config, tp: int, ep: int, scheme: ExpertScheme) -> int:
    """Scale bytes of one MoE layer's routed experts on one rank: E/ep experts (expert parallelism inside the tp
    ranks, NxDI moe_ep_degree), each scaling its gate_up [H, 2I/(tp/ep)] and down [I/(tp/ep), H] slices."""
    h, e_local, i_local = cfg.hidden_size, cfg.n_routed_experts // ep, _div(cfg.moe_intermediate_size, tp // ep)
    if not scheme.quantized:
        return 0
    if scheme.block is None:  # scales [E,1,2I] sharded like the weight, [E,1,H] replicated (§3.6)
        return e_local * (2 * i_local + h) * FP32
    # NxD sizes a rank's scale from its local weight shape / block, a dim below the block collapsing to 1 (§3.6).
    b1, b2 = scheme.block
    gate_up = _div(h, b1) * _div(2 * i_local, b2)
    down = _div(i_local, b1) * _div(h, b2)
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


def _weights(cfg: KimiK2Config, tp: int, ep: int, scheme: ExpertScheme, router_dtype: str = "fp32",
             layout: Layout = Layout()) -> list[Row]:
    """Per rank: each tensor of the converted checkpoint, whole where replicated, else 1/tp of it (the routed
    experts too: E/ep experts of I/(tp/ep) each). MTP layers (num_nextn_predict_layers) are not loaded."""
    dtypes = {part: "bf16" for part in Part} | {Part.ROUTER: router_dtype, Part.EXPERT_SCALES: "fp32",
                                                Part.ROUTED_EXPERTS: "fp8" if scheme.quantized else "bf16"}
    size = {"bf16": BF16, "fp32": FP32, "fp8": FP8}
    total = dict.fromkeys(Part, 0)
    for key, (_, shape) in converted_tensors(cfg, BF16_EXPERTS).items():
        part = _part_of(key)
        total[part] += math.prod(shape) // (tp if _split(part, key, layout) else 1) * size[dtypes[part]]
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    total[Part.EXPERT_SCALES] = n_moe * _expert_scale_bytes(cfg, tp, ep, scheme)
    return [Row(_row_name(part, layout, scheme), dtypes[part], total[part], part) for part in Part
            if part is not Part.EXPERT_SCALES or total[part]]


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


def _moe_runs(cfg: KimiK2Config, spec: RunSpec) -> dict:
    """Selective-loading decode (~11 MB at TP=64) is in the calibrated runtime allowance; all-experts is counted."""
    tp, ep, batch, scheme, tokens = spec.tp, spec.ep, spec.batch, spec.scheme, spec.prefill_tokens
    path = moe_paths.prefill_path(cfg, tokens, spec.prefill_mode(cfg))
    decode = "all-experts" if decodes_all_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch) else "selective"
    prefill_bytes, prefill_fp32 = moe_temporaries(cfg, path, tokens, tp, ep, scheme)
    decode_bytes, decode_fp32 = (moe_temporaries(cfg, decode, batch, tp, ep, scheme) if decode == "all-experts"
                                 else (0, 0))
    return dict(prefill_path=path, decode_path=decode, prefill_bytes=prefill_bytes, decode_bytes=decode_bytes,
                prefill_blocks=(moe_paths.blockwise_blocks(cfg, tokens, ep, moe_paths.MODES[path].block_size)
                                if path in moe_paths.MODES and path != "all-experts" else None),
                unfused_fp32_bytes=prefill_fp32 + decode_fp32)


def _allowance(cfg: KimiK2Config, tokens: int, moe: dict, chunked: bool = False) -> list[Row]:
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

def _chunk_attention(cfg: KimiK2Config, tp: int, slots: int, layout: Layout) -> Row | None:
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


def _bytes_per_token(cfg: KimiK2Config, spec: RunSpec, weights: list[Row]) -> tuple[int, int]:
    """(routed experts read per MoE layer, bytes one decode step reads per rank); the duplicate V slot is not
    read."""
    read = experts_read(cfg, spec)
    e_local = cfg.n_routed_experts // spec.ep
    routed = (Part.ROUTED_EXPERTS, Part.EXPERT_SCALES)
    experts = sum(r.bytes for r in weights if r.part in routed)  # weights and scales, every MoE layer
    non_expert = sum(r.bytes for r in weights if r.part not in (*routed, Part.EMBEDDING))
    embed_rows = spec.batch * _div(cfg.hidden_size, spec.tp) * BF16
    kv_read = cfg.num_hidden_layers * spec.batch * spec.cache_slots * cfg.latent_dim * BF16
    return read, int(non_expert + embed_rows + experts * read / e_local + kv_read)


def _prefill_work(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], path: str, prior: int) -> PrefillWork:
    """What one prefill call computes: the non-expert matmuls every token goes through (lm_head and the embedding aside:
    the last position, a gather), and its MoE path's work."""
    dense = [r for r in weights if r.part in (Part.ATTENTION_A, Part.ATTENTION_B, Part.DENSE_MLP, Part.SHARED_EXPERTS,
                                              Part.ROUTER)]
    params = sum(r.bytes // (FP32 if r.dtype == "fp32" else BF16) for r in dense)
    return PrefillWork(spec.prefill_tokens, prior, params, sum(r.bytes for r in dense),
                       moe_prefill_work(cfg, spec, path, spec.scheme.quantized))


def _ttft(cfg: KimiK2Config, spec: RunSpec, weights: list[Row],
          path: str) -> tuple[Timing, float, Timing | None]:
    """(the first prefill call, the prefill of the longest prompt, its last chunk): one bucket, or with chunks a
    prompt of seq_len tokens, chunk k attending the k x N positions before it."""
    first = prefill_time(cfg, spec, _prefill_work(cfg, spec, weights, path, 0), CHUNK_QUERY_TILE)
    n = spec.layout.prefill_chunk
    if n is None or spec.seq_len <= n:
        return first, first.total_s, None
    later = [prefill_time(cfg, spec, _prefill_work(cfg, spec, weights, path, k * n), CHUNK_QUERY_TILE)
             for k in range(1, spec.seq_len // n)]
    return first, first.total_s + sum(t.total_s for t in later), later[-1]


def plan(cfg: KimiK2Config, spec: RunSpec, port: Port = THIS_PORT) -> Plan:
    """The spec's HBM, byte roofline and modelled decode and prefill time per logical core. `port` models another
    build (NxDI's stock KV cache, a bf16 router, ...: timing.Port)."""
    _check(cfg, spec, port)
    tp, ep, lnc, batch, layout = spec.tp, spec.ep, spec.lnc, spec.batch, spec.layout
    capacity = TRN2_HBM_PER_CHIP * lnc // TRN2_PHYSICAL_CORES_PER_CHIP
    bandwidth = TRN2_HBM_BW_PER_CHIP * lnc / TRN2_PHYSICAL_CORES_PER_CHIP
    weights = _weights(cfg, tp, ep, spec.scheme, port.router_dtype, layout)
    # the stock KVCacheManager gives the latent a K and a same-width V slot
    slots, kv_slots = spec.cache_slots, port.kv_slots
    where = f", {slots} slots/rank of G={layout.kv_group}" if layout.sequence_sharded else ""
    kv = Row(f"KV cache (MLA latent x {kv_slots} slot{'s' * (kv_slots > 1)}{where})", "bf16",
             cfg.num_hidden_layers * kv_slots * batch * slots * cfg.latent_dim * BF16)
    moe = _moe_runs(cfg, spec)
    chunk = _chunk_attention(cfg, tp, slots, layout)
    allowance = _allowance(cfg, spec.prefill_tokens, moe, chunked=chunk is not None) + ([chunk] if chunk else [])
    speculation = _speculation(cfg, spec, weights, port)
    total = sum(r.bytes for r in (*weights, kv, *allowance, *(speculation.rows if speculation else ())))
    read, per_token = _bytes_per_token(cfg, spec, weights)
    first, ttft, last_chunk = _ttft(cfg, spec, weights, moe["prefill_path"])
    usable = capacity - RUNTIME_RESERVED_BYTES
    return Plan(
        model=f"{cfg.source} ({cfg.model_type})", tp=tp, ep=ep, lnc=lnc, seq_len=spec.seq_len, batch=batch,
        experts=spec.scheme.name, context_len=spec.context_length, prefill_rows=spec.prefill_batch,
        moe_prefill=spec.prefill_mode(cfg), prefill_path=moe["prefill_path"], prefill_blocks=moe["prefill_blocks"],
        decode_path=moe["decode_path"], port=port, layout=layout, cache_slots_per_rank=slots,
        logical_cores=_logical_cores(lnc), capacity_bytes=capacity, usable_bytes=usable,
        weights=tuple(weights), kv_cache=kv, allowance=tuple(allowance), total_bytes=total,
        collectives=tuple(layout_collectives(cfg, spec, rows=batch, queries=1, query_tile=1)),
        fits=total <= usable, unfused_fp32_bytes=moe["unfused_fp32_bytes"], experts_read_per_layer=read,
        bytes_per_token=per_token, hbm_bytes_per_s=bandwidth, tpot_lower_bound_s=per_token / bandwidth,
        decode=decode_time(cfg, spec, per_token, port), prefill=first, ttft_s=ttft,
        assumptions=_assumptions(port, layout), speculation=speculation, chunk=last_chunk,
        chunk_merge_bytes=(sum(c.count * c.bytes for c in chunk_merge(cfg, spec, 1))
                           if last_chunk and layout.sequence_sharded else None))


def modelled(cfg: KimiK2Config, spec: RunSpec, port: Port = THIS_PORT) -> dict:
    """The planner's modelled times of a run (estimates), for a benchmark to report beside what it measured: TPOT (one
    decode step), one prefill call, the prefill of the longest prompt, each decode component."""
    p = plan(cfg, spec, port)
    return {"estimate": "kimi-k2-neuron plan's time model (neuron/timing.py), not a measurement",
            "tpot_ms": p.decode.total_s * 1e3, "prefill_call_ms": p.prefill.total_s * 1e3,
            "ttft_longest_prompt_ms": p.ttft_s * 1e3, "decode": _timing_dict(p.decode),
            "prefill": _timing_dict(p.prefill),
            **({"speculation": {"fused_step_ms": p.speculation.step_s * 1e3, "effective_tpot_ms": {
                str(a): p.speculation.tpot_s(a) * 1e3 for a in ACCEPT_LENGTHS}}} if p.speculation else {})}


# Chunk sizes the layout search tries (each must divide seq_len and be a multiple of the KV group).
SEARCHED_CHUNKS = (512, 1024, 2048, 4096)


def layouts(cfg: KimiK2Config, spec: RunSpec, modes: tuple[str, ...] = tuple(moe_paths.MODES)) -> list[RunSpec]:
    """spec at every layout the search tries: each KV group NxD can lay out at its TP and LNC, each chunk size or none,
    each split of q_a/kv_a and the router, each of `modes` for the MoE prefill; the rules refuse the ones that cannot
    run. A prefill bucket the spec gives (--max-context-length M) is kept: the one-shot prefill at M, or chunks of
    M."""
    groups = [g for g in range(1, spec.tp + 1) if spec.tp % g == 0
              and rules.group_layout_supported(spec.tp, g, spec.lnc)]
    bucket = spec.max_context_length
    sizes = SEARCHED_CHUNKS if bucket is None else (bucket,)
    chunks = [None, *(n for n in sizes if n < spec.seq_len)]
    splits = [(a, r) for a in (False, True) for r in (False, True)] if spec.tp > 1 else [(False, False)]
    return [replace(spec, max_context_length=bucket if n is None else None, moe_prefill=mode,
                    layout=Layout(kv_group=g, prefill_chunk=n, shard_attn_a=a, shard_router=r))
            for g in groups for n in chunks for a, r in splits for mode in modes]


def best_layout(cfg: KimiK2Config, spec: RunSpec, modes: tuple[str, ...] = tuple(moe_paths.MODES),
                port: Port = THIS_PORT) -> tuple[Plan | None, list[Plan]]:
    """(the fastest layout that fits, by modelled decode time, then TTFT; every fitting plan, fastest first).
    Refused layouts are skipped; the spec's own layout (and MoE prefill mode) is ignored."""
    fitting = []
    for candidate in layouts(cfg, spec, modes):
        try:
            p = plan(cfg, candidate, port)
        except KimiInputError:
            continue
        if p.fits:
            fitting.append(p)
    fitting.sort(key=lambda p: (round(p.decode.total_s, 6), p.ttft_s))
    return (fitting[0] if fitting else None), fitting


def published_spec(cfg: KimiK2Config, name: str) -> tuple[RunSpec, Port]:
    """A published port's run and build (timing.PUBLISHED), for `plan --port NAME`."""
    from kimi_k2_neuron.formats.scheme import scheme_for

    from .spec import Sampling

    p = timing.PUBLISHED_BY_NAME[name]
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_attention_heads)
    if shape != p.shape:
        names = "hidden_size, num_hidden_layers, n_routed_experts, num_attention_heads"
        raise KimiInputError(f"--port {name}: the config given ({names} {shape}) is not the model that port serves "
                             f"{p.shape} (test/data/configs/{p.config}); give that model's config.json")
    fields = dict(p.spec)
    scheme = scheme_for(fields.pop("experts"), "fp8")
    sampling = Sampling(on_device=fields.pop("on_device_sampling", True))
    return RunSpec(**fields, scheme=scheme, sampling=sampling, checkpoint="(published port)"), p.port


def max_seq_len(cfg: KimiK2Config, spec: RunSpec, **kw) -> Plan:
    """The plan at the largest seq_len that fits (spec's own ignored), else at the smallest tried (`fits` False).
    `kw` as plan()."""
    def at(seq_len: int) -> Plan:
        return plan(cfg, replace(spec, seq_len=seq_len), **kw)

    layout, context_len, batch = spec.layout, spec.max_context_length, spec.batch
    fixed_prefill = [("--max-context-length", context_len)] if context_len is not None else []
    check_counts(("--batch", batch), ("--ep", spec.ep), *fixed_prefill, ("--kv-group", layout.kv_group),
                 *((flag, v) for flag, v in (("--prefill-chunk", layout.prefill_chunk),) if v is not None))
    mode = spec.moe_prefill or moe_paths.DEFAULT_MODE  # the search ranges are computed from these
    moe_paths.mode(mode)
    fixed = layout.prefill_chunk if context_len is None else context_len
    multiple = math.lcm(layout.kv_group, layout.prefill_chunk or 1)
    least = 2 * layout.prefill_chunk if layout.prefill_chunk else 1  # a chunk as wide as the cache is refused
    ranges = [(-(-max(lo, least) // s) * s, hi // s * s, s) for lo, hi, step in
              _constant_path_ranges(cfg, batch, spec.ep, fixed, mode) for s in [math.lcm(step, multiple)]]
    ranges = [r for r in ranges if r[0] <= r[1]]
    if not ranges:
        raise KimiInputError(f"--max-seq-len: no seq_len up to max_position_embeddings {cfg.max_position_embeddings} "
                             f"is a multiple of {multiple} (--kv-group, --prefill-chunk)")
    lowest = at(ranges[0][0])  # refuses the other bad arguments before the search
    for lo, hi, step in reversed(ranges):
        best = _largest_fitting(at, lo, hi, step)
        if best is not None:
            return best
    return lowest


def _constant_path_ranges(cfg: KimiK2Config, batch, ep, context_len, moe_prefill) -> list[tuple[int, int, int]]:
    """(lo, hi, step) seq_len intervals in which the total only grows: it can drop where the prefill's MoE path
    changes (moe_paths.prefill_path), so each is searched apart."""
    top = cfg.max_position_embeddings
    if context_len is not None:  # the prefill is fixed: only the KV cache grows
        return [(context_len, top, 1)]
    pairs = batch * cfg.num_experts_per_tok
    block = moe_paths.mode(moe_prefill).block_size
    switches = [-(-cfg.n_routed_experts // pairs), -(-block // pairs)]
    bounds = sorted({1, *(s for s in switches if 1 < s <= top)}) + [top + 1]
    ranges = [(a, b - 1) for a, b in zip(bounds, bounds[1:])]
    if ep > 1:
        ranges = [(a, b) for a, b in ranges if a >= switches[-1]] or ranges[-1:]
    tile = _tile_step(batch) if moe_prefill == "shard-on-block" else 1
    out = []
    for lo, hi in ranges:
        step = tile if moe_paths.prefill_path(cfg, batch * lo, moe_prefill) == moe_prefill else 1
        lo, hi = -(-lo // step) * step, hi // step * step
        if lo <= hi:
            out.append((lo, hi, step))
    return out


def seq_len_step(p: Plan) -> int:
    """The step between the seq_lens around p's that compile."""
    tiled = p.prefill_path == "shard-on-block" and p.context_len == p.seq_len
    return math.lcm(_tile_step(p.batch) if tiled else 1, p.layout.kv_group, p.layout.prefill_chunk or 1)


def max_batch(cfg: KimiK2Config, spec: RunSpec, **kw) -> Plan:
    """The plan at the largest batch that fits (spec's own ignored), else at the smallest (`fits` False); the total
    is non-decreasing in batch (all-experts decode only adds temporaries). `kw` as plan()."""
    def at(batch: int) -> Plan:
        return plan(cfg, replace(spec, batch=batch), **kw)

    one_shot_tiles = (spec.moe_prefill or moe_paths.DEFAULT_MODE) == "shard-on-block" and not spec.layout.prefill_chunk
    step = 128 // math.gcd(spec.context_length, 128) if one_shot_tiles else 1
    # with EP, NxD decodes only on all experts, which needs batch x top_k >= n_routed_experts (rules.check_ep)
    least = _div(cfg.n_routed_experts, cfg.num_experts_per_tok) if spec.ep > 1 else 1
    lo = _div(least, step) * step
    first = at(lo)  # refuses bad arguments before the search
    # every row adds at least its KV cache, so past this many rows nothing fits
    hi = max(lo, first.usable_bytes // max(1, first.kv_cache.bytes // lo) // step * step)
    return _largest_fitting(at, lo, hi, step) or first


def _tile_step(batch: int) -> int:
    """The smallest seq_len step keeping batch x seq_len in whole 128-token tiles (moe_paths.check_prefill_mode)."""
    return 128 // math.gcd(batch, 128)


def _largest_fitting(at, lo: int, hi: int, step: int = 1) -> Plan | None:
    """Bisection for the largest multiple of `step` in [lo, hi] that fits (the total non-decreasing there)."""
    if not at(lo).fits:
        return None
    k_lo, k_hi = lo // step, hi // step
    while k_lo < k_hi:
        mid = (k_lo + k_hi + 1) // 2
        if at(mid * step).fits:
            k_lo = mid
        else:
            k_hi = mid - 1
    return at(k_lo * step)


def prefill_fallbacks(cfg: KimiK2Config, spec: RunSpec, **kw) -> list[Plan]:
    """The other modes' fitting plans, if spec's mode fails to compile; all-experts at its largest fitting bucket."""
    context = spec.context_length
    out = []
    for name in moe_paths.MODES:
        if name == spec.moe_prefill:
            continue
        try:
            at = replace(spec, max_context_length=context, moe_prefill=name)
            p = plan(cfg, at, **kw)
            if not p.fits and name == "all-experts":
                p = _largest_fitting(lambda c: plan(cfg, replace(at, max_context_length=c), **kw), 1, context) or p
        except KimiInputError:
            continue
        if p.fits:
            out.append(p)
    return out


def fallback_advice(plans: list[Plan], failed: str) -> str:
    if not plans:
        return "no other --moe-prefill fits this configuration by the planner; a smaller --seq-len or --batch may"
    lines = [f"if neuronx-cc fails in the --moe-prefill {failed} kernel, these fit by the planner (estimates):"]
    for p in plans:
        bucket = f" --max-context-length {p.context_len}" if p.context_len != p.seq_len else ""
        blocks = f", {p.prefill_blocks} blocks per MoE layer unrolled into the graph" if p.moe_prefill == "torch" \
            else ""
        limit = f" (prompts up to {p.context_len} tokens)" if bucket else ""
        lines.append(f"  --moe-prefill {p.moe_prefill}{bucket}: {p.total_bytes / GiB:.2f} of "
                     f"{p.usable_bytes / GiB:.2f} GiB{blocks}{limit}")
    return "\n".join(lines)


def _assumptions(port: Port, layout: Layout) -> tuple[str, ...]:
    kv = ("2 KV slots: the stock NxDI KVCacheManager allocates a V slot as wide as K, holding a dead copy of the "
          "latent (what a port on the stock manager pays)" if port.kv_slots == 2 else
          "1 KV slot: our LatentKVCacheManager keeps the latent in K and shrinks V to width 1 (--kv-slots 2 "
          "models the stock manager's duplicate V slot)")
    router = "split by experts, logits all-gathered" if layout.shard_router else "replicated"
    attn_a = "split by output rows, output all-gathered" if layout.shard_attn_a else "replicated"
    lc = []
    if layout.sequence_sharded:
        lc.append(f"sequence-sharded cache: NxDI's flash-decoding layout, position p on rank p % {layout.kv_group}, "
                  f"seq_len / G + {FD_RESERVED_SLOTS} slots per rank (NxDI's get_cache_size); its merge adds 3 "
                  f"collectives per layer to a decode step, up to 5 to a prefill chunk (model/mla.py attend_chunk, "
                  f"over the cheaper chunk group)")
    if layout.prefill_chunk:
        lc.append(f"chunked prefill: one row of {layout.prefill_chunk} tokens per call through one graph (batch 1); "
                  "the calibrated scratchpad is scaled to the chunk, plus its attention temporaries as the shell "
                  "tiles them; the chunk graph's own NEFF code is not counted")
    r = port.router_dtype
    return (
        f"non-expert weights bf16; router {r} ({router}), its e_score_correction_bias {r} whole on every rank; "
        f"q_a/kv_a {attn_a}",
        kv, *lc,
        "allowance and usable HBM are calibrated on the AWS DeepSeek-V3 contrib's footprint (1.55 GiB runtime + "
        "prefill scratchpad 512 MiB per 1024 tokens at hidden 7168, in 512 MiB pages; 0.43 GiB kept by the runtime, "
        "bracketed by its seq 512 loading and seq 1024 running out of HBM); estimates",
        "MoE temporaries, from NxD's code (estimates): the NKI prefill kernels get every local expert dequantized to "
        "bf16 first, for both FP8 schemes; the torch and all-experts paths hold the bf16 "
        "copy of each expert they run and their matmul outputs; one MoE layer at a time; the fp32 products of "
        "dequantization are assumed fused into their bf16 results and are not counted",
        "TPOT bound: bytes read per decode step / per-core HBM bandwidth; every local expert when batch x top_k >= "
        "n_routed_experts or EP > 1 (NxD's all-experts decode), else batch x top_k experts per MoE layer, a repeat "
        "read again (NxD's selective loading loops over the tokens); ignores compute, collectives and launch "
        "overheads",
        "modelled TPOT and TTFT (timing.py, estimates, not trn2 measurements): bytes over HBM bandwidth, each "
        "collective at 24 us + bytes / 100 GB/s, 214 us per layer and 46 us per further token per MoE layer fitted on "
        "the AWS DeepSeek-V3 contrib's published TPOT, prefill scaled by a factor fitted on its TTFT; checked against "
        "the community Kimi ports in docs/planner.md",
    )


def format_plan(p: Plan) -> str:
    w = 58
    lines = [f"plan for {p.model}",
             f"trn2.48xlarge LNC={p.lnc}: {p.logical_cores} logical cores x {p.capacity_bytes / GiB:.2f} GiB HBM, "
             f"{p.hbm_bytes_per_s / 1e9:.1f} GB/s each; TP={p.tp} ranks, experts EP={p.ep} x {p.tp // p.ep}",
             f"seq_len {p.seq_len}, batch {p.batch}, routed experts {p.experts}",
             _moe_line(p),
             _layout_line(p),
             "",
             f"{'per logical core':<{w}}{'dtype':>6}{'GiB':>10}"]

    def row(r: Row) -> str:
        return f"  {r.kind:<{w - 2}}{r.dtype:>6}{r.bytes / GiB:>10.3f}"

    lines += [row(r) for r in p.weights]
    lines.append(f"  {'weights':<{w - 2}}{'':>6}{p.weight_bytes / GiB:>10.3f}")
    lines += [row(p.kv_cache)] + [row(r) for r in p.allowance]
    lines += [f"{'total':<{w}}{'':>6}{p.total_bytes / GiB:>10.3f}",
              f"{'HBM per logical core':<{w}}{'':>6}{p.capacity_bytes / GiB:>10.3f}",
              f"{'  kept by the Neuron runtime':<{w}}{'':>6}{(p.capacity_bytes - p.usable_bytes) / GiB:>10.3f}",
              f"{'usable':<{w}}{'':>6}{p.usable_bytes / GiB:>10.3f}",
              f"{'headroom':<{w}}{'':>6}{p.headroom_bytes / GiB:>10.3f}",
              f"fits: {'yes' if p.fits else 'NO'}",
              *([f"not counted: {p.unfused_fp32_bytes / GiB:.3f} GiB of fp32 dequantization products, assumed fused "
                 f"into their bf16 results (see assumptions)"] if p.unfused_fp32_bytes else []),
              "",
              f"host: {p.presharded_bytes / GiB:.1f} GiB of pre-sharded weights ({p.tp} files of "
              f"{p.weight_bytes / GiB:.2f} GiB) on disk, and as much host RAM for NxDI's load(), which reads each "
              f"whole",
              "",
              f"decode roofline, a lower bound and not a prediction: {p.bytes_per_token / 1e9:.3f} GB read per "
              f"token per core ({p.experts_read_per_layer} routed experts per MoE layer) / "
              f"{p.hbm_bytes_per_s / 1e9:.1f} GB/s = TPOT >= {p.tpot_lower_bound_s * 1e3:.2f} ms",
              *_timing_lines(p),
              *_speculation_lines(p),
              "assumptions:"]
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def _timing_lines(p: Plan) -> list[str]:
    """The modelled decode step by component and collective, and the prefill it implies."""
    d, w = p.decode, 52
    lines = ["", f"modelled TPOT, an estimate (timing.py): {d.total_s * 1e3:.2f} ms = bytes {d.bytes_s * 1e3:.2f} + "
                 f"{d.collective_count} collectives {d.collectives_s * 1e3:.2f} + per-layer {d.fixed_s * 1e3:.2f}"
                 + (f" + batch loop {d.batch_s * 1e3:.2f}" if d.batch_s else "") + " ms",
             f"  {'collectives per decode step':<{w - 2}}{'count':>6}{'group':>6}{'bytes':>10}{'ms':>8}"]
    lines += [f"  {c.what:<{w - 2}}{c.count:>6}{c.group:>6}{c.bytes:>10}{c.seconds() * 1e3:>8.2f}"
              for c in d.collectives]
    f = p.prefill
    longest = (f"a prompt of {p.seq_len} tokens in {p.seq_len // p.layout.prefill_chunk} chunks"
               if p.layout.prefill_chunk else f"a {p.context_len}-token bucket")
    lines.append(f"modelled prefill, an estimate: {f.total_s * 1e3:.0f} ms per call ({p.prefill_rows} x "
                 f"{p.context_len} tokens: matmuls {f.flops_s * 1e3:.0f} + MoE/weight traffic {f.bytes_s * 1e3:.0f} + "
                 f"per-layer {f.fixed_s * 1e3:.0f} + {f.collective_count} collectives {f.collectives_s * 1e3:.0f}); "
                 f"TTFT of {longest}: {p.ttft_s:.2f} s")
    if p.chunk is not None:
        c = p.chunk
        lines.append(f"  the last chunk: {c.total_s * 1e3:.0f} ms, {c.collective_count} collectives "
                     f"{c.collectives_s * 1e3:.0f} ms" + (f"; its attention moves {p.chunk_merge_bytes / 1e6:.1f} MB "
                                                           "per layer and rank" if p.chunk_merge_bytes else ""))
    return lines


def _layout_line(p: Plan) -> str:
    o = p.layout
    cache = f"sequence-sharded over G={o.kv_group} ranks" if o.sequence_sharded else "replicated on every rank"
    prefill = f"chunks of {o.prefill_chunk} tokens, one row per call" if o.prefill_chunk else "one call per bucket"
    split = [name for name, on in (("q_a/kv_a", o.shard_attn_a), ("router", o.shard_router)) if on]
    return (f"layout: KV cache {cache} ({p.cache_slots_per_rank} slots per sequence per rank); prefill {prefill}; "
            f"split across ranks: {', '.join(split) or 'none beyond NxDI'}")


def _moe_line(p: Plan) -> str:
    unrolled = " unrolled into the graph" if p.prefill_path == "torch" else ""
    blocks = f", {p.prefill_blocks} blocks per MoE layer{unrolled}" if p.prefill_blocks else ""
    return (f"prefill {p.prefill_rows} x {p.context_len} tokens: MoE {p.prefill_path} path (--moe-prefill {p.moe_prefill}"
            f"{blocks}); decode: {p.decode_path}")


def plan_json(p: Plan, **extra) -> str:
    return json.dumps({**p.to_dict(), **extra}, indent=2)


# -- speculative decoding with an EAGLE3 draft (neuron/fused_spec.py) --------------------------------------------------
#
# One fused step: the draft's speculation_length calls (K - 1 proposals of one token a row, then one call over the K
# candidates that rewrites its cache with the target's hidden states) and one target call verifying K tokens a row
# (NXDI_CONTRACT.md: fused-spec). A step emits 1..K tokens a row; the effective TPOT is the step over the accept
# length. The accept lengths printed: 2.3, the low end of lightseekorg/kimi-k2.5-eagle3's model card (2.3-3.8, K2.5,
# 3 draft steps), and 3.2, inside that range (README: speculative decoding).
ACCEPT_LENGTHS = (2.3, 3.2)


@dataclass(frozen=True)
class Speculation:
    draft: str
    speculation_length: int
    rows: tuple[Row, ...]  # per core: the draft's weights and KV cache, the hidden-state buffer, verify temporaries
    verify_path: str  # the verify call's MoE path for batch x K tokens (NxD's, as a decode of that many tokens)
    verify: Timing  # the target's verify call (timing.decode_time at batch x K tokens, the cache read per row)
    draft_s: float  # the draft's K calls
    step_s: float  # one fused step

    def tpot_s(self, accept_length: float) -> float:
        """The modelled time per token when a step emits accept_length tokens a row on average."""
        return self.step_s / accept_length


def _speculation(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], port: Port) -> Speculation | None:
    """The draft's HBM and the fused step's time (estimates: timing.decode_time for the verify, timing.draft_call_time
    for each draft call); the draft's facts are its config.json's (launch.draft_spec)."""
    d = spec.draft
    if d is None or d.checkpoint is None:
        return None
    c, k, b, tp = d.checkpoint, d.speculation_length, spec.batch, spec.tp
    tokens = b * k
    kv_heads = max(1, c.num_key_value_heads // tp)  # NxDI's GQA replicates KV heads up to the TP degree
    draft_kv = b * spec.seq_len * 2 * kv_heads * c.head_dim * BF16  # MHA, never sequence-sharded
    path = "all-experts" if decodes_all_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, tokens) else \
        "selective"
    norms = 4 * c.hidden_size * BF16  # replicated; the rest is split tp ways (NxDI's Llama, fc included)
    rows = [Row(f"EAGLE3 draft weights (TP; {c.num_attention_heads} heads, vocab {c.vocab_size})", "bf16",
                _div(c.weight_bytes - norms, tp) + norms),
            Row(f"EAGLE3 draft KV cache ({kv_heads} KV head/rank x {spec.seq_len})", "bf16", draft_kv),
            # rows + a spare x 2 x K positions x 3 captured hiddens (NxDI's HiddenStateRollingBuffer)
            Row(f"EAGLE hidden-state buffer ({b}+1 x 2 x {k} x 3 hidden)", "bf16",
                (b + 1) * 2 * k * 3 * c.hidden_size * BF16)]
    if path == "all-experts":
        rows.append(Row(f"verify MoE temporaries (all-experts, {tokens} tokens, 1 layer)", "bf16",
                        moe_temporaries(cfg, path, tokens, tp, spec.ep, spec.scheme)[0]))
    verify_spec = replace(spec, batch=tokens)
    _, verify_bytes = _bytes_per_token(cfg, verify_spec, weights)
    verify_bytes -= (tokens - b) * cfg.num_hidden_layers * spec.cache_slots * cfg.latent_dim * BF16  # per row
    verify = decode_time(cfg, verify_spec, verify_bytes, port)
    call_bytes = _div(c.weight_bytes - 2 * c.vocab_size * c.hidden_size, tp) + draft_kv  # the embedding: a gather
    draft_s = k * timing.draft_call_time(call_bytes)
    return Speculation(draft=str(d.path), speculation_length=k, rows=tuple(rows), verify_path=path, verify=verify,
                       draft_s=draft_s, step_s=verify.total_s + draft_s)


def _speculation_lines(p: Plan) -> list[str]:
    s = p.speculation
    if s is None:
        return []
    w = 58
    lines = ["", f"speculative decoding, an estimate: EAGLE3 draft {s.draft}, --speculation-length "
                 f"{s.speculation_length} (the target verifies {s.speculation_length} tokens a row a step)",
             *(f"  {r.kind:<{w - 2}}{r.dtype:>6}{r.bytes / GiB:>10.3f}" for r in s.rows),
             f"  (in the total above: {sum(r.bytes for r in s.rows) / GiB:.3f} GiB)",
             f"  fused step {s.step_s * 1e3:.2f} ms = target verify of {p.batch} x {s.speculation_length} tokens "
             f"(MoE {s.verify_path}) {s.verify.total_s * 1e3:.2f} + {s.speculation_length} draft calls "
             f"{s.draft_s * 1e3:.2f} ms"]
    lines += [f"  effective TPOT at accept length {a}: {s.tpot_s(a) * 1e3:.2f} ms (without the draft: "
              f"{p.decode.total_s * 1e3:.2f} ms)" for a in ACCEPT_LENGTHS]
    return lines
