"""The nxdi-cpu tier: the Neuron shell run through the real NxD/NxDI in NxD's CPU mode, checked against the core's
CPU runner and against transformers.

Runs wherever NxD and NxDI import: the venv `bash scripts/build_nxdi_cpu_tier.sh VENV` builds (the real sources plus
our import shim for the binary-only packages; `.ci/run` builds it), or a Neuron SDK venv on a trn2 host. Elsewhere
every test here is skipped with the reason (test_00_tier.py). Each test names the NxD/NxDI path it covers; what
exists only on device (tracing, neuronx-cc, NKI kernels, Neuron collectives, HBM) is not covered here.

KIMI_K2_ORACLE_PYTHON: a Python with this package's `test` extra (transformers >= 5), for the transformers oracle,
which cannot run beside NxDI's pinned transformers 4.57 (oracle.py runs in it as a subprocess). `.ci/run` sets it.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from kimi_k2_neuron.tiny.checkpoint import make_tiny

HERE = Path(__file__).resolve().parent


def _why_not_runnable() -> str | None:
    try:
        import kimi_k2_neuron.neuron.modeling  # noqa: F401  (its ImportError names the missing packages)
    except ImportError as e:
        return (f"NxD/NxDI not importable here ({e}); build the nxdi-cpu venv (docs/nxdi_on_cpu.md) or "
                f"use a Neuron SDK venv")
    return None


REASON = _why_not_runnable()
if REASON:  # the test modules import the SDK at the top; test_00_tier.py reports the skip
    collect_ignore = [p.name for p in HERE.glob("test_*.py") if p.name != "test_00_tier.py"]


@pytest.fixture
def tier_reason() -> str | None:
    return REASON


def nxd_has_cpu_fp8_index_fix() -> bool:
    """NxD 2.29's QuantizedExpertFusedColumnParallel.forward re-indexes float8 weights after its CPU int8-view
    workaround (quantization_layers.py:1147-1148); the nxdi-cpu venv removes those two lines
    (scripts/nxdi_cpu_tier/fix_nxd_cpu_fp8_index.py). Without the fix FP8 selective loading fails in CPU mode."""
    from neuronx_distributed.quantization.quantization_layers import QuantizedExpertFusedColumnParallel

    return "weight = self.weight[expert_indices, ...]" not in inspect.getsource(
        QuantizedExpertFusedColumnParallel.forward)


@pytest.fixture(autouse=True)
def _needs_fp8_index_fix(request):
    if request.node.get_closest_marker("fp8_selective_cpu") and not nxd_has_cpu_fp8_index_fix():
        pytest.skip("this NxD lacks the CPU FP8 indexing fix (scripts/nxdi_cpu_tier/fix_nxd_cpu_fp8_index.py): FP8 "
                    "selective loading fails in its CPU mode")


def pytest_configure(config):
    config.addinivalue_line("markers", "fp8_selective_cpu: runs NxD's FP8 selective loading in CPU mode")


@pytest.fixture
def env(tmp_path):
    """A user's environment: this process's torch.distributed and NxD CPU-mode variables (set by in-process builds)
    left out."""
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NXD_CPU_MODE")}
    return {**inherited, "KIMI_K2_NEURON_CACHE": str(tmp_path / "cache")}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """One tiny raw checkpoint per storage format (FP8 blockwise, INT4 compressed-tensors, BF16)."""
    root = tmp_path_factory.mktemp("tiny")
    return {q: make_tiny(root / q, quant=q, shards=3, seed=0) for q in ("fp8", "int4", "bf16")}


@pytest.fixture(scope="session")
def converted(tiny, tmp_path_factory):
    """(source format, expert scheme) -> the converted checkpoint, made once."""
    from kimi_k2_neuron.convert import convert

    root = tmp_path_factory.mktemp("converted")
    out = {}
    for q, src in tiny.items():
        for scheme in ("fp8-blockwise", "fp8-per-channel"):
            out[(q, scheme)] = root / f"{q}-{scheme}"
            convert(src, out[(q, scheme)], scheme, progress=False)
    return out


@pytest.fixture(scope="session")
def per_channel(converted) -> str:
    """The FP8 source converted to fp8-per-channel: its scales shard 4 ways (blockwise's only 2), as TP=4 needs."""
    return str(converted[("fp8", "fp8-per-channel")])
