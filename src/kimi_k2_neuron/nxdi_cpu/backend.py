"""The NxDI model in NxD's CPU mode: `kimi-k2-neuron logits|generate --backend nxdi-cpu`, scripts' `--cpu`, and the
nxdi-cpu test tier. Everything but tracing, neuronx-cc, NKI kernels, Neuron collectives and HBM is what trn2 runs;
MoEPaths names the torch path taken where NxD's is device-only. One bucket per submodel: the context bucket is seq_len,
or the chunk with --prefill-chunk (NXD_CPU_MODE.md: bucket-positions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

from kimi_k2_neuron.neuron.sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2  # noqa: E402

from kimi_k2_neuron.config import KimiK2Config  # noqa: E402
from kimi_k2_neuron.errors import KimiInputError  # noqa: E402
from kimi_k2_neuron.formats.record import ConversionRecord, experts_for  # noqa: E402
from kimi_k2_neuron.interrupts import stdout_over  # noqa: E402

from kimi_k2_neuron.neuron import contract, moe_paths  # noqa: E402
from kimi_k2_neuron.convert import ensure_converted  # noqa: E402
from kimi_k2_neuron.neuron.chunked_prefill import hidden_rows  # noqa: E402
from kimi_k2_neuron.neuron.modeling import KimiK2InferenceConfig  # noqa: E402
from kimi_k2_neuron.neuron.serving import Decoding, generate_ids  # noqa: E402
from kimi_k2_neuron.neuron.spec import GREEDY, Sampling  # noqa: E402
from kimi_k2_neuron.nxdi_cpu.cpu_mode import CpuKimiK2ForCausalLM  # noqa: E402
from kimi_k2_neuron.nxdi_cpu.fused_spec_cpu import forget_draft_group  # noqa: E402
# Re-exported: the options and their SDK-free checks are part of this module's interface.
from kimi_k2_neuron.nxdi_cpu.options import (CpuOptions, Generation, check, check_layout,  # noqa: E402,F401
                                             check_request, padded_seq_len, request_spec)


def prepare(o: CpuOptions, seq_len: int, batch: int, sampling: Sampling | None = None,
            prompts: list[list[int]] | None = None) -> CpuOptions:
    """o checked before anything is converted or a rank starts, a raw checkpoint converted once here rather than by
    every rank, and the converted config and record carried in o (o.config: the caller's read of o.model's
    config.json, if it has one)."""
    cfg = check_request(o, seq_len, batch, sampling, prompts, cfg=o.config)
    if o.spec.draft:
        from kimi_k2_neuron.nxdi_cpu.fused_spec_cpu import check_device_ops

        check_device_ops()
    record = ConversionRecord.of(cfg)
    path = Path(o.model)
    if record is None:
        path, record = _convert_once(o, experts_for(None, o.experts))
        cfg = KimiK2Config.from_file(path)  # the converted checkpoint's, a new file
    experts_for(record, o.experts)  # refuses another scheme than the converted checkpoint holds
    return dataclasses.replace(o, model=str(path), config=cfg, record=record)


def _convert_once(o: CpuOptions, experts: str) -> tuple[Path, ConversionRecord]:
    return ensure_converted(o.model, experts, root=o.cache_dir)  # (None: the package's one place for it)


def build(o: CpuOptions, seq_len: int, batch: int, sampling: Sampling | None = None) -> CpuKimiK2ForCausalLM:
    """`sampling`: the on-device sampler's settings, None for logits out."""
    return application(o, seq_len, batch, sampling).to_cpu(o.presharded)


def application(o: CpuOptions, seq_len: int, batch: int, sampling: Sampling | None = None,
                on_cpu: bool = True) -> CpuKimiK2ForCausalLM:
    """As compile_and_save builds it, nothing built yet. `sampling` None: logits out; on_cpu False: NxDI's device
    sampler branches."""
    if o.record is None:
        o = prepare(o, seq_len, batch, sampling)
    spec = dataclasses.replace(
        request_spec(o, seq_len, batch), scheme=o.record.scheme, checkpoint=o.model,
        sampling=sampling or Sampling(on_device=False), output_logits=sampling is not None and not on_cpu,
        dtype=o.dtype, extra={"on_cpu": on_cpu,
               **({"flash_decoding_enabled": True} if o.flash_decoding_one_rank else {}),
               # nkilib's max kernel is device-only (NXD_CPU_MODE.md: fused-spec-cpu)
               **({"disable_argmax_kernel": True} if o.spec.draft else {})})
    return CpuKimiK2ForCausalLM(o.model, KimiK2InferenceConfig.for_serving(o.config, spec))


