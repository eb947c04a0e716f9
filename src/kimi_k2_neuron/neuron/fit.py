"""Fit planner: does a configuration fit in one trn2.48xlarge logical core's HBM, and how fast could decode be?

Per rank: weights, the MLA KV cache, the MoE layers' temporaries and a stated runtime allowance (hbm.py), against the
HBM the runtime leaves; plus a roofline bound on decode time and the modelled step (timing.py). Sharding follows the
NxDI design (shared/reference/nxdi_contracts.md §1.4, §3.4, §3.6, §5.1) or issue 17's layout. It plans a RunSpec and
refuses what compile_and_save refuses (both apply rules.py). These are estimates. The searches over it are
layout_search.py's, its text report plan_report.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.model.mla import CHUNK_QUERY_TILE
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.runtime.block_cache import key_tile_for, key_width

from . import moe_paths, rules, timing
from .hbm import (BF16, FP32, GiB, RUNTIME_RESERVED_BYTES, TRN2_HBM_BW_PER_CHIP, TRN2_HBM_PER_CHIP,
                  TRN2_PHYSICAL_CORES_PER_CHIP, Part, Row, allowance_rows, block_attention_row, block_bytes,
                  block_pool_row, chunk_attention_row, div, logical_cores, moe_runs, moe_temporaries, weight_rows)
from .spec import FD_RESERVED_SLOTS, RunSpec, prefix_caching_buckets, prefix_caching_calls
from .timing import (THIS_PORT, Collective, Port, PrefillWork, Timing, chunk_merge, decode_time, decode_traffic,
                     experts_read, layout_collectives, moe_prefill_work, prefill_time)



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
    decode_path: str  # the token-generation MoE path run (RunSpec.decode_path: --moe-decode or the time model's)
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
    prefix: "PrefixTurn | None" = None  # with --prefix-caching: the block pool and a turn reusing a prefix

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
                                "effective_tpot_ms": self.speculation.effective_tpot_ms()}
        if self.prefix is not None:
            x = self.prefix
            d["prefix"] = {**{k: v for k, v in d["prefix"].items() if k not in ("warm", "cold")},
                           "pool_tokens": x.pool_tokens, "more_tokens": x.more_blocks * x.block_size,
                           "warm_ms": x.warm_s * 1e3, "cold_ms": x.cold_s * 1e3, "warm_over_cold": x.warm_s / x.cold_s,
                           "warm": [_timing_dict(t) for t in x.warm], "cold": [_timing_dict(t) for t in x.cold]}
        d.update(tpot_ms=self.decode.total_s * 1e3, ttft_ms=self.ttft_s * 1e3, weight_bytes=self.weight_bytes,
                 headroom_bytes=self.headroom_bytes,
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
            "collectives": [{**asdict(c), "ms": c.seconds() * 1e3} for c in t.collectives],
            **({"compute": _compute_dict(t.compute)} if t.compute is not None else {})}


def _compute_dict(c) -> dict:
    """A decode step's compute (engines.Compute) by matmul, in ms."""
    return {"moe_path": c.moe_path, "tensor_engine_ms": c.tensor_s * 1e3, "vector_engine_ms": c.vector_s * 1e3,
            "routed_experts_ms": c.routed_s() * 1e3, "flops": c.flops,
            "matmuls": [{**asdict(m), "ms": m.seconds() * 1e3} for m in c.matmuls]}



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
    if spec.tp > logical_cores(spec.lnc):
        raise KimiInputError(f"--tp {spec.tp}: exceeds the {logical_cores(spec.lnc)} logical cores of a "
                             f"trn2.48xlarge at --lnc {spec.lnc}")
    rules.check_experts(cfg, spec)


def bytes_per_token(cfg: KimiK2Config, spec: RunSpec, weights: list[Row]) -> tuple[int, int]:
    """(routed experts read per MoE layer, bytes one decode step moves per rank: the weights and cache it reads, the
    all-experts outputs it writes and reads back); the duplicate V slot is not read."""
    path = spec.decode_path(cfg)
    read = experts_read(cfg, spec, path)
    e_local = cfg.n_routed_experts // spec.ep
    routed = (Part.ROUTED_EXPERTS, Part.EXPERT_SCALES)
    experts = sum(r.bytes for r in weights if r.part in routed)  # weights and scales, every MoE layer
    non_expert = sum(r.bytes for r in weights if r.part not in (*routed, Part.EMBEDDING))
    embed_rows = spec.batch * div(cfg.hidden_size, spec.tp) * BF16
    kv_read = cfg.num_hidden_layers * spec.batch * spec.cache_slots * cfg.latent_dim * BF16
    return read, int(non_expert + embed_rows + experts * read / e_local + kv_read + decode_traffic(cfg, spec, path))


