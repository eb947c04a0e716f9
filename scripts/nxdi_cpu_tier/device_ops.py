"""Torch stand-ins for three of torch_neuronx's device ops, for the nxdi-cpu tier (test infrastructure, never on a trn2
host, where torch_neuronx is installed). write_shim.py puts this file in the import shim as _nxdi_cpu_device_ops, and
its torch_neuronx.xla_impl.ops takes the two from it; test/nxdi_cpu/device_ops installs the same in a venv whose shim
lacks them. Each computes the op's documented semantics; every other op stays refused.

- Argmax, which NxD's greedy speculation calls directly (NxD operators/argmax.py; NXD_CPU_MODE.md: fused-spec-cpu):
  torch.argmax with the op's arguments (tensor, dim, keepdim), as NxD's docstring gives them.
- xla_hlo_call for the one HLO NxDI's KV-cache writes build with it, DynamicUpdateSlice (NxDI modules/kvcache/
  utils.py: fill_prefix, dynamic_update_slice; the chunk submodel's write, NXDI_CONTRACT.md: chunk-write), so those
  graphs run and trace on torch_xla's CPU device: the update written at XLA's clamped start indices, in torch ops with
  no host sync (test/nxdi_cpu/test_device_ops.py holds it to NxDI's own CPU-mode branch); and Rng with XLA's uniform
  distribution (1) over [minimum, maximum), which NxDI's rand_like builds for the fused speculation's sampled
  acceptance (NxDI modules/generation/sampling.py rand_like; NXD_CPU_MODE.md: fused-spec-cpu): torch.rand on torch's
  generator, so ranks seeded alike draw alike, as one device program does. Any other HLO raises, naming it.
"""

import functools

import torch


class Argmax:
    @staticmethod
    def apply(tensor, dim, keepdim=False):
        return torch.argmax(tensor, dim=dim, keepdim=keepdim)


def dynamic_update_slice(operand, update, starts):
    """XLA's DynamicUpdateSlice: each start clamped to [0, operand - update] along its dimension, then `update`
    written there; as index_select and where, so torch_xla traces it with tensor starts and no host sync."""
    full, mask = update, None
    for d, (size, width, start) in enumerate(zip(operand.shape, update.shape, starts)):
        if size == width:
            continue
        start = torch.as_tensor(start, device=operand.device).to(torch.int64).clamp(0, size - width)
        offset = torch.arange(size, device=operand.device) - start
        full = full.index_select(d, offset.clamp(0, width - 1))
        shape = [1] * operand.dim()
        shape[d] = size
        inside = ((offset >= 0) & (offset < width)).view(shape)
        mask = inside if mask is None else mask & inside
    return full.clone() if mask is None else torch.where(mask, full, operand)


class _Hlo:
    """What an xla_hlo_call function is handed for a tensor (its .dtype, .sizes, .scribe), and what it returns."""

    def __init__(self, tensor):
        self.tensor = tensor

    @property
    def sizes(self):
        return tuple(self.tensor.shape)

    @property
    def dtype(self):
        return _Type(self.tensor.device, self.tensor.dtype)

    @property
    def scribe(self):
        return _Scribe(self.tensor.device)


class _Scribe:
    def __init__(self, device):
        self.device = device

    def __getattr__(self, name):  # scribe.u32, scribe.s32, ...
        return _Type(self.device)


class _Type:
    def __init__(self, device, dtype=None, shape=None):
        self.device, self.torch_dtype, self.shape = device, dtype, shape

    def __getitem__(self, shape):  # dtype[shape].Op(...)
        return _Type(self.device, self.torch_dtype, tuple(shape))

    def Constant(self, constant_value):  # noqa: N802 -- the scribe's name
        return _Hlo(torch.tensor(constant_value, device=self.device))

    def DynamicUpdateSlice(self, operand, update, *starts):  # noqa: N802
        return _Hlo(dynamic_update_slice(operand.tensor, update.tensor, [s.tensor for s in starts]))

    def Rng(self, minimum, maximum, distribution):  # noqa: N802
        if distribution != 1:
            raise NotImplementedError(f"torch_neuronx xla_hlo_call Rng distribution={distribution}: the nxdi-cpu "
                                      f"tier's stand-in computes the uniform one (1) only")
        low, high = minimum.tensor, maximum.tensor
        draw = torch.rand(self.shape, dtype=self.torch_dtype or torch.float32, device=self.device)
        return _Hlo(low + (high - low) * draw)

    def __getattr__(self, name):
        raise NotImplementedError(f"torch_neuronx xla_hlo_call {name}: the nxdi-cpu tier's stand-in "
                                  f"(test/nxdi_cpu/device_ops) computes DynamicUpdateSlice and Rng only")


def xla_hlo_call(function):
    @functools.wraps(function)
    def call(*args):
        wrap = [_Hlo(a) if isinstance(a, torch.Tensor) else a for a in args]
        return function(*wrap).tensor

    return call
