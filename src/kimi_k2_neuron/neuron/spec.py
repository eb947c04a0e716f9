"""One run of Kimi-K2 on NxDI as a typed spec: the flags, a vLLM request and a reloaded NeuronConfig are each built
into a RunSpec (launch.run_spec, vllm_request.spec_of_request, contract.spec_of); the NeuronConfig
(contract.neuron_config_kwargs), the refusals (rules.py) and the fit planner (fit.py) read it. Pure: no SDK, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kimi_k2_neuron.checkpoint.draft import Eagle3Draft
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.parallel import Layout, slots_for

from . import moe_paths

# NxDI's flash-decoding cache keeps this many slots per rank beyond seq_len / G: non-owners of a decoded token write
# it into the last one, which no mask exposes (NXDI_CONTRACT.md: fd-cache-size).
FD_RESERVED_SLOTS = 128

# The InferenceConfig attribute a RunSpec's Layout is saved under: not NeuronConfig fields, which NxDI validates
# (NXDI_CONTRACT.md: layout-attribute).
LAYOUT_KEY = "kimi_k2_layout"


@dataclass(frozen=True)
class Sampling:
    """NxDI's on-device sampler as compiled, and the per-request settings it draws with."""

    on_device: bool = True  # False: lm_head's logits go to the host
    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    global_topk: int = 256  # the compiled top-k pre-selection; a request's top_k is at most this

    @classmethod
    def of(cls, temperature: float, top_k: int, top_p: float) -> "Sampling":
        """temperature 0 is greedy; top_k 0 becomes global_topk (NxDI's sampler always filters)."""
        if temperature <= 0:
            return cls()
        return cls(do_sample=True, temperature=temperature, top_k=top_k or cls.global_topk, top_p=top_p)

    @property
    def settings(self) -> dict[str, Any]:
        """The per-request settings, as generation configs and NxDI's sampler take them."""
        return {"do_sample": self.do_sample, "top_k": self.top_k, "top_p": self.top_p,
                "temperature": self.temperature}


GREEDY = Sampling()


@dataclass(frozen=True)
class DraftSpec:
    """An EAGLE3 draft run with the target in NxDI's fused speculation (neuron/fused_spec.py)."""

    path: str | None  # the draft folder; None where it is not known yet (a vLLM request before vllm-neuron adds it)
    # NxDI's speculation_length: tokens the target verifies per step, the most a step emits; drafts per step one
    # fewer (vLLM's num_speculative_tokens is this number: NXDI_CONTRACT.md: vllm-spec-config)
    speculation_length: int = 4
    checkpoint: Eagle3Draft | None = field(default=None, compare=False)  # its config.json's facts, when read


