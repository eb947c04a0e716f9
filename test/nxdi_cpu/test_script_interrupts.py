"""Ctrl-C and SIGTERM sent to scripts/run_inference.py --cpu, bench_tpot.py --cpu and compile_and_save.py while they
work on the NxDI model in NxD's CPU mode: the signal goes out once a marker line shows in their output (streamed text,
a rank's start-up line, a progress bar, or the line a test-only pause prints where the SDK's compiler would run).
Then: the last line names the interruption, exit code 130 / 143, no traceback (Python's, or a C++ stack dump from a
rank), no rank left running, and no output that looks complete (report, compiled folder, converted checkpoint)."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kimi_k2_neuron.convert import converted_dir_for
from nxdi_support import REPO

SCRIPTS = REPO / "scripts"
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
PAUSED = "test pause: inside "

pytestmark = pytest.mark.fp8_selective_cpu

PAUSE_CHILD = REPO / "test" / "pause_child.py"  # pauses the script inside a function's nth call, saying PAUSED


@pytest.fixture
def env(tmp_path):
    """A user's environment (this process's torch.distributed and NxD CPU-mode variables left out)."""
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NXD_CPU_MODE")}
    return {**inherited, "KIMI_K2_NEURON_CACHE": str(tmp_path / "cache")}


def signal_after(marker: str | re.Pattern, where: str, sig: int, cmd: list[str], env: dict,
                 terminal: bool = False) -> tuple[int, str, str]:
    """Run cmd, send `sig` once `marker` shows in its `where` ("stdout" or "stderr"; "" on stdout: any text), wait
    for it to end; (exit code, stdout, stderr), after checking that no process it started outlived it. terminal:
    stderr is a pseudo-terminal, as in a user's interactive run (progress bars draw there; on a pipe, a log, they
    wait progress.LOG_SECONDS)."""
    master = slave = None
    if terminal:
        master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave if terminal else subprocess.PIPE, env=env)
    if terminal:
        os.close(slave)
    err_fd = master if terminal else p.stderr.fileno()
    got = {p.stdout.fileno(): b"", err_fd: b""}
    watched = p.stdout.fileno() if where == "stdout" else err_fd

    def read_some(timeout: float) -> bool:
        """Read what is ready; False once both streams are at their end."""
        ready, _, _ = select.select(list(got), [], [], timeout)
        for fd in ready:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # a pseudo-terminal whose other side has closed: its end
                chunk = b""
            if chunk:
                got[fd] += chunk
            else:
                ended.add(fd)
        return len(ended) < len(got)

    ended: set = set()
    children, deadline = [], time.monotonic() + 600
    try:
        while not children and time.monotonic() < deadline:
            read_some(1.0)
            if got[watched] and (marker.search(got[watched]) if isinstance(marker, re.Pattern)
                                 else marker.encode() in got[watched]):
                children = psutil.Process(p.pid).children(recursive=True) or [None]
                p.send_signal(sig)
            elif p.poll() is not None:
                out, err = (b.decode(errors="replace") for b in got.values())
                pytest.fail(f"ended (exit code {p.returncode}) before {marker!r} showed: {err[-3000:]}")
        assert children, f"{marker!r} did not show within 600 s"
        end = time.monotonic() + 120
        while time.monotonic() < end and (p.poll() is None or read_some(0.2)):
            if p.poll() is None:
                read_some(0.5)
        p.wait(timeout=max(0.0, end - time.monotonic()))
    finally:
        if master is not None:
            os.close(master)
    _, alive = psutil.wait_procs([c for c in children if c is not None], timeout=30)
    assert not alive, f"left running: {[c.cmdline() for c in alive]}"
    return (p.returncode, got[p.stdout.fileno()].decode(errors="replace"), got[err_fd].decode(errors="replace"))


def stopped(sig: int, rc: int, err: str, line: str = "") -> None:
    """Exit code 130/143, last stderr line `error: interrupted by SIG...[line]`, no traceback of any kind."""
    assert "Traceback" not in err and "frame #" not in err, err[-5000:]
    last = [s.rsplit("\r", 1)[-1] for s in err.splitlines() if s.rsplit("\r", 1)[-1].strip()][-1]
    assert rc == CODES[sig] and last == f"error: interrupted by {signal.Signals(sig).name}{line}", err[-3000:]


def script(name: str, *argv: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *argv]


def paused_script(target: str, nth: int, name: str, *argv: str) -> list[str]:
    return [sys.executable, str(PAUSE_CHILD), "-", target, str(nth), str(SCRIPTS / name), *argv]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- run_inference.py --cpu ----------------------------------------------------------------------------------------


def test_run_inference_interrupted_mid_stream(tiny, env):
    """Ctrl-C once the reply streams: the text shown so far ends its line, the stop's line comes after it."""
    rc, out, err = signal_after("", "stdout", signal.SIGINT, script(
        "run_inference.py", "--cpu", "--model", str(tiny["fp8"]), "--prompt", "Hello, Kimi!", "--max-new-tokens",
        "400"), env)
    stopped(signal.SIGINT, rc, err)
    assert out.strip() and out.endswith("\n") and "tokens in" not in err


