"""Attention data parallelism, modelled and not built: NxDI's attention_dp_degree with its DataParallelKVCacheManager,
as it would run Kimi's MLA (estimates; NXDI_CONTRACT.md: attention-dp).

In token generation NxDI splits the batch over dp groups of tp / dp ranks: each group attends its batch / dp
sequences with its heads split tp / dp ways, its cache lines holding only those sequences, then gathers the attention
output over the dp groups before the MoE, which runs the whole batch over all ranks as before. Prefill is unchanged
(context encoding keeps TP attention). NxDI requires continuous batching and a batch that dp divides. Against the
replicated cache at the same batch, per rank:

    cache             / dp (each rank holds its group's sequences only)
    q_b, kv_b, o      x dp (dp heads a rank instead of one at TP=64)
    a decode step     the o_proj all-reduce over tp / dp ranks of batch / dp rows, one all-gather of the
                      [batch, hidden] attention output over dp ranks a layer, attention's matmuls for dp heads and
                      batch / dp sequences

Pure: no SDK.
"""

from __future__ import annotations

from dataclasses import replace

from kimi_k2_neuron.config import KimiK2Config

from .engines import decode_matmuls
from .fit import Plan
from .hbm import BF16, Part
from .timing import TRN2, Collective, Constants

ATTENTION = ("q_a + kv_a", "q_b", "q_nope x W_UK", "scores over the cache", "context over the cache",
             "context x W_UV", "o_proj")


def degrees(p: Plan) -> list[int]:
    """The dp degrees NxD's replica groups lay out at p's TP (groups of tp / dp adjacent ranks, rules.GROUP_LAYOUTS)
    that divide p's batch, on the replicated cache (the sequence-sharded one already splits it)."""
    from .rules import GROUP_LAYOUTS

    if p.layout.sequence_sharded or p.lnc is None:
        return []
    dps = [p.tp // size for size in GROUP_LAYOUTS.get((p.tp, p.lnc), ())]
    return [dp for dp in dps if dp > 1 and p.batch % dp == 0]


def modelled(cfg: KimiK2Config, spec, p: Plan, dp: int, c: Constants = TRN2) -> tuple[int, float, dict]:
    """(HBM total per rank, decode step seconds, what changed) of p's run with attention_dp_degree dp."""
    layers, b, h = cfg.num_hidden_layers, p.batch, cfg.hidden_size
    attn_b = sum(r.bytes for r in p.weights if r.part is Part.ATTENTION_B)
    attn_a = sum(r.bytes for r in p.weights if r.part is Part.ATTENTION_A) if p.layout.shard_attn_a else 0
    more_weights = (attn_b + attn_a) * (dp - 1)
    less_cache = p.kv_cache.bytes - p.kv_cache.bytes // dp
    kv_read = layers * b * p.cache_slots_per_rank * cfg.latent_dim * BF16
    read = p.bytes_per_token + more_weights - (kv_read - kv_read // dp)
    colls = [x for x in p.decode.collectives if not x.what.startswith(("o_proj", "q_a|kv_a"))]
    colls += [Collective("o_proj all-reduce (attention TP group), bf16", layers, p.tp // dp, b // dp * h * BF16),
              Collective("attention output all-gather (DP group), bf16", layers, dp, b * h * BF16)]
    if p.layout.shard_attn_a:
        colls.append(Collective("q_a|kv_a output all-gather (attention TP group), bf16", layers, p.tp // dp,
                                b // dp * (cfg.q_lora_rank + cfg.latent_dim) * BF16))
    group_spec = replace(spec, tp=spec.tp // dp, ep=1, batch=b // dp, moe_decode=p.decode_path)  # its attention
    attention = sum(m.seconds() for m in decode_matmuls(cfg, group_spec, p.decode_path) if m.what in ATTENTION)
    before = sum(m.seconds() for m in p.decode.compute.matmuls if m.what in ATTENTION)
    d = p.decode
    step = (read / c.hbm_bytes_per_s + sum(x.seconds(c) for x in colls) + d.flops_s - before + attention + d.fixed_s
            + d.batch_s)
    changed = {"attention_dp_degree": dp, "weights_more_bytes": more_weights, "cache_less_bytes": less_cache,
               "step_bytes": read, "collectives_ms": sum(x.seconds(c) for x in colls) * 1e3,
               "attention_compute_ms": attention * 1e3, "decode_ms": step * 1e3}
    return p.total_bytes + more_weights - less_cache, step, changed
