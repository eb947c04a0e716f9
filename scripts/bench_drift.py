"""Logit drift of a conversion over several tiny models and inputs: |logits(DST) - logits(SRC)| / max |logits(SRC)|.

For each of --models tiny checkpoints (make_tiny seeds 0, 1, ...) in the --source format, converted to --experts,
and --inputs random rows of 12 tokens each (8 prefilled, 4 teacher-forced decode positions), the CPU runner's
logits of SRC and DST are compared in float32 and bfloat16; per input, the largest drift over positions. Prints,
per dtype, the range of those maxima and of the per-input medians, then every input's maximum. docs/converter.md
quotes it: a single input (test_converter.py's) says little, since the drift is set by whether a rounding moves a
router score across the top-k boundary.

  python scripts/bench_drift.py --source fp8 --experts fp8-blockwise --models 3 --inputs 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from kimi_k2_neuron.arguments import fail, integer
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.formats import SCHEMES
from kimi_k2_neuron.interrupts import run_command
from kimi_k2_neuron.launch import script_parser

ROW, PREFILL = 12, 8


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--source", choices=("fp8", "int4", "bf16"), default="fp8", help="the tiny checkpoints' format")
    p.add_argument("--experts", choices=SCHEMES, default="fp8-blockwise", help="the expert scheme converted to")
    p.add_argument("--models", type=integer(1), default=3, metavar="N", help="tiny checkpoints (seeds 0..N-1)")
    p.add_argument("--inputs", type=integer(1), default=8, metavar="N", help="random rows per checkpoint")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_drift.") as root:
            results = measure(Path(root), a)
    except KimiInputError as e:
        return fail(e)
    for dtype, rows in results.items():
        maxima, medians = [m for m, _ in rows], [m for _, m in rows]
        print(f"{dtype}: per-input max {min(maxima):.2e} .. {max(maxima):.2e} (median {statistics.median(maxima):.2e});"
              f" per-input median {min(medians):.2e} .. {max(medians):.2e}; {len(rows)} inputs")
        print("  " + " ".join(f"{m:.1e}" for m in maxima))
    return 0


def measure(root: Path, a: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    import torch

    from kimi_k2_neuron.convert import convert
    from kimi_k2_neuron.runtime.runner import CpuRunner
    from kimi_k2_neuron.tiny.checkpoint import make_tiny

    out: dict[str, list[tuple[float, float]]] = {}
    for seed in range(a.models):
        src = make_tiny(root / f"src-{seed}", quant=a.source, seed=seed)
        dst = root / f"dst-{seed}"
        convert(src, dst, a.experts, progress=False)
        g = torch.Generator().manual_seed(100 + seed)
        rows = [torch.randint(0, 512, (ROW,), generator=g).tolist() for _ in range(a.inputs)]
        for dtype in (torch.float32, torch.bfloat16):
            ref_runner, runner = CpuRunner(src, dtype=dtype), CpuRunner(dst, dtype=dtype)
            for row in rows:
                ref = ref_runner.logits([row], prefill_len=PREFILL)
                per_pos = ((runner.logits([row], prefill_len=PREFILL) - ref).abs().amax(-1) / ref.abs().max())[0]
                out.setdefault(str(dtype).removeprefix("torch."), []).append(
                    (float(per_pos.max()), float(per_pos.median())))
    return out


if __name__ == "__main__":
    sys.exit(run_command(main))
