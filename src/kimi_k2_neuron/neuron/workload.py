"""Many conversations at once: a box's output tokens per second at a latency bound, modelled (estimates).

The scheduling model is vLLM's V1 scheduler as vllm-neuron 0.2.0 drives it (ContinuousBatchingNeuronScheduler,
vllm_neuron/core/scheduler.py): a step is either one waiting request's whole prefill (max_prompt_batch_size 1, as NxDI's
continuous batching prefills one sequence per context-encoding call; with --prefill-chunk the chunk driver runs every
chunk inside that step) or one decode step of every running request; a waiting request is prefilled as soon as a
cache line is free, the running decodes held back meanwhile. In the steady state of C clients each sending its next
request when its last one ends (`vllm bench serve --max-concurrency C`), C = the compiled batch B, a request is
prefilled in the step after another ends, so:

    cycle of B requests  = B prefill steps + (output - 1) decode steps of the whole batch
    output tok/s per box = B x output / cycle
    TPOT (vLLM's: (e2e - TTFT) / (output - 1)) = decode step + (B - 1) x prefill step / (output - 1)
    TTFT                 = the request's own prefill step (no two wait together in that steady state)

That is the clients out of step, as users are: each finish is followed by one prefill. Clients started together with
equal lengths (a benchmark's) stay in step instead, whole cohorts prefilled back to back: the same rate, TTFT up to
B prefills (at_concurrency's `together`); the search assumes users.

each step costing vLLM's per-step overhead beside the model's (timing.Constants.vllm_step_s). Turns of different
lengths (the agentic workload) enter by their mean prefill and output, and TTFT's 90th percentile over the turns.
The prefill of a turn is `turn_prefill`: from position 0 on the contiguous cache; with --prefix-caching (a workload
that reuses prefixes is searched over those builds) the calls NxDI makes after the history's cached blocks
(fit.turn_calls). Pure: no SDK.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.placement import Layout

from . import moe_paths, rules
from .fit import Plan, plan, prefill_call, turn_calls
from .hbm import weight_rows
from .layout_search import SEARCHED_CHUNKS
from .spec import RunSpec
from .timing import TRN2, THIS_PORT, Constants, Timing


@dataclass(frozen=True)
class Turn:
    """One request: `history` tokens of the conversation so far (resent whole: a chat API is stateless), `new` tokens
    it adds (a user message, tool results), `output` tokens it generates."""

    history: int
    new: int
    output: int

    @property
    def prompt(self) -> int:
        return self.history + self.new


@dataclass(frozen=True)
class Workload:
    name: str
    turns: tuple[Turn, ...]  # the requests, each equally often
    tpot_s: float = 0.050  # vLLM's mean TPOT, prefill stalls included, at most this
    ttft_p90_s: float = 5.0  # the 90th percentile of TTFT at most this
    # each turn finds its history in vLLM's prefix cache: the search takes --prefix-caching builds, whose turns
    # prefill only what follows the history's whole blocks (turn_split)
    prefix_reuse: bool = False

    @property
    def seq_len(self) -> int:
        """The cache a request needs: its prompt and its output."""
        return max(t.prompt + t.output for t in self.turns)

    @property
    def mean_output(self) -> float:
        return sum(t.output for t in self.turns) / len(self.turns)


def chat(input_tokens: int = 8192, output_tokens: int = 1024, **bounds) -> Workload:
    """Every request a fresh input_tokens prompt generating output_tokens (InferenceX's 8K/1K)."""
    return Workload(f"{input_tokens}/{output_tokens}", (Turn(0, input_tokens, output_tokens),), **bounds)


def agentic(history: int = 16384, turns: int = 12, new_tokens: int = 3072, output_tokens: int = 512,
            prefix_reuse: bool = False, **bounds) -> Workload:
    """An agent session: a first prompt of `history` tokens (system prompt, tools, the task), then each turn adds
    `new_tokens` (a tool result) to everything before it, and generates `output_tokens` (a tool call), which the next
    turn resends too."""
    out = []
    for t in range(turns):
        past = history + t * (new_tokens + output_tokens) - new_tokens if t else 0
        out.append(Turn(past, history if t == 0 else new_tokens, output_tokens))
    name = f"agentic {turns} turns from {history} (+{new_tokens} in, {output_tokens} out a turn)"
    return Workload(name, tuple(out), prefix_reuse=prefix_reuse, **bounds)


# -- one turn's prefill ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TurnPrefill:
    calls: tuple[Timing, ...]  # each prefill call, in order

    @property
    def seconds(self) -> float:
        return sum(c.total_s for c in self.calls)


def turn_prefill(cfg: KimiK2Config, spec: RunSpec, new_tokens: int, cached_prefix: int = 0,
                 port=THIS_PORT, c: Constants = TRN2) -> TurnPrefill:
    """The prefill work of a turn that adds `new_tokens` after `cached_prefix` positions already in the cache. With
    --prefix-caching: the context-encoding calls NxDI makes for it (fit.turn_calls: its 2D bucket choice, the chunks
    of --prefill-chunk), the cached positions whole blocks (vLLM's hits). The contiguous cache keeps nothing of an
    earlier request (vLLM gives each its cache line afresh), so there a turn prefills from position 0: with
    --prefill-chunk a call per chunk, each attending every position before it; without, one call of the compiled
    bucket (vllm-neuron prefills up to --max-model-len in one call)."""
    total = cached_prefix + new_tokens
    if total > spec.seq_len:
        raise KimiInputError(f"a turn of {total} tokens: exceeds --seq-len {spec.seq_len}")
    if spec.prefix_caching:
        if cached_prefix % spec.block_size:
            raise KimiInputError(f"a cached prefix of {cached_prefix} tokens: vLLM caches whole blocks of "
                                 f"--block-size {spec.block_size}")
        weights = weight_rows(cfg, spec.tp, spec.ep, spec.scheme, port.router_dtype, spec.layout)
        return TurnPrefill(tuple(turn_calls(cfg, spec, weights, cached_prefix, new_tokens, c)))
    if cached_prefix:
        raise KimiInputError(f"a cached prefix of {cached_prefix} tokens: only with --prefix-caching (the contiguous "
                             f"cache keeps no earlier request's positions)")
    n = spec.layout.prefill_chunk
    if n is not None:
        return TurnPrefill(tuple(prefill_call(cfg, spec, k, port, c) for k in range(0, total, n)))
    return TurnPrefill((prefill_call(cfg, spec, 0, port, c),))


def turn_split(spec: RunSpec, w: Workload, t: Turn) -> tuple[int, int]:
    """(cached, new) positions of turn t at spec: with the workload's reuse on a --prefix-caching build, the history's
    whole blocks cached (vLLM hashes full blocks, decoded ones too) and the rest prefilled; else the whole prompt.
    The pool holds the history: at its default size every row's full sequence fits, so the blocks of the turn that
    just ended, freed last, are evicted last, and its session's next turn (sent as it ends) finds them."""
    if w.prefix_reuse and spec.prefix_caching:
        cached = t.history // spec.block_size * spec.block_size
        return cached, t.prompt - cached
    return 0, t.prompt


def workload_prefills(cfg: KimiK2Config, spec: RunSpec, w: Workload, c: Constants = TRN2) -> tuple[float, ...]:
    """Each turn's prefill seconds at the spec's layout (the batch plays no part: one sequence a call)."""
    return tuple(turn_prefill(cfg, spec, new, cached, c=c).seconds
                 for cached, new in (turn_split(spec, w, t) for t in w.turns))


# -- the steady state of continuous batching --------------------------------------------------------------------------

@dataclass(frozen=True)
class Serving:
    """One configuration serving a workload in the steady state (the module's scheduling model)."""

    plan: Plan  # at the compiled batch: HBM and the decode step
    prefills_s: tuple[float, ...]  # each turn's prefill step, vLLM's overhead included
    decode_step_s: float  # vLLM's overhead included
    output_tok_s: float
    tpot_s: float
    ttft_p90_s: float
    mean_output: float
    hbm_bytes: int  # per logical core, against plan.usable_bytes
    binds: str = ""  # what stops a larger batch (or any batch)
    meets: bool = False  # within every bound of the workload (TPOT, TTFT, HBM)
    attention_dp: int = 1  # > 1: a modelled variant (attention_dp.py), not a layout the shell builds
    spec: RunSpec | None = None  # the configuration at the compiled batch (None: a plan given alone)

    @property
    def concurrency(self) -> int:
        return self.plan.batch

    @property
    def fits(self) -> bool:
        return self.hbm_bytes <= self.plan.usable_bytes

    @property
    def prefill_s(self) -> float:
        return sum(self.prefills_s) / len(self.prefills_s)

    @property
    def prefill_share(self) -> float:
        """Of the box's time, spent prefilling (every decode held back meanwhile): B x prefill / cycle."""
        return self.prefill_s * self.output_tok_s / self.mean_output


def steady_state(p: Plan, prefills_s: tuple[float, ...], w: Workload, c: Constants = TRN2,
                 attention_dp: int = 1, decode_step_s: float | None = None, hbm_bytes: int | None = None) -> Serving:
    """The module's formulas at p's batch, prefills and decode step (plus vLLM's per-step overhead); a modelled
    variant's own decode step and HBM where given."""
    b, out = p.batch, w.mean_output
    step = (p.decode.total_s if decode_step_s is None else decode_step_s) + c.vllm_step_s
    prefill = tuple(s + c.vllm_step_s for s in prefills_s)
    mean_prefill = sum(prefill) / len(prefill)
    cycle = b * mean_prefill + (out - 1) * step
    ranked = sorted(prefill)
    p90 = ranked[min(len(ranked) - 1, math.ceil(0.9 * len(ranked)) - 1)]
    return Serving(p, prefill, step, b * out / cycle, step + (b - 1) * mean_prefill / max(out - 1, 1), p90, out,
                   p.total_bytes if hbm_bytes is None else hbm_bytes, attention_dp=attention_dp)


# -- the search -------------------------------------------------------------------------------------------------------

MAX_BATCH = 256
# attention_dp_degree values of the modelled variant: dp groups of 16 and of 4 ranks, groups NxD lays out at TP=64
ATTENTION_DP = (4, 16)


def candidates(cfg: KimiK2Config, base: RunSpec, w: Workload) -> list[RunSpec]:
    """base (tp, lnc, experts, checkpoint) at every layout the serving search tries: each KV group NxD lays out, each
    prefill chunk or none, q_a/kv_a and the router split or not, each EP NxD lays out with the prefill modes it takes
    (shard-on-block; shard-on-intermediate where its tiles fit), each decode path NxD can run there (selective
    loading at EP 1 only); seq_len the workload's, rounded up to what the layout divides. A workload that reuses
    prefixes is searched on --prefix-caching builds only (base's --block-size, the pool following the batch:
    vllm-neuron's minimum, every row's full sequence), leaving out the layouts rules.check_prefix_caching refuses (the
    sequence-sharded cache). The rules refuse the rest."""
    tp, lnc = base.tp, base.lnc
    groups = [g for g in range(1, tp + 1) if tp % g == 0 and rules.group_layout_supported(tp, g, lnc)]
    eps = [e for e in groups if cfg.n_routed_experts % e == 0]
    out, reuse = [], w.prefix_reuse
    for g in groups:
        for n in (None, *SEARCHED_CHUNKS):
            step = math.lcm(g, n or 1, moe_paths.OUTPUT_TILE, base.block_size if reuse else 1)
            seq_len = -(-w.seq_len // step) * step
            if n is not None and n >= seq_len:
                continue
            for a in (False, True):
                for r in (False, True):
                    layout = Layout(kv_group=g, prefill_chunk=n, shard_attn_a=a, shard_router=r)
                    for ep in eps:
                        modes = ("shard-on-block",) + (("shard-on-intermediate",) if ep >= 16 else ())
                        for mode in modes:
                            for path in (moe_paths.DECODE_PATHS if ep == 1 else ("all-experts",)):
                                spec = replace(base, seq_len=seq_len, batch=1, ep=ep, moe_prefill=mode,
                                               moe_decode=path, layout=layout, continuous_batching=True,
                                               max_context_length=None, prefix_caching=reuse, num_blocks=None)
                                if reuse and not _takes_prefix_caching(spec):
                                    continue
                                out.append(spec)
    return out


def _takes_prefix_caching(spec: RunSpec) -> bool:
    try:
        rules.check_prefix_caching(spec)
    except KimiInputError:
        return False
    return True


def serve(cfg: KimiK2Config, spec: RunSpec, w: Workload, port=THIS_PORT, c: Constants = TRN2,
          prefills: tuple[float, ...] | None = None, attention_dp: int = 1) -> Serving | None:
    """spec's layout at the largest batch within the bounds (TPOT below w.tpot_s, the plan fitting: both monotone in
    the batch; `meets` says whether its TTFT is within w.ttft_p90_s too, which the batch does not change), or at
    batch 1 saying what misses there; None where the rules refuse the layout. attention_dp > 1: that modelled
    variant of the replicated cache (attention_dp.py), at batches it divides."""
    from . import attention_dp as adp

    def at(b: int) -> tuple[Serving, bool]:
        at_b = replace(spec, batch=b)
        p = plan(cfg, at_b, port, c, longest_prompt=False)
        if attention_dp == 1:
            s = steady_state(p, prefills, w, c)
        else:
            hbm, step, _ = adp.modelled(cfg, at_b, p, attention_dp, c)
            s = steady_state(p, prefills, w, c, attention_dp, step, hbm)
        s = replace(s, spec=at_b)
        return s, s.fits and s.tpot_s <= w.tpot_s

    try:
        prefills = prefills or workload_prefills(cfg, spec, w, c)
        best, ok = at(attention_dp)
    except KimiInputError:
        return None
    ttft = best.ttft_p90_s <= w.ttft_p90_s
    if not ok:
        return replace(best, binds=("HBM" if not best.fits else "TPOT") + f": batch {attention_dp} misses the bound")
    lo, hi = 1, MAX_BATCH // attention_dp  # in batches of attention_dp rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        s, ok = at(mid * attention_dp)
        if ok:
            lo, best = mid, s
        else:
            hi = mid - 1
    if lo == MAX_BATCH // attention_dp:
        return replace(best, binds=f"the search's largest batch, {best.concurrency}", meets=ttft)
    nxt = at((lo + 1) * attention_dp)[0]
    why = "HBM" if not nxt.fits else f"TPOT ({nxt.tpot_s * 1e3:.1f} ms at batch {nxt.concurrency})"
    return replace(best, binds=why, meets=ttft)


def best_serving(cfg: KimiK2Config, base: RunSpec, w: Workload, port=THIS_PORT,
                 c: Constants = TRN2) -> tuple[Serving | None, list[Serving]]:
    """(the configuration of the most output tokens per second within every bound, else, where none meets the TTFT
    bound, the most within the others (its `meets` False); every configuration that fits a batch within the TPOT
    bound, best first)."""
    found, prefills = [], {}
    for spec in candidates(cfg, base, w):
        key = _prefill_key(spec)
        if key not in prefills:
            try:
                prefills[key] = workload_prefills(cfg, spec, w, c)
            except KimiInputError:
                prefills[key] = None
        if prefills[key] is None:
            continue
        # NxDI's DataParallelKVCacheManager replaces the block layout's manager (init_inference_optimization)
        replicated = spec.layout == Layout(shard_attn_a=spec.layout.shard_attn_a, shard_router=spec.layout.shard_router)
        for dp in (1, *(ATTENTION_DP if replicated and not spec.prefix_caching else ())):
            s = serve(cfg, spec, w, port, c, prefills[key], dp)
            if s is not None and ": batch" not in s.binds:
                found.append(s)
    found.sort(key=lambda s: (not s.meets, -round(s.output_tok_s, 6), s.tpot_s))
    return (found[0] if found else None), found


def _prefill_key(spec: RunSpec) -> tuple:
    """What a turn's prefill depends on (the batch and decode path play no part)."""
    return spec.layout, spec.ep, spec.moe_prefill, spec.seq_len, spec.prefix_caching, spec.block_size


def vllm_today(found: list[Serving]) -> Serving | None:
    """The best of `found` that compile_and_save.py --for-vllm builds today: the replicated cache, one-shot prefill
    (vllm-neuron's request carries no layout) or, with --prefix-caching, any --prefill-chunk (its chunk driver runs
    behind vLLM's prefill of a whole prompt), no modelled variant."""
    def built(s: Serving) -> bool:
        layout = s.plan.layout
        if s.plan.prefix is not None:
            layout = replace(layout, prefill_chunk=None)
        return layout == Layout() and s.attention_dp == 1

    return next((s for s in found if built(s)), None)


def serve_flags(s: Serving) -> list[str]:
    """The compile_and_save.py flags of a configuration (plan --serve prints them)."""
    from .spec import layout_flags

    p = s.plan
    cache = [f"--prefix-caching --block-size {p.prefix.block_size}"] if p.prefix is not None else []
    return [f"--tp {p.tp}", f"--ep {p.ep}", f"--seq-len {p.seq_len}", f"--batch {p.batch}",
            f"--moe-prefill {p.moe_prefill}", f"--moe-decode {p.decode_path}", *layout_flags(p.layout), *cache]


def at_concurrency(s: Serving, clients: int, together: bool = False) -> dict:
    """The steady state of `clients` closed-loop clients on s's configuration (compiled batch B; NxDI pads a smaller
    batch, so each decode step costs B's): up to B, the module's formulas with `clients` in place of B; beyond, the
    extra clients queue for a cache line, the box runs at B's rate and TTFT grows by the wait (Little's law: a request
    spends clients x output / rate in the system, of which (output - 1) x TPOT decoding); the TTFT there is a mean.
    together: clients started at once with equal lengths (a benchmark's, e.g. `vllm bench serve --max-concurrency`)
    stay in step, each cohort prefilled back to back: the same rate, but the k-th of a cohort waits k prefills for
    its first token and (clients - k) more stall its decode (up to B only)."""
    b, out, p = s.concurrency, s.mean_output, s.prefill_s
    n = min(clients, b)
    cycle = n * p + (out - 1) * s.decode_step_s
    rate, tpot = n * out / cycle, s.decode_step_s + (n - 1) * p / max(out - 1, 1)
    if together and clients <= b:
        return {"clients": clients, "output_tok_s": rate, "started": "together",
                "tpot_ms": (s.decode_step_s + (n - 1) / 2 * p / max(out - 1, 1)) * 1e3,
                "ttft_mean_s": (n + 1) / 2 * p, "ttft_p90_s": math.ceil(0.9 * n) * p, "queued": 0}
    ttft = s.ttft_p90_s if clients <= b else clients * out / rate - (out - 1) * tpot
    return {"clients": clients, "output_tok_s": rate, "tpot_ms": tpot * 1e3, "started": "staggered",
            ("ttft_p90_s" if clients <= b else "ttft_mean_s"): ttft, "queued": max(0, clients - b)}


def best_at_batch(cfg: KimiK2Config, base: RunSpec, w: Workload, batch: int, port=THIS_PORT,
                  c: Constants = TRN2) -> Serving | None:
    """The configuration of the most output tokens per second at this compiled batch, whatever its TPOT and TTFT
    (docs/planner.md's table by batch): every candidate that fits at `batch`."""
    best, prefills = None, {}
    for spec in candidates(cfg, base, w):
        key, at_b = _prefill_key(spec), replace(spec, batch=batch)
        try:
            if key not in prefills:
                prefills[key] = workload_prefills(cfg, spec, w, c)
            p = plan(cfg, at_b, port, c, longest_prompt=False)
        except KimiInputError:
            continue
        s = replace(steady_state(p, prefills[key], w, c), spec=at_b)
        if s.fits and (best is None or s.output_tok_s > best.output_tok_s):
            best = s
    return best
