"""The compute of one decode step on a trn2 logical core, modelled: each matmul the step issues as TensorEngine
instructions, and the all-experts path's combine on the VectorEngine, by the NKI architecture guides' cost model.
Estimates: nothing here ran on trn2.

A TensorEngine instruction multiplies a stationary tile of at most 128 (contraction) x 128 (columns) by a moving
tensor of at most 128 x 512; back to back, one issues every max(N, 64) cycles, N the moving tensor's free size, and a
float32 one costs 4x (trainium_inferentia2_arch.rst, "Performance Consideration": MM_INIT_LATENCY). So a decode
matmul of a few tokens costs 64 cycles per 128 x 128 weight tile whatever the batch: at batch 1 its efficiency is
1/64 of the peak, and a path's compute is the weight tiles it streams through the PE array. The compiler's choice of
which operand is stationary is taken as the cheaper. An LNC=2 logical core has two TensorEngines (the planner's
peak, timing.Constants.bf16_flops, assumes the same). Pure: no SDK, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k2_neuron.config import KimiK2Config

from . import moe_paths
from .spec import RunSpec


@dataclass(frozen=True)
class Engines:
    """One trn2 logical core's compute engines at LNC=2."""

    # trainium_inferentia2_arch.rst: a 128 x 128 systolic array; the moving tensor's free size at most 512 (one PSUM
    # bank); MM_INIT_LATENCY 64 cycles (given for NeuronCore-v2: the guide gives no other for v3); fp32 4x
    pe_rows: int = 128
    pe_cols: int = 128
    moving_max: int = 512
    init_cycles: int = 64
    fp32_factor: int = 4
    # trainium2_arch.rst: TensorEngine 2.4 GHz (128 x 128 x 2 x 2.4e9 = 79 TFLOPS, neuron-core-v3.rst's bf16 peak)
    tensor_hz: float = 2.4e9
    # trainium2_arch.rst: VectorEngine 0.96 GHz, 512 bf16 elements a cycle
    vector_hz: float = 0.96e9
    vector_width: int = 512
    cores: int = 2  # physical NeuronCores per LNC=2 logical core, each with its own engines


TRN2_ENGINES = Engines()


