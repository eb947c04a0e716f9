"""Which of NxD's MoE paths a call takes, and what each prefill mode (`--moe-prefill`) needs of Kimi's shapes.

ExpertMLPsV2 picks a path per call from T, top-k and E (NXDI_CONTRACT.md: moe-paths), the blockwise kernel from two
flags (NXDI_CONTRACT.md: blockwise-dispatch); with neither, NxD 2.29 calls a kernel that only raises, so every mode
names its path and is refused where it cannot run (NXDI_CONTRACT.md: shard-on-block-kernel, shard-on-i-kernel).
Pure: no SDK, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError

DEFAULT_BLOCK_SIZE = 512  # NxD's default blockwise block
# A block no prefill reaches: every prefill takes the all-experts path (as NxDI's GLM-5.2 contrib does).
ALL_EXPERTS_BLOCK_SIZE = 2**30
KERNEL_BLOCK_SIZES = (128, 256, 512, 1024)  # NxD's kernel eligibility (NXDI_CONTRACT.md: blockwise-eligibility)
# NxD runs MoE decode on every local expert once batch x top_k / E reaches this (and only then with EP).
SELECTIVE_LOADING_THRESHOLD = 1.0
OUTPUT_TILE = 128  # rows of the shard-on-block kernel's output tiles: its prefill is a whole number of them


@dataclass(frozen=True)
class PrefillMode:
    """The BlockwiseMatmulConfig keys a mode sets (contract.py adds logical_nc_config) and NxD's kernel, if any."""

    name: str
    blockwise: dict = field(default_factory=dict)
    kernel: str | None = None
    about: str = ""

    @property
    def block_size(self) -> int:
        return self.blockwise.get("block_size", DEFAULT_BLOCK_SIZE)


MODES = {m.name: m for m in (
    # The only kernel NxD 2.29 reaches that takes 32 expert columns per rank as they are; block 128 pads the fewest
    # rows with the smallest SBUF working set; skip_dma_token as nkilib's own tests use it. FP8 reaches it
    # dequantized (NXDI_CONTRACT.md: kernel-dequantizes).
    PrefillMode("shard-on-block", {"use_shard_on_block_dynamic_while": True, "block_sharding_strategy": "PING_PONG",
                                   "block_size": 128, "skip_dma_token": True},
                kernel="bwmm_shard_on_block",
                about="a fused Neuron kernel that runs each rank's routed experts block by block, 128 tokens a block "
                      "(NxD's nkilib kernel bwmm_shard_on_block)"),
    # Splits each rank's expert columns over the 2 physical cores and skips empty blocks; needs 128 columns per core.
    PrefillMode("shard-on-intermediate", {"use_shard_on_intermediate_dynamic_while": True, "block_size": 256},
                kernel="blockwise_mm_baseline_shard_intermediate_hybrid",
                about="a fused Neuron kernel that splits each rank's expert columns over its 2 physical cores and "
                      "skips empty blocks, 256 tokens a block; needs moe_intermediate_size / (tp / ep) / 2 a multiple "
                      "of 128 (--ep 16 or 64 at --tp 64) (NxD's nkilib shard-on-intermediate kernel)"),
    PrefillMode("torch", {"use_torch_block_wise": True},
                about="plain PyTorch, one copy of an expert MLP per block, ~400 per MoE layer, unrolled into the "
                      "graph (NxD's torch blockwise loop)"),
    PrefillMode("all-experts", {"block_size": ALL_EXPERTS_BLOCK_SIZE},
                about="every token through every local expert (E / top_k times the expert FLOPs, an [E, tokens, "
                      "hidden] output); no EP"),
)}
DEFAULT_MODE = "shard-on-block"
KERNEL_MODES = tuple(name for name, m in MODES.items() if m.kernel)


def modes_help() -> str:
    return "; ".join(f"{m.name} = {m.about}" for m in MODES.values())


def mode(name: str) -> PrefillMode:
    if name not in MODES:
        raise KimiInputError(f"--moe-prefill {name!r}: expected one of {', '.join(MODES)}")
    return MODES[name]