def _prefill_work(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], path: str, prior: int) -> PrefillWork:
    """What one prefill call computes: the non-expert matmuls every token goes through (lm_head and the embedding aside:
    the last position, a gather), and its MoE path's work."""
    dense = [r for r in weights if r.part in (Part.ATTENTION_A, Part.ATTENTION_B, Part.DENSE_MLP, Part.SHARED_EXPERTS,
                                              Part.ROUTER)]
    params = sum(r.bytes // (FP32 if r.dtype == "fp32" else BF16) for r in dense)
    return PrefillWork(spec.prefill_tokens, prior, params, sum(r.bytes for r in dense),
                       moe_prefill_work(cfg, spec, path, spec.scheme.quantized))


def prefill_call(cfg: KimiK2Config, spec: RunSpec, prior: int = 0, port: Port = THIS_PORT,
                 c: timing.Constants = timing.TRN2) -> Timing:
    """One prefill call of spec.prefill_tokens tokens after `prior` positions already in the cache (a chunk's, or a
    turn's cached prefix), on the MoE path NxD takes for that many tokens (an estimate: timing.prefill_time)."""
    weights = weight_rows(cfg, spec.tp, spec.ep, spec.scheme, port.router_dtype, spec.layout)
    path = moe_paths.prefill_path(cfg, spec.prefill_tokens, spec.prefill_mode(cfg))
    return prefill_time(cfg, spec, _prefill_work(cfg, spec, weights, path, prior), CHUNK_QUERY_TILE, c)


def _ttft(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], path: str, c: timing.Constants,
          longest: bool = True) -> tuple[Timing, float, Timing | None]:
    """(the first prefill call, the prefill of the longest prompt, its last chunk): one bucket, or with chunks a
    prompt of seq_len tokens, chunk k attending the k x N positions before it (not longest: the first call's); with
    prefix caching, its calls with nothing cached (turn_calls)."""
    if spec.prefix_caching:
        calls = turn_calls(cfg, spec, weights, 0, spec.seq_len, c)
        return calls[0], sum(t.total_s for t in calls), calls[-1] if len(calls) > 1 and longest else None
    first = prefill_time(cfg, spec, _prefill_work(cfg, spec, weights, path, 0), CHUNK_QUERY_TILE, c)
    n = spec.layout.prefill_chunk
    if n is None or spec.seq_len <= n or not longest:
        return first, first.total_s, None
    later = [prefill_time(cfg, spec, _prefill_work(cfg, spec, weights, path, k * n), CHUNK_QUERY_TILE, c)
             for k in range(1, spec.seq_len // n)]
    return first, first.total_s + sum(t.total_s for t in later), later[-1]


def plan(cfg: KimiK2Config, spec: RunSpec, port: Port = THIS_PORT, c: timing.Constants = timing.TRN2,
         longest_prompt: bool = True, turn: tuple[int, int] | None = None) -> Plan:
    """The spec's HBM, byte roofline and modelled decode and prefill time per logical core. `port` models another
    build (NxDI's stock KV cache, a bf16 router, ...: timing.Port), `c` other constants. Without --moe-decode,
    planned at the path the spec decides (RunSpec.decode_path), else at the one the time model says is fastest: the
    lowest modelled decode step among those that fit, NxD's own on a tie. longest_prompt False: ttft_s is the first
    prefill call's alone (for searches that time their own prompts: workload.py). With prefix caching, `turn`
    (cached, new positions; default TURN) is the turn whose warm and cold prefill it models."""
    if spec.moe_decode is None:
        given = spec.decode_path(cfg)
        if given is not None:
            return plan(cfg, replace(spec, moe_decode=given), port, c, longest_prompt, turn)
        plans = [plan(cfg, replace(spec, moe_decode=path), port, c, longest_prompt, turn)
                 for path in moe_paths.decode_candidates(spec.ep)]
        nxd = moe_paths.nxd_decode_path(cfg, spec.batch)
        return min(plans, key=lambda p: (not p.fits, round(p.decode.total_s, 9), p.decode_path != nxd))
    _check(cfg, spec, port)
    tp, ep, lnc, batch, layout = spec.tp, spec.ep, spec.lnc, spec.batch, spec.layout
    capacity = TRN2_HBM_PER_CHIP * lnc // TRN2_PHYSICAL_CORES_PER_CHIP
    bandwidth = TRN2_HBM_BW_PER_CHIP * lnc / TRN2_PHYSICAL_CORES_PER_CHIP
    weights = weight_rows(cfg, tp, ep, spec.scheme, port.router_dtype, layout)
    # the stock KVCacheManager gives the latent a K and a same-width V slot
    slots, kv_slots = spec.cache_slots, port.kv_slots
    where = f", {slots} slots/rank of G={layout.kv_group}" if layout.sequence_sharded else ""
    kv = Row(f"KV cache (MLA latent x {kv_slots} slot{'s' * (kv_slots > 1)}{where})", "bf16",
             cfg.num_hidden_layers * kv_slots * batch * slots * cfg.latent_dim * BF16)
    moe = moe_runs(cfg, spec)
    chunk = chunk_attention_row(cfg, tp, slots, layout)
    if spec.prefix_caching:  # the pool for the cache; no chunk submodel, the prefill attends over blocks
        kv, chunk = block_pool_row(cfg, spec), block_attention_row(cfg, spec)
    allowance = allowance_rows(cfg, spec.prefill_tokens, moe, chunked=chunk is not None) + ([chunk] if chunk else [])
    speculation = _speculation(cfg, spec, weights, port)
    total = sum(r.bytes for r in (*weights, kv, *allowance, *(speculation.rows if speculation else ())))
    read, per_token = bytes_per_token(cfg, spec, weights)
    first, ttft, last_chunk = _ttft(cfg, spec, weights, moe["prefill_path"], c, longest_prompt)
    usable = capacity - RUNTIME_RESERVED_BYTES
    return Plan(
        model=f"{cfg.source} ({cfg.model_type})", tp=tp, ep=ep, lnc=lnc, seq_len=spec.seq_len, batch=batch,
        experts=spec.scheme.name, context_len=spec.context_length, prefill_rows=spec.prefill_batch,
        moe_prefill=spec.prefill_mode(cfg), prefill_path=moe["prefill_path"], prefill_blocks=moe["prefill_blocks"],
        decode_path=spec.moe_decode, port=port, layout=layout, cache_slots_per_rank=slots,
        logical_cores=logical_cores(lnc), capacity_bytes=capacity, usable_bytes=usable,
        weights=tuple(weights), kv_cache=kv, allowance=tuple(allowance), total_bytes=total,
        collectives=tuple(layout_collectives(cfg, spec, rows=batch, queries=1, query_tile=1)),
        fits=total <= usable, unfused_fp32_bytes=moe["unfused_fp32_bytes"], experts_read_per_layer=read,
        bytes_per_token=per_token, hbm_bytes_per_s=bandwidth, tpot_lower_bound_s=per_token / bandwidth,
        decode=decode_time(cfg, spec, per_token, port, c), prefill=first, ttft_s=ttft,
        assumptions=_assumptions(port, layout, spec), speculation=speculation, chunk=last_chunk,
        chunk_merge_bytes=(sum(c.count * c.bytes for c in chunk_merge(cfg, spec, 1))
                           if last_chunk and layout.sequence_sharded else None),
        prefix=(prefix_caching(cfg, spec, weights, usable - total, turn or TURN, c) if spec.prefix_caching else None))


# -- prefix caching: the pool, and a turn that reuses a cached prefix -------------------------------------------------

# the agentic turn plan prints (issue 37): a long shared history cached, a tool result and a question added
TURN = (65536, 2048)


@dataclass(frozen=True)
class PrefixTurn:
    """The block pool per rank and a turn's modelled prefill with and without its prefix cached (estimates)."""

    block_size: int
    pool_blocks: int  # vLLM's blocks (--num-gpu-blocks-override)
    block_bytes: int  # one block of every layer on one rank
    more_blocks: int  # blocks the HBM headroom would hold beyond the pool (0 when it does not fit)
    cached: int  # the turn: positions in cached blocks
    new: int  # and positions to prefill
    warm_calls: tuple[tuple[int, int], ...]  # (prefill bucket, prefix bucket) of each call, as NxDI picks them
    warm: tuple[Timing, ...]
    cold_calls: tuple[tuple[int, int], ...]  # the same prompt with nothing cached
    cold: tuple[Timing, ...]

    @property
    def pool_tokens(self) -> int:
        """Positions the pool holds: every row's running sequence and whatever history stays cached beside them."""
        return self.pool_blocks * self.block_size

    @property
    def warm_s(self) -> float:
        return sum(t.total_s for t in self.warm)

    @property
    def cold_s(self) -> float:
        return sum(t.total_s for t in self.cold)


def turn_calls(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], cached: int, new: int,
               c: timing.Constants = timing.TRN2) -> list[Timing]:
    """Each context-encoding call prefilling `new` positions after `cached` ones in blocks (spec.prefix_caching_calls:
    NxDI's bucket choice, the chunks), timed as prefill_time counts a call: its prefill bucket's tokens through the
    dense layers and the MoE path NxD takes for them, every key tile of its positions (prefix bucket + prefill
    bucket) scored after kv_b expands each key (MLAttention.attend_positions)."""
    tile, mode = key_tile_for(spec.seq_len), spec.prefill_mode(cfg)
    out = []
    for a, pfx in prefix_caching_calls(spec, cached, new):
        call = replace(spec, max_context_length=a, layout=replace(spec.layout, prefill_chunk=None))
        keys = key_width(pfx + a, tile)
        work = replace(_prefill_work(cfg, call, weights, moe_paths.prefill_path(cfg, a, mode), pfx), keys=keys,
                       expanded_keys=keys)
        out.append(prefill_time(cfg, call, work, CHUNK_QUERY_TILE, c))
    return out


def turn_seconds(cfg: KimiK2Config, spec: RunSpec, cached: int, new: int) -> float:
    """The modelled prefill (TTFT less the first token's sampling) of a turn of `new` positions after `cached` ones in
    blocks: the planner's serving view reads a warm turn from here (an estimate)."""
    weights = weight_rows(cfg, spec.tp, spec.ep, spec.scheme, THIS_PORT.router_dtype, spec.layout)
    return sum(t.total_s for t in turn_calls(cfg, spec, weights, cached, new))


def prefix_caching(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], headroom: int,
                   turn: tuple[int, int] = TURN, c: timing.Constants = timing.TRN2) -> PrefixTurn:
    """The pool, what the headroom would add to it, and `turn` (cached, new) warm and cold, shortened to seq_len."""
    cached, new = turn
    new = min(new, spec.seq_len)
    cached = min(cached, spec.seq_len - new) // spec.block_size * spec.block_size  # vLLM hits whole blocks
    per_block = block_bytes(cfg, spec.block_size)
    warm, cold = prefix_caching_calls(spec, cached, new), prefix_caching_calls(spec, 0, cached + new)
    return PrefixTurn(spec.block_size, spec.pool_blocks, per_block, max(0, headroom) // per_block, cached, new,
                         tuple(warm), tuple(turn_calls(cfg, spec, weights, cached, new, c)), tuple(cold),
                         tuple(turn_calls(cfg, spec, weights, 0, cached + new, c)))