@dataclass(frozen=True)
class Matmul:
    """`count` matmuls of [n, k] @ [k, m] (n tokens, the weight k x m)."""

    what: str
    k: int
    m: int
    n: int
    count: int = 1
    fp32: bool = False

    def cycles(self, e: Engines = TRN2_ENGINES) -> int:
        """TensorEngine cycles of all `count`: the cheaper of the weight stationary (the tokens moving) and the
        tokens stationary (the weight moving)."""
        def issue(tiles: int, free: int) -> int:  # instructions over `tiles` stationary tiles, a moving free size each
            full, rest = divmod(free, e.moving_max)
            return tiles * (full * e.moving_max + (max(rest, e.init_cycles) if rest else 0))

        k_tiles = -(-self.k // e.pe_rows)
        weight_still = issue(k_tiles * -(-self.m // e.pe_cols), self.n)
        tokens_still = issue(k_tiles * -(-self.n // e.pe_cols), self.m)
        return self.count * min(weight_still, tokens_still) * (e.fp32_factor if self.fp32 else 1)

    def seconds(self, e: Engines = TRN2_ENGINES) -> float:
        return self.cycles(e) / (e.tensor_hz * e.cores)

    @property
    def flops(self) -> int:
        return 2 * self.count * self.k * self.m * self.n


@dataclass(frozen=True)
class Compute:
    """One decode step's compute on one logical core (seconds)."""

    matmuls: tuple[Matmul, ...]
    tensor_s: float  # every matmul's instructions
    vector_s: float  # the routed experts' combine (all-experts: every local expert's output weighted and summed)
    moe_path: str

    @property
    def total_s(self) -> float:
        return self.tensor_s + self.vector_s

    @property
    def flops(self) -> int:
        return sum(m.flops for m in self.matmuls)

    def routed_s(self, e: Engines = TRN2_ENGINES) -> float:
        return sum(m.seconds(e) for m in self.matmuls if m.what.startswith("routed"))


def routed_matmuls(cfg: KimiK2Config, spec: RunSpec, path: str, tokens: int) -> list[Matmul]:
    """One MoE layer's routed experts on one rank, as NxD's path computes them (NXDI_CONTRACT.md: moe-paths):
    selective loading runs each token through its top-k experts, one token at a time; all-experts every token through
    every local expert (forward_all_experts, or forward_all_experts_EP: E/ep experts of I/(tp/ep) columns); a
    blockwise path every block NxD forms (its worst case, moe_paths.blockwise_blocks), a block of rows each."""
    h, e_local, i_local = cfg.hidden_size, cfg.n_routed_experts // spec.ep, moe_paths.local_intermediate(
        cfg, spec.tp, spec.ep)
    if path == "selective":
        count, rows = tokens * cfg.num_experts_per_tok, 1
    elif path == "all-experts":
        count, rows = e_local, tokens
    else:
        block = moe_paths.mode(path).block_size
        count, rows = moe_paths.blockwise_blocks(cfg, tokens, spec.ep, block), block
    return [Matmul(f"routed gate_up ({path})", h, 2 * i_local, rows, count),
            Matmul(f"routed down ({path})", i_local, h, rows, count)]


def combine_elements(cfg: KimiK2Config, spec: RunSpec, path: str, tokens: int) -> int:
    """VectorEngine element operations of one MoE layer's combine: each expert output a token gets, multiplied by its
    affinity and added (forward_all_experts: every local expert's [tokens, H] output, zero affinities included)."""
    per_token = cfg.n_routed_experts // spec.ep if path == "all-experts" else cfg.num_experts_per_tok
    return 2 * per_token * tokens * cfg.hidden_size


def decode_matmuls(cfg: KimiK2Config, spec: RunSpec, path: str, router_fp32: bool = True) -> list[Matmul]:
    """Every matmul of one decode step of spec.batch rows on one rank: attention's projections, the absorbed
    attention over the cache slots a rank holds (model/mla.py: per head q_nope x W_UK, then per sequence the scores
    and the context over the latent, then x W_UV), the dense MLPs and shared expert, the router, the routed experts
    by `path`, lm_head."""
    b, tp, h, layers = spec.batch, spec.tp, cfg.hidden_size, cfg.num_hidden_layers
    n_moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    heads = cfg.num_attention_heads // tp
    group = spec.layout.kv_group  # a sequence-sharded rank attends every head of its KV group (attend_sharded)
    hq, slots = heads * group, spec.cache_slots
    attn_a = tp if spec.layout.shard_attn_a else 1
    nope, rope, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = [Matmul("q_a + kv_a", h, (cfg.q_lora_rank + cfg.latent_dim) // attn_a, b, layers),
           Matmul("q_b", cfg.q_lora_rank, heads * cfg.qk_head_dim, b, layers),
           Matmul("q_nope x W_UK", nope, r, b, layers * heads),  # its own heads, then gathered when sharded
           Matmul("scores over the cache", r + rope, slots, hq, layers * b),
           Matmul("context over the cache", slots, r, hq, layers * b),
           Matmul("context x W_UV", r, v, b, layers * heads),
           Matmul("o_proj", heads * v, h, b, layers)]
    mlp = -(-cfg.intermediate_size // tp)
    out += [Matmul("dense MLP gate_up", h, 2 * mlp, b, layers - n_moe), Matmul("dense MLP down", mlp, h, b,
                                                                              layers - n_moe)]
    if cfg.n_shared_experts:
        shared = -(-cfg.n_shared_experts * cfg.moe_intermediate_size // tp)
        out += [Matmul("shared expert gate_up", h, 2 * shared, b, n_moe), Matmul("shared expert down", shared, h, b,
                                                                                n_moe)]
    router = tp if spec.layout.shard_router else 1
    out.append(Matmul("router", h, cfg.n_routed_experts // router, b, n_moe, fp32=router_fp32))
    out += [Matmul(m.what, m.k, m.m, m.n, m.count * n_moe) for m in routed_matmuls(cfg, spec, path, b)]
    out.append(Matmul("lm_head", h, -(-cfg.vocab_size // tp), b))
    return [m for m in out if m.count]


def decode_compute(cfg: KimiK2Config, spec: RunSpec, path: str, router_fp32: bool = True,
                   e: Engines = TRN2_ENGINES) -> Compute:
    matmuls = tuple(decode_matmuls(cfg, spec, path, router_fp32))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    vector = n_moe * combine_elements(cfg, spec, path, spec.batch) / (e.vector_width * e.vector_hz * e.cores)
    return Compute(matmuls, sum(m.seconds(e) for m in matmuls), vector, path)
