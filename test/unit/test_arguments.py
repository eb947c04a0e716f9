"""arguments.py's output-path checks: every output (--out, DST, OUT, --report) refuses a device node, a FIFO or a
socket in one line before any work, since the atomic write's rename would replace the node (as root, /dev/null for
the whole machine)."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from kimi_k2_neuron.arguments import check_out_dir, check_out_file


def _node(tmp_path, kind: str):
    """A node of `kind` to write to: /dev/null, a FIFO or a Unix socket in tmp_path."""
    if kind == "device":
        return "/dev/null", None
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
        return str(path), None
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return str(path), sock


NODES = {"device": "a character device", "fifo": "a FIFO", "socket": "a socket"}


@pytest.mark.parametrize("kind", NODES)
def test_an_output_file_onto_a_node_is_refused_and_the_node_kept(kind, tmp_path, one_line_error):
    path, sock = _node(tmp_path, kind)
    try:
        before = os.stat(path).st_mode
        one_line_error(lambda: check_out_file(path, "--out"), f"--out {path}: is {NODES[kind]}",
                       "expected a regular file path")
        assert os.stat(path).st_mode == before and not stat.S_ISREG(before)
    finally:
        if sock:
            sock.close()


@pytest.mark.parametrize("kind", NODES)
def test_an_output_folder_onto_a_node_names_what_it_is(kind, tmp_path, one_line_error):
    path, sock = _node(tmp_path, kind)
    try:
        one_line_error(lambda: check_out_dir(path, "DST"), f"but {path} is {NODES[kind]}")
        one_line_error(lambda: check_out_dir(f"{path}/sub", "OUT"), f"but {path} is {NODES[kind]}")
    finally:
        if sock:
            sock.close()


def test_a_regular_file_and_a_new_path_are_outputs(tmp_path):
    (tmp_path / "old").write_bytes(b"x")
    check_out_file(tmp_path / "old", "--out")  # replaced, as before
    check_out_file(tmp_path / "new", "--out")
