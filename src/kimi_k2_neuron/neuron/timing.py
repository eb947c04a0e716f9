"""Time on trn2, modelled: what a decode step and a prefill call cost as the code builds them. Estimates: nothing here
ran on trn2.

A step is the bytes it reads over the core's HBM bandwidth, plus each collective at a latency and its bytes over a link
bandwidth, plus its matmuls as TensorEngine instructions and the all-experts combine on the VectorEngine (engines.py),
plus a fixed cost per layer (everything per layer that is none of these: scalar ops, DMA setup, semaphores,
stragglers), plus NxD's per-token loop of the selective-loading MoE at batch > 1 beyond its counted bytes and compute.
A prefill call adds its matmul FLOPs at the TensorEngine's rate and its MoE path's traffic, scaled by one overhead
factor. Additive, not a maximum: the DeepSeek-V3 contrib's profile lists compute, collectives and exposed memory as
separate slices of its step. The constants are one table (TRN2), each with its source; the fitted ones come from the
AWS DeepSeek-V3 contrib and are checked against the community Kimi ports (PUBLISHED; docs/planner.md). Pure: no SDK;
the chunk's collectives are the model's own list (model/mla.py chunk_collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.model.mla import HeadDims, chunk_collectives, chunk_group_for

from . import moe_paths
from .engines import Compute, decode_compute
from .spec import RunSpec

BF16, FP8, FP32 = 2, 1, 4  # bytes per element


@dataclass(frozen=True)
class Constants:
    """trn2.48xlarge at LNC=2, per logical core."""

    # aws-neuron-sdk trainium2.rst: 2.9 TB/s of HBM per chip; logical-neuroncore-config.rst: four banks, one per LNC=2
    # logical core
    hbm_bytes_per_s: float = 2.9e12 / 4
    # neuron-core-v3.rst: 79 dense BF16 TFLOPS per NeuronCore-v3; an LNC=2 logical core is two of them
    bf16_flops: float = 2 * 79e12
    # per collective: the DeepSeek-V3 contrib's decode profile shows ~3 ms of collectives (contrib/models/DeepSeek-V3/
    # README.md, "Profile") over the 125 its step issues (decode_collectives at its configuration): 24 us each; AWS's
    # intranode-collective-comm.rst gives 1-2 us per hop, a few hops per algorithm, and the CC core's orchestration
    alpha_s: float = 24e-6
    # the same AWS page's transfer-rate example (100 GBps); only prefill chunks move enough bytes for it to matter
    beta_bytes_per_s: float = 100e9
    # fitted: the DeepSeek-V3 contrib's 20.5 ms p50 TPOT (README, NxDI benchmark_sampling, seq 512, batch 1) less its
    # modelled bytes, collectives and compute, over its 61 layers (test_timing refits it)
    layer_s: float = 184e-6
    # fitted, with vllm_step_s, by least squares on all four of the same contrib's vLLM sync ITLs at compiled batch 1,
    # 2, 4 and 8 (22.2, 30.5, 37.1, 47.6 ms: README, "vLLM Serving + GuideLLM Sweep"), each less its modelled step: NxD's
    # selective-loading MoE loops over the tokens, so each further token of a batch costs this per MoE layer beyond
    # its counted bytes and compute (test_timing refits both and pins the residuals)
    token_moe_s: float = 29.3e-6
    # fitted with token_moe_s: what a step costs through vLLM and vllm-neuron beyond NxDI's own (the scheduler, the
    # model runner's inputs, the detokenizer), per step whatever the batch
    vllm_step_s: float = 4.55e-3
    # fitted: the same contrib's 1,667 ms TTFT (a 512-token bucket) over its counted on-core prefill time
    prefill_factor: float = 2.84


TRN2 = Constants()


@dataclass(frozen=True)
class Collective:
    """`count` collectives over `group` ranks of `bytes` each: an all-reduce's tensor, an all-gather's output, a
    reduce-scatter's input."""

    what: str
    count: int
    group: int
    bytes: int

    def seconds(self, c: Constants = TRN2) -> float:
        return self.count * (c.alpha_s + self.bytes / c.beta_bytes_per_s)


