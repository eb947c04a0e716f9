"""runtime.ranks.run_ranks: every rank gets the torch.distributed environment, a failing rank takes the others down
and reports on one line, and no rank outlives its parent (SIGTERM, Ctrl-C or even SIGKILL to the parent).

This module imports no torch (kimi_k2_neuron.cli imports it, so main is imported where it is used): its functions
are the ranks' targets, and each spawned rank imports the module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.runtime.ranks import RankFailed, run_ranks

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def write_env(rank, folder):
    Path(folder, f"{rank}.json").write_text(json.dumps({k: os.environ[k] for k in ENV_KEYS}))


def rank1_fails(rank, error, folder):
    """The others leave their pid in `folder` and sleep until terminated; rank 1 raises `error` once they are up."""
    if rank == 1:
        deadline = time.monotonic() + 60
        while len(list(Path(folder).glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise error
    Path(folder, f"{rank}.tmp").write_text(str(os.getpid()))
    os.replace(Path(folder, f"{rank}.tmp"), Path(folder, f"{rank}.pid"))  # rank 1 never sees a half-written file
    time.sleep(600)


def rank1_dies(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def rank1_aborts(rank):
    if rank == 1:
        os.abort()  # as a native library does on a failed check


def rank1_aborts_at_exit(rank):
    if rank == 1:
        import atexit

        atexit.register(os.abort)  # as a library's teardown might, once the work is done


def test_every_rank_gets_the_distributed_environment(tmp_path):
    run_ranks(write_env, 3, args=(str(tmp_path),))
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [(str(r), str(r), "3") for r in range(3)]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1


@pytest.mark.parametrize("error, raised, message", [
    (KimiInputError("model.safetensors: tensor x has shape [2], expected [3]"), KimiInputError,
     "model.safetensors: tensor x has shape [2], expected [3]"),
    (ValueError("boom\nsecond line"), RankFailed, "rank 1: ValueError: boom"),
], ids=["bad input", "bug"])
def test_a_failing_rank_stops_the_others_and_reports_one_line(tmp_path, error, raised, message):
    t0 = time.monotonic()
    with pytest.raises(raised) as info:
        run_ranks(rank1_fails, 3, args=(error, str(tmp_path)))
    assert str(info.value) == message
    assert time.monotonic() - t0 < 60  # not the sleepers' 600 s
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(psutil.pid_exists(pid) for pid in pids)


def test_a_rank_killed_by_a_signal_is_reported():
    with pytest.raises(RankFailed, match="rank 1: died from signal SIGKILL without reporting an error"):
        run_ranks(rank1_dies, 2)


def test_a_native_crash_in_a_rank_prints_its_python_stack(capfd):
    with pytest.raises(RankFailed, match="rank 1: died from signal SIGABRT without reporting an error"):
        run_ranks(rank1_aborts, 2)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "rank1_aborts" in err


def test_a_crash_after_the_work_is_a_note_not_a_failure(capfd):
    run_ranks(rank1_aborts_at_exit, 2)
    assert "note: rank 1 finished its work, then died from signal SIGABRT while exiting" in capfd.readouterr().err


@pytest.mark.slow
def test_a_bad_input_in_a_rank_is_the_cli_one_line_error(tiny, tmp_path, capsys):
    from kimi_k2_neuron.cli import main

    # A shape mismatch only the weights show, so the ranks find it after the CLI's own checks have passed.
    d = Path(shutil.copytree(tiny["int4"], tmp_path / "bad"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 96}))
    rc = main(["logits", "--model", str(d), "--input-ids", "1,2,3", "--tp", "2", "--out", str(tmp_path / "l")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "expected" in err[0], err
    assert not (tmp_path / "l").exists()


# -- the parent is stopped: no rank may stay behind ------------------------------------------------------------------


def start_tp_logits(model: Path, out: Path, session: bool = False) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`kimi-k2-neuron logits --tp 2` in a subprocess (in a session of its own with `session`, as a terminal's
    command is), long enough to signal; returns it and its children once both ranks have started (the children
    include multiprocessing's resource tracker, which must go too)."""
    ids = ";".join([",".join(["5"] * 64)] * 2)
    p = subprocess.Popen([sys.executable, "-m", "kimi_k2_neuron.cli", "logits", "--model", str(model), "--input-ids",
                          ids, "--prefill-len", "1", "--tp", "2", "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=session)
    parent, deadline = psutil.Process(p.pid), time.monotonic() + 60
    while time.monotonic() < deadline:
        children = parent.children(recursive=True)
        if sum("spawn_main" in " ".join(c.cmdline()) for c in children) == 2:
            return p, children
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the two ranks did not start within 60 s")


# SIGINT takes SIGTERM's path (one handler for both), so it is left out to save a model load per run.
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_no_rank_outlives_a_stopped_parent(tiny, tmp_path, sig):
    p, children = start_tp_logits(tiny["int4"], tmp_path / "l")
    p.send_signal(sig)
    rc = p.wait(30)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.cmdline() for c in alive]
    err = p.stderr.read()
    if sig == signal.SIGKILL:  # no handler runs: PR_SET_PDEATHSIG took the ranks down
        assert rc == -signal.SIGKILL
    else:
        assert rc == 128 + sig and "Traceback" not in err
        assert err.rstrip().splitlines()[-1].endswith(f"error: interrupted by {sig.name}; terminated every rank")
    assert not (tmp_path / "l").exists()


def test_a_hangup_of_the_whole_group_stops_the_ranks_with_one_line(tiny, tmp_path):
    """The terminal closes: SIGHUP reaches the command and its ranks (one process group). The promise is SIGTERM's:
    one line, exit 129, every rank stopped, no output left (before: exit 129 and no line, from the default action)."""
    p, children = start_tp_logits(tiny["int4"], tmp_path / "l", session=True)
    os.killpg(p.pid, signal.SIGHUP)
    rc = p.wait(30)
    _, alive = psutil.wait_procs(children, timeout=30)
    err = p.stderr.read()
    assert not alive, [c.cmdline() for c in alive]
    assert rc == 129 and "Traceback" not in err, err[-2000:]
    assert err.rstrip().splitlines()[-1].endswith("error: interrupted by SIGHUP; terminated every rank"), err[-2000:]
    assert not (tmp_path / "l").exists()


def sleep_long(rank):
    time.sleep(600)


def test_a_signal_while_a_rank_starts_still_stops_that_rank(monkeypatch):
    # SIGTERM lands just after the second rank's process exists and before run_ranks has noted it: that rank must be
    # stopped with the others, not left for the interpreter to wait for at exit.
    from multiprocessing.context import SpawnProcess
    from kimi_k2_neuron.runtime.ranks import RanksInterrupted

    started, real_start = [], SpawnProcess.start

    def start_then_signal(self):
        real_start(self)
        started.append(self)
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(SpawnProcess, "start", start_then_signal)
    t0 = time.monotonic()
    with pytest.raises(RanksInterrupted, match="interrupted by SIGTERM"):
        run_ranks(sleep_long, 3)
    assert len(started) == 2 and not any(p.is_alive() for p in started)
    assert time.monotonic() - t0 < 60
