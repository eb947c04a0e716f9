"""Ctrl-C and SIGTERM, sent to real processes in the middle of their work: one `error: interrupted by SIG...` line,
exit code 130 / 143, no traceback, and nothing left that looks complete (no --out file, no config.json, no export
folder, no temp file). An interrupted conversion is recognised by every command that reads a checkpoint, with the
command that resumes it; resumed, it finishes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_k2_neuron import cli, interrupts
from kimi_k2_neuron.convert.converter import MANIFEST, convert
from kimi_k2_neuron.interrupts import PARTIAL_SUFFIX

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}

# The child: test/pause_child.py, which pauses the command or script inside `target`'s nth call and touches a marker.
PAUSE_CHILD = REPO / "test" / "pause_child.py"


def interrupt(tmp_path: Path, sig: int, target: str, nth: int, what: str, *argv: str, env=None, times: int = 1):
    """Run `what` (kimi_k2_neuron.cli or a script's path) with argv, send `sig` (`times` times, back to back) once it
    is inside `target`'s nth call; returns (exit code, stdout, stderr)."""
    marker = tmp_path / f"marker-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, str(PAUSE_CHILD), str(marker), target, str(nth), what, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # bytes: keep the bars' \r
                            env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})})
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the process ended before {target} ran {nth} times: {proc.communicate()}"
    for i in range(times):
        time.sleep(0.01 * (i > 0))  # after the first one's handler ran (two pending signals would merge into one)
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode(), err.decode()


