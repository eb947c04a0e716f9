"""`kimi-k2-neuron plan --serve`: a workload's modelled output tokens per second per box (workload.py) as text and
JSON, beside the anchor a trn2 box must reach to earn its price."""

from __future__ import annotations

import json
from dataclasses import asdict

from .hbm import GiB
from .timing import TRN2
from .workload import Serving, Workload, serve_flags, turn_split

# The anchor (issue 36, 2026-12-01): 8xH200 serves Kimi-K2.5 at 8K/1K at ~930-1,090 output tok/s per node at
# concurrency 32-64 (SemiAnalysis InferenceX, via kimi-capacity-report; shared/reference/peers_and_users.md); at
# Capacity Block list prices, trn2.48xlarge $35.76/h and p5en (8xH200) $63.16/h, a trn2 box ties per dollar at
# 35.76 / 63.16 = 57 % of that.
H200_NODE_TOK_S = (930.0, 1090.0)
TRN2_PER_H200_PRICE = 35.76 / 63.16


def h200_tie() -> tuple[float, float]:
    lo, hi = H200_NODE_TOK_S
    return lo * TRN2_PER_H200_PRICE, hi * TRN2_PER_H200_PRICE


def format_serving(w: Workload, best: Serving | None, found: list[Serving], vllm_today: Serving | None) -> str:
    lo, hi = h200_tie()
    head = (f"serving {w.name} on one trn2.48xlarge: the most output tokens per second with TPOT <= "
            f"{w.tpot_s * 1e3:.0f} ms and p90 TTFT <= {w.ttft_p90_s:g} s"
            + (" (each turn reusing its history from vLLM's prefix cache: --prefix-caching builds only)"
               if w.prefix_reuse else "")
            + "; modelled, an estimate (neuron/workload.py's scheduling model; nothing here ran on trn2)")
    if best is None:
        return head + "\nno configuration fits a batch within the TPOT bound"
    p, lines = best.plan, [head]
    if not best.meets:
        lines.append(f"  no configuration meets p90 TTFT <= {w.ttft_p90_s:g} s; the best within the other bounds:")
    stall = best.tpot_s - best.decode_step_s
    lines += [
        f"  output {best.output_tok_s:.1f} tok/s per box at concurrency {best.concurrency} (the compiled batch)",
        f"  TPOT {best.tpot_s * 1e3:.1f} ms = decode step {best.decode_step_s * 1e3:.1f} ms (vLLM's "
        f"{TRN2.vllm_step_s * 1e3:.2f} ms a step included) + prefill stalls {stall * 1e3:.1f} ms (the other "
        f"{best.concurrency - 1} requests' prefills, {best.prefill_s:.2f} s each, over a request's "
        f"{best.mean_output - 1:.0f} decode steps)",
        f"  TTFT {best.ttft_p90_s:.2f} s (p90): the request's own prefill step; {best.prefill_share:.0%} of the box's "
        f"time is prefill, every decode held back",
        f"  HBM {best.hbm_bytes / GiB:.2f} of {p.usable_bytes / GiB:.2f} GiB per logical core; a larger batch misses: "
        f"{best.binds}",
        f"  configuration: {' '.join(serve_flags(best))}"
        + (f" (attention_dp_degree {best.attention_dp}: modelled, not built)" if best.attention_dp > 1 else ""),
        _step_line(best), *_prefix_lines(w, best),
        f"  against the H200 tie ({lo:.0f}-{hi:.0f} tok/s per box: 8xH200's {H200_NODE_TOK_S[0]:.0f}-"
        f"{H200_NODE_TOK_S[1]:.0f} at 8K/1K x the price ratio {TRN2_PER_H200_PRICE:.2f}): "
        f"{best.output_tok_s / ((lo + hi) / 2):.0%} of it",
        _vllm_line(vllm_today, p.seq_len, w.prefix_reuse)]
    rest = _distinct(found)[1:6]
    if rest:
        lines.append("  runners-up (tok/s, concurrency, TPOT ms, p90 TTFT s, configuration):")
        lines += [f"    {s.output_tok_s:7.1f} {s.concurrency:4d} {s.tpot_s * 1e3:6.1f} {s.ttft_p90_s:6.2f}  "
                  f"{' '.join(serve_flags(s))}" + (f" + attention_dp_degree {s.attention_dp} (modelled, not built)"
                                                   if s.attention_dp > 1 else "")
                  + ("" if s.meets else "  (misses TTFT)") for s in rest]
    return "\n".join(lines)


