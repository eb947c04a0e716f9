"""Helpers of the nxdi-cpu tier (imported by its test modules; conftest.py holds the fixtures)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def oracle_logits(model_dir: Path, rows, prefill_len, bf16_non_experts: bool, tmp_path: Path) -> list[torch.Tensor]:
    """transformers' DeepseekV3ForCausalLM logits per row (oracle.py), run by KIMI_K2_ORACLE_PYTHON."""
    python = os.environ.get("KIMI_K2_ORACLE_PYTHON")
    if not python:
        pytest.skip("KIMI_K2_ORACLE_PYTHON is not set: the transformers >= 5 oracle needs a Python with this "
                    "package's test extra (see conftest.py)")
    out = tmp_path / "oracle.safetensors"
    cmd = [python, str(HERE / "oracle.py"), str(model_dir), json.dumps(rows), str(prefill_len), str(out)]
    r = subprocess.run(cmd + (["--bf16-non-experts"] if bf16_non_experts else []), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(str(out))
    return [got[f"row{i}"] for i in range(len(rows))]


# CpuOptions' own fields; the rest are its RunSpec's (as the flags build it: NxDI's LNC, the prefill mode the shapes
# allow)
CPU_OWN = ("experts", "dtype", "cache_dir", "presharded", "flash_decoding_one_rank")


def cpu_options(model, **fields):
    """nxdi_cpu.options.CpuOptions of `model` with these fields, its own or its spec's."""
    from kimi_k2_neuron.neuron.spec import RunSpec
    from kimi_k2_neuron.nxdi_cpu.options import CpuOptions

    own = {k: fields.pop(k) for k in CPU_OWN if k in fields}
    return CpuOptions(model=str(model), spec=RunSpec(lnc=None, moe_prefill=None, **fields), **own)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def replicated_run(model: str, job, rows, prefill, out_dir: Path):
    """job(0, o, rows, prefill, str(out_dir)) at TP=1 over NxDI's replicated cache, for the reference the sharded
    caches are compared with; the job saves its cache to out_dir/rank0.safetensors -> (its result, that cache)."""
    from kimi_k2_neuron.nxdi_cpu import backend  # NxD/NxDI at import: only where a test runs the model

    o = backend.prepare(cpu_options(model), max(map(len, rows)), len(rows))
    return backend.run(o, job, rows, prefill, str(out_dir)), load_file(Path(out_dir) / "rank0.safetensors")


# -- the device-only ops the tier stands in: Argmax, DynamicUpdateSlice (device_ops/sitecustomize.py) ---------------

DEVICE_OPS = HERE / "device_ops"


def with_device_ops(env: dict) -> dict:
    """`env` for a child process whose Python stands in torch_neuronx's Argmax and DynamicUpdateSlice
    (device_ops/sitecustomize.py)."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(DEVICE_OPS), env.get("PYTHONPATH", "")) if p)}


def stand_in_device_ops():
    """The same stand-ins in this process (and the ranks it spawns, which inherit PYTHONPATH) -> their module
    (scripts/nxdi_cpu_tier/device_ops.py)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("nxdi_cpu_device_ops", DEVICE_OPS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.patch_loaded()
    os.environ["PYTHONPATH"] = with_device_ops(dict(os.environ))["PYTHONPATH"]
    return sys.modules.setdefault("nxdi_cpu_device_ops", module)._ops()