def shown(stderr: str) -> list[str]:
    """The stderr lines a terminal shows at the end: progress bars redraw (and clear) their line with \r."""
    return [line.rsplit("\r", 1)[-1] for line in stderr.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def one_interrupt_line(sig: int, rc: int, stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = shown(stderr)
    name = signal.Signals(sig).name
    assert rc == CODES[sig] and len(lines) == 1 and lines[0].startswith(f"error: interrupted by {name}"), stderr
    return lines[0]


def no_partial_files(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]


# -- convert: interrupted, recognised, resumed ---------------------------------------------------------------------


# times 2: one stop delivered twice at once, as `timeout -s INT` does (to the child, then to its process group)
# SIGHUP: the terminal closed; the promise is SIGTERM's (one line, exit 129, resumable)
@pytest.mark.parametrize("sig, times", [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGINT, 2),
                                        (signal.SIGHUP, 1)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-twice", "SIGHUP"])
def test_an_interrupted_conversion_says_how_to_resume_and_resumes(sig, times, tiny, tmp_path, capsys,
                                                                 one_line_error):
    src, dst = tiny["fp8"], tmp_path / "dst"
    rc, out, err = interrupt(tmp_path, sig, "kimi_k2_neuron.convert.converter:_Job._convert_unit", 3,
                             "kimi_k2_neuron.cli", "convert", str(src), str(dst), "--experts", "fp8-blockwise",
                             times=times)
    resume = f"kimi-k2-neuron convert {src} {dst} --experts fp8-blockwise"
    line = one_interrupt_line(sig, rc, err)
    assert line.endswith(f"2 of 5 files finished and kept; resume with: {resume}"), line
    assert out == ""
    assert not (dst / "config.json").exists()  # nothing says "a finished checkpoint"
    no_partial_files(dst)
    # Every later command that reads it says what it is and how to finish it.
    rc, _, err = run_cli(["logits", "--model", str(dst), "--input-ids", "1,2", "--out", str(tmp_path / "l")], capsys)
    one_line_error.exit(rc, err, f"{dst}: an unfinished conversion (2 of 5 files done", f"resume it with: {resume}")
    assert convert(src, dst, "fp8-blockwise", progress=False).skipped == 2
    assert (dst / "config.json").is_file()


def test_an_interrupted_verify_leaves_the_finished_conversion_as_it_was(tiny, tmp_path):
    """Ctrl-C while `convert --verify` re-hashes a finished conversion: one line saying the conversion is as it was,
    and it is (its config.json, files and a manifest still marked complete; before, the manifest said incomplete
    beside a config.json, and the line said nothing)."""
    src, dst = tiny["fp8"], tmp_path / "dst"
    convert(src, dst, "fp8-blockwise", progress=False)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    rc, out, err = interrupt(tmp_path, signal.SIGINT, "kimi_k2_neuron.convert.converter:file_digest", 2,
                             "kimi_k2_neuron.cli", "convert", str(src), str(dst), "--experts", "fp8-blockwise",
                             "--verify")
    line = one_interrupt_line(signal.SIGINT, rc, err)
    assert line.endswith("the conversion there is finished as it was; the re-hash stopped: run convert --verify "
                         "again to finish it"), line
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before and out == ""
    assert json.loads((dst / MANIFEST).read_text())["complete"] is True


def run_cli(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _unfinished(tmp_path: Path, manifest: dict | str) -> Path:
    d = tmp_path / "half"
    d.mkdir(parents=True)
    (d / MANIFEST).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    (d / "model-00001-of-00005.safetensors").write_bytes(b"")
    return d


HALF = {"source_dir": "/data/Kimi K2", "experts": "fp8-blockwise", "workers": 2, "files_total": 5,
        "files": {"model-00001-of-00005.safetensors": {}}}
RESUME = "kimi-k2-neuron convert '/data/Kimi K2' {dst} --experts fp8-blockwise --workers 2"
SCRIPTS = REPO / "scripts"


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--model", "{d}", "--input-ids", "1", "--out", "{t}/l"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--model", "{d}", "--prompt", "hi"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--model", "{d}", "--prompt", "hi", "--backend",
     "nxdi-cpu"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "plan", "--model", "{d}", "--tp", "64", "--seq-len", "8"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "convert", "{d}", "{t}/again", "--experts", "fp8-blockwise"],
    [sys.executable, "-m", "kimi_k2_neuron.cli", "trace-cpu", "--model", "{d}", "--submodel", "token"],
    [sys.executable, str(SCRIPTS / "compile_and_save.py"), "--model", "{d}", "--out", "{t}/c", "--tp", "64"],
    [sys.executable, str(SCRIPTS / "run_inference.py"), "--cpu", "--model", "{d}", "--prompt", "hi"],
    [sys.executable, str(SCRIPTS / "bench_tpot.py"), "--cpu", "--model", "{d}"],
], ids=["logits", "generate", "generate nxdi-cpu", "plan", "convert", "trace-cpu", "compile_and_save",
        "run_inference --cpu", "bench_tpot --cpu"])
def test_every_command_that_reads_a_checkpoint_recognises_an_unfinished_conversion(argv, tmp_path, one_line_error):
    d = _unfinished(tmp_path, HALF)
    argv = [a.format(d=d, t=tmp_path) for a in argv]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    one_line_error.exit(r.returncode, r.stderr, f"{d}: an unfinished conversion (1 of 5 files done, no config.json",
                        RESUME.format(dst=d))


def test_an_unreadable_manifest_still_says_unfinished(tmp_path, one_line_error):
    from kimi_k2_neuron.config import KimiK2Config

    from kimi_k2_neuron.convert.resume import unfinished_conversion
    from kimi_k2_neuron.errors import MissingConfig

    d = _unfinished(tmp_path, "{not json")
    # the config reader names the folder; the entry point (arguments.fail) asks the converter's protocol about it
    with pytest.raises(MissingConfig) as e:
        KimiK2Config.from_file(d)
    assert e.value.folder == d
    assert "an unfinished conversion" in unfinished_conversion(d) and "delete it and convert again" in \
        unfinished_conversion(d)
    # a manifest from before it recorded its source: the command with SRC to fill in
    old = _unfinished(tmp_path / "old", {"experts": "bf16", "files": {}})
    assert unfinished_conversion(old).endswith(f"resume it with: kimi-k2-neuron convert SRC {old} --experts bf16")
    assert unfinished_conversion(tmp_path) is None  # no manifest: not a conversion at all


# -- logits, generate, demo ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig, target, nth", [
    (signal.SIGTERM, "kimi_k2_neuron.model.decoder:DecoderLayer.forward", 2),
    # the logits complete in the temp file, not yet renamed: the interrupt removes it
    (signal.SIGINT, "safetensors.torch:save_file", 1),
], ids=["mid-forward", "while writing"])
def test_interrupted_logits_leave_no_file(sig, target, nth, tiny, tmp_path):
    out = tmp_path / "out" / "l.safetensors"
    out.parent.mkdir()
    rc, stdout, err = interrupt(tmp_path, sig, target, nth, "kimi_k2_neuron.cli", "logits", "--model",
                                str(tiny["fp8"]), "--input-ids", "1,2,3", "--out", str(out))
    one_interrupt_line(sig, rc, err)
    assert stdout == "" and list(out.parent.iterdir()) == []


