"""The planner's searches over run specs (estimates, by fit.plan): the fastest layout that fits, the largest seq_len
or batch that fits, a published port's run, and the other MoE prefill modes if one fails to compile."""

from __future__ import annotations

import math
from dataclasses import replace

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.placement import Layout

from . import moe_paths, rules, timing
from .fit import Plan, plan
from .hbm import GiB
from .rules import check_counts
from .spec import RunSpec
from .timing import THIS_PORT, Port


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
    # they ran stock NxD, whose token generation takes its threshold's path
    decode = moe_paths.nxd_decode_path(cfg, fields["batch"])
    return RunSpec(**fields, scheme=scheme, sampling=sampling, checkpoint="(published port)", moe_decode=decode), p.port


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
    is non-decreasing in batch (all-experts decode only adds temporaries, and without --moe-decode a batch fits if
    its selective-loading plan does). `kw` as plan()."""
    def at(batch: int) -> Plan:
        return plan(cfg, replace(spec, batch=batch), **kw)

    one_shot_tiles = (spec.moe_prefill or moe_paths.DEFAULT_MODE) == "shard-on-block" and not spec.layout.prefill_chunk
    step = 128 // math.gcd(spec.context_length, 128) if one_shot_tiles else 1
    lo = step
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

