"""One NxDI submodel traced with torch_xla on the XLA CPU device as NxD traces it for neuronx-cc (NXD_CPU_MODE.md:
aot-build), `kimi-k2-neuron trace-cpu`: on trn2 a host sync, a data-dependent shape or an op torch_xla cannot lower
shows up only as a failed or exploding compile. An eager prefill and decode step record the call NxDI's wrapper makes
(NXD_CPU_MODE.md: wrapper-inputs); it is replayed on the XLA device in NxD's device mode, so NxD takes its tracing
branches, and torch_xla's metrics and debug log name each sync and aten fallback. Not shown: KV-cache aliasing, NKI
kernels, neuronx-cc's verdict, HBM, and TP > 1, which ModelBuilder traces under a mocked torch.distributed
(NXD_CPU_MODE.md: mock-distributed)."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import tempfile
import traceback
from pathlib import Path

import torch

from kimi_k2_neuron.errors import KimiInputError, env_int

from kimi_k2_neuron.neuron.chunked_prefill import CHUNK_MODEL_TAG

from . import backend
from .options import check_submodel

# NxDI's wrapper attributes, and ours for the chunked-prefill submodel
SUBMODELS = {"context": "context_encoding_model", "token": "token_generation_model", "chunk": CHUNK_MODEL_TAG}
SEED = 0
FRAMES_KEPT = 8  # innermost Python frames kept per sync
# max |traced - eager| / max |eager| that bf16 rounding alone reaches (XLA fuses what eager rounds op by op): 1e-2 to
# 1.6e-2 measured (docs/nxdi_on_cpu.md, "Tracing on CPU")
BF16_ROUNDING = 2e-2


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    model: backend.CpuOptions  # dtype: bfloat16, the device dtype, unless asked otherwise
    submodel: str  # a key of SUBMODELS
    seq_len: int = 16
    batch: int = 1


@dataclasses.dataclass
class SubmodelCall:
    """One call NxDI's model wrapper made of a submodel: its arguments, the KV cache before it, its eager outputs."""

    args: list[torch.Tensor]
    cache_before: list[torch.Tensor]
    outputs: list[torch.Tensor]


@dataclasses.dataclass
class Prepared:
    options: TraceOptions
    app: object
    model: torch.nn.Module  # the submodel's NeuronKimiK2Model
    call: SubmodelCall


@dataclasses.dataclass
class Sync:
    cause: str  # torch_xla's "Execution Cause"
    frames: list[str]  # innermost first, "function (file:line)"


