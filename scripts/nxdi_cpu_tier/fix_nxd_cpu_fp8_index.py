"""Fix NxD's QuantizedExpertFusedColumnParallel.forward for CPU mode, in an unpacked NxD source tree.

    python fix_nxd_cpu_fp8_index.py NXD_DIR      # NXD_DIR holds src/neuronx_distributed/

On CPU, torch cannot index a float8 tensor ("index_cpu" not implemented for 'Float8_e4m3fn'). NxD (fbac349,
Release 2.29) knows it: its forward picks the selected experts' weights through an int8 view when cpu_mode() is on,
and then indexes self.weight and self.scale a second time, directly, which undoes that and fails on CPU (on the
device the second indexing is only redundant). This deletes the second indexing (its two assignments), which leaves
the weights the CPU-safe branch picked. Only CPU mode reaches the failing line; a real SDK install still has it.
Idempotent: a tree already fixed is left as it is; a tree whose forward looks otherwise is refused (exit 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

FILE = "src/neuronx_distributed/quantization/quantization_layers.py"
# The two assignments that index the float8 weight again after the int8-view branch chose `weight` and `scale`.
REDUNDANT = ("weight = self.weight[expert_indices, ...] if expert_indices is not None else self.weight",
             "scale = self.scale[expert_indices, ...] if expert_indices is not None else self.scale")
CPU_SAFE = "self.weight.view(torch.int8)[expert_indices"


def fix(nxd_dir: Path) -> str:
    path = nxd_dir / FILE
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() in REDUNDANT]
    if not hits:
        if CPU_SAFE not in "".join(lines):
            raise SystemExit(f"{path}: neither the CPU int8-view branch nor the lines to remove; another NxD?")
        return "already fixed"
    if len(hits) != 2 or hits[1] != hits[0] + 1 or CPU_SAFE not in "".join(lines[max(0, hits[0] - 15):hits[0]]):
        raise SystemExit(f"{path}: lines {[h + 1 for h in hits]} are not the two expected after the CPU branch")
    del lines[hits[0]:hits[1] + 1]
    path.write_text("".join(lines))
    return f"removed lines {hits[0] + 1}-{hits[1] + 1}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python fix_nxd_cpu_fp8_index.py NXD_DIR")
    print(f"NxD CPU float8 indexing fix: {fix(Path(sys.argv[1]))}", file=sys.stderr)
