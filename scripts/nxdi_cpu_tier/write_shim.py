"""Write the import shim of the nxdi-cpu tier: importable stand-ins for the Neuron SDK's binary-only packages
(torch_neuronx, neuronxcc, libneuronxla, nki, nkilib), so that the public NxD and NxDI Python sources import on a
machine without them and run in NxD's CPU mode.

    python write_shim.py DEST      # DEST: a folder to put on sys.path (the build script's .pth does)

Test infrastructure, never on a trn2 host (there the real packages are installed). What NxD/NxDI need at import
time is a name to bind; nothing of the SDK runs here, so every function, kernel and class below raises
NotImplementedError when used, naming itself, except two device ops computed in torch by their documented semantics
(device_ops.py: Argmax, which NxD's greedy speculation calls, and xla_hlo_call's DynamicUpdateSlice, NxDI's KV-cache
writes under torch_xla) and a few plain values that NxD reads on CPU: the platform target
("trn2"), torch_neuronx's version string (ModelBuilder checks it is a 2.x release), a collectives config that
initialize_model_parallel builds and only ring attention reads, the kernels' enums and dtype names, and one frozen
config record. Kernels that NxD/NxDI import inside try/except are left out on purpose, so that they take their own
"kernel not available" torch paths.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# The helpers every stand-in module imports (written as DEST/_nxdi_cpu_stand_in.py).
HELPERS = '''"""Stand-ins for the Neuron SDK's binary-only packages (kimi-k2-neuron's nxdi-cpu tier; not the SDK)."""
import enum


class NotOnCpu(NotImplementedError):
    pass


def _refuse(name):
    raise NotOnCpu(f"{name}: part of the Neuron SDK, which this CPU test venv stands in for (import only)")


def function(name):
    def refuse(*args, **kwargs):
        _refuse(name)
    refuse.__name__ = refuse.__qualname__ = name.rpartition(".")[2]
    return refuse


def klass(name):
    def __init__(self, *args, **kwargs):
        _refuse(name)
    return type(name.rpartition(".")[2], (), {"__init__": __init__, "apply": staticmethod(function(name + ".apply"))})


class Kernel:
    """What a kernel decorator returns: indexable by a launch grid, refuses to run."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        _refuse(self.name)