def test_run_inference_at_tp2_interrupted_while_the_ranks_work(tiny, env):
    rc, out, err = signal_after("[Gloo] Rank 0 is connected", "stderr", signal.SIGTERM, script(
        "run_inference.py", "--cpu", "--tp", "2", "--model", str(tiny["fp8"]), "--prompt", "Hello, Kimi!",
        "--max-new-tokens", "400"), env)
    stopped(signal.SIGTERM, rc, err, "; terminated every rank")
    assert out == ""


# -- bench_tpot.py --cpu -------------------------------------------------------------------------------------------


# the sweep between its first length done and its last: the bar at any of 1/40 .. 39/40 (tqdm skips redraws that
# come within 0.1 s of the last, so no single frame is sure to be drawn, and on a loaded machine 1/40 was not)
MID_SWEEP = re.compile(rb"\| (?:[1-9]|[1-3][0-9])/40 \[")


@pytest.mark.parametrize("sig, tp", [(signal.SIGINT, "2"), (signal.SIGTERM, "1")], ids=["SIGINT-tp2", "SIGTERM-tp1"])
def test_bench_tpot_interrupted_mid_sweep_writes_no_report(sig, tp, tiny, env, tmp_path):
    """Signalled mid-sweep, one length done: no report, no temp file. At one rank the run is paused inside the
    second timed length's generation (a state: the warm-up and the first length done); at two, the sweep runs in the
    ranks, where no pause reaches, and the bar's count between 1 and 39 says the same."""
    report = tmp_path / "out" / "b.json"
    report.parent.mkdir()
    argv = ["--cpu", "--tp", tp, "--model", str(tiny["fp8"]), "--seq-len", "32", "--context-lengths",
            ",".join(["8"] * 40), "--decode-steps", "20", "--report", str(report)]
    if tp == "1":
        rc, out, err = signal_after(PAUSED, "stderr", sig, paused_script(
            "kimi_k2_neuron.neuron.serving:generate_ids", 3, "bench_tpot.py", *argv), env, terminal=True)
    else:
        rc, out, err = signal_after(MID_SWEEP, "stderr", sig, script("bench_tpot.py", *argv), env, terminal=True)
    stopped(sig, rc, err, "; terminated every rank" if tp == "2" else "")
    assert out == "" and list(report.parent.iterdir()) == []


# -- compile_and_save.py -------------------------------------------------------------------------------------------


@pytest.fixture
def raw(tiny, tmp_path):
    """A copy of the tiny raw checkpoint: compile_and_save converts it into $KIMI_K2_NEURON_CACHE/converted."""
    return Path(shutil.copytree(tiny["fp8"], tmp_path / "ckpt" / "fp8"))


COMPILE = ["--tp", "2", "--seq-len", "32", "--moe-prefill", "torch"]


def test_compile_interrupted_while_tracing_keeps_the_earlier_compile(raw, env, tmp_path):
    """Signalled inside NxD's trace (where neuronx-cc would run for minutes): NxDI has already written
    neuron_config.json, but into a hidden folder beside --out, which goes; the earlier compile in --out stays as it
    was, and nothing hidden is left beside it."""
    out = tmp_path / "compiled"
    out.mkdir()
    (out / "kimi_k2_neuron.json").write_text("{}")  # an earlier, finished compile
    (out / "model.pt").write_bytes(b"earlier")
    rc, stdout, err = signal_after(PAUSED, "stderr", signal.SIGTERM, paused_script(
        "neuronx_distributed.trace.model_builder:ModelBuilder.trace", 1, "compile_and_save.py", "--model", str(raw),
        "--out", str(out), *COMPILE), env)
    stopped(signal.SIGTERM, rc, err)
    assert sorted(p.name for p in out.iterdir()) == ["kimi_k2_neuron.json", "model.pt"]
    assert (out / "model.pt").read_bytes() == b"earlier" and leftovers(tmp_path) == []


def test_compile_interrupted_while_converting_leaves_no_folder(raw, env, tmp_path):
    """Ctrl-C while the raw checkpoint is converted (before any compiling): no --out, and the converted folder has
    no config.json (the next run resumes it)."""
    out = tmp_path / "compiled"
    rc, _, err = signal_after(PAUSED, "stderr", signal.SIGINT, paused_script(
        "kimi_k2_neuron.convert.converter:_Job._convert_unit", 3, "compile_and_save.py", "--model", str(raw),
        "--out", str(out), *COMPILE), env)
    stopped(signal.SIGINT, rc, err)
    assert not out.exists() and leftovers(tmp_path) == []
    converted = converted_dir_for(raw, "fp8-blockwise", Path(env["KIMI_K2_NEURON_CACHE"]) / "converted")
    assert converted.is_dir() and not (converted / "config.json").exists()


def test_compile_refuses_an_out_folder_that_is_no_compile(raw, env, tmp_path):
    """A finished compile replaces --out: a folder holding anything else is refused before any work."""
    out = tmp_path / "compiled"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = subprocess.run(script("compile_and_save.py", "--model", str(raw), "--out", str(out), *COMPILE),
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (f"error: --out {out}: not empty and not a finished compile (no "
                                                 f"kimi_k2_neuron.json in it); give a new or empty folder (the "
                                                 f"compile is written beside it and renamed once complete)")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not (Path(env["KIMI_K2_NEURON_CACHE"]) / "converted").exists()
