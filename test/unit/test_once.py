"""convert/once.py: a raw checkpoint converted once into a sibling folder where a converted one is needed."""

from __future__ import annotations

import shutil

from kimi_k2_neuron.convert import converted_dir_for, ensure_converted
from kimi_k2_neuron.formats.record import ConversionRecord


def test_a_raw_checkpoint_is_converted_once_into_a_sibling_folder(tiny_dirs, tmp_path):
    raw = tmp_path / "kimi"
    shutil.copytree(tiny_dirs["fp8"], raw)
    dst, record = ensure_converted(raw, "fp8-per-channel", workers=1)
    assert dst == converted_dir_for(raw, "fp8-per-channel") == tmp_path / "kimi-neuron-fp8-per-channel"
    assert record == ConversionRecord.read(dst) and record.experts == "fp8-per-channel"
    stamp = (dst / "config.json").stat().st_mtime_ns
    assert ensure_converted(raw, "fp8-per-channel")[0] == dst and (dst / "config.json").stat().st_mtime_ns == stamp
    assert ensure_converted(dst, "fp8-per-channel") == (dst, record)  # already converted: used as is


def test_a_conversion_of_another_checkpoint_at_the_same_path_is_not_reused(tiny_dirs, tmp_path, one_line_error):
    raw = tmp_path / "kimi"
    shutil.copytree(tiny_dirs["fp8"], raw)
    dst, _ = ensure_converted(raw, "fp8-blockwise", workers=1)
    shutil.rmtree(raw)
    shutil.copytree(tiny_dirs["int4"], raw)  # another checkpoint, downloaded to the same folder
    one_line_error(lambda: ensure_converted(raw, "fp8-blockwise"), str(dst), "holds another conversion")