def preshard(o: CpuOptions, out: str | Path, seq_len: int, batch: int) -> Path:
    """shard_weights as compile() runs it, outside CPU mode: there NxD would ask the mocked torch.distributed for
    gloo groups (NXD_CPU_MODE.md: sharding-outside-cpu-mode)."""
    from neuronx_distributed.parallel_layers import parallel_state

    app = application(o, seq_len, batch, GREEDY if o.spec.draft else None)  # fused speculation samples on device
    # ModelBuilder sets NxD's model-parallel state up for the compile's world, as in compile()'s own process: here it
    # must not see the state (a cached TP size) an in-process run left, nor leave its mock world's behind
    parallel_state.destroy_model_parallel()
    forget_draft_group()
    try:
        with nxd_cpu_mode(False):
            app.shard_weights(str(out))
    finally:
        parallel_state.destroy_model_parallel()
        forget_draft_group()
    return Path(out) / "weights"


@contextlib.contextmanager
def nxd_cpu_mode(on: bool):
    """NxD reads NXD_CPU_MODE at every cpu_mode() call (NXD_CPU_MODE.md: cpu-mode-switch)."""
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
    """The ExpertMLPsV2 path each MoE call takes, by forward pre-hooks (nothing patched); on CPU every blockwise mode
    runs NxD's torch loop, so the report names trn2's kernel (NXD_CPU_MODE.md: nki-kernel-on-cpu)."""

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
    """moe_paths.call_path, or at token generation the shell's --moe-decode path (nxd_moe.KimiExpertMLPs); "-ep" added
    to all-experts decode under EP."""
    cfg = module.routed_experts_mlp_config
    if cfg.capacity_factor is not None:
        return "capacity-factor"
    path = moe_paths.call_path(tokens, cfg.top_k, cfg.num_experts, module.blockwise_matmul_config.block_size,
                               decode=seq_len == 1)
    if seq_len == 1 and getattr(module, "decode_path", None):
        path = module.decode_path
    ep = module.moe_expert_model_parallel_group.size() > 1
    return path + "-ep" if path == "all-experts" and seq_len == 1 and ep else path


# -- teacher-forced logits ----------------------------------------------------------------------------------------

def padded_prefill(rows: list[list[int]], lengths: list[int]):
    """As NxDI's HF adapter pads: padding gets position 1 (NXDI_CONTRACT.md: adapter-pad-positions)."""
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (row, n) in enumerate(zip(rows, lengths)):
        ids[r, :n], mask[r, :n] = torch.tensor(row[:n]), 1
    return ids, mask, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def teacher_forced_logits(app, rows: list[list[int]], prefill_len: int | list[int] | None = None) -> torch.Tensor:
    """float32 logits [B, max row length, V]; NaN beyond a row's end. NxDI returns only the last prefill position's
    (NXDI_CONTRACT.md: last-position-logits), so the rest come from a hook on the norm, checked against it.
    prefill_len: tokens prefilled per row (one for all, or one per row), the rest teacher-forced one a step."""
    b, longest = len(rows), max(len(r) for r in rows)
    wanted = prefill_len if isinstance(prefill_len, list) else [prefill_len] * b
    k = [len(r) if p is None else min(p, len(r)) for r, p in zip(rows, wanted)]
    out = torch.full((b, longest, app.config.vocab_size), float("nan"))
    cte = app.context_encoding_model.model
    # every prefill call's normed hidden states, in the driver's order (chunked_prefill.hidden_rows)
    prefill_models = [cte] + ([app.chunked_prefill_model.model] if hasattr(app, "chunked_prefill_model") else [])
    calls: list[torch.Tensor] = []
    handles = [m.norm.register_forward_hook(lambda _m, _i, h: calls.append(h)) for m in prefill_models]
    ids, mask, pos = padded_prefill(rows, k)
    seq_ids = torch.arange(b)
    with torch.no_grad():
        try:
            last = _forward(app, ids, mask, pos, seq_ids)
        finally:
            for handle in handles:
                handle.remove()
        for r, h in enumerate(hidden_rows(calls, k, contract.run_spec(app.config).layout.prefill_chunk)):
            out[r, :k[r]] = cte.lm_head(h[None]).float()[0]
        check_hooked_logits(out[torch.arange(b), torch.tensor(k) - 1], last[:, -1], app.neuron_config.torch_dtype)
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


def check_hooked_logits(hooked: torch.Tensor, nxdi: torch.Tensor, dtype: torch.dtype) -> None:
    """The hook's last prefill logits against NxDI's own, both lm_head over the same normed hidden state but as
    different matmuls ([1, k, H] per row here, NxDI's [B, 1, H]): their float32 sums differ by reordering (1e-4 of
    the largest logit covers it), and each is then rounded to `dtype`, so one logit may differ by one unit in its
    last place, eps(dtype) x |logit| (bf16: 2^-7, 0.8%). Strict to that bound (a rtol of 1e-4 failed bf16 at batch 4
    on one machine and not another, by the GEMM's blocking); the wrong tensor (another row's, the norm's input)
    differs by O(1)."""
    rtol = max(torch.finfo(dtype).eps, 1e-4)
    if not torch.allclose(hooked, nxdi, rtol=rtol, atol=1e-4 * hooked.abs().max().item()):
        worst = ((hooked - nxdi).abs() / nxdi.abs().clamp_min(1e-30)).max().item()
        raise RuntimeError(f"the hooked prefill logits differ from NxDI's beyond one {dtype} rounding (relative "
                           f"{worst:.3g} > {rtol:.3g}): the hook read the wrong tensor")


