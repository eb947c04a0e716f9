"""Which token-generation MoE path a compiled batch runs: the one the time model says is fastest (estimates).

NxD's ExpertMLPsV2 picks by a constant: selective loading while batch x top_k / E < 1.0, else every local expert
(NXDI_CONTRACT.md: moe-paths); with EP it has only the all-experts path. The time model counts what each path does
(timing.py, engines.py): selective loading reads and computes each token's top-k experts in a per-token loop;
all-experts reads every local expert once and streams it through the TensorEngine for the whole batch, then writes and
combines every expert's output. The planner (fit.plan) plans a spec without --moe-decode at the fastest path that
fits; the shell then runs the chosen path through NxD's public forward_* methods (nxd_moe.KimiExpertMLPs). Pure: no
SDK.
"""

from __future__ import annotations

from dataclasses import replace

from kimi_k2_neuron.config import KimiK2Config

from .fit import plan
from .moe_paths import decode_candidates
from .spec import RunSpec
from .timing import THIS_PORT


def choose(cfg: KimiK2Config, spec: RunSpec) -> str:
    """The path a build of this spec runs: the spec's own (RunSpec.decode_path: --moe-decode, EP, NxD's CPU mode),
    else the planner's, the fastest that fits."""
    return spec.decode_path(cfg) or plan(cfg, spec).decode_path


def modelled(cfg: KimiK2Config, spec: RunSpec, port=None) -> dict[str, float]:
    """{path: the modelled decode step in seconds} for each path NxD can run at this EP."""
    return {path: plan(cfg, replace(spec, moe_decode=path), port or THIS_PORT).decode.total_s
            for path in decode_candidates(spec.ep)}
