"""Step 0 on a trn2 host: each NKI kernel the recommended graphs call, run on a NeuronCore at Kimi-K2's per-rank shapes
against nki-library's own torch reference (the golden its device tests use), before anything is compiled.

Kernels (kimi_k2_neuron.neuron.kernels and docs/trn2.md say why these and no others):
  bwmm_shard_on_block  the prefill's routed experts at TP=64: --tokens (1024) rows, hidden 7168, 384 experts of 32
                       columns, blocks of 128 (445), top-8, affinities after the down projection, the token skip mode,
                       LNC=2: the arguments NxD passes it
  topk                 the sampler's rotated top-k: 256 of each rank's 2,560 float32 logits (unsorted), then 256 of
                       the 64 x 256 gathered candidates (sorted), at --batch rows
  cumsum               the sampler's cumsum over --batch x 256 float32 probabilities
Each case builds its inputs as NxD does (random hidden states through a random noaux_tc router, NxD's own
token-to-block mapping), first holds the reference to the model's own math (the core's MoE; torch.topk and
torch.cumsum), then runs the kernel on the device and holds it to the reference with nki-library's own tolerances
(moe_cte: rtol 2e-2; topk values: rtol 1e-3, atol 1e-5; cumsum: atol and rtol 1e-3), here as a max error over the
tensor's largest magnitude. The MoE kernel is called as NxD calls it: NxD's BlockwiseMatmulArgs through
neuronx_distributed.modules.moe.blockwise._call_bwmm_shard_on_block_kernel, which launches NxD's own import of the
kernel (import_nki_beta2: nki.jit(kernel, mode='torchxla'), modules/moe/nki_import.py) with the arguments it builds;
the reference is computed from the arguments that same wrapper passes (the kernel object stood in by the reference for
that call). --dry-run stops before the device (no Neuron SDK needed; the nxdi-cpu tier runs it): the reference through
NxD's wrapper, against the model's math. Each case runs on its own: one that raises is reported FAILED with its error
and the others still run.

The references are files of aws-neuron/nki-library at d2ad3a5, the version NxD 2.29 calls: --nki-library DIR, a
checkout (git clone https://github.com/aws-neuron/nki-library && git -C nki-library checkout d2ad3a5); default the
nxdi-cpu venv's unpacked copy. Needs NxD (the Neuron SDK's venv; the nxdi-cpu venv for --dry-run).

  python scripts/check_kernels.py --nki-library ~/nki-library --report kernels.json
exit 0: every comparison within its tolerance; 1: one is not; 2: bad input.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from contextlib import contextmanager
from pathlib import Path

from kimi_k2_neuron.arguments import check_out_file, fail, integer, path
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command, write_atomically
from kimi_k2_neuron.launch import script_parser
from kimi_k2_neuron.neuron.spec import Sampling

REPO = Path(__file__).resolve().parents[1]
KERNELS = ("bwmm_shard_on_block", "topk", "cumsum")
# The checks, as a max |error| over max |expected| (nki-library's device tests: moe_cte rtol 2e-2, topk rtol 1e-3 and
# atol 1e-5, cumsum rtol and atol 1e-3; the MoE reference against the core's float32 math: bf16 experts, affinities
# and per-block outputs, measured ~5e-3 at these shapes)
TOLERANCE = {"bwmm_shard_on_block": 2e-2, "topk": 1e-3, "cumsum": 1e-3}
GLOBAL_TOPK = Sampling.global_topk  # the sampler's compiled top-k
SEED = 0


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--dry-run", action="store_true",
                   help="compare the references with the model's math on CPU only; no device, no Neuron SDK")
    p.add_argument("--nki-library", metavar="DIR", default=None, type=path,
                   help="an aws-neuron/nki-library checkout at d2ad3a5 (default: <venv>/nxdi-cpu-src/nki-library)")
    p.add_argument("--config", metavar="FILE", type=path,
                   default=str(REPO / "test/data/configs/kimi-k2-instruct-0905.json"),
                   help="Kimi-K2's config.json (a checkpoint's), whose per-rank shapes the kernels run at")
    p.add_argument("--tp", type=integer(1), default=64, help="the ranks the experts and the vocabulary split over")
    p.add_argument("--tokens", type=integer(128), default=1024,
                   help="prefill rows of the MoE kernel call (a multiple of 128: its output tiles)")
    p.add_argument("--batch", type=integer(1), default=1, help="rows of the sampler's kernels")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {', '.join(KERNELS)}")
    p.add_argument("--report", metavar="FILE", default=None, type=path,
                   help="write the results as JSON here too (default: no file)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        names = _check(a)
        root = _library(a.nki_library)
        import torch  # noqa: F401 -- after the flags are checked

        from kimi_k2_neuron.config import KimiK2Config

        cfg = KimiK2Config.from_file(a.config)
        if cfg.moe_intermediate_size % a.tp or cfg.vocab_size % a.tp:
            raise KimiInputError(f"--tp {a.tp}: must divide moe_intermediate_size {cfg.moe_intermediate_size} and "
                                 f"vocab_size {cfg.vocab_size} of --config {a.config}")
        refs = References(root)
        device = None if a.dry_run else _device()
    except KimiInputError as e:
        return fail(e)
    except ImportError as e:
        needs = "NxD (neuronx-distributed)" + ("" if a.dry_run else " and the Neuron SDK")
        return fail(KimiInputError(f"check_kernels needs {needs}: {e}"))
    results = []
    for name in names:
        for case in CASES[name](cfg, a):
            t0 = time.monotonic()
            results.append(guarded(case, refs, device))
            r = results[-1]
            if "error" in r:
                print(f"{r['case']}: FAILED: {r['error']} [{time.monotonic() - t0:.1f} s]", flush=True)
                continue
            print(f"{r['case']}: reference vs model {r['reference_vs_model']:.2e}"
                  + (f", device vs reference {r['device_vs_reference']:.2e}" if device else "")
                  + f" (tolerance {r['tolerance']:.0e}) {'ok' if r['ok'] else 'FAILED'} "
                  + f"[{time.monotonic() - t0:.1f} s]", flush=True)
    if a.report:
        try:
            write_atomically(a.report, json.dumps({"dry_run": a.dry_run, "results": results}, indent=2))
        except KimiInputError as e:
            return fail(e)
    bad = [r["case"] for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)} of {len(results)} within tolerance" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def _check(a: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in a.kernels.split(",") if n.strip()]
    if not names or set(names) - set(KERNELS):
        raise KimiInputError(f"--kernels {a.kernels}: expected a comma-separated subset of {', '.join(KERNELS)}")
    if a.tokens % 128:
        raise KimiInputError(f"--tokens {a.tokens}: expected a multiple of 128 (the kernel's 128-row output tiles)")
    if not Path(a.config).is_file():
        raise KimiInputError(f"--config {a.config}: not a file")
    if a.report:
        check_out_file(a.report, "--report")
    return names


def _library(path: str | None) -> Path:
    root = Path(path) if path else Path(sys.prefix) / "nxdi-cpu-src" / "nki-library"
    if not (root / "src/nkilib_src/nkilib/core/moe/moe_cte/moe_cte_torch.py").is_file():
        raise KimiInputError(f"--nki-library {root}: expected an aws-neuron/nki-library checkout (d2ad3a5), with "
                             f"src/nkilib_src/nkilib/core/moe/moe_cte/moe_cte_torch.py")
    return root


def _device():
    import torch_xla

    return torch_xla.device()


# -- nki-library's torch references, loaded from the checkout ------------------------------------------------------

class References:
    """The reference files, imported by path under a package name of their own (the SDK's nkilib stays what NxD
    imports). moe_cte_torch.py imports two names this needs help with: moe_cte_utils' module-level `nki` imports
    (real on a trn2 host; without the Neuron SDK, placeholders while the file is imported: the references are plain
    torch) and, at call time, BWMMFunc from nki-library's test tree (not installed: an enum of the same members)."""

    PACKAGE = "_check_kernels_nkilib"

    def __init__(self, root: Path):
        self.root = root / "src/nkilib_src/nkilib"
        if self.PACKAGE not in sys.modules:
            for d in [self.root, *sorted(p for p in self.root.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
                name = ".".join([self.PACKAGE, *d.relative_to(self.root).parts])
                m = types.ModuleType(name)
                m.__path__, m.__package__ = [str(d)], name
                sys.modules[name] = m
        with _nki_names():
            self.moe = importlib.import_module(f"{self.PACKAGE}.core.moe.moe_cte.moe_cte_torch")
            self.types = importlib.import_module(f"{self.PACKAGE}.core.utils.common_types")
            self.moe_utils = importlib.import_module(f"{self.PACKAGE}.core.moe.moe_cte.moe_cte_utils")
        self.topk = importlib.import_module(f"{self.PACKAGE}.core.topk.torch_ref").topk_torch_ref
        self.cumsum = importlib.import_module(f"{self.PACKAGE}.core.cumsum.cumsum_torch").cumsum_torch_ref

    def moe_cte(self, **kwargs):
        import enum

        members = ("SHARD_ON_BLOCK", "SHARD_ON_HIDDEN", "SHARD_ON_INTERMEDIATE",
                   "SHARD_ON_INTERMEDIATE_AFFINITY_ON_INTERMEDIATE", "SHARD_ON_INTERMEDIATE_HW",
                   "SHARD_ON_INTERMEDIATE_DROPPING")
        bwmm = enum.Enum("BWMMFunc", {m: i + 1 for i, m in enumerate(members)})
        name = "test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common"
        parts = name.split(".")
        saved = {".".join(parts[:i]): sys.modules.get(".".join(parts[:i])) for i in range(1, len(parts) + 1)}
        for k in saved:
            sys.modules[k] = types.ModuleType(k)
        sys.modules[name].BWMMFunc = bwmm
        try:
            return self.moe.moe_cte_torch_ref(bwmm_func=bwmm.SHARD_ON_BLOCK, **kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v


@contextmanager
def _nki_names():
    """Without the Neuron SDK, what moe_cte_utils and its imports take from `nki` at import, as placeholders."""
    try:
        from nki.isa.constants import oob_mode  # noqa: F401 -- the real SDK
        from nki.language import NKIObject  # noqa: F401
        yield
        return
    except ImportError:
        pass
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "nki" or k.startswith("nki.")}

    class Name:  # a hashable, callable stand-in for any nki name (dtypes key dicts, decorators are called)
        def __init__(self, name):
            self.name = name

        def __call__(self, *args, **kwargs):
            return self

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Name(f"{self.name}.{name}")

    class Placeholders(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            setattr(self, name, Name(f"{self.__name__}.{name}"))
            return getattr(self, name)

    nki, isa, constants, language = (Placeholders(n) for n in ("nki", "nki.isa", "nki.isa.constants", "nki.language"))
    language.NKIObject = type("NKIObject", (), {})
    nki.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    nki.isa, nki.language, isa.constants = isa, language, constants
    sys.modules.update({"nki": nki, "nki.isa": isa, "nki.isa.constants": constants, "nki.language": language})
    try:
        yield
    finally:
        for k in ("nki", "nki.isa", "nki.isa.constants", "nki.language"):
            sys.modules.pop(k, None)
        sys.modules.update(saved)


# -- the cases -------------------------------------------------------------------------------------------------------

def _moe_cases(cfg, a):
    yield {"kernel": "bwmm_shard_on_block", "case": f"bwmm_shard_on_block {a.tokens} tokens", "build": _moe_call,
           "cfg": cfg, "args": a}


def _topk_cases(cfg, a):
    shard = cfg.vocab_size // a.tp
    yield {"kernel": "topk", "case": f"topk {GLOBAL_TOPK} of [{a.batch}, {shard}] unsorted", "shape": (a.batch, shard),
           "k": GLOBAL_TOPK, "sorted": False}
    gathered = a.tp * min(GLOBAL_TOPK, shard)
    yield {"kernel": "topk", "case": f"topk {GLOBAL_TOPK} of [{a.batch}, {gathered}] sorted",
           "shape": (a.batch, gathered), "k": GLOBAL_TOPK, "sorted": True}


def _cumsum_cases(cfg, a):
    yield {"kernel": "cumsum", "case": f"cumsum of [{a.batch}, {GLOBAL_TOPK}]", "shape": (a.batch, GLOBAL_TOPK)}


CASES = {"bwmm_shard_on_block": _moe_cases, "topk": _topk_cases, "cumsum": _cumsum_cases}


def _moe_call(cfg, a):
    """(the core's routed experts, hidden states, the kernel's arguments as NxD passes them) at one rank's shapes:
    a random router and random experts, NxD's block count and its own token-to-block mapping."""
    import dataclasses

    import torch
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    from kimi_k2_neuron.model.moe import MoE
    from kimi_k2_neuron.neuron import moe_paths
    from kimi_k2_neuron.parallel import SINGLE

    rank = dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size // a.tp)
    g = torch.manual_seed(SEED)
    moe = MoE(rank, torch.float32, SINGLE)
    moe.shared_experts = None  # the kernel computes the routed experts only
    with torch.no_grad():  # the layers are allocated, not initialised
        moe.gate.weight.normal_(0, rank.hidden_size ** -0.5, generator=g)
        moe.gate.e_score_correction_bias.normal_(0, 0.1, generator=g)
        for e in moe.experts:  # bf16-exact, as the kernel gets them
            for lin in (e.gate_proj, e.up_proj, e.down_proj):
                lin.weight.normal_(0, lin.weight.shape[1] ** -0.5, generator=g)
                lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    x = torch.randn(a.tokens, rank.hidden_size, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        weights, ids = moe.gate(x.float())
    e, block = rank.n_routed_experts, moe_paths.MODES["shard-on-block"].block_size
    affinities = torch.zeros(a.tokens, e).scatter(1, ids, weights).to(torch.bfloat16)
    blocks = moe_paths.blockwise_blocks(rank, a.tokens, 1, block)
    b2e, rows = ExpertMLPsV2.get_blockwise_expert_and_token_mapping(
        total_tokens=a.tokens, num_blocks=blocks, expert_mask=(affinities != 0).long(), expert_index=ids,
        block_size=block, device=x.device, enable_spmd_rank=False, spmd_rank=None,
        tensor_parallel_group=types.SimpleNamespace(size=lambda: 1))
    kw = {"hidden_states": x, "expert_affinities_masked": affinities.view(-1, 1),
          "gate_up_proj_weight": torch.stack([torch.stack([m.gate_proj.weight.t(), m.up_proj.weight.t()], 1)
                                              for m in moe.experts]).to(torch.bfloat16),
          "down_proj_weight": torch.stack([m.down_proj.weight.t() for m in moe.experts]).to(torch.bfloat16),
          "block_size": block, "token_position_to_id": rows.to(torch.int32), "block_to_expert": b2e.to(torch.int32)}
    return moe, x, kw


def _error(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max())


def guarded(case: dict, refs: References, device) -> dict:
    """run_case, an exception (a kernel's assert, a device fault) reported as the case's failure, in one line."""
    try:
        return run_case(case, refs, device)
    except Exception as e:  # noqa: BLE001 -- whatever the case raised: the next cases still run
        message = " ".join(f"{type(e).__name__}: {e}".split())
        return {"case": case["case"], "kernel": case["kernel"], "tolerance": TOLERANCE[case["kernel"]], "ok": False,
                "error": message[:500]}


def run_case(case: dict, refs: References, device) -> dict:
    import torch

    name, tol = case["kernel"], TOLERANCE[case["kernel"]]
    out = {"case": case["case"], "kernel": name, "tolerance": tol}
    if name == "bwmm_shard_on_block":
        moe, x, kw = case["build"](case["cfg"], case["args"])
        with torch.no_grad():
            want = moe(x.float())
        stand_in = ReferenceKernel(refs, top_k=case["cfg"].num_experts_per_tok)
        reference = through_nxd(kw, stand_in)
        out["reference_vs_model"] = _error(reference, want)
        out["wrapper"] = f"{WRAPPER[0]}.{WRAPPER[1]}"
        out["kernel_call"] = stand_in.calls[-1]
        if device is not None:
            out["device_vs_reference"] = _error(through_nxd(kw, None, device).cpu(), reference)
    else:
        g = torch.Generator().manual_seed(SEED)
        x = torch.randn(case["shape"], generator=g)
        if name == "topk":
            config = types.SimpleNamespace(topk_config=types.SimpleNamespace(k=case["k"], sorted=case["sorted"]))
            reference = refs.topk(x, config)["topk_values"]
            want = torch.topk(x, case["k"], dim=-1, sorted=case["sorted"]).values
            # unsorted: the same set, in whatever order
            pair = (reference, want) if case["sorted"] else (reference.sort(-1).values, want.sort(-1).values)
            out["reference_vs_model"] = _error(*pair)
            if device is not None:
                got = _device_topk(x, case["k"], case["sorted"], device)
                pair = (got, reference) if case["sorted"] else (got.sort(-1).values, reference.sort(-1).values)
                out["device_vs_reference"] = _error(*pair)
        else:
            x = torch.softmax(x, -1)  # probabilities, as the sampler's
            reference = refs.cumsum(x, axis=1)["output_0"]
            out["reference_vs_model"] = _error(reference, torch.cumsum(x, dim=1))
            if device is not None:
                out["device_vs_reference"] = _error(_device_cumsum(x, device), reference)
    out["ok"] = all(out[k] <= tol for k in ("reference_vs_model", "device_vs_reference") if k in out)
    return out


# -- the kernels on the device, called as NxD and NxDI call them ---------------------------------------------------

WRAPPER = ("neuronx_distributed.modules.moe.blockwise", "_call_bwmm_shard_on_block_kernel")
KERNEL = "_bwmm_shard_on_block_nki_call"  # the wrapper's kernel: import_nki_beta2's nki.jit(..., mode='torchxla')


def through_nxd(kw: dict, stand_in=None, device=None):
    """The routed experts through NxD's wrapper as BlockwiseMatmulNKIFunc calls it for Kimi's shard-on-block mode
    (moe_paths.MODES: block 128, PING_PONG, skip_dma_token; the activation NxD's ExpertMLPsV2 derives from SiLU and
    GLU; top-k > 1: accumulating): the kernel NxD imported on a device, else `stand_in` for it during the call."""
    import torch
    from neuronx_distributed.modules.moe import blockwise as bw
    from neuronx_distributed.modules.moe.model_utils import ACTFunc, GLUType, get_kernel_activation_func_id

    def on(t):
        return t.to(device) if device is not None else t

    args = bw.BlockwiseMatmulArgs(
        hidden_states=on(kw["hidden_states"]), expert_affinities_masked=on(kw["expert_affinities_masked"]),
        gate_up_proj_weight=on(kw["gate_up_proj_weight"]), down_proj_weight=on(kw["down_proj_weight"]),
        token_position_to_id=on(kw["token_position_to_id"]), block_to_expert=on(kw["block_to_expert"]),
        block_size=kw["block_size"], skip_dma=bw.SkipMode(True, False), is_tensor_update_accumulating=True,
        expert_affinities_scaling_mode=bw.ExpertAffinityScaleMode.POST_SCALE,
        block_sharding_strategy=bw.BlockShardStrategy.PING_PONG, dtype=torch.bfloat16,
        kernel_act_fn=bw.ActivationFunction(get_kernel_activation_func_id(ACTFunc.SILU, GLUType.GLU)))
    wrapper = getattr(importlib.import_module(WRAPPER[0]), WRAPPER[1])
    if stand_in is None:
        return wrapper(args)
    saved = getattr(bw, KERNEL)
    setattr(bw, KERNEL, stand_in)
    try:
        return wrapper(args)
    finally:
        setattr(bw, KERNEL, saved)


class ReferenceKernel:
    """Stands in for NxD's kernel object during one wrapper call on CPU: `kernel[grid](**kwargs)` computes
    nki-library's moe_cte torch reference from exactly the keyword arguments the wrapper passes (NxD's nkilib enums
    read by name, nki's compute dtype as the torch one), and records the call. A keyword the reference does not take
    fails the case."""

    def __init__(self, refs: References, top_k: int):
        self.refs, self.top_k, self.calls = refs, top_k, []

    def __getitem__(self, grid):
        def call(**kwargs):
            import inspect

            self.calls.append({"grid": str(grid), "arguments": sorted(kwargs)})
            taken = inspect.signature(self.refs.moe.moe_cte_torch_ref).parameters
            extra = sorted(set(kwargs) - set(taken))
            if extra:
                raise TypeError(f"the wrapper passes {', '.join(extra)}, which nki-library's moe_cte reference "
                                f"does not take")
            args = {k: self._translate(v) for k, v in kwargs.items()}
            lnc = int(getattr(grid, "value", grid)) if str(getattr(grid, "value", grid)).isdigit() else 2
            return self.refs.moe_cte(**args, lnc_degree=lnc, top_k=self.top_k)["output"]
        return call

    def _translate(self, value):
        import enum

        import torch

        if isinstance(value, enum.Enum):
            for module in (self.refs.types, self.refs.moe_utils):
                cls = getattr(module, type(value).__name__, None)
                if cls is not None:
                    return cls[value.name]
        if type(value).__name__ == "SkipMode":
            return self.refs.moe_utils.SkipMode(bool(value.skip_token), bool(value.skip_weight))
        if isinstance(value, torch.Tensor) or value is None or isinstance(value, (int, float, bool)):
            return value
        return getattr(torch, str(getattr(value, "name", value)).split(".")[-1], value)  # nki.language dtypes


def _device_topk(x, k: int, sorted_flag: bool, device):
    """NxD operators/topk.py's nki_topk[lnc](t, k, sorted_flag=...), LNC=2."""
    from nkilib.core.topk import topk

    values, _ = topk[2](x.to(device), k, sorted_flag=sorted_flag)
    return values.cpu()


def _device_cumsum(x, device):
    """NxDI sampling.py's nki_cumsum(t, axis=1)."""
    from nkilib.core.cumsum.cumsum import cumsum

    return cumsum(x.to(device), axis=1).cpu()


if __name__ == "__main__":
    sys.exit(run_command(main))
