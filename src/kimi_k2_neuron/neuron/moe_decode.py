"""Which token-generation MoE path a compiled batch runs: the one the time model says is fastest (estimates).

NxD's ExpertMLPsV2 picks by a constant: selective loading while batch x top_k / E < 1.0, else every local expert
(NXDI_CONTRACT.md: moe-paths); with EP it has only the all-experts path. The time model counts what each path does
(timing.py, engines.py): selective loading reads and computes each token's top-k experts in a per-token loop;
all-experts reads every local expert once and streams it through the TensorEngine for the whole batch, then writes and
combines every expert's output. The shell then runs the chosen path through NxD's public forward_* methods
(nxd_moe.KimiExpertMLPs). Pure: no SDK.
"""

from __future__ import annotations

from dataclasses import replace

from kimi_k2_neuron.config import KimiK2Config

from .moe_paths import DECODE_PATHS
from .spec import RunSpec


def candidates(spec: RunSpec) -> tuple[str, ...]:
    """The paths NxD can run at this EP: selective loading has no EP variant (NXDI_CONTRACT.md: moe-decode)."""
    return ("all-experts",) if spec.ep > 1 else DECODE_PATHS


def fastest_plan(cfg: KimiK2Config, spec: RunSpec, port=None, c=None, longest_prompt: bool = True, turn=None):
    """fit.plan at the path of the lowest modelled decode step among those that fit (NxD's own on a tie: the one its
    threshold picks); where the spec decides it without the time model (RunSpec.decode_path: EP, a CPU run), at that
    path."""
    from .fit import plan
    from .moe_paths import nxd_decode_path
    from .timing import THIS_PORT, TRN2

    port, c = port or THIS_PORT, c or TRN2
    if spec.ep > 1 or spec.lnc is None or spec.scheme is None:
        return plan(cfg, replace(spec, moe_decode=spec.decode_path(cfg)), port, c, longest_prompt, turn)
    plans = [plan(cfg, replace(spec, moe_decode=path), port, c, longest_prompt, turn) for path in candidates(spec)]
    nxd = nxd_decode_path(cfg, spec.batch)
    return min(plans, key=lambda p: (not p.fits, round(p.decode.total_s, 9), p.decode_path != nxd))


def modelled(cfg: KimiK2Config, spec: RunSpec, port=None) -> dict[str, float]:
    """{path: the modelled decode step in seconds} for each path NxD can run at this EP."""
    from .fit import plan
    from .timing import THIS_PORT

    return {path: plan(cfg, replace(spec, moe_decode=path), port or THIS_PORT).decode.total_s
            for path in candidates(spec)}


def fastest(cfg: KimiK2Config, spec: RunSpec) -> str:
    """The path fastest_plan plans: the fastest that fits."""
    return fastest_plan(cfg, replace(spec, moe_decode=None)).decode_path
