"""Which NKI kernels the trn2 graphs call, and why each other kernel NxD/NxDI offer is off; the work the prefill
kernels do at Kimi's shapes (blocks computed, padded rows, MACs) and what dequantizing the FP8 experts before them
moves through HBM, for the planner's time model to weigh. Pure: no SDK, no torch.

Each statement rests on an NXDI_CONTRACT.md entry (NxD, NxDI and nki-library d2ad3a5 lines); the nxdi-cpu tier
(test_real_shapes.py, test_prefill_kernels.py) checks the counts against the kernels' own code and the arguments
against their own asserts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.scheme import ExpertScheme

from . import moe_paths
from .spec import RunSpec

BF16, FP8, FP32 = 2, 1, 4  # bytes per element
LNC2_CORES = 2  # physical cores one LNC=2 logical core (one rank) runs a kernel's programs on
ROUTINGS = ("balanced", "worst")


@dataclass(frozen=True)
class PrefillWork:
    """What one rank's MoE prefill kernel computes for one MoE layer and one prefill call."""

    mode: str  # moe_paths.MODES
    kernel: str | None
    tokens: int  # the call's tokens (batch x context, or a chunk)
    routing: str  # "balanced": every local expert gets tokens x top_k / E rows; "worst": NxD's worst case
    blocks: int  # blocks the kernel computes, both cores together
    block_size: int
    blocks_per_core: int  # blocks each physical core computes (the longer of the two)
    columns_per_core: int  # expert columns each core's block covers
    routed_rows: int  # (token, expert) pairs on this rank's local experts: the useful rows
    hidden: int

    @property
    def padded_rows(self) -> int:
        return self.blocks * self.block_size

    @property
    def padding(self) -> float:
        """Computed rows per useful row (1.0: no padding)."""
        return self.padded_rows / max(self.routed_rows, 1)

    @property
    def macs_per_core(self) -> int:
        """gate, up and down projections of every computed row on one physical core."""
        return self.blocks_per_core * self.block_size * self.columns_per_core * 3 * self.hidden

    @property
    def weight_bytes_per_core(self) -> int:
        """bf16 expert weights one core loads: each block its expert's gate, up and down columns (the shard-on-block
        kernel reloads them per block without the weight skip mode)."""
        return self.blocks_per_core * 3 * self.hidden * self.columns_per_core * BF16

    def to_dict(self) -> dict:
        return {**asdict(self), "padded_rows": self.padded_rows, "padding": round(self.padding, 2),
                "macs_per_core": self.macs_per_core, "weight_bytes_per_core": self.weight_bytes_per_core}


def routed_rows(cfg: KimiK2Config, tokens: int, ep: int) -> int:
    """(token, expert) pairs a rank's local experts receive on average: all of them at EP=1."""
    return tokens * cfg.num_experts_per_tok // ep


