"""The tier's stand-ins for torch_neuronx's device ops (scripts/nxdi_cpu_tier/device_ops.py) against NxDI's own code: its
DynamicUpdateSlice, through NxDI's dynamic_update_slice and fill_prefix with torch_xla's device, equals the update
NxDI's CPU-mode branch of the same functions writes (modules/kvcache/utils.py), and traces with no host sync; its Rng,
through NxDI's own rand_like (the fused step's sampled acceptance), draws XLA's uniform [0, 1) in the tensor's shape and
dtype from torch's generator."""

import pytest
import torch
from nxdi_support import stand_in_device_ops

from kimi_k2_neuron.nxdi_cpu import backend


@pytest.fixture(scope="module")
def utils():
    stand_in_device_ops()
    from neuronx_distributed_inference.modules.kvcache import utils

    return utils


CASES = [  # cache [lines, heads, T, D], update, start (in range: XLA's clamp and NxDI's CPU branch agree there)
    ((3, 1, 16, 8), (1, 1, 4, 8), (2, 0, 12, 0)),
    ((3, 1, 16, 8), (1, 1, 4, 8), (0, 0, 0, 0)),
    ((2, 2, 32, 4), (1, 2, 8, 4), (1, 0, 5, 0)),
    ((4, 1, 16, 8), (4, 1, 16, 8), (0, 0, 0, 0)),
]


@pytest.mark.parametrize("cache_shape,update_shape,start", CASES)
def test_dynamic_update_slice_equals_nxdis_cpu_branch(utils, cache_shape, update_shape, start):
    import torch_xla

    torch.manual_seed(0)
    cache, update = torch.randn(cache_shape), torch.randn(update_shape)
    starts = [torch.tensor(s, dtype=torch.int32) for s in start]
    with backend.nxd_cpu_mode(True):
        want = utils.dynamic_update_slice(cache.clone(), update, [int(s) for s in start])
    with backend.nxd_cpu_mode(False):
        device = torch_xla.device()
        got = utils.dynamic_update_slice(cache.to(device), update.to(device), [s.to(device) for s in starts])
        assert torch.equal(got.cpu(), want)
        got = utils.dynamic_update_slice(cache, update, starts)  # eager, on the host
        assert torch.equal(got, want)


def test_fill_prefix_equals_nxdis_cpu_branch(utils):
    torch.manual_seed(1)
    cache, prefix = torch.randn(2, 1, 16, 8), torch.randn(2, 1, 6, 8)
    with backend.nxd_cpu_mode(True):
        want = utils.fill_prefix(cache.clone(), prefix)
    with backend.nxd_cpu_mode(False):
        assert torch.equal(utils.fill_prefix(cache.clone(), prefix), want)


def test_a_start_past_the_end_is_clamped_as_xla_specifies():
    """XLA's DynamicUpdateSlice clamps each start to [0, operand - update] (openxla.org operation semantics); NxDI's
    CPU branch truncates instead, so this one is held to the spec's words."""
    dynamic_update_slice = stand_in_device_ops().dynamic_update_slice
    cache, update = torch.zeros(1, 10), torch.ones(1, 4)
    got = dynamic_update_slice(cache, update, [torch.tensor(0), torch.tensor(9)])
    assert got[0].tolist() == [0.0] * 6 + [1.0] * 4


def test_rng_is_nxdis_rand_like_uniform_draw():
    """NxDI's rand_like (modules/generation/sampling.py) under the stand-in: XLA's Rng(0, 1, distribution=1)."""
    ops = stand_in_device_ops()
    from neuronx_distributed_inference.modules.generation import sampling

    raw = getattr(sampling.rand_like, "__wrapped__", None)
    if raw is None:
        pytest.skip("this venv's torch_neuronx shim does not wrap rand_like with functools.wraps")
    draw = ops.xla_hlo_call(raw)
    torch.manual_seed(3)
    x = draw(torch.zeros(4, 5))
    torch.manual_seed(3)
    assert torch.equal(draw(torch.zeros(4, 5)), x)  # torch's generator: ranks seeded alike draw alike
    assert x.shape == (4, 5) and x.dtype == torch.float32 and bool(((x >= 0) & (x < 1)).all())
    many = draw(torch.zeros(20000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005
