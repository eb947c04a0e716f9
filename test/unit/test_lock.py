"""convert/lock.py: two `convert` runs into one DST. The second is refused with one line naming the first (pid, host)
while the first writes; once the first is gone, however it ended, a run takes over (and resumes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kimi_k2_neuron.convert import convert
from kimi_k2_neuron.convert.lock import LOCK_NAME

REPO = Path(__file__).resolve().parents[2]
PAUSE_CHILD = REPO / "test" / "pause_child.py"


def _convert_cli(src, dst) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", "convert", str(src), str(dst), "--experts",
                           "fp8-blockwise"], capture_output=True, text=True, timeout=300)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "conversion_manifest.json"}


def test_a_second_conversion_into_the_same_dst_is_refused_naming_the_first(tiny, tmp_path, one_line_error):
    src, dst = tiny["fp8"], tmp_path / "dst"
    marker = tmp_path / "marker"
    # the first run, paused inside its second output file (the first one written, the manifest saying incomplete)
    first = subprocess.Popen([sys.executable, str(PAUSE_CHILD), str(marker),
                              "kimi_k2_neuron.convert.converter:_Job._convert_unit", "2", "kimi_k2_neuron.cli",
                              "convert", str(src), str(dst), "--experts", "fp8-blockwise"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), first.communicate()
        # what a second run would write first: its manifest (and its lock record); the first's own writer thread
        # may still be finishing a shard meanwhile, so those are what is compared
        watched = ("conversion_manifest.json", LOCK_NAME)
        before = {name: (dst / name).read_bytes() for name in watched}
        second = _convert_cli(src, dst)
        line = one_line_error.exit(second.returncode, second.stderr,
                                   f"DST {dst}: another conversion is writing it (pid {first.pid} on "
                                   f"{socket.gethostname()}, since")
        assert "wait for it to finish" in line
        assert {name: (dst / name).read_bytes() for name in watched} == before  # nothing of the first's touched
        assert f'"pid": {first.pid}' in before[LOCK_NAME].decode()
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 143 and not (dst / LOCK_NAME).exists() and not (dst / "config.json").exists()
    # the first is gone: the next run takes over, resumes, and ends with what one uninterrupted run writes
    again = _convert_cli(src, dst)
    assert again.returncode == 0, again.stderr
    convert(src, tmp_path / "reference", "fp8-blockwise", progress=False)
    assert _files(dst) == _files(tmp_path / "reference")


def test_a_lock_left_by_a_killed_run_does_not_block(tiny, tmp_path):
    """SIGKILL leaves the lock file, but the kernel released its lock with the process."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / LOCK_NAME).write_text('{"pid": 1, "host": "elsewhere", "since": "then"}')
    assert convert(tiny["fp8"], dst, "fp8-blockwise", progress=False).files == 5
    assert not (dst / LOCK_NAME).exists() and (dst / "config.json").is_file()


def test_a_refused_conversion_leaves_no_folder(tiny, tmp_path, one_line_error):
    """A run refused after it took the lock (here: DST holds another checkpoint's files) leaves DST as it was."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    one_line_error(lambda: convert(tiny["fp8"], dst, "fp8-blockwise", progress=False), "is not empty")
    assert sorted(os.listdir(dst)) == ["notes.txt"]