def _step_line(s: Serving) -> str:
    d = s.plan.decode
    if s.attention_dp > 1:
        return f"  decode step (modelled variant): {(s.decode_step_s - TRN2.vllm_step_s) * 1e3:.1f} ms"
    return (f"  decode step: bytes {d.bytes_s * 1e3:.1f} + {d.collective_count} collectives {d.collectives_s * 1e3:.1f} "
            f"+ compute {d.flops_s * 1e3:.1f} + per-layer {d.fixed_s * 1e3:.1f}"
            + (f" + selective-loading loop {d.batch_s * 1e3:.1f}" if d.batch_s else "") + " ms (MoE "
            f"{s.plan.decode_path}, EP {s.plan.ep})")


def _prefix_lines(w: Workload, s: Serving) -> list[str]:
    """With --prefix-caching: the pool and what the turns reuse of it."""
    x, spec = s.plan.prefix, s.spec
    if x is None or spec is None:
        return []
    split = [turn_split(spec, w, t) for t in w.turns]
    cached, prompt = sum(c for c, _ in split), sum(c + n for c, n in split)
    warm = [p for (c, _), p in zip(split, s.prefills_s) if c]
    cold = [p for (c, _), p in zip(split, s.prefills_s) if not c]
    return [f"  prefix cache: a pool of {x.pool_blocks} blocks of {x.block_size} ({s.plan.kv_cache.bytes / GiB:.2f} "
            f"GiB, every row's full sequence: vllm-neuron's minimum); the turns find {cached / prompt:.0%} of their "
            f"prompts cached, in whole blocks"
            + (f"; a warm turn's prefill step {sum(warm) / len(warm):.2f} s on average" if warm else "")
            + (f", a cold one's {sum(cold) / len(cold):.2f} s" if cold else "")
            + " (NxDI's calls: fit.turn_calls)"]


def _vllm_line(s: Serving | None, seq_len: int, prefix: bool = False) -> str:
    if s is None:
        if prefix:
            return (f"  through vLLM today: compile_and_save.py --for-vllm --prefix-caching builds the "
                    f"replicated cache in blocks, any --prefill-chunk, no --shard-* (vllm-neuron's request carries "
                    f"no layout), which fits no batch at seq_len {seq_len}")
        return (f"  through vLLM today: compile_and_save.py --for-vllm builds only the replicated cache with one-shot "
                f"prefill (vllm-neuron's request carries no layout), which fits no batch at seq_len {seq_len}")
    return (f"  through vLLM today ("
            + ("the replicated cache in blocks, no --shard-*: what --for-vllm --prefix-caching builds" if prefix else
               "the replicated cache, one-shot prefill: what --for-vllm builds") + "): "
            f"{s.output_tok_s:.1f} tok/s at concurrency {s.concurrency}, TPOT {s.tpot_s * 1e3:.1f} ms, p90 TTFT "
            f"{s.ttft_p90_s:.2f} s")


def _distinct(found: list[Serving]) -> list[Serving]:
    """The best of each layout (its other decode paths and batches aside)."""
    seen, out = set(), []
    for s in found:
        key = (s.plan.layout, s.plan.ep, s.plan.moe_prefill, s.attention_dp)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def serving_dict(s: Serving, w: Workload | None = None) -> dict:
    d = s.plan.to_dict()
    reuse = {}
    if s.plan.prefix is not None and s.spec is not None and w is not None:
        reuse = {"prefix_caching": {"block_size": s.spec.block_size, "pool_blocks": s.spec.pool_blocks,
                                    "pool_gib": s.plan.kv_cache.bytes / GiB,
                                    "turns": [{"cached": c, "new": n} for c, n in
                                              (turn_split(s.spec, w, t) for t in w.turns)]}}
    return {"output_tok_s": s.output_tok_s, "concurrency": s.concurrency, "tpot_ms": s.tpot_s * 1e3,
            "ttft_p90_s": s.ttft_p90_s, "decode_step_ms": s.decode_step_s * 1e3,
            "prefill_steps_s": list(s.prefills_s), "prefill_share": s.prefill_share, "hbm_bytes": s.hbm_bytes,
            "hbm_gib": s.hbm_bytes / GiB, "usable_gib": s.plan.usable_bytes / GiB, "binds": s.binds,
            "meets_bounds": s.meets, "attention_dp_degree": s.attention_dp, "flags": serve_flags(s),
            "vllm_step_ms": TRN2.vllm_step_s * 1e3, **reuse, "plan": d}


def serving_json(w: Workload, best: Serving | None, found: list[Serving], vllm_today: Serving | None) -> str:
    lo, hi = h200_tie()
    return json.dumps({
        "estimate": "kimi-k2-neuron plan's serving model (neuron/workload.py, timing.py), not a measurement",
        "workload": {**asdict(w), "seq_len": w.seq_len},
        "best": serving_dict(best, w) if best else None,
        "h200_tie_tok_s": [lo, hi], "vllm_today": serving_dict(vllm_today, w) if vllm_today else None,
        "runners_up": [serving_dict(s, w) for s in _distinct(found)[1:6]], "configurations_within_tpot": len(found)},
        indent=2)