@dataclasses.dataclass
class TraceReport:
    submodel: str
    batch: int
    seq_len: int
    dtype: str
    compiles: int  # graphs torch_xla compiled or took from its compile cache, forward and step together
    executes: int
    host_syncs: int  # graphs executed before the step was marked: values read back mid-forward
    syncs: list[Sync]
    aten_fallbacks: list[str]  # torch_xla counters "aten::<op>": ops run on the host instead of lowered
    hlo_instructions: int
    max_rel_diff_vs_eager: float | None
    rel_diff_vs_eager: dict[str, float]
    argmax_equal: bool | None
    # Rows whose traced argmax differs, with eager's top-1 minus top-2 logit: in bf16 a margin below
    # max_abs_logit_diff is a near tie that rounding can flip, not a wrong graph.
    argmax_mismatches: list[dict]
    max_abs_logit_diff: float | None
    stopped: str | None = None  # the forward raised while tracing: why and where

    @property
    def clean(self) -> bool:
        return (self.stopped is None and self.compiles == 1 and self.executes == 1 and self.host_syncs == 0
                and not self.aten_fallbacks)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "clean": self.clean})

    def format(self) -> str:
        head = f"{self.submodel} submodel, batch {self.batch}, seq_len {self.seq_len}, {self.dtype}, NXD_CPU_MODE=0"
        if self.stopped:
            return f"{head}: the trace stopped: {self.stopped}\nNOT CLEAN"
        lines = [head,
                 f"  HLO instructions {self.hlo_instructions}; compiles {self.compiles}, executes {self.executes}, "
                 f"host syncs before the step {self.host_syncs}",
                 f"  aten fallbacks: {', '.join(self.aten_fallbacks) or 'none'}"]
        lines += [f"  sync {i + 1} ({s.cause}): {' <- '.join(s.frames[:3]) or 'frame unknown'}"
                  for i, s in enumerate(self.syncs)]
        lines.append(f"  max |xla - eager| / max |eager| over logits and KV cache: {self.max_rel_diff_vs_eager:.3g} "
                     f"(logits {self.rel_diff_vs_eager['logits']:.3g}); argmax equal: {self.argmax_equal}")
        lines += self._beyond_rounding()
        lines += [f"  argmax differs in row {m['row']}: eager {m['eager']}, traced {m['traced']}; eager top-2 margin "
                  f"{m['eager_margin']:.3g} vs max |logit diff| {self.max_abs_logit_diff:.3g}"
                  for m in self.argmax_mismatches]
        lines.append("CLEAN: one graph, one compile, one execute" if self.clean else "NOT CLEAN")
        return "\n".join(lines)


    def _beyond_rounding(self) -> list[str]:
        """In bf16, the first output past rounding's reach, in the order the forward writes them (each layer's cache,
        then the logits), and what usually puts it there: a router near tie (two experts' scores closer than bf16
        can tell) that rounding flipped in an earlier layer, sending a token to another expert."""
        if self.dtype != "bfloat16" or not self.max_rel_diff_vs_eager > BF16_ROUNDING:
            return []
        names = [n for n in self.rel_diff_vs_eager if n != "logits"] + ["logits"]
        first = next(n for n in names if self.rel_diff_vs_eager[n] > BF16_ROUNDING)
        return [f"  note: bf16 rounding alone stays below {BF16_ROUNDING:g}; {first} is the first output past it: "
                f"most likely a router near tie in an earlier layer that rounding flipped (another expert for a token, "
                f"carried on), not a wrong graph; --dtype float32 tells (below 1e-5: the graph computes what NxDI "
                f"computes)"]


def check(o: TraceOptions) -> None:
    """What this trace cannot run, refused before any work."""
    if o.submodel not in SUBMODELS:
        raise KimiInputError(f"--submodel {o.submodel}: expected one of {', '.join(SUBMODELS)}")
    if o.batch < 1:
        raise KimiInputError(f"--batch {o.batch}: expected at least 1")
    if o.seq_len < 2:
        raise KimiInputError(f"--seq-len {o.seq_len}: expected at least 2 (a prefill and one decode position)")
    check_submodel(o.submodel, o.seq_len, o.model.spec.layout.prefill_chunk)
    if o.model.tp != 1:
        raise KimiInputError(f"--tp {o.model.tp}: trace-cpu traces TP=1 only; TP > 1 needs NxD's ModelBuilder "
                             f"world (all ranks in one process under a mocked torch.distributed), not built here")
    backend.check(o.model)


def trace(o: TraceOptions) -> TraceReport:
    return run(prepare(o))


def prepare(o: TraceOptions) -> Prepared:
    """Build the application in NxD's CPU mode and record one eager call of the submodel."""
    check(o)
    # Set before torch_xla's runtime first executes, which latches them (on trn2 it would pick the Neuron device).
    if os.environ.setdefault("PJRT_DEVICE", "CPU") != "CPU":
        raise KimiInputError(f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}: trace-cpu traces on torch_xla's CPU device; "
                             f"unset it or set PJRT_DEVICE=CPU")
    sync_log()
    app = backend.build(o.model, seq_len=o.seq_len, batch=o.batch)
    model = getattr(app, SUBMODELS[o.submodel]).model
    rows = prompt_rows(o.batch, o.seq_len, app.config.vocab_size)
    return Prepared(o, app, model, record_call(app, model, rows))