def modelled(cfg: KimiK2Config, spec: RunSpec, port: Port = THIS_PORT) -> dict:
    """The planner's modelled times of a run (estimates), for a benchmark to report beside what it measured: TPOT (one
    decode step), one prefill call, the prefill of the longest prompt, each decode component."""
    p = plan(cfg, spec, port)
    return {"estimate": "kimi-k2-neuron plan's time model (neuron/timing.py), not a measurement",
            "tpot_ms": p.decode.total_s * 1e3, "prefill_call_ms": p.prefill.total_s * 1e3,
            "ttft_longest_prompt_ms": p.ttft_s * 1e3, "decode": _timing_dict(p.decode),
            "prefill": _timing_dict(p.prefill),
            **({"speculation": {"fused_step_ms": p.speculation.step_s * 1e3,
                                "effective_tpot_ms": p.speculation.effective_tpot_ms()}} if p.speculation else {})}



def _assumptions(port: Port, layout: Layout, spec: RunSpec | None = None) -> tuple[str, ...]:
    c = timing.TRN2
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
    if spec is not None and spec.prefix_caching:
        prefill, prefix = prefix_caching_buckets(spec)
        lc.append(f"prefix caching: the latent cache in NxDI's block layout, one pool on every rank; "
                  f"{len(prefill)} x {len(prefix) + 1} context-encoding graphs (prefill buckets {prefill[0]}.."
                  f"{prefill[-1]} by prefix buckets 0, {prefix[0]}..{prefix[-1]}; their NEFF code not counted); a call "
                  f"scores every key tile of its positions, no causal halving, after kv_b expands each key "
                  f"(neuron/prefix_caching.py); a turn's cached positions are whole blocks (vLLM's hits)")
    elif layout.prefill_chunk:
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
        "TPOT bound: bytes moved per decode step / per-core HBM bandwidth; every local expert on the all-experts "
        "decode path (and its [experts, batch, hidden] output written and read back), else batch x top_k experts per "
        "MoE layer, a repeat read again (NxD's selective loading loops over the tokens); ignores compute, collectives "
        "and launch overheads",
        f"modelled TPOT and TTFT (timing.py, estimates, not trn2 measurements): bytes over HBM bandwidth, each "
        f"collective at {c.alpha_s * 1e6:.0f} us + bytes / {c.beta_bytes_per_s / 1e9:.0f} GB/s, each decode matmul as "
        f"TensorEngine instructions of max(tokens, 64) cycles per 128 x 128 weight tile (engines.py), "
        f"{c.layer_s * 1e6:.0f} us per layer and {c.token_moe_s * 1e6:.1f} us per further token per MoE layer on the "
        f"selective path fitted on the AWS DeepSeek-V3 contrib's published TPOT and vLLM ITLs, prefill scaled by a "
        f"factor fitted on its TTFT; checked against the community Kimi ports in docs/planner.md",
    )