def _generated(model, *flags) -> dict:
    """generate --json, uninterrupted: the oracle of what an interrupted run had made by then (greedy)."""
    r = subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", "generate", "--model", str(model), "--json",
                        *flags], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_generate_streams_and_an_interrupt_keeps_what_was_generated(tiny, tmp_path):
    """One row streams: the first three tokens are on stdout while the run is still inside its fourth forward
    pass (the prefill, then two decode steps, each after a token); Ctrl-C then ends the line, keeping them, and the
    interrupt's one line follows on stderr."""
    marker = tmp_path / "marker"
    argv = ["generate", "--model", str(tiny["fp8"]), "--input-ids", "5,17,300", "--max-new-tokens", "8"]
    proc = subprocess.Popen([sys.executable, str(PAUSE_CHILD), str(marker),
                             "kimi_k2_neuron.runtime.runner:CpuRunner.forward", "4", "kimi_k2_neuron.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(SRC)})
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.set_blocking(proc.stdout.fileno(), False)
    so_far = b""
    while time.monotonic() < deadline and so_far.count(b",") < 2:  # the third token's id may still be on its way
        so_far += proc.stdout.read() or b""
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    want = _generated(tiny["fp8"], *argv[3:5], "--max-new-tokens", "3")["tokens"][0]
    assert (so_far + (rest or b"")).decode() == ",".join(map(str, want)) + "\n"
    one_interrupt_line(signal.SIGINT, proc.returncode, err.decode())


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--prompt", "hi"], ["--prompt", "hi", "--prompt", "a longer one"],
                                   ["--prompt", "hi", "--json"]], ids=["one row", "two rows", "json"])
def test_an_interrupted_generate_prints_what_it_had_made(flags, tiny, tmp_path):
    """Interrupted inside the third forward pass (after the prefill and one decode step; two prefills and one step
    for two rows), each row has its tokens so far: printed as the finished rows would be."""
    from kimi_k2_neuron.runtime.chat import display_text

    nth = 4 if flags.count("--prompt") == 2 else 3
    rc, out, err = interrupt(tmp_path, signal.SIGINT, "kimi_k2_neuron.runtime.runner:CpuRunner.forward", nth,
                             "kimi_k2_neuron.cli", "generate", "--model", str(tiny["fp8"]), *flags,
                             "--max-new-tokens", "8")
    one_interrupt_line(signal.SIGINT, rc, err)
    done = _generated(tiny["fp8"], *[f for f in flags if f != "--json"], "--max-new-tokens", "2")
    assert all(len(t) == 2 for t in done["tokens"])
    if "--json" in flags:
        got = json.loads(out)
        assert got["tokens"] == done["tokens"] and got["text"] == done["text"] and got["interrupted"] is True
    elif len(done["text"]) == 1:
        assert out == display_text(done["text"][0]) + "\n"
    else:
        assert out == "".join(f"### {p}\n{display_text(t)}\n\n" for p, t in zip(("hi", "a longer one"), done["text"]))


def test_demo_interrupted(tmp_path):
    rc, _, err = interrupt(tmp_path, signal.SIGTERM, "kimi_k2_neuron.model.decoder:DecoderLayer.forward", 2,
                           "kimi_k2_neuron.cli", "demo", env={"KIMI_K2_NEURON_CACHE": str(tmp_path / "cache")})
    one_interrupt_line(signal.SIGTERM, rc, err)


# -- scripts -------------------------------------------------------------------------------------------------------


def test_bench_mla_decode_interrupted(tiny, tmp_path):
    rc, _, err = interrupt(tmp_path, signal.SIGINT, "kimi_k2_neuron.model.mla:MLAttention.forward", 2,
                           str(SCRIPTS / "bench_mla_decode.py"), "--config", str(tiny["fp8"] / "config.json"),
                           "--contexts", "64", "--repeats", "1")
    one_interrupt_line(signal.SIGINT, rc, err)


