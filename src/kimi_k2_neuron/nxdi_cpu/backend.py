"""The NxDI model in NxD's CPU mode: `kimi-k2-neuron logits|generate --backend nxdi-cpu`, scripts' `--cpu`, and the
nxdi-cpu test tier.

The application class, its NeuronConfig, the checkpoint loader, NxDI's model wrappers, KV cache manager, sampler and
HF generation adapter are the ones a trn2 run uses; NeuronKimiK2ForCausalLM.to_cpu builds each submodel as the
device path does and loads it strictly. What this cannot show: tracing (xla_trace traces a submodel with torch_xla
on its CPU device), neuronx-cc, NKI kernels, Neuron collectives, HBM. Where NxD would take a device-only path (the
NKI blockwise prefill kernel), it takes its torch path here, and MoEPaths says which one ran.

Rows of different lengths are right-padded as NxDI's HuggingFaceGenerationAdapter pads them, pad position ids 1
(NXDI_CONTRACT.md: adapter-pad-positions). A compiled context bucket below seq_len would need per-bucket n_positions,
which only the traced path sets (NXDI_CONTRACT.md: bucket-positions), so a CPU run compiles one bucket of seq_len.
The NxDI/NxD code this rests on is cited by name from NXDI_CONTRACT.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

from kimi_k2_neuron.neuron.contract import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402
from kimi_k2_neuron.formats.record import ConversionRecord, experts_for  # noqa: E402
from kimi_k2_neuron.runtime.runner import DTYPES  # noqa: E402

from kimi_k2_neuron.neuron import contract, moe_paths  # noqa: E402
from kimi_k2_neuron.convert import converted_dir_for, ensure_converted  # noqa: E402
from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig, NeuronKimiK2ForCausalLM  # noqa: E402
# Re-exported: the options and their SDK-free checks are part of this module's interface.
from kimi_k2_neuron.nxdi_cpu.options import (CpuOptions, Generation, check, check_layout,  # noqa: E402,F401
                                             check_request, prefill_mode)


def prepare(o: CpuOptions, seq_len: int, batch: int, sampling: dict | None = None,
            prompts: list[list[int]] | None = None) -> CpuOptions:
    """o for one request, ready: refused with one line where config.json and the flags alone refuse (the TP split, the
    prefill mode, the sampler's top-k, a batch NxDI's generation adapter would get wrong) before anything is
    converted or a rank starts; a raw checkpoint converted once here rather than by every rank; and the converted
    checkpoint's config and record carried in o, so that nothing reads them again."""
    cfg = check_request(o, seq_len, batch, sampling, prompts)
    record = ConversionRecord.of(cfg)
    path = Path(o.model)
    if record is None:
        path, record = _convert_once(o, experts_for(None, o.experts))
        cfg = KimiK2Config.from_file(path)  # the converted checkpoint's, a new file
    experts_for(record, o.experts)  # refuses another scheme than the converted checkpoint holds
    return dataclasses.replace(o, model=str(path), config=cfg, record=record)


def _convert_once(o: CpuOptions, experts: str) -> tuple[Path, ConversionRecord]:
    """The raw checkpoint o.model converted once (into o.cache_dir when given), and its record."""
    dst = None
    if o.cache_dir:
        # one folder per source path and scheme: another checkpoint of the same name must not reuse it
        tag = hashlib.sha256(str(Path(o.model).resolve()).encode()).hexdigest()[:10]
        dst = Path(o.cache_dir) / f"{converted_dir_for(o.model, experts).name}-{tag}"
    return ensure_converted(o.model, experts, dst=dst)


def build(o: CpuOptions, seq_len: int, batch: int, sampling: dict | None = None) -> NeuronKimiK2ForCausalLM:
    """NeuronKimiK2ForCausalLM for `batch` rows of up to `seq_len` positions, in NxD's CPU mode. `sampling`: the
    on-device sampler's settings (ServeOptions do_sample/top_k/top_p/temperature), None for logits out."""
    return application(o, seq_len, batch, sampling).to_cpu(o.presharded)


