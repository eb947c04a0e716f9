"""What one NxD CPU-mode run is, and its checks without the SDK, so a refusal comes before NxD's import chatter. The
run's settings are a RunSpec (neuron/spec.py) whose shape each request sets; the rules are the shell's own."""

from __future__ import annotations

import dataclasses

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.neuron import rules
from kimi_k2_neuron.neuron.spec import GREEDY, RunSpec, Sampling, speculation_overrun
from kimi_k2_neuron.runtime.memory import check_one_call


@dataclasses.dataclass(frozen=True)
class CpuOptions:

    model: str
    # tp, ep, the MoE prefill mode (None: what the shapes allow, at LNC 2), continuous batching and the layout; each
    # request sets the shape (seq_len, batch), the sampler and the checkpoint's experts
    spec: RunSpec = RunSpec(lnc=None, moe_prefill=None)
    experts: str | None = None  # None: a converted checkpoint's own scheme, DEFAULT_SCHEME for a raw one
    dtype: str = "float32"
    cache_dir: str | None = None  # where a raw checkpoint is converted to (default: cache.converted_root())
    presharded: str | None = None  # NxD's per-rank weight files to load instead of sharding here (see preshard)
    # NxDI's flash-decoding graph at a KV group of one rank (trace-cpu --kv-shard sequence traces one rank)
    flash_decoding_one_rank: bool = False
    # Filled by prepare(): the converted checkpoint's typed config and its record, read once per request.
    config: KimiK2Config | None = None
    record: ConversionRecord | None = None

    @property
    def tp(self) -> int:
        return self.spec.tp


@dataclasses.dataclass(frozen=True)
class Generation:

    rows: list[list[int]]
    stop_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = GREEDY  # the on-device sampler's settings, as compile_and_save sets them
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings, decoded with the tokenizer of `tokenizer_dir`
    tokenizer_dir: str | None = None

    @property
    def seq_len(self) -> int:
        return max(len(r) for r in self.rows) + self.max_new_tokens


def check(o: CpuOptions) -> None:
    from kimi_k2_neuron.runtime.runner import DTYPES

    if o.dtype not in DTYPES:
        raise KimiInputError(f"--dtype {o.dtype}: expected one of {', '.join(DTYPES)}")
    check_cpu_run(DTYPES[o.dtype], o.tp, o.spec.ep)


def check_cpu_run(torch_dtype, tp: int, moe_ep: int | None) -> None:
    """NXD_CPU_MODE.md: cpu-mode-limits. The harness also sets on_cpu, or NxDI's sampler takes its device-only
    branches (NXD_CPU_MODE.md: cpu-sampler)."""
    import torch

    if torch_dtype not in (torch.float32, torch.bfloat16) or (torch_dtype == torch.bfloat16 and tp > 1):
        dtype = str(torch_dtype).removeprefix("torch.")
        raise KimiInputError(f"--dtype {dtype} at --tp {tp}: NxD's CPU mode runs float32, or bfloat16 at "
                             f"--tp 1 (gloo has no bfloat16 collectives)")
    if (moe_ep or 1) > 1:
        raise KimiInputError(f"--ep {moe_ep}: NxD's MoE expert parallelism does not run in its CPU mode (its "
                             f"expert-rank lookup reads the XLA process group's _mesh, which gloo groups lack: "
                             f"NXD_CPU_MODE.md: cpu-mode-limits); use --ep 1 on CPU")


def check_layout(o: CpuOptions, cfg: KimiK2Config | None = None) -> KimiK2Config:
    """Checks that need no request; returns the config (read here unless given)."""
    from kimi_k2_neuron.parallel import check_tp_divides

    check(o)
    cfg = cfg or KimiK2Config.from_file(o.model)
    check_tp_divides(cfg, o.tp, split_embedding_dim=True)
    return cfg


def request_spec(o: CpuOptions, seq_len: int, batch: int) -> RunSpec:
    """o's spec at a request's shape: a cache of at least seq_len positions (padded_seq_len), `batch` rows; with a
    draft, the room the last fused step writes past them (spec.speculation_overrun)."""
    extra = speculation_overrun(o.spec.draft.speculation_length) if o.spec.draft else 0
    return dataclasses.replace(o.spec, seq_len=padded_seq_len(o, seq_len + extra), batch=batch)


def check_request(o: CpuOptions, seq_len: int, batch: int, sampling: Sampling | None = None,
                  prompts: list[list[int]] | None = None, cfg: KimiK2Config | None = None) -> KimiK2Config:
    """Everything config.json and the flags alone refuse; returns the config (read here unless given)."""
    cfg = check_layout(o, cfg)
    spec = request_spec(o, seq_len, batch)
    rules.check_shapes(cfg, spec)
    # NxDI's context encoding attends all its bucket at once; a chunk call, its N tokens over the whole cache
    keys = spec.seq_len if spec.layout.prefill_chunk else spec.context_length
    check_one_call(cfg.num_attention_heads, spec.prefill_batch, spec.context_length, keys, "prefill", ranks=o.tp)
    if sampling is not None:
        rules.check_top_k(sampling)
        if o.spec.draft and sampling.do_sample:
            raise KimiInputError("--temperature with --draft: NxDI's sampling branch of the fused speculation step "
                                 "does not run in NxD's CPU mode (NXD_CPU_MODE.md: fused-spec-cpu); greedy here, "
                                 "sampling on trn2")
    if prompts is not None:
        rules.check_prompt_lengths([len(r) for r in prompts])
    return cfg


def padded_seq_len(o: CpuOptions, needed: int) -> int:
    """The cache length built for `needed` positions: a whole number of chunks (each chunk writes N slots), of blocks
    (prefix caching), else of the KV group (the sequence-sharded cache splits it evenly; a chunk is a multiple of the
    group: rules.check_layout)."""
    step = o.spec.layout.prefill_chunk or (o.spec.block_size if o.spec.prefix_caching else o.spec.layout.kv_group)
    return -(-needed // step) * step


def check_submodel(submodel: str, seq_len: int, prefill_chunk: int | None) -> None:
    """trace-cpu's chunk submodel exists with --prefill-chunk, and the traced prefill (seq_len / 2) must reach it."""
    if submodel == "chunk" and (prefill_chunk is None or seq_len // 2 <= prefill_chunk):
        raise KimiInputError("--submodel chunk: needs --prefill-chunk N with N < --seq-len / 2 (the traced prefill "
                             "of seq_len / 2 tokens must reach a second chunk)")
