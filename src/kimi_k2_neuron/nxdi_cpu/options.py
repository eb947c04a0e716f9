"""NxD CPU-mode options and their checks without the SDK, so a refusal comes before NxD's import chatter."""

from __future__ import annotations

import dataclasses

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.neuron import contract, moe_paths
from kimi_k2_neuron.runtime.memory import check_one_call


@dataclasses.dataclass(frozen=True)
class CpuOptions:

    model: str
    experts: str | None = None  # None: a converted checkpoint's own scheme, DEFAULT_SCHEME for a raw one
    tp: int = 1
    ep: int = 1
    dtype: str = "float32"
    cache_dir: str | None = None  # where a raw checkpoint is converted to (default: cache.converted_root())
    presharded: str | None = None  # NxD's per-rank weight files to load instead of sharding here (see preshard)
    # on CPU every blockwise mode runs NxD's torch loop; the mode sets its block size
    moe_prefill: str | None = None
    continuous_batching: bool = False
    # --kv-shard/--kv-group, --prefill-chunk, --shard-attn-a, --shard-router; the default replicates all
    layout: contract.LayoutOptions = contract.LayoutOptions()
    # Filled by prepare(): the converted checkpoint's typed config and its record, read once per request.
    config: KimiK2Config | None = None
    record: ConversionRecord | None = None


@dataclasses.dataclass(frozen=True)
class Generation:

    rows: list[list[int]]
    stop_ids: tuple[int, ...]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings, decoded with the tokenizer of `tokenizer_dir`
    tokenizer_dir: str | None = None

    @property
    def seq_len(self) -> int:
        return max(len(r) for r in self.rows) + self.max_new_tokens

    @property
    def sampling(self) -> dict:
        """The on-device sampler's settings, as compile_and_save sets them (its top-k caps the per-call one)."""
        return {"do_sample": self.do_sample, "top_k": self.top_k, "top_p": self.top_p, "temperature": self.temperature}


def check(o: CpuOptions) -> None:
    from kimi_k2_neuron.runtime.runner import DTYPES

    if o.dtype not in DTYPES:
        raise KimiInputError(f"--dtype {o.dtype}: expected one of {', '.join(DTYPES)}")
    contract.check_cpu_run(DTYPES[o.dtype], o.tp, o.ep)


def check_layout(o: CpuOptions) -> KimiK2Config:
    """Checks that need no request; returns the config read."""
    check(o)
    cfg = KimiK2Config.from_file(o.model)
    contract.check_tp_divides(cfg, o.tp, split_embedding_dim=True)
    return cfg


def check_request(o: CpuOptions, seq_len: int, batch: int, sampling: dict | None = None,
                  prompts: list[list[int]] | None = None) -> KimiK2Config:
    """Everything config.json and the flags alone refuse; returns the config read."""
    cfg = check_layout(o)
    rows, seq_len = prefill_rows(o, batch), padded_seq_len(o, seq_len)
    context = context_length(o, seq_len)
    contract.check_compile_options(cfg, o.tp, o.ep, None, seq_len, context, batch,
                                   prefill_mode(cfg, o, context * rows), o.layout, prefill_rows=rows)
    # NxDI's context encoding attends all its bucket at once; a chunk call, its N tokens over the whole cache
    check_one_call(cfg.num_attention_heads, rows, context, seq_len if o.layout.prefill_chunk else context, "prefill",
                   ranks=o.tp)
    if sampling is not None:
        contract.check_top_k(sampling["top_k"])
    if prompts is not None:
        contract.check_prompt_lengths([len(r) for r in prompts])
    return cfg


def prefill_rows(o: CpuOptions, batch: int) -> int:
    """Rows of one prefill call (contract.prefill_batch)."""
    return contract.prefill_batch(batch, o.layout, o.continuous_batching)


def padded_seq_len(o: CpuOptions, needed: int) -> int:
    """The cache length built for `needed` positions: a whole number of chunks (each chunk writes N slots), else of
    the KV group (the sequence-sharded cache splits it evenly; a chunk is a multiple of the group:
    contract.check_layout)."""
    step = o.layout.prefill_chunk or o.layout.kv_group or 1
    return -(-needed // step) * step


def context_length(o: CpuOptions, seq_len: int) -> int:
    """The context-encoding bucket (one bucket: NXDI_CONTRACT.md: bucket-positions)."""
    return contract.context_bucket(seq_len, o.layout)


def check_submodel(submodel: str, seq_len: int, prefill_chunk: int | None) -> None:
    """trace-cpu's chunk submodel exists with --prefill-chunk, and the traced prefill (seq_len / 2) must reach it."""
    if submodel == "chunk" and (prefill_chunk is None or seq_len // 2 <= prefill_chunk):
        raise KimiInputError("--submodel chunk: needs --prefill-chunk N with N < --seq-len / 2 (the traced prefill "
                             "of seq_len / 2 tokens must reach a second chunk)")


def prefill_mode(cfg: KimiK2Config, o: CpuOptions, tokens: int) -> str:
    """o.moe_prefill, else moe_paths.default_mode at LNC=2."""
    return o.moe_prefill if o.moe_prefill is not None else moe_paths.default_mode(cfg, o.tp, o.ep, 2, tokens)