def test_export_contrib_interrupted_keeps_the_earlier_export(tmp_path):
    """An export cut short leaves the earlier one as it was (or none), and no hidden half-copy beside it."""
    dest = tmp_path / "Kimi-K2"
    r = subprocess.run([sys.executable, str(SCRIPTS / "export_contrib.py"), str(dest)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert r.returncode == 0, r.stderr
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    (dest / "earlier").write_text("")  # stale: a finished new export would remove it
    rc, _, err = interrupt(tmp_path, signal.SIGTERM, "shutil:copyfile", 3, str(SCRIPTS / "export_contrib.py"),
                           str(dest))
    one_interrupt_line(signal.SIGTERM, rc, err)
    assert (dest / "earlier").exists() and sorted(p.relative_to(dest) for p in dest.rglob("*")) == sorted(
        before + [Path("earlier")])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    shutil.rmtree(dest)


# -- run_command in-process ----------------------------------------------------------------------------------------


def test_a_second_ctrl_c_during_a_slow_clean_up_ends_at_once_in_one_line(tmp_path):
    """Ctrl-C, then Ctrl-C again 1.5 s later (past the window in which a repeat is the same stop) while the first
    one's clean-up still runs: the process ends at once, exit 130, with one line saying the clean-up was cut short
    (an unfinished conversion is then recognised by every command, with its resume command: the SIGKILL tests)."""
    code = ("import sys, time; from pathlib import Path; from kimi_k2_neuron import interrupts\n"
            "def main(argv):\n"
            "    try:\n        Path(sys.argv[1]).touch(); time.sleep(60)\n"
            "    finally:\n        time.sleep(30)  # a clean-up that takes its time\n"
            "sys.exit(interrupts.run_command(main))")
    marker = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", code, str(marker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(interrupts.REPEAT_WINDOW_S + 0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 10 and proc.returncode == 130, (proc.returncode, err)
    assert err == "error: interrupted by SIGINT again; stopped without cleaning up\n" and out == "", err


def test_a_command_started_under_nohup_keeps_ignoring_sighup(tmp_path):
    """nohup's promise (SIGHUP ignored) is kept: the command runs on through a hangup."""
    code = ("import os, signal, sys, time; from kimi_k2_neuron import interrupts\n"
            "def main(argv):\n    os.kill(os.getpid(), signal.SIGHUP); time.sleep(0.2); print('ran on'); return 0\n"
            "sys.exit(interrupts.run_command(main))")
    r = subprocess.run(["nohup", sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=60)
    assert r.returncode == 0 and r.stdout == "ran on\n", (r.returncode, r.stdout, r.stderr)


def test_run_command_in_process_gives_back_the_handlers(capsys):
    def main(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the handler raises inside the sleep
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert interrupts.run_command(main, []) == 143
    assert capsys.readouterr().err == "error: interrupted by SIGTERM\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_bench_convert_interrupted_stops_its_child_and_removes_its_files(tmp_path):
    """Ctrl-C while the child process builds the synthetic checkpoint (the parent polls its memory meanwhile): the
    child, in a session of its own, is killed, and the benchmark's folder under /tmp goes with it."""
    before = set(Path("/tmp").glob("bench_convert.*"))
    rc, _, err = interrupt(tmp_path, signal.SIGINT, "psutil:Process.memory_info", 3,
                           str(SCRIPTS / "bench_convert.py"), "--layers", "1", "--experts", "1")
    one_interrupt_line(signal.SIGINT, rc, err)
    assert set(Path("/tmp").glob("bench_convert.*")) == before


def test_check_nxdi_api_interrupted(tmp_path):
    """The script parses our own files before it looks anything up in the libraries, so two empty work trees of
    theirs reach the interrupt (no test here depends on a developer's copy of the sources)."""
    sources = tmp_path / "src"
    for name, package in (("nxdi", "neuronx_distributed_inference"), ("nxd", "neuronx_distributed")):
        (sources / name / "src" / package).mkdir(parents=True)
        (sources / name / "src" / package / "__init__.py").write_text("")
    rc, _, err = interrupt(tmp_path, signal.SIGTERM, "ast:parse", 5, str(SCRIPTS / "check_nxdi_api.py"),
                           "--nxdi", str(sources / "nxdi"), "--nxd", str(sources / "nxd"))
    one_interrupt_line(signal.SIGTERM, rc, err)


def test_an_atomic_output_has_the_modes_a_plain_write_gets(tmp_path):
    """The temp file behind atomic_output is created as a plain open() would be (the umask's mode), not mkstemp's
    0600, which the rename would keep."""
    from kimi_k2_neuron.interrupts import atomic_output

    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    with atomic_output(tmp_path / "out") as tmp:
        tmp.write_bytes(b"x")
    assert (tmp_path / "out").stat().st_mode == plain.stat().st_mode


def test_an_atomic_output_never_replaces_a_node(tmp_path, one_line_error):
    """A FIFO (or /dev/null) where an output goes is refused in one line and stays what it was: the rename would have
    put a regular file in its place."""
    from kimi_k2_neuron.interrupts import atomic_folder, atomic_output, write_atomically

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def enter(cm):
        with cm:
            raise AssertionError("entered")

    one_line_error(lambda: write_atomically(fifo, b"x"), f"{fifo}: is a FIFO", "would replace the FIFO")
    one_line_error(lambda: enter(atomic_output(fifo)), "is a FIFO")
    one_line_error(lambda: enter(atomic_folder(fifo)), f"{fifo}: is a FIFO; expected a folder")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


@pytest.mark.parametrize("flags", [[], ["--best", "--json"]], ids=["buffered whole", "written mid-run"])
def test_a_reader_that_leaves_early_ends_the_command_quietly(flags):
    """`plan | head -1`: the pipe's reader gone before plan writes, so its writes fail (mid-run, or the last flush):
    no traceback, no `Exception ignored`, exit 141 as a writer killed by SIGPIPE, or plan's own when only the last
    flush failed."""
    config = REPO / "test" / "data" / "configs" / "kimi-k2-instruct-0905.json"
    read, write = os.pipe()
    os.close(read)  # before the child starts: its first write or flush meets no reader
    r = subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", "plan", "--config", str(config), "--tp", "64",
                        "--seq-len", "1024", *flags], stdout=write, stderr=subprocess.PIPE, text=True,
                       env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=600)
    os.close(write)
    assert r.returncode in (0, interrupts.BROKEN_PIPE_EXIT) and r.stderr == "", (r.returncode, r.stderr[-2000:])


def test_a_broken_pipe_that_is_not_stdout_is_not_hushed(capsys):
    """Only stdout's reader leaving ends a command quietly: a broken pipe elsewhere (a rank's) stays an error."""
    def main(argv):
        raise BrokenPipeError("a rank's pipe")

    with pytest.raises(BrokenPipeError):
        interrupts.run_command(main, [])


# -- stdout that cannot take the output -----------------------------------------------------------------------------


def _command(*argv: str, stdout, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})}, timeout=600)