def prompt_rows(batch: int, seq_len: int, vocab: int) -> list[list[int]]:
    """Seeded rows: a prefill of seq_len // 2 (padded to the bucket, as NxDI pads a short prompt) and one decode."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (batch, seq_len // 2 + 1), generator=g).tolist()


def record_call(app, model: torch.nn.Module, rows: list[list[int]]) -> SubmodelCall:
    """The first call NxDI's model wrapper makes of `model` while teacher_forced_logits runs the rows."""
    seen = {}

    def before(_module, args):
        if "args" not in seen:
            seen["args"] = [a.clone() for a in args]
            seen["cache"] = [p.detach().clone() for p in model.kv_mgr.past_key_values]

    def after(_module, _args, outputs):
        if "outputs" not in seen:
            seen["outputs"] = [o.detach().clone() for o in outputs]

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        backend.teacher_forced_logits(app, rows, prefill_len=len(rows[0]) - 1)
    finally:
        for h in handles:
            h.remove()
    return SubmodelCall(seen["args"], seen["cache"], seen["outputs"])


def run(p: Prepared) -> TraceReport:
    """Replay the recorded call on the XLA device in NxD's device mode; the app is on that device afterwards."""
    import torch_xla
    import torch_xla.debug.metrics as met

    log = sync_log()
    device = torch_xla.device()
    with torch.no_grad():
        for cache, before in zip(p.model.kv_mgr.past_key_values, p.call.cache_before):
            cache.data = before.clone()
        p.model.to(device)
        args = [a.to(device) for a in p.call.args]
        torch_xla.sync()  # nothing pending before the forward: weights and arguments are device data
        met.clear_all()
        start = log.tell()
        try:
            with backend.nxd_cpu_mode(False):
                outputs = list(p.model(*args))
        except Exception as e:  # a trace that stops is a finding to report, not a crash
            return _stopped(p.options, e)
        host_syncs = _counter(met, "ExecuteComputation")
        syncs = log.executions(start)
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
        torch_xla.sync()
        got = [o.cpu() for o in outputs]
    diffs = rel_diffs(got, p.call.outputs)
    mismatches = argmax_mismatches(got[0], p.call.outputs[0])
    return TraceReport(
        submodel=p.options.submodel, batch=p.options.batch, seq_len=p.options.seq_len, dtype=p.options.model.dtype,
        compiles=_counter(met, "UncachedCompile") + _counter(met, "CachedCompile"),
        executes=_counter(met, "ExecuteComputation"), host_syncs=host_syncs, syncs=syncs,
        aten_fallbacks=sorted(n for n in met.counter_names() if n.startswith("aten::")),
        hlo_instructions=hlo_instructions(hlo), max_rel_diff_vs_eager=max(diffs.values()), rel_diff_vs_eager=diffs,
        argmax_equal=not mismatches, argmax_mismatches=mismatches,
        max_abs_logit_diff=(got[0].float() - p.call.outputs[0].float()).abs().max().item())


def _counter(met, name: str) -> int:
    return met.counter_value(name) or 0


def _stopped(o: TraceOptions, e: Exception) -> TraceReport:
    frames = traceback.extract_tb(e.__traceback__)[-3:][::-1]
    where = " <- ".join(f"{f.name} ({f.filename}:{f.lineno})" for f in frames)
    why = str(e).splitlines()[0] if str(e) else ""
    return TraceReport(submodel=o.submodel, batch=o.batch, seq_len=o.seq_len, dtype=o.model.dtype, compiles=0,
                       executes=0, host_syncs=0, syncs=[], aten_fallbacks=[], hlo_instructions=0,
                       max_rel_diff_vs_eager=None, rel_diff_vs_eager={}, argmax_equal=None, argmax_mismatches=[],
                       max_abs_logit_diff=None,
                       stopped=f"{type(e).__name__}: {why} at {where}")


# -- comparison and counting -----------------------------------------------------------------------------------------