# -- speculative decoding with an EAGLE3 draft (neuron/fused_spec.py) --------------------------------------------------
#
# One fused step: the draft's speculation_length calls (K - 1 proposals of one token a row, then one call over the K
# candidates that rewrites its cache with the target's hidden states) and one target call verifying K tokens a row
# (NXDI_CONTRACT.md: fused-spec). A step emits 1..K tokens a row; the effective TPOT is the step over the accept
# length. The accept lengths the planner prints are a low and a high one of the public drafts of the draft's family,
# each measured with 3 draft tokens a step (K = 4) on its model card (docs/speculative.md: expected accept lengths):
PUBLISHED_K = 4
ACCEPT_LENGTHS = {
    # lightseekorg/kimi-k2.5-eagle3 (2.3-3.8); AQ-MedAI/Kimi-K26-eagle3 (GSM8K 3.172, HumanEval 3.217)
    "eagle3": (2.3, 3.2),
    # lightseekorg/kimi-k2.6-eagle3-mla, vLLM 0.20 (CEval 2.494 .. MATH500 3.245)
    "eagle3-mla": (2.5, 3.2),
    # lightseekorg/kimi-k2.6-eagle3.1-mla (MTBench 2.611, GSM8K 3.195)
    "eagle3.1-mla": (2.6, 3.2),
}


