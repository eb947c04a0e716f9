"""Tensor parallelism through NxD's real parallel layers over gloo, and NxD's real pre-sharding.

TP ranks are separate processes (kimi_k2_neuron.runtime.ranks); rank 0's logits come back. The collectives are gloo's,
not Neuron's: this checks sharding and the model's use of NxD's layers, not the device's collectives.
"""

import dataclasses
import subprocess
import sys

import pytest
from safetensors import safe_open

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.neuron import cpu
from nxdi_support import rel_err

ROWS = [[5, 17, 300, 42, 256, 9, 77, 123, 8, 511], [400, 3, 3, 3, 260, 100]]
PREFILL = 4

pytestmark = pytest.mark.fp8_selective_cpu


def _tp1(opts):
    return cpu.logits(dataclasses.replace(opts, tp=1, presharded=None), ROWS, PREFILL)[0]


def _close(a, b):
    for r, row in enumerate(ROWS):
        assert rel_err(a[r, :len(row)], b[r, :len(row)]) < 1e-4, f"row {r}"


@pytest.mark.parametrize("scheme", ["fp8-blockwise", "fp8-per-channel"])
def test_tp2_equals_tp1(converted, scheme):
    o = cpu.CpuOptions(model=str(converted[("fp8", scheme)]), tp=2)
    got, report = cpu.logits(o, ROWS, PREFILL)
    _close(got, _tp1(o))
    assert "context_encoding_model: all-experts" in report and "token_generation_model: selective-loading" in report


# ModelBuilder refuses a torch_neuronx without __version__ (model_builder.py:461); the nxdi-cpu import shim has none,
# a real torch-neuronx has it. Test-side only: the product never touches torch_neuronx.
PRESHARD = """
import sys, torch_neuronx
if not hasattr(torch_neuronx, "__version__"):
    torch_neuronx.__version__ = "2 (nxdi-cpu import shim)"
from kimi_k2_neuron.neuron import cpu
cpu.preshard(cpu.CpuOptions(model=sys.argv[1], tp=int(sys.argv[2])), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
"""


def _scale_shapes(weights, rank):
    with safe_open(str(weights / f"tp{rank}_sharded_checkpoint.safetensors"), "pt") as f:
        return {k.split(".mlp.")[1]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith(".scale")
                and k.startswith("layers.1.")}


# Tiny: E=8 experts, H=192, I=64. Blockwise [32, 32] scales of gate_up [E, H, 2I/tp] and down [E, I/tp, H]; per-channel
# [E, 1, out/tp] for gate_up (columns split) and [E, 1, H] for down (rows split, every output column kept).
GATE_UP, DOWN = "expert_mlps.mlp_op.gate_up_proj.scale", "expert_mlps.mlp_op.down_proj.scale"
SCALES = {
    ("fp8-blockwise", 2): {GATE_UP: (8, 6, 2), DOWN: (8, 1, 6)},
    ("fp8-per-channel", 2): {GATE_UP: (8, 1, 64), DOWN: (8, 1, 192)},
    ("fp8-per-channel", 4): {GATE_UP: (8, 1, 32), DOWN: (8, 1, 192)},
}

@pytest.mark.parametrize("scheme,tp", list(SCALES), ids=[f"{s}-tp{t}" for s, t in SCALES])
def test_presharded_ranks_give_the_tp1_logits(converted, tmp_path, scheme, tp):
    """NxD's shard_checkpoint through our shard_weights rank passes; each rank then loads its own file, strictly."""
    ckpt = converted[("fp8", scheme)]
    r = subprocess.run([sys.executable, "-c", PRESHARD, str(ckpt), str(tp), str(tmp_path), str(max(map(len, ROWS))),
                        str(len(ROWS))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    weights = tmp_path / "weights"
    assert sorted(p.name for p in weights.iterdir()) == [f"tp{i}_sharded_checkpoint.safetensors" for i in range(tp)]
    for rank in range(tp):
        assert _scale_shapes(weights, rank) == SCALES[(scheme, tp)]
    o = cpu.CpuOptions(model=str(ckpt), tp=tp, presharded=str(weights))
    _close(cpu.logits(o, ROWS, PREFILL)[0], _tp1(o))


def test_expert_parallelism_is_refused_on_cpu_with_the_reason(converted):
    o = cpu.CpuOptions(model=str(converted[("fp8", "fp8-blockwise")]), tp=2, ep=2)
    with pytest.raises(KimiInputError, match="XLA process group's _mesh"):
        cpu.logits(o, ROWS, PREFILL)


def test_bfloat16_over_gloo_is_refused(converted):
    o = cpu.CpuOptions(model=str(converted[("fp8", "fp8-blockwise")]), tp=2, dtype="bfloat16")
    with pytest.raises(KimiInputError, match="gloo has no bfloat16"):
        cpu.logits(o, ROWS, PREFILL)