def kernel_decorator(name):
    """@deco, @deco(...) and deco(...)(fn) all give a Kernel named after the function."""
    def deco(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return Kernel(f"{name}({getattr(args[0], '__name__', '?')})")
        return lambda fn: Kernel(f"{name}({getattr(fn, '__name__', '?')})")
    return deco


def enumeration(name, members):
    return enum.Enum(name, [(m, i) for i, m in enumerate(members.split())])
'''

# module -> its lines: "function NAME", "class NAME", "kernel NAME" (a kernel decorator), "enum NAME MEMBERS...", or
# any other line, which is Python written into the module as it is. A module named only as a parent is an empty
# package.
MODULES: dict[str, list[str]] = {
    "libneuronxla": ["function neuron_xla_compile"],  # no libneuronpjrt_path: torch_xla must not find a Neuron PJRT
    "neuronxcc.nki": ["kernel jit"],
    "neuronxcc.nki.language": [
        "from types import SimpleNamespace",
        "tile_size = SimpleNamespace(pmax=128, psum_fmax=512, gemm_stationary_fmax=128, gemm_moving_fmax=512)",
        "bfloat16, float16, float32 = 'bfloat16', 'float16', 'float32'",
    ],
    "neuronxcc.nki.kernels.attention": ["class FlashConfig", "function attention_isa_kernel"],
    "neuronxcc.nki.compiler.backends.neuron.dimensions": ["function VNC"],
    # initialize_model_parallel builds one unconditionally and keeps .rank_src_tgt_pairs[rank]; only ring attention
    # (context parallelism) reads it, which this venv cannot run: no pairs
    "neuronxcc.nki._private_kernels.collectives": [
        "class CollectivesConfig:",
        "    def __init__(self, replica_groups=None, **kwargs):",
        "        self.replica_groups = replica_groups",
        "        self.rank_src_tgt_pairs = _NoPairs()",
        "class _NoPairs(dict):",
        "    def __missing__(self, rank):",
        "        return None",
    ],
    "nki": ["kernel jit"],
    "nki.isa": [],
    "nki.language": [
        "bfloat16, float16, float32, float4_e2m1fn_x4 = 'bfloat16', 'float16', 'float32', 'float4_e2m1fn_x4'",
        "class ndarray:  # annotations only",
        "    pass",
    ],
    "nkilib.core.attention.attention_cte": [],  # NxDI looks attention_cte up with getattr(..., None): absent
    "nkilib.core.cumsum.cumsum": ["function cumsum"],
    "nkilib.core.max.cascaded_max": ["function cascaded_max"],
    "nkilib.core.mlp.mlp": ["function mlp"],
    "nkilib.core.moe.moe_cte.moe_cte_utils": [
        "enum BlockShardStrategy HI_LO PING_PONG",
        "from dataclasses import dataclass",
        "@dataclass(frozen=True)",
        "class SkipMode:  # a plain settings record of the kernel's",
        "    skip_token: bool = False",
        "    skip_weight: bool = False",
    ],
    "nkilib.core.moe_block.moe_block_tkg": ["function moe_block_tkg"],
    "nkilib.core.output_projection.output_projection_cte": ["function output_projection_cte"],
    "nkilib.core.qkv.qkv": ["function qkv"],
    "nkilib.core.rmsnorm.rmsnorm_quant": ["function rmsnorm_quant_kernel", "class RmsNormQuantKernelArgs"],
    "nkilib.core.subkernels.find_nonzero_indices": ["function find_nonzero_indices"],
    "nkilib.core.subkernels.indexed_flatten": ["function indexed_flatten"],
    "nkilib.core.topk": ["function topk"],
    "nkilib.core.utils.common_types": [
        "enum ActFnType SiLU GELU GELU_Tanh_Approx Swish",
        "enum NormType NO_NORM RMS_NORM RMS_NORM_SKIP_GAMMA LAYER_NORM",
        "enum QKVOutputLayout BSD NBSd",
        "enum QuantizationType NONE ROW PER_TENSOR_SYMMETRIC PER_CHANNEL_SYMMETRIC EXPERT_WISE_PER_CHANNEL_SYMMETRIC "
        "BLOCKWISE_SYMMETRIC PER_KEY_SYMMETRIC",
        "enum RouterActFnType SIGMOID SOFTMAX",
        "enum ExpertAffinityScaleMode NO_SCALE PRE_SCALE POST_SCALE",
    ],
    "nkilib.core.utils.kernel_helpers": ["function get_verified_program_sharding_info", "function kernel_assert"],
    "nkilib.core.utils.tensor_view": ["class TensorView"],
    "nkilib.experimental.transformer.attention_block_tkg": ["function attention_block_tkg"],
    "torch_neuronx": [
        # ModelBuilder accepts a 2.x torch-neuronx; SDK 2.29's is 2.9.0.x
        "__version__ = '2.9.0+kimi-k2-nxdi-cpu'",
        "class BucketModelConfig",
        # the real package registers these TorchScript classes from C++; NxD names them in signatures at import
        "import torch as _torch",
        "from types import SimpleNamespace as _NS",
        "_torch.classes.neuron = _NS(SPMDModel=klass('torch.classes.neuron.SPMDModel'),",
        "                            LayoutTransformation=klass('torch.classes.neuron.LayoutTransformation'))",
    ],
    "torch_neuronx.experimental.profiler.v2_x.custom_op_name": ["function hlo_debug"],
    "torch_neuronx.proto.metaneff_pb2": ["class MetaNeff"],
    "torch_neuronx.pyhlo.hlo_pb2": ["class HloModuleProto", "class HloComputationProto", "class HloInstructionProto"],
    "torch_neuronx.pyhlo.xla_data_pb2": [],
    "torch_neuronx.utils": [
        "import os",
        "def get_platform_target():  # the real one asks the instance; NxD configures itself for what this says",
        "    return os.environ.get('NEURON_PLATFORM_TARGET_OVERRIDE', 'trn2')",
    ],
    "torch_neuronx.utils.utils": [
        "import torch",
        "from torch_neuronx.utils import get_platform_target",
        "SUPPORTED_TYPES = (torch.float32, torch.bfloat16, torch.float16)",
    ],
    "torch_neuronx.xla_impl.base": ["kernel xla_call", "kernel xla_hlo_call"],
    "torch_neuronx.xla_impl.bucket_trace": ["function create_bucket_model"],
    "torch_neuronx.xla_impl.custom_call_targets": [
        "AwsNeuronModuleMarkerStartForward = 'AwsNeuronModuleMarkerStartForward'",
        "AwsNeuronModuleMarkerEndForward = 'AwsNeuronModuleMarkerEndForward'",
    ],
    "torch_neuronx.xla_impl.ops": [
        # torch stand-ins for Argmax and xla_hlo_call's DynamicUpdateSlice (device_ops.py says why)
        "from _nxdi_cpu_device_ops import Argmax, xla_hlo_call  # noqa: F401",
        "class ConcatenateOp", "class RmsNorm", "class TopK",
        "_nki_jit = kernel_decorator('torch_neuronx.xla_impl.ops.nki_jit')",
        "def nki_jit(*args, **kwargs):  # NxD calls it as nki_jit()(kernel)",
        "    return _nki_jit(*args, **kwargs) if args else _nki_jit",
    ],
    "torch_neuronx.xla_impl.structure": ["class Packer"],
    "torch_neuronx.xla_impl.torchscript": ["function replace_weights"],
    "torch_neuronx.xla_impl.trace": [
        "class HloArtifacts", "class NeffArtifacts", "XLA_DTYPE_TO_METANEFF_DTYPE = {}", "function generate_neff",
        "function get_hlo_computation_by_id", "function get_hlo_root_instruction", "function get_torch_dtype",
        "function hlo_entry_computation",
    ],
}


def module_source(module: str, lines: list[str]) -> str:
    out = [f'"""Stand-in for {module} (kimi-k2-neuron nxdi-cpu tier: import only, not the Neuron SDK)."""',
           "from _nxdi_cpu_stand_in import Kernel, enumeration, function, kernel_decorator, klass  # noqa: F401"]
    for line in lines:
        kind, _, rest = line.partition(" ")
        name = rest.split(" ")[0]
        if kind == "function":
            out.append(f"{name} = function({module + '.' + name!r})")
        elif kind == "class" and rest.isidentifier():
            out.append(f"{name} = klass({module + '.' + name!r})")
        elif kind == "kernel":
            out.append(f"{name} = kernel_decorator({module + '.' + name!r})")
        elif kind == "enum":
            out.append(f"{name} = enumeration({name!r}, {rest.partition(' ')[2]!r})")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def write(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    (dest / "_nxdi_cpu_stand_in.py").write_text(HELPERS)
    shutil.copyfile(Path(__file__).with_name("device_ops.py"), dest / "_nxdi_cpu_device_ops.py")
    packages = {".".join(m.split(".")[:i]) for m in MODULES for i in range(1, m.count(".") + 1)}
    for module in sorted(packages | set(MODULES)):
        parts = module.split(".")
        is_package = module in packages
        path = dest.joinpath(*parts, "__init__.py") if is_package else dest.joinpath(*parts[:-1], parts[-1] + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(module_source(module, MODULES.get(module, [])))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python write_shim.py DEST")
    write(Path(sys.argv[1]))