def prefill_work(cfg: KimiK2Config, mode: str, tokens: int, tp: int, ep: int = 1,
                 routing: str = "balanced") -> PrefillWork:
    """The blocks a prefill mode computes per MoE layer at these shapes.

    - shard-on-block (bwmm_shard_on_block): all N = NxD's block count (NXDI_CONTRACT.md: blockwise-dispatch) in
      one static loop with no skip conditions, PING_PONG over the two cores: ceil(N / 2) on core 0, each block over
      all of the rank's expert columns (NXDI_CONTRACT.md: shard-on-block-work).
    - shard-on-intermediate (blockwise_mm_baseline_shard_intermediate_hybrid): NxD's num_static_blocks =
      ceil(ceil(T x top_k / ep) / B) in a static loop, then a dynamic loop up to the non-padded blocks' count:
      max(static, non-padded) blocks, each on both cores, half the columns each (NXDI_CONTRACT.md: shard-on-i-work).
      Non-padded blocks: the sum over local experts of ceil(rows / B), T x top_k / E rows each when balanced; N
      (every block holding a row) at worst.
    - torch: NxD's loop computes all N blocks (NXDI_CONTRACT.md: blockwise-dispatch) as XLA ops.
    - all-experts: every token through every local expert: E_local "blocks" of T rows."""
    m = moe_paths.mode(mode)
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r}: expected one of {ROUTINGS}")
    e_local, i_local = cfg.n_routed_experts // ep, moe_paths.local_intermediate(cfg, tp, ep)
    useful = routed_rows(cfg, tokens, ep)
    common = dict(mode=m.name, kernel=m.kernel, tokens=tokens, routing=routing, hidden=cfg.hidden_size,
                  routed_rows=useful)
    if m.name == "all-experts":
        return PrefillWork(**common, blocks=e_local, block_size=tokens, blocks_per_core=e_local,
                           columns_per_core=i_local)
    b = m.block_size
    n = moe_paths.blockwise_blocks(cfg, tokens, ep, b)
    if m.name == "shard-on-intermediate":
        static = math.ceil(math.ceil(tokens * cfg.num_experts_per_tok / ep) / b)
        needed = n if routing == "worst" else e_local * math.ceil(useful / e_local / b)
        blocks = max(static, min(needed, n))
        return PrefillWork(**common, blocks=blocks, block_size=b, blocks_per_core=blocks,
                           columns_per_core=i_local // LNC2_CORES)
    per_core = math.ceil(n / LNC2_CORES) if m.kernel else n
    return PrefillWork(**common, blocks=n, block_size=b, blocks_per_core=per_core, columns_per_core=i_local)


@dataclass(frozen=True)
class DequantTraffic:
    """HBM bytes of NxD dequantizing every local FP8 expert to bf16 before a prefill kernel, per MoE layer and call
    (NXDI_CONTRACT.md: kernel-dequantizes; its fp32 weight x scale products assumed fused, as neuron/hbm.py assumes)."""

    elements: int  # local expert weight elements: E_local x 3 x H x I_local
    fp8_read: int
    scale_read: int
    bf16_written: int
    bf16_read: int  # the kernel reading the bf16 copy, each expert at least once
    fp8_kernel_read: int  # what a kernel taking the FP8 weights and scales would read instead

    @property
    def total(self) -> int:
        return self.fp8_read + self.scale_read + self.bf16_written + self.bf16_read

    @property
    def extra(self) -> int:
        """Over a kernel that takes the FP8 weights and their scales."""
        return self.total - self.fp8_kernel_read

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "extra": self.extra}


def dequantize_traffic(cfg: KimiK2Config, scheme: ExpertScheme, tp: int, ep: int = 1) -> DequantTraffic | None:
    """None for bf16 experts (nothing to dequantize)."""
    if not scheme.quantized:
        return None
    e, h, i = cfg.n_routed_experts // ep, cfg.hidden_size, moe_paths.local_intermediate(cfg, tp, ep)
    elements = e * 3 * h * i
    scales = sum(math.prod(scheme.scale_shape(e, a, b)) for a, b in ((h, 2 * i), (i, h))) * FP32
    return DequantTraffic(elements=elements, fp8_read=elements * FP8, scale_read=scales,
                          bf16_written=elements * BF16, bf16_read=elements * BF16,
                          fp8_kernel_read=elements * FP8 + scales)


# -- the kernels, on or off, and why --------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelChoice:
    kernel: str  # nki-library's name
    submodel: str  # "context_encoding" | "token_generation" | "both"
    on: bool
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


# The fused decode kernels NxD/NxDI offer, and why none computes Kimi's decode (NXDI_CONTRACT.md: fused-tkg-bias,
# router-topk-bias, mlp-kernel-call-site, attention-kernels-gqa).
DECODE_OFF = (
    KernelChoice("moe_block_tkg (NxD MoEFusedTKG)", "token_generation", False,
                 "NxD calls it only without a shared expert, and the kernel's shared expert is a TODO; its router adds "
                 "router_bias to the logits before the sigmoid and selects on the biased affinities, where Kimi adds "
                 "e_score_correction_bias after the sigmoid for the choice only; no routed_scaling_factor (2.827); "
                 "expert scales for MX weights only, not FP8 blockwise or per-channel (NXDI_CONTRACT.md: "
                 "fused-tkg-bias)"),
    KernelChoice("router_topk", "both", False,
                 "computes sigmoid(x W + b) and its top-k: the bias shifts the weights and the choice alike; Kimi's "
                 "noaux_tc adds the bias after the sigmoid, to the choice only, then normalises and scales by 2.827 "
                 "(NXDI_CONTRACT.md: router-topk-bias)"),
    KernelChoice("mlp (mlp_tkg)", "token_generation", False,
                 "would compute the dense layer's and the shared expert's SwiGLU, but NxDI calls it only from its "
                 "Llama-family MLP modules, not from the parallel layers this model's MLPs and NxD's SharedExperts "
                 "use; nki-library d2ad3a5's mlp.py does not parse, and it has no torch reference of the bf16 path "
                 "to check a call against on CPU (NXDI_CONTRACT.md: mlp-kernel-call-site)"),
    KernelChoice("attention_block_tkg / attention_tkg", "token_generation", False,
                 "GQA attention over heads of at most 128; Kimi's absorbed MLA decode attends over the 576-wide latent "
                 "per head, its naive form over 192-wide query/key heads (NXDI_CONTRACT.md: attention-kernels-gqa)"),
    KernelChoice("rmsnorm_quant / qkv / output_projection", "both", False,
                 "NxDI calls them from its GQA attention and quantized-MLP paths only; Kimi's norms and projections "
                 "run as torch ops in the decoder layer (NXDI_CONTRACT.md: attention-kernels-gqa)"),
)


