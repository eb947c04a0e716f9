"""What NxD can compile and run for Kimi-K2, each rule once, over a RunSpec: the flags, a vLLM request and a reloaded
spec are all checked here, once per build (KimiK2InferenceConfig.for_serving, or contract.adopt_run_spec on a
reload). A refusal is one line naming the flag that sets the refused value (each flag sets one spec field: spec.FLAGS).
Pure: no SDK, no torch."""

from __future__ import annotations

from kimi_k2_neuron.checkpoint.draft import MIN_TARGET_LAYERS
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.parallel import check_tp_divides, check_weight_sharding
from kimi_k2_neuron.placement import check_kv_group

from . import moe_paths
from .spec import RUN_SPEC_KEY, RunSpec, Sampling

# Group sizes by (tp, lnc) that NxD's trn2 replica-group logic supports for groups of adjacent ranks: 8 x 8 is
# documented unsupported, 32 x 2 needs its other logic (for EP it mixes the two halves), 2 x 32 is not documented
# (NXDI_CONTRACT.md: ep-replica-groups). Kimi-K2 fits only at TP=64 LNC=2. Both --ep and --kv-group take them.
GROUP_LAYOUTS = {(64, 2): (1, 4, 16, 64)}
# NxDI's EAGLE hidden-state buffer holds 2 x speculation_length positions and the draft loop is unrolled K - 1 times
# into the fused graph; vLLM's EAGLE3 recipes stop at 8 (NXDI_CONTRACT.md: fused-spec)
SPECULATION_LENGTHS = range(2, 9)
# The compute dtype: the device's, or float32 in the CPU harness (NxD's CPU mode)
DTYPES = ("bfloat16", "float32")


def check(cfg: KimiK2Config, spec: RunSpec) -> None:
    """Everything: the shapes, the experts' format, the checkpoint it is read from, and the sampler."""
    check_shapes(cfg, spec)
    check_experts(cfg, spec)
    if spec.dtype not in DTYPES:
        raise KimiInputError(f"--dtype {spec.dtype!r}: expected one of {', '.join(DTYPES)}")
    if spec.scheme.quantized and not spec.checkpoint:
        raise KimiInputError(f"--experts {spec.scheme.name}: needs a converted checkpoint (kimi-k2-neuron convert), "
                             f"whose config.json records the expert quantization")
    if spec.sampling.on_device:
        check_top_k(spec.sampling)