def decodes_all_experts(n_experts: int, top_k: int, batch: int) -> bool:
    """NxD's own token-generation choice: all-experts once batch x top_k / E reaches its threshold."""
    return batch * top_k >= SELECTIVE_LOADING_THRESHOLD * n_experts


# The token-generation paths the shell runs (--moe-decode), each one of ExpertMLPsV2's public methods: selective
# loading (forward_selective_loading, EP 1 only), every local expert (forward_all_experts; forward_all_experts_EP with
# EP) (NXDI_CONTRACT.md: moe-paths, moe-decode)
DECODE_PATHS = ("selective", "all-experts")


def decode_candidates(ep: int) -> tuple[str, ...]:
    """The token-generation paths NxD can run at this EP: selective loading has no EP variant."""
    return ("all-experts",) if ep > 1 else DECODE_PATHS


def nxd_decode_path(cfg: KimiK2Config, batch: int) -> str:
    """The path NxD's ExpertMLPsV2.forward takes for a decode of `batch` tokens by its threshold."""
    return "all-experts" if decodes_all_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch) else "selective"


def local_intermediate(cfg: KimiK2Config, tp: int, ep: int) -> int:
    """One rank's columns of each routed expert: experts split ep ways, each expert tp / ep ways."""
    return -(-cfg.moe_intermediate_size // (tp // ep))


def call_path(tokens: int, top_k: int, n_experts: int, block_size: int, decode: bool) -> str:
    """"selective", "all-experts" or "blockwise" for one dropless call (NXDI_CONTRACT.md: moe-paths)."""
    loaded = tokens * top_k / n_experts
    if loaded < SELECTIVE_LOADING_THRESHOLD:
        return "selective"
    if decode or tokens * top_k < block_size:
        return "all-experts"
    return "blockwise"


def prefill_path(cfg: KimiK2Config, tokens: int, mode_name: str) -> str:
    """call_path, with "blockwise" named by its mode."""
    m = mode(mode_name)
    path = call_path(tokens, cfg.num_experts_per_tok, cfg.n_routed_experts, m.block_size, decode=False)
    return m.name if path == "blockwise" else path


# The fused graph's verify of batch x speculation_length tokens: selective loading, else all experts, which reads no
# more than the blockwise kernel there (48 x 8 = 384 = E at Kimi's shapes) and needs none (NXDI_CONTRACT.md:
# verify-moe-path)
VERIFY_MODE = "all-experts"


def verify_path(cfg: KimiK2Config, tokens: int) -> str:
    """The MoE path of a verify call of `tokens` tokens (batch x speculation_length)."""
    return prefill_path(cfg, tokens, VERIFY_MODE)


def mode_of(blockwise_config) -> str | None:
    """The mode a BlockwiseMatmulConfig (or dict) is for; None, e.g. no kernel flag at LNC=2, is refused."""
    def value(key):
        v = blockwise_config.get(key) if isinstance(blockwise_config, dict) else getattr(blockwise_config, key, None)
        return getattr(v, "name", v)  # NxD's BlockShardStrategy enum, by name

    flags = ("use_shard_on_block_dynamic_while", "use_shard_on_intermediate_dynamic_while", "use_torch_block_wise")
    for m in MODES.values():
        if (all(value(k) == v for k, v in m.blockwise.items())
                and all(bool(value(f)) == bool(m.blockwise.get(f)) for f in flags)):
            return m.name
    return None


def blockwise_blocks(cfg: KimiK2Config, tokens: int, ep: int, block_size: int) -> int:
    """Blocks per MoE layer, NxD's worst case over routings; every path computes every one."""
    pairs, e_local = tokens * cfg.num_experts_per_tok, cfg.n_routed_experts // ep
    return min(math.ceil((pairs - (e_local - 1)) / block_size) + e_local - 1, pairs)


def default_mode(cfg: KimiK2Config, tp: int, ep: int, lnc: int | None, tokens: int) -> str:
    """DEFAULT_MODE where its kernel can run the model's shapes, else "torch" (tiny configs). A prefill of tokens the
    kernel's output tiles do not hold keeps DEFAULT_MODE, whose rule then refuses it: never a silent torch loop of
    hundreds of unrolled blocks at Kimi's shapes."""
    try:
        check_prefill_mode(cfg, DEFAULT_MODE, tp, ep, lnc, -(-tokens // OUTPUT_TILE) * OUTPUT_TILE)
    except KimiInputError:
        return "torch"
    return DEFAULT_MODE


def _ep_minimum(cfg: KimiK2Config, mode_name: str) -> int:
    """The fewest tokens per prefill call on which mode_name takes its blockwise path (neither the selective nor the
    all-experts path has an EP variant), in whole output tiles for the shard-on-block kernel."""
    k = cfg.num_experts_per_tok
    least = max(-(-mode(mode_name).block_size // k), math.ceil(cfg.n_routed_experts * SELECTIVE_LOADING_THRESHOLD / k))
    return -(-least // OUTPUT_TILE) * OUTPUT_TILE if mode_name == "shard-on-block" else least


def check_prefill_mode(cfg: KimiK2Config, mode_name: str, tp: int, ep: int, lnc: int | None, tokens: int) -> None:
    """lnc None skips the LNC rule; the shell re-checks the resolved config."""
    m = mode(mode_name)
    path = prefill_path(cfg, tokens, mode_name)
    # NxD's all-experts prefill has no EP variant: it runs for --moe-prefill all-experts and below one block
    # (NXDI_CONTRACT.md: all-experts-no-ep).
    if ep > 1 and path in ("all-experts", "selective"):
        raise KimiInputError(f"--ep {ep}: a prefill of {tokens} tokens takes NxD's {path} path, which has no EP "
                             f"variant; use " + " or ".join(
                                 f"--moe-prefill {n} with at least {_ep_minimum(cfg, n)} tokens per prefill call"
                                 for n in (DEFAULT_MODE, "torch")))
    if m.kernel is None:
        return
    flag = f"--moe-prefill {m.name}"
    if lnc is not None and lnc != 2:
        raise KimiInputError(f"{flag} with --lnc {lnc}: nkilib has its MoE prefill kernels for LNC=2 only (at LNC=1 "
                             f"NxD would silently take its torch loop); use --lnc 2 or --moe-prefill torch")
    h, i_local = cfg.hidden_size, local_intermediate(cfg, tp, ep)
    if not (512 <= h <= 8192 and h % 512 == 0):
        raise KimiInputError(f"{flag}: NxD's blockwise kernels need hidden_size in 512..8192, a multiple of 512 "
                             f"(config.json has {h}); use --moe-prefill torch")
    if i_local % 16:
        raise KimiInputError(f"{flag}: the kernel needs each rank's expert columns (moe_intermediate_size / (tp / ep)"
                             f" = {i_local}) a multiple of 16; use --moe-prefill torch")
    if m.block_size not in KERNEL_BLOCK_SIZES:
        raise KimiInputError(f"{flag}: block {m.block_size} is not one of NxD's kernel blocks {KERNEL_BLOCK_SIZES}")
    if m.name == "shard-on-block" and path == m.name and tokens % OUTPUT_TILE:
        # The kernel's final reduction reads whole 128-row tiles of the output.
        raise KimiInputError(f"{flag}: a prefill of {tokens} tokens (batch x --max-context-length) must be a "
                             f"multiple of 128 for the kernel's 128-row output tiles")
    if m.name == "shard-on-intermediate" and (i_local // 2) % 128:
        raise KimiInputError(f"{flag}: the kernel splits each rank's {i_local} expert columns over the 2 physical "
                             f"cores and computes them in 128-row tiles, so it needs moe_intermediate_size / (tp / ep)"
                             f" / 2 a multiple of 128 ({i_local // 2} here); use --moe-prefill {DEFAULT_MODE}, or "
                             f"more --ep")