def speculation_overrun(speculation_length: int) -> int:
    """Cache positions a generation must leave free past its last new token's, beyond a plain decode's: a fused step
    at p writes p .. p + K - 1 (NXDI_CONTRACT.md: fused-positions); 0 without speculation."""
    return max(speculation_length - 2, 0)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One compiled (or CPU-mode) configuration of the model."""

    tp: int = 1  # ranks (logical cores); attention, embedding, lm_head and the shared expert split tp ways
    ep: int = 1  # NxDI moe_ep_degree inside the tp ranks, not NxD's global ep_degree (contract.UNSUPPORTED)
    lnc: int | None = 2  # None: NxDI's choice (NEURON_LOGICAL_NC_CONFIG, else the platform's)
    seq_len: int = 1024  # the KV cache's positions per sequence
    max_context_length: int | None = None  # the prefill bucket; default the chunk, else seq_len
    batch: int = 1
    scheme: ExpertScheme | None = None  # the routed experts on device; None: not known yet (a checkpoint's own)
    checkpoint: str | None = None  # the converted checkpoint folder (NxDI requires a path when quantized)
    sampling: Sampling = GREEDY
    output_logits: bool = False  # also return logits under on-device sampling
    # moe_paths.MODES; None: the default where its kernel can run these shapes, else torch (moe_paths.default_mode)
    moe_prefill: str | None = moe_paths.DEFAULT_MODE
    # one sequence per prefill into its seq_id's line (NXDI_CONTRACT.md: continuous-batching)
    continuous_batching: bool = False
    # an InferenceConfig attribute, not NeuronConfig fields (LAYOUT_KEY); its prefill_chunk is the CTE
    # bucket, then the chunk submodel's width (neuron/chunked_prefill.py), one row a call
    layout: Layout = Layout()
    draft: DraftSpec | None = None  # speculative decoding with this EAGLE3 draft (NXDI_CONTRACT.md: fused-spec)
    # vLLM's prefix caching: the latent cache in NxDI's block layout, a pool of num_blocks blocks of block_size
    # positions shared by every sequence, found through the block tables vLLM's scheduler keeps (neuron/prefix_caching.py)
    prefix_caching: bool = False
    block_size: int = 32  # vLLM's --block-size, NxDI's pa_block_size
    num_blocks: int | None = None  # vLLM's --num-gpu-blocks-override; None: min_blocks, a full sequence per row
    extra: Mapping[str, Any] = field(default_factory=dict)  # further NeuronConfig kwargs (checked by NxDI)

    @property
    def context_length(self) -> int:
        """The context-encoding bucket: --max-context-length, else the chunk, else the whole cache."""
        return self.max_context_length or self.layout.prefill_chunk or self.seq_len

    @property
    def prefill_batch(self) -> int:
        """Rows of one prefill call. One per chunk: a batch-B chunk graph would hold B x chunk tokens of activations;
        one under continuous batching: each sequence into its own cache line (NXDI_CONTRACT.md:
        continuous-batching)."""
        return 1 if self.layout.prefill_chunk or self.continuous_batching or self.prefix_caching else self.batch

    @property
    def prefill_tokens(self) -> int:
        """Tokens of one prefill call, what decides its MoE path."""
        return self.context_length * self.prefill_batch

    @property
    def cache_slots(self) -> int:
        """Latent cache slots per rank and sequence: NxDI's get_cache_size when sequence-sharded."""
        g = self.layout.kv_group
        return self.seq_len if g == 1 else slots_for(self.seq_len, g) + FD_RESERVED_SLOTS  # seq_len % G == 0 (rules)

    @property
    def min_blocks(self) -> int:
        """Blocks for every row's full sequence at once: the fewest vllm-neuron accepts (its _validate_neuron_config)."""
        return self.batch * -(-self.seq_len // self.block_size)

    @property
    def pool_blocks(self) -> int:
        """Blocks of the prefix-caching pool vLLM hands out (NxDI's pa_num_blocks is one more: vLLM's null block 0)."""
        return self.num_blocks or self.min_blocks

    def prefill_mode(self, cfg: KimiK2Config) -> str:
        """--moe-prefill, else the default mode where its kernel can run these shapes."""
        return self.moe_prefill or moe_paths.default_mode(cfg, self.tp, self.ep, self.lnc, self.prefill_tokens)


# The smallest prefill (active) and prefix bucket of a prefix-caching build, as NxDI's own default 2D buckets start
# (modules/autobucketing.py generate_buckets_for_cte), unless a context of fewer than 8 of them asks for smaller ones
PREFIX_BUCKET_MIN = 512


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out = []
    while lo < hi:
        out.append(lo)
        lo *= 2
    return out + [hi]


def prefix_caching_buckets(spec: RunSpec) -> tuple[list[int], list[int]]:
    """(prefill buckets, prefix buckets) of the context-encoding graphs: one graph per pair, and one per prefill
    bucket with no prefix (NXDI_CONTRACT.md: prefix-buckets). A turn's new tokens pick the smallest prefill bucket
    that holds them and NxDI fills the rest of it with cached positions recomputed, so the prefix bucket covers what
    is left of the cached prefix."""
    bs = spec.block_size
    lo = -(-min(PREFIX_BUCKET_MIN, max(bs, spec.context_length // 8)) // bs) * bs  # whole blocks: NxDI reads a prefix
    return powers_of_two(lo, spec.context_length), powers_of_two(lo, spec.seq_len)


def prefix_caching_calls(spec: RunSpec, cached: int, new: int) -> list[tuple[int, int]]:
    """(prefill bucket, prefix bucket) of each context-encoding call that prefills `new` tokens after `cached` ones in
    blocks: chunks of --prefill-chunk (neuron/prefix_caching.py), each at the bucket NxDI's wrapper picks: the smallest
    prefill bucket holding the call's tokens, the rest of it refilled with cached positions recomputed, the smallest
    prefix bucket holding the cached positions left, or a 512-token bucket without a prefix for 257-512 positions in
    all (NXDI_CONTRACT.md: prefix-buckets)."""
    prefill, prefix = prefix_caching_buckets(spec)
    calls, start, end = [], cached, cached + new
    while start < end:
        stop = min(start + (spec.layout.prefill_chunk or end), end)
        n = stop - start
        if 256 < stop <= 512 and 512 in prefill:
            calls.append((512, 0))
        else:
            a = min(b for b in prefill if b >= n)
            left = max(0, start - (a - n))
            calls.append((a, min(b for b in prefix if b >= left) if left else 0))
        start = stop
    return calls


def layout_flags(layout: Layout) -> list[str]:
    """The command-line flags that ask for this layout (none for the default)."""
    given = ((f"--kv-shard sequence --kv-group {layout.kv_group}", layout.sequence_sharded),
             (f"--prefill-chunk {layout.prefill_chunk}", layout.prefill_chunk is not None),
             ("--shard-attn-a", layout.shard_attn_a), ("--shard-router", layout.shard_router))
    return [flag for flag, on in given if on]