@dataclass(frozen=True)
class Port:
    """How a build differs from this port's, to model the published ports at their own configuration: their stock KV
    cache holds the latent twice, their router runs in bf16 (NxDI's cast_type="config"), the community Kimi ports run
    the shared expert as its own row-parallel layer (one more all-reduce per MoE layer, in fp32), and they sample on the
    host or by NxD's argmax."""

    kv_slots: int = 1  # 1: our latent-only manager; 2: NxDI's stock KVCacheManager (V a copy of K)
    router_dtype: str = "fp32"
    shared_expert_reduce: bool = False  # a separate fp32 all-reduce of the shared expert per MoE layer
    dense_reduce_bytes: int = BF16  # the dense MLP's all-reduce (RowParallelLinear defaults it to fp32)
    # "topk": the dynamic on-device sampler (NxD's 3-stage distributed top-k at TP=64); "argmax": on-device greedy;
    # "host": lm_head's logits gathered and sampled on the host
    sampler: str = "topk"


THIS_PORT = Port()


@dataclass(frozen=True)
class Timing:
    """One decode step, or one prefill call, by component (seconds)."""

    bytes: int  # read from HBM (a decode step; a prefill call's MoE and weight traffic)
    bytes_s: float
    collectives: tuple[Collective, ...]
    collectives_s: float
    flops_s: float  # matmuls: at the TensorEngine's rate (prefill); as instructions, with the combine (decode)
    fixed_s: float  # layers x the fitted per-layer cost
    batch_s: float  # the selective-loading MoE's per-token loop (decode at batch > 1)
    total_s: float
    compute: Compute | None = None  # a decode step's matmuls and combine, one by one (engines.py)

    @property
    def collective_count(self) -> int:
        return sum(c.count for c in self.collectives)


# -- a decode step -----------------------------------------------------------------------------------------------

def decode_collectives(cfg: KimiK2Config, spec: RunSpec, port: Port = THIS_PORT) -> list[Collective]:
    """Every collective of one decode step, as the code issues them (NXDI_CONTRACT.md: moe-shared-expert,
    numeric-cc-token, sampler-collectives)."""
    tp, b, h, layers = spec.tp, spec.batch, cfg.hidden_size, cfg.num_hidden_layers
    n_moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    out = [Collective("o_proj all-reduce (TP), bf16", layers, tp, b * h * BF16),
           Collective("dense MLP all-reduce (TP)", layers - n_moe, tp, b * h * port.dense_reduce_bytes),
           Collective("MoE all-reduce, shared expert inside (TP), bf16", n_moe, tp, b * h * BF16),
           Collective("embedding all-gather (TP), bf16", 1, tp, b * h * BF16)]
    if port.shared_expert_reduce:
        out.append(Collective("shared expert all-reduce (TP), fp32", n_moe, tp, b * h * FP32))
    out += _sampler_collectives(cfg, spec, port)
    out += layout_collectives(cfg, spec, rows=b, queries=1, query_tile=1)
    return [c for c in out if c.count]


def _sampler_collectives(cfg: KimiK2Config, spec: RunSpec, port: Port) -> list[Collective]:
    b, tp = spec.batch, spec.tp
    if not spec.sampling.on_device or port.sampler == "host":
        return [Collective("logits all-gather (TP), bf16", 1, tp, b * cfg.vocab_size * BF16)]
    if port.sampler == "argmax":  # values and indices of each rank's max
        return [Collective("argmax all-gathers (TP)", 2, tp, b * tp * FP32)]
    # NxD's distributed top-k with NxDI's default rotated top-k kernel on trn2: each rank's top-k of its vocabulary
    # shard, then one all-gather of the values (float32 logits) and one of the indices (int32) over the TP group
    # (NXDI_CONTRACT.md: sampler-collectives)
    k = spec.sampling.global_topk
    out = [Collective("top-k values and indices all-gathers (TP)", 2, tp, b * tp * k * FP32)]
    if spec.output_logits:  # the logits too, for the host (a grammar's steps: neuron/vllm_worker.py)
        out.append(Collective("output_logits all-gather (TP), fp32", 1, tp, b * cfg.vocab_size * FP32))
    return out