@pytest.mark.parametrize("argv", [
    ["plan", "--tp", "64", "--seq-len", "1024"],  # the table, written past the buffer mid-run
    ["plan", "--tp", "64", "--seq-len", "1024", "--json"],  # buffered whole: fails at the last flush
    ["--version"],
    ["plan", "--help"],  # longer than the buffer: written inside argparse, which swallows an OSError
], ids=["plan", "plan --json", "--version", "plan --help"])
def test_a_full_stdout_is_one_line_and_exit_2(argv):
    """`plan > /dev/full`: one `error: stdout: cannot write (disk full)` line and exit 2 (as a full --out), no
    traceback and no `Exception ignored` (before: a traceback and exit 1, plan's 'does not fit')."""
    config = REPO / "test" / "data" / "configs" / "kimi-k2-instruct-0905.json"
    argv = [*argv[:1], "--config", str(config), *argv[1:]] if argv[:1] == ["plan"] and "--help" not in argv else argv
    with open("/dev/full", "w") as full:
        r = _command(*argv, stdout=full)
    assert r.returncode == 2 and r.stderr.decode() == "error: stdout: cannot write (disk full)\n", r.stderr[-2000:]


def test_generate_json_on_a_full_stdout(tiny):
    with open("/dev/full", "w") as full:
        r = _command("generate", "--model", str(tiny["fp8"]), "--input-ids", "1,2", "--max-new-tokens", "2",
                     "--json", stdout=full)
    assert r.returncode == 2 and r.stderr.decode().splitlines() == ["error: stdout: cannot write (disk full)"], \
        r.stderr[-2000:]


def test_a_reply_the_terminal_cannot_encode_is_replaced(tiny):
    """PYTHONIOENCODING=ascii and a reply that is not ASCII: the text with '?' where ASCII has no character, exit 0
    (before: a UnicodeEncodeError traceback)."""
    model = str(tiny["fp8"])
    argv = ("generate", "--model", model, "--prompt", "héllo", "--max-new-tokens", "8")
    text = json.loads(_command(*argv, "--json", stdout=subprocess.PIPE).stdout)["text"][0]
    assert not text.isascii(), text  # (the tiny model's greedy bytes are not all ASCII)
    r = _command(*argv, stdout=subprocess.PIPE, env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode(), r.stderr.decode()[-2000:]
    assert r.stdout.decode("ascii") == text.encode("ascii", "replace").decode() + "\n"


def test_stdout_over_replaces_and_names_its_failures():
    from kimi_k2_neuron.interrupts import StdoutError, stdout_over

    read, write = os.pipe()
    like = type("Like", (), {"encoding": "ascii", "errors": "strict", "line_buffering": False})()
    stream = stdout_over(write, like)
    stream.write("h\u00e9llo \u2713\n")
    stream.flush()
    assert os.read(read, 100) == b"h?llo ?\n"
    os.close(write)
    os.close(read)
    full = os.open("/dev/full", os.O_WRONLY)
    stream = stdout_over(full, like)
    stream.write("x")
    with pytest.raises(StdoutError):
        stream.flush()
    os.close(full)