def _forward(app, ids, mask, pos, seq_ids) -> torch.Tensor:
    """Names NxD's CPU-mode FP8 indexing bug (NXD_CPU_MODE.md: cpu-fp8-index)."""
    try:
        return app.forward(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=seq_ids).logits.float()
    except NotImplementedError as e:
        if "Float8" in str(e) and "index" in str(e):
            raise KimiInputError(
                "NxD's QuantizedExpertFusedColumnParallel.forward re-indexes its float8 weight on CPU without its "
                "int8-view workaround (NXD_CPU_MODE.md: cpu-fp8-index), so FP8 selective loading fails "
                "in CPU mode; NxD needs that two-line fix (the nxdi-cpu test venv carries it)") from e
        raise


# -- running at o.tp ranks -----------------------------------------------------------------------------------------

def run(o: CpuOptions, job, *args):
    """job(rank, o, *args) at o.tp ranks -> rank 0's result. `job` module-level (ranks are spawned)."""
    if o.record is None:
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
    # The ranks leave together and take their process groups down before the interpreter's teardown does.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@contextlib.contextmanager
def library_output_to_stderr():
    """fd 1 to stderr (NxD's handlers and gloo write there), so stdout holds only the command's output."""
    sys.stdout.flush()
    saved, previous = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = stdout_over(saved, previous)  # guarded as run_command guards the process's own
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = previous
        os.dup2(saved, 1)
        os.close(saved)


def logits(o: CpuOptions, rows: list[list[int]],
           prefill_len: int | list[int] | None = None) -> tuple[torch.Tensor, str]:
    return run(prepare(o, max(len(r) for r in rows), len(rows)), _logits_job, rows, prefill_len)


def _logits_job(rank: int, o: CpuOptions, rows, prefill_len):
    app = build(o, seq_len=max(len(r) for r in rows), batch=len(rows))
    paths = MoEPaths(app)
    return teacher_forced_logits(app, rows, prefill_len), paths.report()


# -- generation --------------------------------------------------------------------------------------------------------

def generate(o: CpuOptions, g: Generation, stream=None) -> tuple[list[list[int]], str]:
    """New tokens per row and the MoEPaths report. `stream` (TP=1 only) receives row 0's text."""
    o = prepare(o, g.seq_len, len(g.rows), g.sampling, g.rows)
    return run(o, _generate_job, g, stream if o.tp == 1 else None)


def _generate_job(rank: int, o: CpuOptions, g: Generation, stream=None) -> tuple[list[list[int]], str]:
    from kimi_k2_neuron.runtime.chat import reply_text

    from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer

    torch.manual_seed(g.seed)  # the same on every rank: the sampler draws the same numbers everywhere
    app = build(o, seq_len=g.seq_len, batch=len(g.rows), sampling=g.sampling)
    tok = KimiTokenizer.from_dir(g.tokenizer_dir) if g.tokenizer_dir else None
    decode = partial(reply_text, tok) if tok else None
    paths, accepted = MoEPaths(app), []
    rows = generate_ids(app, g.rows, set(g.stop_ids), Decoding(g.max_new_tokens, g.sampling, g.stop), decode=decode,
                        stream=stream if rank == 0 else None, accepted=accepted)
    if o.spec.draft:
        from kimi_k2_neuron.neuron.fused_spec import accept_summary

        return rows, paths.report() + "\n" + accept_summary(accepted, o.spec.draft.speculation_length)
    return rows, paths.report()


# -- NxDI's benchmark -------------------------------------------------------------------------------------------------

BENCH_SAMPLING = GREEDY  # as benchmark_sampling runs on trn2


def benchmark(o: CpuOptions, seq_len: int, batch: int, num_runs: int) -> dict:
    """bench_tpot.py's report, with CPU latencies that say nothing about trn2."""
    return run(prepare(o, seq_len, batch, BENCH_SAMPLING), _benchmark_job, seq_len, batch, num_runs)


def _benchmark_job(rank: int, o: CpuOptions, seq_len: int, batch: int, num_runs: int) -> dict:
    from neuronx_distributed_inference.utils.benchmark import benchmark_sampling
    from transformers import GenerationConfig

    app = build(o, seq_len=seq_len, batch=batch, sampling=BENCH_SAMPLING)
    gen = GenerationConfig(**BENCH_SAMPLING.settings, eos_token_id=[], pad_token_id=0)
    with tempfile.TemporaryDirectory() as d:
        return benchmark_sampling(app, None, gen, target="all", num_runs=num_runs,
                                  benchmark_report_path=str(Path(d) / "nxdi.json"))