def layout_collectives(cfg: KimiK2Config, spec: RunSpec, rows: int, queries: int, query_tile: int,
                       merge: bool = True) -> list[Collective]:
    """What the long-context layout adds per call of `rows` x `queries` tokens: the sequence-sharded merge where the
    call attends through it (merge: a decode step, model/mla.py attend_sharded: the absorbed queries gathered, then
    per query tile a max all-reduce and a [context | sum] reduce-scatter; or a prefill chunk, attend_chunk, as
    mla.chunk_collectives lists it at the chunk group the model chooses), the gathered q_a/kv_a and router
    outputs."""
    layout, layers, g = spec.layout, cfg.num_hidden_layers, spec.layout.kv_group
    out = []
    heads = cfg.num_attention_heads // spec.tp
    if layout.sequence_sharded and merge and queries > 1:
        out += chunk_merge(cfg, spec, layers, queries, rows)
    elif layout.sequence_sharded and merge:
        hg = heads * g
        tiles, tile = -(-queries // query_tile), min(queries, query_tile)
        out += [Collective("absorbed Q all-gather (KV group), bf16", layers, g,
                           rows * hg * queries * cfg.latent_dim * BF16),
                Collective("softmax max all-reduce (KV group), fp32", layers * tiles, g, rows * hg * tile * FP32),
                Collective("[context | sum] reduce-scatter (KV group), fp32", layers * tiles, g,
                           rows * hg * tile * (cfg.kv_lora_rank + 1) * FP32)]
    rows = rows * queries
    if layout.shard_attn_a:
        out.append(Collective("q_a|kv_a output all-gather (TP), bf16", layers, spec.tp,
                              rows * (cfg.q_lora_rank + cfg.latent_dim) * BF16))
    if layout.shard_router:
        n_moe = sum(cfg.is_moe_layer(i) for i in range(layers))
        out.append(Collective("router logits all-gather (TP), fp32", n_moe, spec.tp, rows * cfg.n_routed_experts * FP32))
    return out


def chunk_merge(cfg: KimiK2Config, spec: RunSpec, layers: int, queries: int | None = None,
                rows: int = 1) -> list[Collective]:
    """A prefill chunk's attention over the sequence-sharded cache, `layers` times: model/mla.py chunk_collectives at
    the chunk group the model chooses (chunk_group_for) over the whole cache a rank holds; none at G = 1."""
    if not spec.layout.sequence_sharded:
        return []
    dims, n = HeadDims.of(cfg, spec.tp), queries or spec.layout.prefill_chunk
    c = chunk_group_for(spec.layout, dims, spec.cache_slots, n)
    return [Collective(what, layers * k, size, moved) for what, k, size, moved in chunk_collectives(
        dims, spec.layout.kv_group, c, spec.cache_slots, n, rows=rows)]


def experts_read(cfg: KimiK2Config, spec: RunSpec, path: str) -> int:
    """Routed experts one decode step reads per MoE layer on `path`: selective loading gathers each token's top-k,
    a repeat read again; all-experts reads every local expert once (NXDI_CONTRACT.md: moe-paths)."""
    return cfg.n_routed_experts // spec.ep if path == "all-experts" else spec.batch * cfg.num_experts_per_tok


def decode_traffic(cfg: KimiK2Config, spec: RunSpec, path: str) -> int:
    """HBM bytes a decode step moves per core beyond the weights and the cache: the all-experts path writes every
    local expert's [batch, H] bf16 output and reads it back to combine (forward_all_experts; hbm.moe_temporaries
    counts the same tensor), every MoE layer."""
    if path != "all-experts":
        return 0
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return n_moe * 2 * (cfg.n_routed_experts // spec.ep) * spec.batch * cfg.hidden_size * BF16


def decode_time(cfg: KimiK2Config, spec: RunSpec, step_bytes: int, port: Port = THIS_PORT,
                c: Constants = TRN2) -> Timing:
    """One decode step reading `step_bytes` per core (the planner counts them from the weights, the cache and
    decode_traffic) on the spec's MoE path."""
    colls = tuple(decode_collectives(cfg, spec, port))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    path = spec.decode_path(cfg)
    compute = decode_compute(cfg, spec, path, router_fp32=port.router_dtype == "fp32")
    batch_s = (spec.batch - 1) * n_moe * c.token_moe_s if path == "selective" else 0.0
    parts = dict(bytes_s=step_bytes / c.hbm_bytes_per_s, collectives_s=sum(x.seconds(c) for x in colls),
                 flops_s=compute.total_s, fixed_s=cfg.num_hidden_layers * c.layer_s, batch_s=batch_s)
    return Timing(bytes=step_bytes, collectives=colls, total_s=sum(parts.values()), compute=compute, **parts)


# -- a prefill call ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillWork:
    """What one prefill call computes on one core, beyond the layout's collectives."""

    tokens: int  # rows x bucket
    prior: int  # cache positions before the call (a chunk's)
    dense_params: int  # per-core parameters of the non-expert matmuls every token goes through
    dense_bytes: int  # their bytes, read once per call
    moe: "MoeWork"
    # keys each query's scores cover; None: the prior and half the call (causal). A prefill through a block table
    # scores every key tile of its positions, after expanding each key's c_kv through kv_b (prefix_caching.py)
    keys: int | None = None
    expanded_keys: int = 0


# a draft call's collectives in NxDI's Llama: the embedding's all-gather, fc's output gather, the o_proj and MLP
# all-reduces, the argmax's two all-gathers (NxD operators/argmax.py); each moves one token's hidden a row
DRAFT_CALL_COLLECTIVES = 6


def draft_call_time(read_bytes: int, c: Constants = TRN2) -> float:
    """One call of an EAGLE3 draft (one dense decoder layer): its weights and cache over HBM bandwidth, its
    collectives at their latency, one layer's fixed cost (fitted on a MoE layer: an upper bound for a dense one)."""
    return read_bytes / c.hbm_bytes_per_s + DRAFT_CALL_COLLECTIVES * c.alpha_s + c.layer_s


@dataclass(frozen=True)
class MoeWork:
    """One MoE layer's routed experts on one core for one prefill call."""

    flops: float
    bytes: float


def moe_prefill_work(cfg: KimiK2Config, spec: RunSpec, path: str, quantized: bool) -> MoeWork:
    """By NxD's path for the call (moe_paths.prefill_path): blockwise computes every block of its worst case, each
    reading its expert's bf16 weights, its token rows and writing its fp32 output rows, after every local expert is
    dequantized to bf16 when quantized (NXDI_CONTRACT.md: moe-temporaries); all-experts runs every token through every
    local expert and writes an [E, T, H] output; selective gathers each token's top-k."""
    h, t = cfg.hidden_size, spec.prefill_tokens
    e_local, i_local = cfg.n_routed_experts // spec.ep, moe_paths.local_intermediate(cfg, spec.tp, spec.ep)
    expert = 3 * h * i_local  # gate_up [H, 2I] + down [I, H] elements
    dequantize = e_local * expert * (FP8 + BF16) if quantized and path != "selective" else 0
    if path == "selective":
        pairs = t * cfg.num_experts_per_tok
        return MoeWork(2 * pairs * expert, pairs * expert * (FP8 if quantized else BF16))
    if path == "all-experts":
        return MoeWork(2 * e_local * t * expert, dequantize + e_local * expert * BF16 + 2 * e_local * t * h * BF16)
    block = moe_paths.mode(path).block_size
    blocks = moe_paths.blockwise_blocks(cfg, t, spec.ep, block)
    per_block = expert * BF16 + block * h * BF16 + block * h * FP32
    return MoeWork(2 * blocks * block * expert, dequantize + blocks * per_block)


def prefill_time(cfg: KimiK2Config, spec: RunSpec, work: PrefillWork, query_tile: int,
                 c: Constants = TRN2) -> Timing:
    """One prefill call: the dense and attention matmuls at the TensorEngine's rate, the MoE's traffic and FLOPs,
    NxD's two TP all-reduces of the call's hidden states per layer, the layout's collectives, the per-layer cost; the
    on-core part scaled by the fitted overhead factor."""
    t, layers, h = work.tokens, cfg.num_hidden_layers, cfg.hidden_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    heads = cfg.num_attention_heads // spec.tp
    keys = work.prior + t / 2 if work.keys is None else work.keys  # causal within the call, or every tile
    attention = 2 * heads * t * keys * (cfg.qk_head_dim + cfg.v_head_dim) * layers
    attention += 2 * heads * work.expanded_keys * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) * layers
    flops = 2 * t * work.dense_params + attention + n_moe * work.moe.flops
    chunk = spec.layout.prefill_chunk is not None and work.prior > 0  # the chunk submodel merges over the group
    rows, queries = (1, t) if spec.layout.prefill_chunk else (spec.prefill_batch, spec.context_length)
    colls = (Collective("o_proj + MLP all-reduces (TP), bf16", 2 * layers, spec.tp, t * h * BF16),
             *layout_collectives(cfg, spec, rows, queries, query_tile, merge=chunk))
    read = n_moe * work.moe.bytes + work.dense_bytes
    f = c.prefill_factor  # on the core's work, not the collectives
    parts = dict(bytes_s=read / c.hbm_bytes_per_s * f, flops_s=flops / c.bf16_flops * f, fixed_s=layers * c.layer_s * f,
                 collectives_s=sum(x.seconds(c) for x in colls), batch_s=0.0)
    return Timing(bytes=int(read), collectives=colls, total_s=sum(parts.values()), **parts)


# -- the published trn2 ports the fixed costs are fitted on and checked against ---------------------------------------

@dataclass(frozen=True)
class Published:
    """A published trn2 port of this architecture at its own configuration: the config.json it serves (the Kimi
    ports' text model is Kimi-K2's), its run, how its build differs from ours, and what it measured."""

    name: str
    config: str  # a config.json of test/data/configs
    # (hidden_size, num_hidden_layers, n_routed_experts, num_attention_heads) of that model: plan --port refuses
    # another's config.json, whose times would be compared with numbers it never ran
    shape: tuple[int, int, int, int]
    spec: dict  # RunSpec fields; "experts" the scheme's name
    port: Port
    tpot_ms: float
    ttft_ms: float
    source: str


PUBLISHED = (
    # NxDI's benchmark_sampling p50, seq 512 (one 512-token bucket), batch 1, on-device greedy; BF16 experts, a bf16
    # GroupLimited router, the stock K+V cache, the SDK 2.28 default blockwise kernel (block 512: 263 blocks a layer)
    Published("deepseek-v3-contrib", "deepseek-v3.json", (7168, 61, 256, 128),
              dict(tp=64, lnc=2, seq_len=512, batch=1, experts="bf16", moe_prefill="torch"),
              Port(kv_slots=2, router_dtype="bf16", dense_reduce_bytes=FP32, sampler="argmax"), 20.5, 1667.0,
              "aws-neuron/neuronx-distributed-inference@4bcdc54 contrib/models/DeepSeek-V3/README.md"),
    # a host loop's mean over 31 decode steps, seq 512, batch 1, logits to the host; FP8 per-channel experts, a bf16
    # router, the stock K+V cache, the shared expert's own fp32 all-reduce, all-experts prefill
    Published("kimi-k2.5-community", "kimi-k2-instruct-0905.json", (7168, 61, 384, 64),
              dict(tp=64, lnc=2, seq_len=512, batch=1, experts="fp8-per-channel", moe_prefill="all-experts",
                   on_device_sampling=False),
              Port(kv_slots=2, router_dtype="bf16", shared_expert_reduce=True, dense_reduce_bytes=FP32, sampler="host"),
              21.4, 2094.6, "jimburtoft/neuronx-distributed-inference@13eccd9 contrib/models/Kimi-K2.5/README.md"),
    # the same contrib's K2.6 run, on K2.5's compiled NEFFs (its README): the spread between the two is the data's own
    Published("kimi-k2.6-community", "kimi-k2-instruct-0905.json", (7168, 61, 384, 64),
              dict(tp=64, lnc=2, seq_len=512, batch=1, experts="fp8-per-channel", moe_prefill="all-experts",
                   on_device_sampling=False),
              Port(kv_slots=2, router_dtype="bf16", shared_expert_reduce=True, dense_reduce_bytes=FP32, sampler="host"),
              17.3, 1010.2, "jimburtoft/neuronx-distributed-inference@13eccd9 contrib/models/Kimi-K2.5/README.md"),
)
PUBLISHED_BY_NAME = {p.name: p for p in PUBLISHED}
