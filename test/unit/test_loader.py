"""The shell's loader without NxD/NxDI: a safetensors checkpoint memory-mapped tensor by tensor, and a raw checkpoint
converted once into a sibling folder."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from kimi_k2_neuron.formats.record import ConversionRecord
from kimi_k2_neuron.neuron import loader


def test_mmap_checkpoint_reads_what_safetensors_reads(tiny_dirs):
    """A 3-shard checkpoint with an index and FP8, float32 and bf16 tensors (the tiny FP8 one)."""
    d = tiny_dirs["fp8"]
    got = loader.mmap_checkpoint(d)
    want = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))


def test_a_raw_checkpoint_is_converted_once_into_a_sibling_folder(tiny_dirs, tmp_path):
    raw = tmp_path / "kimi"
    shutil.copytree(tiny_dirs["fp8"], raw)
    dst = loader.ensure_converted(raw, "fp8-per-channel", workers=1)
    assert dst == loader.converted_dir_for(raw, "fp8-per-channel") == tmp_path / "kimi-neuron-fp8-per-channel"
    assert ConversionRecord.read(dst).experts == "fp8-per-channel"
    stamp = (dst / "config.json").stat().st_mtime_ns
    assert loader.ensure_converted(raw, "fp8-per-channel") == dst and (dst / "config.json").stat().st_mtime_ns == stamp
    assert loader.ensure_converted(dst, "fp8-per-channel") == dst  # already converted: used as is


def test_a_conversion_of_another_checkpoint_at_the_same_path_is_not_reused(tiny_dirs, tmp_path, one_line_error):
    raw = tmp_path / "kimi"
    shutil.copytree(tiny_dirs["fp8"], raw)
    dst = loader.ensure_converted(raw, "fp8-blockwise", workers=1)
    shutil.rmtree(raw)
    shutil.copytree(tiny_dirs["int4"], raw)  # another checkpoint, downloaded to the same folder
    one_line_error(lambda: loader.ensure_converted(raw, "fp8-blockwise"), str(dst), "holds another conversion")