def application(o: CpuOptions, seq_len: int, batch: int, sampling: dict | None = None,
                on_cpu: bool = True) -> NeuronKimiK2ForCausalLM:
    """The application as compile_and_save builds it, with this CPU run's NeuronConfig; nothing built yet. on_cpu
    False gives NxDI's device sampler branches (the nxdi-cpu tier's test of them replaces their device-only ops)."""
    if o.config is None:
        o = prepare(o, seq_len, batch, sampling)
    opts = contract.ServeOptions(
        tp=o.tp, ep=o.ep, lnc=None, seq_len=seq_len, batch=batch, scheme=o.record.scheme, checkpoint=o.model,
        moe_prefill=prefill_mode(o.config, o, seq_len * (1 if o.continuous_batching else batch)),
        continuous_batching=o.continuous_batching,
        on_device_sampling=sampling is not None, **(sampling or {}), output_logits=sampling is not None and not on_cpu,
        extra={"on_cpu": on_cpu, "torch_dtype": DTYPES[o.dtype]})
    return NeuronKimiK2ForCausalLM(o.model, KimiK2InferenceConfig.for_serving(o.config, opts))


def preshard(o: CpuOptions, out: str | Path, seq_len: int, batch: int) -> Path:
    """NxDI's pre-sharding (our shard_weights: NxD's ModelBuilder.shard_checkpoint, a few ranks per pass) of the
    checkpoint at o.tp, as compile() runs it after tracing: `out`/weights/tp{rank}_sharded_checkpoint.safetensors.
    Outside NxD's CPU mode, as on a trn2 host: ModelBuilder shards under a mocked torch.distributed, and in CPU
    mode NxD would ask it for gloo groups (NXDI_CONTRACT.md: sharding-outside-cpu-mode)."""
    app = application(o, seq_len, batch)
    with nxd_cpu_mode(False):
        app.shard_weights(str(out))
    return Path(out) / "weights"


