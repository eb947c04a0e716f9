"""convert/once.py: a raw checkpoint converted once, into one place ($KIMI_K2_NEURON_CACHE/converted), wherever a
converted one is needed; said before it starts, refused up front without the room."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from kimi_k2_neuron.convert import converted_dir_for, ensure_converted, once
from kimi_k2_neuron.convert.converter import planned_bytes
from kimi_k2_neuron.formats.record import ConversionRecord

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_K2_NEURON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "converted"


def test_a_raw_checkpoint_is_converted_once_into_the_cache_saying_so_first(tiny, tmp_path, cache, capsys):
    raw = tmp_path / "kimi"
    shutil.copytree(tiny["fp8"], raw)
    dst, record = ensure_converted(raw, "fp8-per-channel", workers=1)
    assert dst == converted_dir_for(raw, "fp8-per-channel") and dst.parent == cache
    assert dst.name.startswith("kimi-neuron-fp8-per-channel-")
    assert record == ConversionRecord.read(dst) and record.experts == "fp8-per-channel"
    note = capsys.readouterr().err.splitlines()[0]
    assert note.startswith(f"note: --model {raw} is a raw checkpoint: converting it once (fp8-per-channel experts, ")
    assert f"into {dst}, which every later run reuses; KIMI_K2_NEURON_CACHE moves that folder" in note
    stamp = (dst / "config.json").stat().st_mtime_ns
    assert ensure_converted(raw, "fp8-per-channel")[0] == dst and (dst / "config.json").stat().st_mtime_ns == stamp
    assert ensure_converted(dst, "fp8-per-channel") == (dst, record)  # already converted: used as is
    assert capsys.readouterr().err == ""  # reused in silence


def test_the_planned_size_is_what_convert_writes(tiny, tmp_path, cache):
    for quant in ("fp8", "int4", "bf16"):
        dst, _ = ensure_converted(tiny[quant], "fp8-blockwise", workers=1)
        written = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
        planned = planned_bytes(tiny[quant], "fp8-blockwise")
        assert planned <= written <= planned + 5 * 16384, quant  # + each file's header (5 files)


def test_without_the_room_it_is_refused_before_anything_is_written(tiny, tmp_path, cache, monkeypatch,
                                                                   one_line_error):
    monkeypatch.setattr(once.shutil, "disk_usage", lambda p: namedtuple("U", "total used free")(10**12, 0, 1000))
    line = one_line_error(lambda: ensure_converted(tiny["fp8"], "fp8-blockwise"), "--model",
                          "a raw checkpoint, to be converted once into", "GB free there; set KIMI_K2_NEURON_CACHE")
    assert "kimi-k2-neuron convert" in line and not cache.exists()


def test_a_conversion_of_another_checkpoint_at_the_same_path_is_not_reused(tiny, tmp_path, cache,
                                                                           one_line_error):
    raw = tmp_path / "kimi"
    shutil.copytree(tiny["fp8"], raw)
    dst, _ = ensure_converted(raw, "fp8-blockwise", workers=1)
    shutil.rmtree(raw)
    shutil.copytree(tiny["int4"], raw)  # another checkpoint, downloaded to the same folder
    one_line_error(lambda: ensure_converted(raw, "fp8-blockwise"), str(dst), "holds another conversion")


def test_every_tool_converts_into_the_same_place():
    """compile_and_save.py and the NxDI model on CPU (--backend nxdi-cpu, the scripts' --cpu) both take
    ensure_converted's one place: neither names another folder."""
    for path in (REPO / "scripts/compile_and_save.py", REPO / "src/kimi_k2_neuron/nxdi_cpu/backend.py"):
        text = path.read_text()
        assert "ensure_converted(" in text and "dst=" not in text.split("ensure_converted(", 1)[1].split(")")[0]