def draft_family(draft) -> str:
    """ACCEPT_LENGTHS' key of a draft's facts (checkpoint/draft.py's Eagle3Draft)."""
    if draft.kind == "eagle3-mla":
        return "eagle3.1-mla" if draft.eagle31 else "eagle3-mla"
    return "eagle3"


def accept_lengths(family: str, k: int) -> tuple[float, ...]:
    """The family's published accept lengths at speculation length k: as measured at PUBLISHED_K, else each scaled
    by the constant per-draft acceptance rate a that gives it there (1 + a + ... + a^(K0 - 1) = L) to 1 + a + ... +
    a^(k - 1), which a step of k tokens can emit (an estimate: real acceptance falls along the draft)."""
    if k == PUBLISHED_K:
        return ACCEPT_LENGTHS[family]
    out = []
    for length in ACCEPT_LENGTHS[family]:
        lo, hi = 0.0, 1.0
        for _ in range(60):  # bisection: the sum grows with a
            a = (lo + hi) / 2
            lo, hi = (a, hi) if sum(a ** i for i in range(PUBLISHED_K)) < length else (lo, a)
        out.append(round(sum(lo ** i for i in range(k)), 2))
    return tuple(out)


@dataclass(frozen=True)
class Speculation:
    draft: str
    speculation_length: int
    rows: tuple[Row, ...]  # per core: the draft's weights and KV cache, the hidden-state buffer, verify temporaries
    verify_path: str  # the verify call's MoE path for batch x K tokens (NxD's, as a decode of that many tokens)
    verify: Timing  # the target's verify call (timing.decode_time at batch x K tokens, the cache read per row)
    draft_s: float  # the draft's K calls
    step_s: float  # one fused step
    family: str = "eagle3"  # ACCEPT_LENGTHS' key
    accept_lengths: tuple[float, ...] = ()  # accept_lengths(family, speculation_length)

    def tpot_s(self, accept_length: float) -> float:
        """The modelled time per token when a step emits accept_length tokens a row on average."""
        return self.step_s / accept_length

    def effective_tpot_ms(self) -> dict[str, float]:
        return {str(a): self.tpot_s(a) * 1e3 for a in self.accept_lengths}


