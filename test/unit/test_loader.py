"""The shell's loader without NxD/NxDI: a safetensors checkpoint memory-mapped tensor by tensor; a raw one refused."""

from __future__ import annotations


import torch
from safetensors.torch import load_file

from kimi_k2_neuron.neuron import loader


def test_mmap_checkpoint_reads_what_safetensors_reads(tiny_dirs):
    """A 3-shard checkpoint with an index and FP8, float32 and bf16 tensors (the tiny FP8 one)."""
    d = tiny_dirs["fp8"]
    got = loader.mmap_checkpoint(d)
    want = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))


def test_a_raw_checkpoint_is_refused_with_the_command_that_converts_it(tiny_dirs, one_line_error):
    """The shell never converts: the entry points do, once, up front (kimi_k2_neuron.convert.once). A raw
    checkpoint's per-expert tensors have no place in the Neuron model."""
    from types import SimpleNamespace

    from kimi_k2_neuron.config import KimiK2Config

    nc = SimpleNamespace(quantized=True, quantization_type="blockwise_symmetric", quantization_block_size=[32, 32],
                         tp_degree=1)
    config = SimpleNamespace(neuron_config=nc, core_config=lambda: KimiK2Config.from_file(tiny_dirs["fp8"]))
    one_line_error(lambda: loader.load_neuron_state_dict(tiny_dirs["fp8"], config), str(tiny_dirs["fp8"]),
                   "per-expert HF tensors", "kimi-k2-neuron convert SRC DST --experts fp8-blockwise")