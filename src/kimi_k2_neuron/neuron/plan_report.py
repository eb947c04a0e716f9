"""The fit planner's report: a Plan (fit.py) as the text `kimi-k2-neuron plan` prints, and as JSON."""

from __future__ import annotations

import json

from .fit import PUBLISHED_K, Plan
from .hbm import GiB, Row


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
              *_prefix_lines(p),
              *_speculation_lines(p),
              "assumptions:"]
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def _timing_lines(p: Plan) -> list[str]:
    """The modelled decode step by component and collective, and the prefill it implies."""
    d, w = p.decode, 52
    lines = ["", f"modelled TPOT, an estimate (timing.py): {d.total_s * 1e3:.2f} ms = bytes {d.bytes_s * 1e3:.2f} + "
                 f"{d.collective_count} collectives {d.collectives_s * 1e3:.2f} + compute {d.flops_s * 1e3:.2f} + "
                 f"per-layer {d.fixed_s * 1e3:.2f}"
                 + (f" + selective-loading loop {d.batch_s * 1e3:.2f}" if d.batch_s else "") + " ms",
             *_compute_lines(p),
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


def _compute_lines(p: Plan) -> list[str]:
    """The decode step's compute (engines.py): the routed experts on the decode path, the rest, the combine."""
    c = p.decode.compute
    if c is None:
        return []
    routed = c.routed_s()
    return [f"  compute (TensorEngine instructions, engines.py): routed experts on the {c.moe_path} path "
            f"{routed * 1e3:.2f} ms, the other matmuls {(c.tensor_s - routed) * 1e3:.2f} ms, the experts' combine "
            f"on the VectorEngine {c.vector_s * 1e3:.2f} ms ({c.flops / 1e12:.3f} TFLOP a step)"]


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
    return (f"prefill {p.prefill_rows} x {p.context_len} tokens: MoE {p.prefill_path} path (--moe-prefill "
            f"{p.moe_prefill}{blocks}); decode: {p.decode_path}")


def plan_json(p: Plan, **extra) -> str:
    return json.dumps({**p.to_dict(), **extra}, indent=2)



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
    how = f"{s.family}'s published accept lengths" + ("" if s.speculation_length == PUBLISHED_K else
                                                      f", scaled from --speculation-length {PUBLISHED_K}")
    lines += [f"  effective TPOT at accept length {a}: {s.tpot_s(a) * 1e3:.2f} ms (without the draft: "
              f"{p.decode.total_s * 1e3:.2f} ms)" for a in s.accept_lengths]
    lines.append(f"  (accept lengths: {how}; docs/speculative.md)")
    return lines


def _prefix_lines(p: Plan) -> list[str]:
    """The block pool, what the headroom would add, and a turn's prefill warm against cold."""
    x = p.prefix
    if x is None:
        return []

    def calls(c):
        return ", ".join(f"[{a}, {b}]" for a, b in c[:3]) + (f", ... ({len(c)} calls)" if len(c) > 3 else "")
    pool = x.pool_blocks * x.block_bytes / GiB
    return ["", f"prefix caching (vLLM --enable-prefix-caching), an estimate: a pool of {x.pool_blocks} blocks x "
                f"{x.block_size} = {x.pool_tokens:,} positions ({pool:.2f} GiB per core, the KV row above), for the running rows' sequences and the history kept for later turns; the "
                f"headroom would hold {x.more_blocks} blocks ({x.more_blocks * x.block_size:,} positions) more",
            f"  a turn of {x.new:,} new tokens after {x.cached:,} cached: warm TTFT {x.warm_s:.2f} s in "
            f"{len(x.warm)} call(s) ({calls(x.warm_calls)} as [prefill bucket, prefix bucket]) vs cold "
            f"{x.cold_s:.2f} s ({calls(x.cold_calls)}): {x.warm_s / x.cold_s * 100:.1f} % of cold"]
