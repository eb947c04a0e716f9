"""Fit planner: does a configuration fit in one trn2.48xlarge logical core's HBM, and how fast could decode be?

Per logical core (one NxD rank) it adds up the weights by kind and dtype, the MLA KV cache and a stated allowance
for what the Neuron runtime needs on top, and compares the total with the HBM the runtime leaves to the model. It
also gives a roofline lower bound on decode time per token (bytes read per token / HBM bandwidth). Every model
dimension comes from the config; the sharding follows the NxDI design (shared/reference/nxdi_contracts.md §1.4,
§3.4, §3.6, §5.1). These are estimates.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from .config import KimiK2Config
from .convert.layout import SCHEMES, scheme_for
from .errors import KimiInputError

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

EXPERT_FORMATS = (*SCHEMES, "bf16")  # the converter's FP8 expert layouts, or unquantized
BF16, FP8, FP32 = 2, 1, 4  # bytes per element


@dataclass(frozen=True)
class Row:
    kind: str
    dtype: str
    bytes: int


@dataclass(frozen=True)
class Plan:
    model: str
    tp: int
    ep: int
    lnc: int
    seq_len: int
    batch: int
    experts: str
    kv_slots: int
    logical_cores: int
    capacity_bytes: int  # the logical core's HBM
    usable_bytes: int  # what the runtime leaves to the model (RUNTIME_RESERVED_BYTES less)
    router_dtype: str
    weights: tuple[Row, ...]
    kv_cache: Row
    allowance: tuple[Row, ...]
    total_bytes: int
    fits: bool
    active_experts_per_layer: float  # expected distinct routed experts one decode step reads on this core
    bytes_per_token: int
    hbm_bytes_per_s: float
    tpot_lower_bound_s: float
    assumptions: tuple[str, ...]

    @property
    def weight_bytes(self) -> int:
        return sum(r.bytes for r in self.weights)

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.total_bytes

    def summary(self) -> str:
        """One line, for refusing to compile a configuration that does not fit."""
        return (f"{self.model}: TP={self.tp} EP={self.ep} LNC={self.lnc} seq_len={self.seq_len} batch={self.batch} "
                f"experts={self.experts} needs {self.total_bytes / GiB:.2f} GiB per logical core of "
                f"{self.usable_bytes / GiB:.2f} GiB usable ({'fits' if self.fits else 'does not fit'})")

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("weights", "allowance"):
            d[key] = [{**r, "gib": r["bytes"] / GiB} for r in d[key]]
        d["kv_cache"]["gib"] = self.kv_cache.bytes / GiB
        d.update(weight_bytes=self.weight_bytes, headroom_bytes=self.headroom_bytes,
                 total_gib=self.total_bytes / GiB, capacity_gib=self.capacity_bytes / GiB,
                 usable_gib=self.usable_bytes / GiB,
                 headroom_gib=self.headroom_bytes / GiB, tpot_lower_bound_ms=self.tpot_lower_bound_s * 1e3)
        return d


# --ep layouts by (tp, lnc). NxD builds the MoE groups with its trn2 replica-group logic (parallel_state.py:355-378):
# at 64 ranks on LNC=2, 4 x 16, 16 x 4 and 64 x 1 (tp x replicas) are documented to work, 8 x 8 as unsupported, and
# 32 x 2 takes LOGIC2, whose expert-TP groups mix the two EP halves (the prefill token-to-block MAX-reduce over that
# group, expert_mlps_v2.py:1312-1328, would merge two expert sets). 1 x 64 is what NxDI's MiniMax-M3 contrib runs.
# Kimi-K2 only fits at TP=64 LNC=2, so no other layout is listed. (The Neuron shell refuses the rest too.)
EP_LAYOUTS = {(64, 2): (1, 4, 16, 64)}


def ep_layout_supported(tp: int, ep: int, lnc: int | None) -> bool:
    return ep == 1 or ep in EP_LAYOUTS.get((tp, lnc), ())


def decodes_all_experts(n_experts: int, top_k: int, batch: int) -> bool:
    """NxD's decode runs every local expert once batch * top_k >= E (expert_mlps_v2.py:1473-1478, threshold 1.0 in
    model_utils.py:93), and only then with EP (there is no selective loading with EP, l.1480-1481)."""
    return batch * top_k >= n_experts


def check_ep(cfg: KimiK2Config, tp: int, ep: int, lnc: int | None, batch: int) -> None:
    """The expert parallelism NxD can run for this model (the planner and the Neuron shell both apply it).
    lnc None (NxDI resolves it later) skips the layout rule; the shell re-checks the resolved config."""
    if tp % ep or cfg.n_routed_experts % ep:
        raise KimiInputError(f"--ep {ep}: must divide --tp {tp} and n_routed_experts={cfg.n_routed_experts}")
    if ep == 1:
        return
    if lnc is not None and not ep_layout_supported(tp, ep, lnc):
        raise KimiInputError(f"--ep {ep} at --tp {tp} --lnc {lnc}: not an expert layout NxD's replica groups "
                             f"support; use --ep in {list(EP_LAYOUTS.get((tp, lnc), (1,)))}")
    if not decodes_all_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch):
        need = -(-cfg.n_routed_experts // cfg.num_experts_per_tok)
        raise KimiInputError(f"--ep {ep} with --batch {batch}: NxD decodes with EP > 1 only on the all-experts "
                             f"path, which needs batch >= {need} (n_routed_experts / num_experts_per_tok)")


def _div(n: int, parts: int) -> int:
    """One rank's share of n split `parts` ways (NxD pads uneven splits, so round up)."""
    return -(-n // parts)


def _check(cfg: KimiK2Config, tp, ep, lnc, seq_len, batch, experts, kv_slots) -> None:
    for name, v in (("--tp", tp), ("--ep", ep), ("--seq-len", seq_len), ("--batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KimiInputError(f"{name} {v!r}: expected an integer >= 1")
    if lnc not in (1, 2):
        raise KimiInputError(f"--lnc {lnc!r}: expected 1 or 2 (physical NeuronCores per logical core on trn2)")
    if experts not in EXPERT_FORMATS:
        raise KimiInputError(f"--experts {experts!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    if kv_slots not in (1, 2):
        raise KimiInputError(f"--kv-slots {kv_slots!r}: expected 1 (latent only) or 2 (stock KVCacheManager K+V)")
    cores = _logical_cores(lnc)
    if tp > cores:
        raise KimiInputError(f"--tp {tp}: exceeds the {cores} logical cores of a trn2.48xlarge at --lnc {lnc}")
    check_ep(cfg, tp, ep, lnc, batch)


def _logical_cores(lnc: int) -> int:
    return TRN2_CHIPS * TRN2_PHYSICAL_CORES_PER_CHIP // lnc


def _attention_params(cfg: KimiK2Config, tp: int) -> tuple[int, int]:
    """(replicated, TP-sharded) MLA parameters of one layer on one rank. q_a and kv_a are plain nn.Linear on
    every rank in the NxDI design (§5.1); q_b/kv_b/o split by heads (one head per rank or more if tp > heads)."""
    h, heads = cfg.hidden_size, _div(cfg.num_attention_heads, tp)
    replicated = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    sharded = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h
    if cfg.q_lora_rank:
        replicated += h * cfg.q_lora_rank
        sharded += cfg.q_lora_rank * heads * cfg.qk_head_dim
    else:
        sharded += h * heads * cfg.qk_head_dim
    return replicated, sharded


def default_block(cfg: KimiK2Config) -> tuple[int, int]:
    """The blockwise layout `kimi-k2-neuron convert` writes for this source: [32, 1] (one scale per INT4 group)
    for compressed-tensors INT4 checkpoints, [32, 32] otherwise (convert/layout.py)."""
    int4 = cfg.quant is not None and cfg.quant.method == "compressed-tensors"
    return scheme_for("fp8-blockwise", "int4" if int4 else "fp8", cfg.quant.group_size if int4 else None).block


def recorded_block(record: dict | None, experts: str) -> tuple[int, int] | None:
    """The blockwise block a converted checkpoint's record (convert.layout.read_record) says its scales were
    written with; None when there is none to read, and plan() then assumes default_block. A converted config.json
    no longer carries the source's quantization_config, so default_block cannot tell an INT4 source from it."""
    if record is not None and experts == "fp8-blockwise" and record["experts"] == "fp8-blockwise":
        return tuple(record["nxd"]["quantization_block_size"])
    return None


def _expert_bytes(cfg: KimiK2Config, tp: int, ep: int, experts: str, block=None) -> tuple[int, int]:
    """(weight bytes, scale bytes) of one MoE layer's routed experts on one rank: E/ep experts (expert parallelism
    inside the tp ranks, NxDI moe_ep_degree), each with its gate_up [H, 2I/(tp/ep)] and down [I/(tp/ep), H] slices."""
    h, e_local, i_local = cfg.hidden_size, cfg.n_routed_experts // ep, _div(cfg.moe_intermediate_size, tp // ep)
    params = e_local * 3 * h * i_local
    if experts == "bf16":
        return params * BF16, 0
    if experts == "fp8-per-channel":  # scales [E,1,2I] sharded like the weight, [E,1,H] replicated (§3.6)
        return params * FP8, e_local * (2 * i_local + h) * FP32
    # Local scale = local weight shape / block, a dim below the block collapsing to 1 (§3.6).
    b1, b2 = block or default_block(cfg)
    gate_up = _div(h, b1) * _div(2 * i_local, b2)
    down = _div(i_local, b1) * _div(h, b2)
    return params * FP8, e_local * (gate_up + down) * FP32


def _weights(cfg: KimiK2Config, tp: int, ep: int, experts: str, block=None,
             router_dtype: str = "fp32") -> list[Row]:
    h, layers = cfg.hidden_size, cfg.num_hidden_layers  # MTP layers (num_nextn_predict_layers) are not loaded
    n_moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    att_rep, att_tp = _attention_params(cfg, tp)
    norms = layers * (2 * h + (cfg.q_lora_rank or 0) + cfg.kv_lora_rank) + h
    expert_w, expert_s = _expert_bytes(cfg, tp, ep, experts, block)
    rows = [
        Row("attention q_a+kv_a (replicated)", "bf16", layers * att_rep * BF16),
        Row("attention q_b+kv_b+o (TP)", "bf16", layers * att_tp * BF16),
        Row("norms (replicated)", "bf16", norms * BF16),
        Row("embedding (TP)", "bf16", cfg.vocab_size * _div(h, tp) * BF16),
        Row("lm_head (TP)", "bf16", _div(cfg.vocab_size, tp) * h * BF16),
        Row("dense MLP (TP)", "bf16", (layers - n_moe) * 3 * h * _div(cfg.intermediate_size, tp) * BF16),
        Row("shared experts (TP)", "bf16",
            n_moe * 3 * h * _div(cfg.moe_intermediate_size * cfg.n_shared_experts, tp) * BF16),
        Row("router + bias (replicated)", router_dtype,
            n_moe * (cfg.n_routed_experts * (h + 1)) * (FP32 if router_dtype == "fp32" else BF16)),
        Row("routed experts (E/ep, I/(tp/ep))", "bf16" if experts == "bf16" else "fp8", n_moe * expert_w),
    ]
    if expert_s:
        rows.append(Row(f"routed expert scales ({experts[4:]})", "fp32", n_moe * expert_s))
    return rows


def _allowance(cfg: KimiK2Config, seq_len: int, batch: int) -> list[Row]:
    scratch = batch * seq_len * cfg.hidden_size * CTE_SCRATCH_BYTES_PER_TOKEN_PER_HIDDEN
    pages = max(1, math.ceil(scratch / SCRATCHPAD_PAGE_BYTES))
    return [Row("runtime: NEFF code, DMA rings, I/O, CC, decode scratch", "-", RUNTIME_FIXED_BYTES),
            Row(f"prefill scratchpad ({pages} x 512 MiB page)", "-", pages * SCRATCHPAD_PAGE_BYTES)]


def _bytes_per_token(cfg, weights: list[Row], tp, ep, experts, seq_len, batch, block=None) -> tuple[float, int]:
    """Bytes one decode step reads per rank: every non-expert weight (the embedding only for its B rows), the
    routed experts the step runs, and the latent KV cache once (the duplicate V slot is not read)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if ep > 1 or decodes_all_experts(e, k, batch):  # with EP it must (check_ep)
        active = float(e // ep)
    else:  # selective loading: uniform, independent routing misses an expert per token with probability 1 - k/E
        active = (e // ep) * (1 - (1 - k / e) ** batch)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    expert_w, expert_s = _expert_bytes(cfg, tp, ep, experts, block)
    non_expert = sum(r.bytes for r in weights if not r.kind.startswith(("routed", "embedding")))
    embed_rows = batch * _div(cfg.hidden_size, tp) * BF16
    experts_read = n_moe * (expert_w + expert_s) * active / (e // ep)
    kv_read = cfg.num_hidden_layers * batch * seq_len * cfg.latent_dim * BF16
    return active, int(non_expert + embed_rows + experts_read + kv_read)


def plan(cfg: KimiK2Config, tp: int, ep: int, lnc: int, seq_len: int, batch: int, experts: str,
         kv_slots: int = 1, block: tuple[int, int] | None = None, router_dtype: str = "fp32") -> Plan:
    """`block`: the (in, out) blockwise scale block of fp8-blockwise experts; None = what the converter writes
    for this config's source format (or read it from a converted checkpoint's record, as the CLI does).
    `kv_slots` 2 and `router_dtype` "bf16" model other ports (NxDI's stock KV cache, a bf16 router)."""
    _check(cfg, tp, ep, lnc, seq_len, batch, experts, kv_slots)
    if router_dtype not in ("fp32", "bf16"):
        raise KimiInputError(f"--router-dtype {router_dtype!r}: expected fp32 (this port) or bf16")
    cores = _logical_cores(lnc)
    capacity = TRN2_HBM_PER_CHIP * lnc // TRN2_PHYSICAL_CORES_PER_CHIP
    bandwidth = TRN2_HBM_BW_PER_CHIP * lnc / TRN2_PHYSICAL_CORES_PER_CHIP
    weights = _weights(cfg, tp, ep, experts, block, router_dtype)
    # The MLA latent is replicated on every rank; the stock KVCacheManager gives it a K and a same-width V slot.
    kv = Row(f"KV cache (MLA latent x {kv_slots} slot{'s' * (kv_slots > 1)})", "bf16",
             cfg.num_hidden_layers * kv_slots * batch * seq_len * cfg.latent_dim * BF16)
    allowance = _allowance(cfg, seq_len, batch)
    total = sum(r.bytes for r in (*weights, kv, *allowance))
    active, per_token = _bytes_per_token(cfg, weights, tp, ep, experts, seq_len, batch, block)
    usable = capacity - RUNTIME_RESERVED_BYTES
    return Plan(
        model=f"{cfg.source} ({cfg.model_type})", tp=tp, ep=ep, lnc=lnc, seq_len=seq_len, batch=batch,
        experts=experts, kv_slots=kv_slots, logical_cores=cores, capacity_bytes=capacity,
        usable_bytes=usable, router_dtype=router_dtype,
        weights=tuple(weights), kv_cache=kv, allowance=tuple(allowance), total_bytes=total,
        fits=total <= usable, active_experts_per_layer=active, bytes_per_token=per_token,
        hbm_bytes_per_s=bandwidth, tpot_lower_bound_s=per_token / bandwidth,
        assumptions=_assumptions(kv_slots, router_dtype))


def _assumptions(kv_slots: int, router_dtype: str) -> tuple[str, ...]:
    kv = ("2 KV slots: the stock NxDI KVCacheManager allocates a V slot as wide as K, holding a dead copy of the "
          "latent (what a port on the stock manager pays)" if kv_slots == 2 else
          "1 KV slot: our LatentKVCacheManager keeps the latent in K and shrinks V to width 1 (--kv-slots 2 "
          "models the stock manager's duplicate V slot)")
    return (
        f"non-expert weights bf16; router + e_score_correction_bias {router_dtype}, replicated; q_a/kv_a replicated",
        kv,
        "allowance and usable HBM are calibrated on the AWS DeepSeek-V3 contrib's footprint (1.55 GiB runtime + "
        "prefill scratchpad 512 MiB per 1024 tokens at hidden 7168, in 512 MiB pages; 0.43 GiB kept by the runtime, "
        "bracketed by its seq 512 loading and seq 1024 running out of HBM); estimates",
        "TPOT bound: bytes read per decode step / per-core HBM bandwidth; every local expert when batch x top_k >= "
        "n_routed_experts or EP > 1 (NxD's all-experts decode), else the distinct experts uniform, independent "
        "routing hits, each read once; ignores compute, collectives and launch overheads",
    )


def format_plan(p: Plan) -> str:
    w = 58
    lines = [f"plan for {p.model}",
             f"trn2.48xlarge LNC={p.lnc}: {p.logical_cores} logical cores x {p.capacity_bytes / GiB:.2f} GiB HBM, "
             f"{p.hbm_bytes_per_s / 1e9:.1f} GB/s each; TP={p.tp} ranks, experts EP={p.ep} x {p.tp // p.ep}",
             f"seq_len {p.seq_len}, batch {p.batch}, routed experts {p.experts}",
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
              "",
              f"decode roofline, a lower bound and not a prediction: {p.bytes_per_token / 1e9:.3f} GB read per "
              f"token per core ({p.active_experts_per_layer:.2f} routed experts per MoE layer) / "
              f"{p.hbm_bytes_per_s / 1e9:.1f} GB/s = TPOT >= {p.tpot_lower_bound_s * 1e3:.2f} ms",
              "assumptions:"]
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def plan_json(p: Plan) -> str:
    return json.dumps(p.to_dict(), indent=2)