@contextlib.contextmanager
def nxd_cpu_mode(on: bool):
    """NXD_CPU_MODE for a block (NxD reads it at every cpu_mode() call, NXDI_CONTRACT.md: cpu-mode-switch), restored
    after."""
    previous = os.environ.get("NXD_CPU_MODE")
    os.environ["NXD_CPU_MODE"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("NXD_CPU_MODE")
        else:
            os.environ["NXD_CPU_MODE"] = previous


# -- which of NxD's MoE paths ran ------------------------------------------------------------------------------------

class MoEPaths:
    """Records which ExpertMLPsV2 inference path each MoE call takes, with forward pre-hooks on the model's own
    expert modules (nothing of NxD is patched). The choice mirrors ExpertMLPsV2.forward (moe_paths.call_path); the
    nxdi-cpu tier checks it against the method NxD really calls. NxD runs every blockwise mode with its torch loop
    on CPU; the report names the kernel trn2 runs instead (NXDI_CONTRACT.md: nki-kernel-on-cpu)."""

    def __init__(self, app):
        self.seen: dict[str, set[str]] = {}
        self._handles = []
        self._sampling = app.neuron_config.on_device_sampling_config is not None
        self._mode = moe_paths.mode_of(app.neuron_config.blockwise_matmul_config)
        for wrapper in app.models:
            for module in wrapper.model.modules():
                if isinstance(module, ExpertMLPsV2):
                    hook = self._hook(wrapper.tag, module)
                    self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _hook(self, tag: str, module: ExpertMLPsV2):
        def record(_module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self.seen.setdefault(tag, set()).add(moe_path(module, hidden.shape[0], kwargs.get("seq_len")))
        return record

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def report(self) -> str:
        kernel = moe_paths.MODES[self._mode].kernel if self._mode else None
        device = (f"blockwise (NxD's torch loop here; on trn2 nkilib's {kernel} kernel, --moe-prefill {self._mode})"
                  if kernel else f"blockwise (NxD's torch loop, --moe-prefill {self._mode}, as on trn2)")
        parts = []
        for tag, paths in sorted(self.seen.items()):
            notes = [device if p == "blockwise" else p for p in sorted(paths)]
            parts.append(f"{tag}: {', '.join(notes)}")
        report = "NxD MoE paths taken in CPU mode: " + ("; ".join(parts) or "none")
        if self._sampling:  # see NeuronKimiK2Model.init_model
            report += ("; on-device sampling: NxDI's CPU branch over logits gathered in lm_head (on trn2 over "
                       "vocab-sharded logits with NxD's distributed top-k/argmax)")
        return report


def moe_path(module: ExpertMLPsV2, tokens: int, seq_len: int | None) -> str:
    """The inference path ExpertMLPsV2.forward takes for `tokens` tokens (moe_paths.call_path), "-ep" added to
    all-experts decode under expert parallelism."""
    cfg = module.routed_experts_mlp_config
    if cfg.capacity_factor is not None:
        return "capacity-factor"
    path = moe_paths.call_path(tokens, cfg.top_k, cfg.num_experts, module.blockwise_matmul_config.block_size,
                               decode=seq_len == 1)
    ep = module.moe_expert_model_parallel_group.size() > 1
    return path + "-ep" if path == "all-experts" and seq_len == 1 and ep else path


# -- teacher-forced logits ----------------------------------------------------------------------------------------

def padded_prefill(rows: list[list[int]], lengths: list[int]):
    """input_ids, attention_mask and position_ids of a right-padded prefill, as NxDI's HF adapter makes them:
    positions count the real tokens, padding gets position 1 (NXDI_CONTRACT.md: adapter-pad-positions)."""
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (row, n) in enumerate(zip(rows, lengths)):
        ids[r, :n], mask[r, :n] = torch.tensor(row[:n]), 1
    return ids, mask, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def teacher_forced_logits(app, rows: list[list[int]], prefill_len: int | None = None) -> torch.Tensor:
    """float32 logits [B, max row length, V] at every position of every row; NaN beyond a row's end.

    Row r's first min(prefill_len, len) tokens go through NxDI's context-encoding submodel in one call; the rest are
    fed one token per call through the token-generation submodel and NxDI's KV cache, all rows together, each at
    its own position (a row already done is fed token 0 and its logits dropped). NxDI returns only the last prefill
    position's logits (NXDI_CONTRACT.md: last-position-logits), so the prefill's final hidden states are read with a
    forward hook on the model's norm and put through its lm_head; the position NxDI returns is checked against
    them."""
    b, longest = len(rows), max(len(r) for r in rows)
    k = [len(r) if prefill_len is None else min(prefill_len, len(r)) for r in rows]
    out = torch.full((b, longest, app.config.vocab_size), float("nan"))
    cte = app.context_encoding_model.model
    captured = {}
    handle = cte.norm.register_forward_hook(lambda _m, _i, h: captured.__setitem__("h", h))
    ids, mask, pos = padded_prefill(rows, k)
    seq_ids = torch.arange(b)
    with torch.no_grad():
        try:
            last = _forward(app, ids, mask, pos, seq_ids)
        finally:
            handle.remove()
        full = cte.lm_head(captured["h"]).float()
        picked = full[torch.arange(b), pos.argmax(dim=1)]
        if not torch.allclose(picked, last[:, -1], rtol=1e-4, atol=1e-4 * picked.abs().max().item()):
            raise RuntimeError("the hooked prefill logits differ from NxDI's: the hook read the wrong tensor")
        for r in range(b):
            out[r, :k[r]] = full[r, :k[r]]
        cur = torch.tensor(k)
        for step in range(max(len(r) - kr for r, kr in zip(rows, k))):
            tok = torch.tensor([[r[kr + step] if kr + step < len(r) else 0] for r, kr in zip(rows, k)])
            step_mask = (torch.arange(int(cur.max()))[None] < cur[:, None]).long()  # [0, pos) of each row
            logits = _forward(app, tok, step_mask, cur[:, None], seq_ids)
            for r in range(b):
                if k[r] + step < len(rows[r]):
                    out[r, k[r] + step] = logits[r, -1]
            cur = cur + 1
    return out


def _forward(app, ids, mask, pos, seq_ids) -> torch.Tensor:
    """NeuronBaseForCausalLM.forward, with NxD's CPU-mode FP8 indexing bug named (NXDI_CONTRACT.md:
    cpu-fp8-index)."""
    try:
        return app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=seq_ids).logits.float()
    except NotImplementedError as e:
        if "Float8" in str(e) and "index" in str(e):
            raise KimiInputError(
                "NxD's QuantizedExpertFusedColumnParallel.forward re-indexes its float8 weight on CPU without its "
                "int8-view workaround (NXDI_CONTRACT.md: cpu-fp8-index), so FP8 selective loading fails "
                "in CPU mode; NxD needs that two-line fix (the nxdi-cpu test venv carries it)") from e
        raise


# -- running at o.tp ranks -----------------------------------------------------------------------------------------

def run(o: CpuOptions, job, *args):
    """job(rank, o, *args) at o.tp ranks (one process each, gloo; kimi_k2_neuron.runtime.ranks) and rank 0's result;
    at TP=1 in this process. `job` must be a module-level function (ranks are spawned). o is prepare()d."""
    if o.config is None:
        raise ValueError("run() takes options prepare() made")
    if o.tp == 1:
        with library_output_to_stderr():
            return job(0, o, *args)
    from kimi_k2_neuron.runtime.ranks import run_ranks

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        run_ranks(_rank_main, o.tp, (job, o, args, out))
        return torch.load(out, weights_only=False)


def _rank_main(rank: int, job, o: CpuOptions, args: tuple, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // o.tp))  # the ranks share the host's cores
    os.dup2(2, 1)  # a rank's stdout is library chatter only (see library_output_to_stderr)
    result = job(rank, o, *args)
    if rank == 0:
        torch.save(result, out)


@contextlib.contextmanager
def library_output_to_stderr():
    """NxD's log handlers write INFO lines to the stdout they were given at import and gloo prints from C++ to fd 1:
    point fd 1 at stderr while the model is built and run, so stdout carries only the command's output (`--json`,
    streamed text); sys.stdout meanwhile writes to the real stdout."""
    sys.stdout.flush()
    saved, previous = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = open(saved, "w", closefd=False, encoding=previous.encoding, errors=previous.errors)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = previous
        os.dup2(saved, 1)
        os.close(saved)


def logits(o: CpuOptions, rows: list[list[int]], prefill_len: int | None = None) -> tuple[torch.Tensor, str]:
    """teacher_forced_logits of the NxDI model at o.tp ranks, and the MoE path report."""
    return run(prepare(o, max(len(r) for r in rows), len(rows)), _logits_job, rows, prefill_len)


def _logits_job(rank: int, o: CpuOptions, rows, prefill_len):
    app = build(o, seq_len=max(len(r) for r in rows), batch=len(rows))
    paths = MoEPaths(app)
    return teacher_forced_logits(app, rows, prefill_len), paths.report()


# -- generation --------------------------------------------------------------------------------------------------------

def generate(o: CpuOptions, g: Generation, stream=None) -> tuple[list[list[int]], str]:
    """New tokens per row from NxDI's generation adapter and on-device sampler (its CPU branches), at o.tp ranks, and
    the report of the paths taken (MoEPaths). `stream` (TP=1 only: ranks are other processes) receives row 0's text
    as it comes."""
    o = prepare(o, g.seq_len, len(g.rows), g.sampling, g.rows)
    return run(o, _generate_job, g, stream if o.tp == 1 else None)


def _generate_job(rank: int, o: CpuOptions, g: Generation, stream=None) -> tuple[list[list[int]], str]:
    from kimi_k2_neuron.runtime.chat import reply_text

    from kimi_k2_neuron.neuron.serving import generate_ids
    from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

    torch.manual_seed(g.seed)  # the same on every rank: the sampler draws the same numbers everywhere
    app = build(o, seq_len=g.seq_len, batch=len(g.rows), sampling=g.sampling)
    tok = KimiTokenizer.from_dir(g.tokenizer_dir) if g.tokenizer_dir else None
    decode = partial(reply_text, tok) if tok else None
    paths = MoEPaths(app)
    rows = generate_ids(app, g.rows, set(g.stop_ids), decode=decode, max_new_tokens=g.max_new_tokens,
                        do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                        stream=stream if rank == 0 else None, stop=g.stop)
    return rows, paths.report()


# -- NxDI's benchmark -------------------------------------------------------------------------------------------------

BENCH_SAMPLING = contract.sampler_settings(0.0, 0, 1.0)  # greedy, as benchmark_sampling runs on trn2


def benchmark(o: CpuOptions, seq_len: int, batch: int, num_runs: int) -> dict:
    """NxDI's benchmark_sampling on the NxDI model in NxD's CPU mode: the report scripts/bench_tpot.py makes on trn2,
    here with CPU latencies that say nothing about trn2."""
    return run(prepare(o, seq_len, batch, BENCH_SAMPLING), _benchmark_job, seq_len, batch, num_runs)


def _benchmark_job(rank: int, o: CpuOptions, seq_len: int, batch: int, num_runs: int) -> dict:
    from neuronx_distributed_inference.utils.benchmark import benchmark_sampling
    from transformers import GenerationConfig

    app = build(o, seq_len=seq_len, batch=batch, sampling=BENCH_SAMPLING)
    gen = GenerationConfig(**BENCH_SAMPLING, eos_token_id=[], pad_token_id=0)
    with tempfile.TemporaryDirectory() as d:
        return benchmark_sampling(app, None, gen, target="all", num_runs=num_runs,
                                  benchmark_report_path=str(Path(d) / "nxdi.json"))
