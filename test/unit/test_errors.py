"""errors.py's helpers: what a bad environment variable or path says, in one line."""

from __future__ import annotations

import os

from kimi_k2_neuron.errors import env_int, special_file


def test_an_integer_environment_variable_that_is_not_one_is_one_line(monkeypatch, one_line_error):
    """NEURON_COMBINE_KV_ALLOCATIONS=yes, WORLD_SIZE=two, PT_XLA_DEBUG_LEVEL=high: int() raised a ValueError
    traceback from inside a build (latent_cache.py, cpu_mode.py, xla_trace.py read them through env_int)."""
    monkeypatch.delenv("KIMI_TEST_INT", raising=False)
    assert env_int("KIMI_TEST_INT", 3) == 3
    monkeypatch.setenv("KIMI_TEST_INT", " ")
    assert env_int("KIMI_TEST_INT", 3) == 3
    monkeypatch.setenv("KIMI_TEST_INT", " 7 ")
    assert env_int("KIMI_TEST_INT", 3) == 7
    monkeypatch.setenv("KIMI_TEST_INT", "yes")
    one_line_error(lambda: env_int("KIMI_TEST_INT", 0), "environment variable KIMI_TEST_INT='yes': expected an integer")


def test_special_file_names_nodes_only(tmp_path):
    os.mkfifo(tmp_path / "f")
    (tmp_path / "r").write_text("")
    assert special_file("/dev/null") == "a character device" and special_file(tmp_path / "f") == "a FIFO"
    assert special_file(tmp_path / "r") is None and special_file(tmp_path) is None
    assert special_file(tmp_path / "missing") is None