def output_names(n: int) -> list[str]:
    """The submodel's outputs without on-device sampling: logits, then each layer's K and V cache
    (NXDI_CONTRACT.md: submodel-outputs)."""
    return ["logits"] + [f"cache.{i // 2}.{'kv'[i % 2]}" for i in range(n - 1)]


def rel_diffs(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """max |got - want| / max |want| per output; the plain max |got - want| where want is all zeros (the latent
    cache's 1-wide V slot)."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        raise RuntimeError(f"the traced outputs {[tuple(g.shape) for g in got]} differ in number or shape from the "
                           f"eager ones {[tuple(w.shape) for w in want]}")
    out = {}
    for name, g, w in zip(output_names(len(want)), got, want):
        diff, scale = (g.float() - w.float()).abs().max().item(), w.float().abs().max().item()
        out[name] = diff / scale if scale else diff
    return out


def argmax_mismatches(got: torch.Tensor, want: torch.Tensor) -> list[dict]:
    """The rows (flattened batch x position) whose argmax differs, with eager's top-2 margin."""
    g, w = got.float().flatten(0, -2), want.float().flatten(0, -2)
    out = []
    for row in (g.argmax(-1) != w.argmax(-1)).nonzero().flatten().tolist():
        top = w[row].topk(2).values
        out.append({"row": row, "eager": int(w[row].argmax()), "traced": int(g[row].argmax()),
                    "eager_margin": float(top[0] - top[1])})
    return out


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s", re.MULTILINE)


def hlo_instructions(hlo_text: str) -> int:
    """Instructions in an HLO module's text, in every computation (the entry and the reducers it calls)."""
    return len(_INSTRUCTION.findall(hlo_text))


# -- naming the Python frame of each sync ---------------------------------------------------------------------------

class SyncLog:
    """torch_xla's "Execution Analysis" of every graph execution (PT_XLA_DEBUG_LEVEL >= 2, to PT_XLA_DEBUG_FILE)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None

    def tell(self) -> int:
        return self.path.stat().st_size if self.path and self.path.exists() else 0

    def executions(self, start: int) -> list[Sync]:
        if not self.path or not self.path.exists():
            return []
        with open(self.path, errors="replace") as f:
            f.seek(start)
            return parse_executions(f.read())


_SYNC_LOG: SyncLog | None = None


def sync_log() -> SyncLog:
    """Enables level 2 (level 1 writes only compilations) unless the caller chose; torch_xla reads it at its first
    execution, so after one without it syncs are counted but not named."""
    global _SYNC_LOG
    if _SYNC_LOG is None:
        if "PT_XLA_DEBUG_FILE" not in os.environ and env_int("PT_XLA_DEBUG_LEVEL", 0) < 1:
            fd, path = tempfile.mkstemp(prefix="kimi-k2-xla-debug-", suffix=".txt")
            os.close(fd)
            atexit.register(lambda: Path(path).unlink(missing_ok=True))
            os.environ.update(PT_XLA_DEBUG_LEVEL="2", PT_XLA_DEBUG_FILE=path)
        _SYNC_LOG = SyncLog(os.environ.get("PT_XLA_DEBUG_FILE"))
    return _SYNC_LOG


_PREFIX = "Execution Analysis: "


def parse_executions(text: str) -> list[Sync]:
    """torch_xla's "Execution Analysis" blocks: the line after "Execution Cause" is the cause; the lines after
    "Python Frame Triggered Execution:" up to the dashes are the frames, innermost first."""
    syncs, state = [], None
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            continue
        body = line[len(_PREFIX):].strip()
        if body == "Execution Cause":
            syncs.append(Sync("", []))
            state = "cause"
        elif state == "cause":
            syncs[-1].cause, state = body, None
        elif body.startswith("Python Frame Triggered Execution"):
            state = "frames" if syncs else None
        elif state == "frames":
            if body.startswith(("---", "===")):
                state = None
            elif len(syncs[-1].frames) < FRAMES_KEPT:
                syncs[-1].frames.append(body)
    return syncs