def _speculation(cfg: KimiK2Config, spec: RunSpec, weights: list[Row], port: Port) -> Speculation | None:
    """The draft's HBM and the fused step's time (estimates: timing.decode_time for the verify, timing.draft_call_time
    for each draft call); the draft's facts are its config.json's (launch.draft_spec)."""
    d = spec.draft
    if d is None or d.checkpoint is None:
        return None
    c, k, b, tp = d.checkpoint, d.speculation_length, spec.batch, spec.tp
    tokens = b * k
    if c.mla is None:
        heads = max(1, c.num_key_value_heads // tp)  # NxDI's GQA replicates KV heads up to the TP degree
        kv_what = f"{heads} KV head/rank"
    else:  # one latent entry a position on every rank, V's slot 1 wide (eagle3_mla.py)
        heads, kv_what = 1, "latent, every rank"
    draft_kv = b * spec.seq_len * heads * c.kv_width * BF16  # never sequence-sharded
    path = moe_paths.verify_path(cfg, tokens)
    # whole on every rank: the norms, and the MLA draft's q_a / kv_a projections (as the target's: NxDParallelContext)
    whole = sum(_numel(shape) for name, shape in c.shapes().items()
                if len(shape) == 1 or name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight"))) * BF16
    per_core = div(c.weight_bytes - whole, tp) + whole
    rows = [Row(f"EAGLE3 draft weights (TP; {c.kind}, {c.num_attention_heads} heads, lm_head {c.lm_head_rows} rows)",
                "bf16", per_core),
            Row(f"EAGLE3 draft KV cache ({kv_what} x {spec.seq_len})", "bf16", draft_kv),
            # rows + a spare x 2 x K positions x 3 captured hiddens (NxDI's HiddenStateRollingBuffer)
            Row(f"EAGLE hidden-state buffer ({b}+1 x 2 x {k} x 3 hidden)", "bf16",
                (b + 1) * 2 * k * 3 * c.hidden_size * BF16)]
    if path == "all-experts":
        rows.append(Row(f"verify MoE temporaries (all-experts, {tokens} tokens, 1 layer)", "bf16",
                        moe_temporaries(cfg, path, tokens, tp, spec.ep, spec.scheme)[0]))
    verify_spec = replace(spec, batch=tokens, moe_decode=path)  # NxD's own forward: a verify is no token generation
    _, verify_bytes = bytes_per_token(cfg, verify_spec, weights)
    verify_bytes -= (tokens - b) * cfg.num_hidden_layers * spec.cache_slots * cfg.latent_dim * BF16  # per row
    verify = decode_time(cfg, verify_spec, verify_bytes, port)
    embedding = div(2 * c.vocab_size * c.hidden_size, tp)  # a gather: not read whole
    draft_s = k * timing.draft_call_time(per_core - embedding + draft_kv)
    family = draft_family(c)
    return Speculation(draft=str(d.path), speculation_length=k, rows=tuple(rows), verify_path=path, verify=verify,
                       draft_s=draft_s, step_s=verify.total_s + draft_s, family=family,
                       accept_lengths=accept_lengths(family, k))


def _numel(shape) -> int:
    n = 1
    for v in shape:
        n *= v
    return n