def report(cfg: KimiK2Config, spec: RunSpec) -> list[dict]:
    """Each NKI kernel the spec's graphs call, and each other one NxD/NxDI offer with why it is off
    (`compile_and_save.py --dry-run`)."""
    tokens, batch, tp, ep, scheme = spec.prefill_tokens, spec.batch, spec.tp, spec.ep, spec.scheme
    path = moe_paths.prefill_path(cfg, tokens, spec.prefill_mode(cfg))
    out = []
    for name, m in moe_paths.MODES.items():
        if not m.kernel:
            continue
        if name == path:
            work = prefill_work(cfg, name, tokens, tp, ep)
            why = (f"--moe-prefill {name}: {work.blocks} blocks of {work.block_size} rows per MoE layer, "
                   f"{work.padding:.1f}x the {work.routed_rows} routed rows, {work.blocks_per_core} per core over "
                   f"{work.columns_per_core} expert columns")
            traffic = dequantize_traffic(cfg, scheme, tp, ep)
            if traffic:
                why += (f"; NxD dequantizes all {cfg.n_routed_experts // ep} local FP8 experts to bf16 first: "
                        f"{traffic.total / 1e9:.2f} GB of HBM traffic per MoE layer per call "
                        f"(NXDI_CONTRACT.md: kernel-dequantizes)")
            out.append(KernelChoice(m.kernel, "context_encoding", True, why))
        else:
            out.append(KernelChoice(m.kernel, "context_encoding", False,
                                    f"--moe-prefill {name} not chosen ({m.about})" if path in moe_paths.MODES or
                                    path == "torch" else f"this prefill takes NxD's {path} path"))
    out.append(KernelChoice("find_nonzero_indices / indexed_flatten", "context_encoding", False,
                            "NxDI's use_index_calc_kernel defaults to False: NxD's torch token-to-block mapping runs "
                            "(NXDI_CONTRACT.md: index-calc-kernel)"))
    decode = moe_paths.call_path(batch, cfg.num_experts_per_tok, cfg.n_routed_experts, 1, decode=True)
    out.append(KernelChoice("(none: NxD's torch selective loading)" if decode == "selective" else
                            "(none: NxD's torch all-experts path)", "token_generation", False,
                            f"batch {batch} x top-{cfg.num_experts_per_tok} of {cfg.n_routed_experts} experts: the "
                            f"{decode} path as XLA ops (NXDI_CONTRACT.md: moe-paths)"))
    out += DECODE_OFF
    if spec.sampling.on_device:
        out += [KernelChoice("topk (rotational)", "both", True,
                             "NxD's distributed top-k of global_topk on each vocabulary shard, then on the gathered "
                             "candidates, sorted; NxDI's top_k_kernel_enabled is on by default on trn2 "
                             "(NXDI_CONTRACT.md: device-sampler)"),
                KernelChoice("cumsum", "both", True,
                             "NxDI's dynamic sampler: top-p and the multinomial draw over the top-k probabilities "
                             "(NXDI_CONTRACT.md: device-sampler)"),
                KernelChoice("cascaded_max", "both", False,
                             "only a static greedy sampler calls NxD's distributed argmax; the dynamic sampler this "
                             "configuration compiles samples every request (NXDI_CONTRACT.md: device-sampler)")]
    return [c.to_dict() for c in out]