def check_shapes(cfg: KimiK2Config, spec: RunSpec) -> None:
    """What config.json and the run's shapes decide, before the expert format is known. lnc None skips the LNC rules
    (re-checked on the NeuronConfig NxDI resolves)."""
    s = spec
    check_counts(("--tp", s.tp), ("--ep", s.ep), ("--seq-len", s.seq_len), ("--batch", s.batch))
    if s.seq_len > cfg.max_position_embeddings:  # positions past it are not the model's (YaRN is scaled to it)
        raise KimiInputError(f"--seq-len {s.seq_len}: exceeds config.json field max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    if s.lnc not in (None, 1, 2):
        raise KimiInputError(f"--lnc {s.lnc!r}: expected 1 or 2 (physical NeuronCores per logical core on trn2)")
    context = s.context_length
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= s.seq_len:
        # the bucket is the chunk unless --max-context-length was given: name the flag the user gave
        flag = "--max-context-length" if s.max_context_length else "--prefill-chunk"
        raise KimiInputError(f"{flag} {context!r}: expected 1..--seq-len {s.seq_len}")
    check_tp_divides(cfg, s.tp, split_embedding_dim=True)  # NxD's embedding shards the embedding dim
    check_layout(cfg, s)
    check_moe_decode(s)
    check_prefix_caching(s)
    check_ep(cfg, s)
    check_draft(cfg, s)
    moe_paths.check_prefill_mode(cfg, s.prefill_mode(cfg), s.tp, s.ep, s.lnc, s.prefill_tokens)


def check_layout(cfg: KimiK2Config, spec: RunSpec) -> None:
    g, n, seq_len, context = spec.layout.kv_group, spec.layout.prefill_chunk, spec.seq_len, spec.context_length
    check_counts(("--kv-group", g), *((flag, v) for flag, v in (("--prefill-chunk", n),) if v is not None))
    if g > 1:
        # NxD's initialize_kv_group asserts it; the masks take rank % G (NXDI_CONTRACT.md: kv-group)
        check_kv_group(spec.tp, g)
        if spec.lnc is not None and not group_layout_supported(spec.tp, g, spec.lnc):
            raise KimiInputError(f"--kv-group {g} at --tp {spec.tp} --lnc {spec.lnc}: not a layout of adjacent-rank "
                                 f"groups NxD's replica groups support; use --kv-group in "
                                 f"{list(GROUP_LAYOUTS.get((spec.tp, spec.lnc), ()))}")
        if seq_len % g:
            raise KimiInputError(f"--seq-len {seq_len}: with --kv-shard sequence must be a multiple of --kv-group {g} "
                                 f"(NxDI's get_cache_size divides it; its cache manager would pad it silently)")
        # rank r keeps prefill positions r, r + G, ...; a chunk's own rule below (NXDI_CONTRACT.md: fd-cte-filter)
        if n is None and context % g:
            raise KimiInputError(f"--max-context-length {context}: with --kv-shard sequence must be a multiple of "
                                 f"--kv-group {g} (each rank writes every G-th position of a prefill)")
    if n is not None:
        if seq_len % n:
            raise KimiInputError(f"--prefill-chunk {n}: must divide --seq-len {seq_len} (the last chunk would write "
                                 f"past the cache)")
        if n % g:
            raise KimiInputError(f"--prefill-chunk {n}: must be a multiple of --kv-group {g} (a chunk writes whole "
                                 f"stripes of positions, N / G slots on every rank)")
        if context != n:
            raise KimiInputError(f"--max-context-length {context}: with --prefill-chunk {n} the prefill bucket "
                                 f"is the chunk; leave it out or give {n}")
        if n == seq_len:  # NxD would route every prefill to the chunk graph (same input shapes), a wasted NEFF
            raise KimiInputError(f"--prefill-chunk {n}: equals --seq-len; the context-encoding graph already prefills "
                                 f"{n} tokens in one call: leave --prefill-chunk out")
    c = spec.layout.chunk_group
    if c is not None:
        if n is None or g == 1:
            raise KimiInputError(f"{RUN_SPEC_KEY}.layout.chunk_group {c}: only with --kv-shard sequence and "
                                 f"--prefill-chunk (it groups a chunk's attention over the sharded cache)")
        meshes = spec.layout.laid_out_chunk_groups
        if spec.lnc is not None and (spec.tp, spec.lnc) in GROUP_LAYOUTS and c not in meshes:
            raise KimiInputError(f"{RUN_SPEC_KEY}.layout.chunk_group {c} at --tp {spec.tp} --lnc {spec.lnc}: not a "
                                 f"pair of meshes NxD lays out; use one of {list(meshes)}")
    check_weight_sharding(cfg, spec.tp, spec.layout.shard_attn_a, spec.layout.shard_router)


def check_prefix_caching(spec: RunSpec) -> None:
    """NxDI's block KV layout under vLLM's prefix caching (neuron/prefix_caching.py)."""
    s = spec
    if not s.prefix_caching:
        for flag, value, default in (("--block-size", s.block_size, RunSpec.block_size),
                                     ("--num-blocks", s.num_blocks, RunSpec.num_blocks)):
            if value != default:
                raise KimiInputError(f"{flag} {value}: only with --prefix-caching (the contiguous cache has no blocks)")
        return
    check_counts(("--block-size", s.block_size), *((("--num-blocks", s.num_blocks),) if s.num_blocks is not None
                                                   else ()))
    if s.seq_len % s.block_size:
        raise KimiInputError(f"--seq-len {s.seq_len}: with --prefix-caching must be a multiple of --block-size "
                             f"{s.block_size} (vllm-neuron gives a sequence seq_len / block_size blocks)")
    if s.layout.prefill_chunk and s.layout.prefill_chunk % s.block_size:
        raise KimiInputError(f"--prefill-chunk {s.layout.prefill_chunk}: with --prefix-caching must be a multiple of "
                             f"--block-size {s.block_size} (each chunk starts on a block)")
    if s.pool_blocks < s.min_blocks:
        raise KimiInputError(f"--num-blocks {s.num_blocks}: at least --batch {s.batch} x --seq-len {s.seq_len} / "
                             f"--block-size {s.block_size} = {s.min_blocks} (vllm-neuron's minimum: every row's "
                             f"full sequence)")
    for flag, given, why in (
            (f"--kv-shard sequence --kv-group {s.layout.kv_group}", s.layout.sequence_sharded,
             "NxDI's BlockKVCacheManager keeps whole blocks on every rank; the block layout has no flash-decoding "
             "slot map"),
            (f"--max-context-length {s.max_context_length}",
             not s.layout.prefill_chunk and s.context_length != s.seq_len,
             "a prompt with nothing cached is prefilled in one call of up to --seq-len tokens; --prefill-chunk N "
             "prefills it N tokens a call"),
            ("--draft", s.draft, "NxDI's EAGLE speculation asserts it is not run with prefix caching")):
        if given:
            raise KimiInputError(f"{flag}: not with --prefix-caching ({why})")


def group_layout_supported(tp: int, size: int, lnc: int | None) -> bool:
    """Groups of `size` adjacent ranks of `tp` at this LNC; sizes 1 and (off the table: CPU, other TPs) any."""
    return size == 1 or (tp, lnc) not in GROUP_LAYOUTS or size in GROUP_LAYOUTS[(tp, lnc)]


def check_ep(cfg: KimiK2Config, spec: RunSpec) -> None:
    """lnc None skips the layout rule."""
    tp, ep, lnc = spec.tp, spec.ep, spec.lnc
    if tp % ep or cfg.n_routed_experts % ep:
        raise KimiInputError(f"--ep {ep}: must divide --tp {tp} and n_routed_experts={cfg.n_routed_experts}")
    if ep == 1:
        return
    if lnc is not None and (ep not in GROUP_LAYOUTS.get((tp, lnc), ())):
        raise KimiInputError(f"--ep {ep} at --tp {tp} --lnc {lnc}: not an expert layout NxD's replica groups "
                             f"support; use --ep in {list(GROUP_LAYOUTS.get((tp, lnc), (1,)))}")
    if spec.moe_decode == "selective":  # ExpertMLPsV2.forward raises NotImplementedError there
        raise KimiInputError(f"--moe-decode selective with --ep {ep}: NxD's selective loading has no expert-parallel "
                             f"variant; leave --moe-decode out (EP decodes on all experts) or use --ep 1")


def check_moe_decode(spec: RunSpec) -> None:
    if spec.moe_decode is not None and spec.moe_decode not in moe_paths.DECODE_PATHS:
        raise KimiInputError(f"--moe-decode {spec.moe_decode!r}: expected one of {', '.join(moe_paths.DECODE_PATHS)}")


def check_draft(cfg: KimiK2Config, spec: RunSpec) -> None:
    """What NxDI's fused EAGLE3 speculation can run for Kimi (NXDI_CONTRACT.md: fused-spec); the draft folder's own
    refusals are checkpoint/draft.py's."""
    d = spec.draft
    if d is None:
        return
    k = d.speculation_length
    if isinstance(k, bool) or not isinstance(k, int) or k not in SPECULATION_LENGTHS:
        lo, hi = SPECULATION_LENGTHS[0], SPECULATION_LENGTHS[-1]
        raise KimiInputError(f"--speculation-length {k!r}: expected {lo}..{hi} (tokens the target verifies per step; "
                             f"the draft proposes one fewer)")
    if cfg.num_hidden_layers < MIN_TARGET_LAYERS:
        raise KimiInputError(f"--draft: the target has {cfg.num_hidden_layers} layers; NxDI's EAGLE3 capture needs "
                             f">= {MIN_TARGET_LAYERS} (layers 1, N//2 - 1 and N - 4)")
    for flag, given, why in (
            (f"--ep {spec.ep}", spec.ep > 1, "the verify call's expert paths (selective, all-experts) have no EP "
                                             "variant"),
            (f"--prefill-chunk {spec.layout.prefill_chunk}", spec.layout.prefill_chunk,
             "the fused graph has no chunk submodel, and the draft's prefill reads the whole prompt's hidden states"),
            (f"--seq-len {spec.seq_len}", spec.seq_len <= k, f"a step writes {k} positions"),
            ("--no-on-device-sampling", not spec.sampling.on_device, "NxDI's fused speculation samples on the device")):
        if given:
            raise KimiInputError(f"{flag}: not with --draft ({why})")
    c = d.checkpoint
    if c is None:
        return
    if (c.hidden_size, c.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise KimiInputError(f"--draft {d.path}: hidden_size {c.hidden_size}, vocab_size {c.vocab_size}; expected the "
                             f"target's {cfg.hidden_size}, {cfg.vocab_size}")
    tp = spec.tp
    for name, n in (("num_attention_heads", c.num_attention_heads), ("intermediate_size", c.intermediate_size)):
        if n % tp:  # NxDI's Llama shards the draft's attention and MLP over the whole TP group (draft-tp)
            raise KimiInputError(f"--draft {d.path}: {name}={n} does not split --tp {tp} ways (the draft runs at the "
                                 f"target's TP)")
    kv = c.num_key_value_heads
    if kv % tp and tp % kv:
        raise KimiInputError(f"--draft {d.path}: num_key_value_heads={kv} neither divides nor is a multiple of --tp "
                             f"{tp} (NxDI's GQA sharding)")


def check_experts(cfg: KimiK2Config, spec: RunSpec) -> None:
    """The experts' scales shard only for the expert TP degrees (tp / ep) whose slices hold whole scale blocks."""
    scheme, tp, ep = spec.scheme, spec.tp, spec.ep
    if scheme is None:
        raise KimiInputError("--experts: the routed experts' format is not known (give a converted checkpoint, or "
                             "--experts)")
    valid = scheme.nxd(cfg.moe_intermediate_size)["valid_moe_tp_degrees"]
    if tp // ep not in valid:
        raise KimiInputError(f"--tp {tp} --ep {ep}: experts split {tp // ep} ways (tp / ep), but {scheme.name} "
                             f"expert scales of block {scheme.block} shard only {valid} ways")


def check_top_k(sampling: Sampling) -> None:
    """NxDI's on-device sampler draws from at most the compiled global top-k, at a temperature it can divide by."""
    if not 1 <= sampling.top_k <= sampling.global_topk:
        raise KimiInputError(f"--top-k {sampling.top_k}: on-device sampling needs 1 <= top_k <= "
                             f"{sampling.global_topk}")
    check_temperature(sampling)


# NxDI's sampler divides the top-k logits by the temperature in float32 (sampling.py: _multinomial_sample): below
# this, a logit of 3.4e8 (none comes near) would overflow float32 to inf (1e-46 and less are 0) and the draw see NaN
MIN_TEMPERATURE = 1e-30


def check_temperature(sampling: Sampling) -> None:
    if sampling.do_sample and not sampling.temperature >= MIN_TEMPERATURE:
        raise KimiInputError(f"--temperature {sampling.temperature:g}: below {MIN_TEMPERATURE:g}, the smallest NxDI's "
                             f"sampler takes (it divides the logits by the temperature in float32, which overflows "
                             f"to inf); give {MIN_TEMPERATURE:g} or more, or 0 for greedy decoding")


def check_counts(*named) -> None:
    for name, v in named:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KimiInputError(f"{name} {v!r}: expected an integer >= 1")


def check_prompt_lengths(lengths: list[int]) -> None:
    """NxDI's HF adapter mispositions a one-token row among longer ones (NXDI_CONTRACT.md: adapter-pad-positions)."""
    if not lengths or min(lengths) < 1:
        raise KimiInputError("every prompt needs at least one token")
    if min(lengths) == 1 < max(lengths):
        raise KimiInputError("a one-token prompt cannot share a batch with longer prompts (NxDI's HF adapter "
                             "positions its padding wrongly); run it in a batch of its own")
