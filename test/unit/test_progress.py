"""progress.bar: tqdm's redraws on a terminal; on a log, whole lines no more often than LOG_SECONDS and none before
(a redirected `convert` must not fill its log with carriage-return frames)."""

import io
import os
import subprocess
import sys

from kimi_k2_neuron import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(monkeypatch, stream, n=50, **kw) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    with progress.bar(total=n, desc="work", unit="step", **kw) as b:
        for _ in range(n):
            b.update()
    return stream.getvalue()


def test_on_a_log_each_report_is_one_whole_line(monkeypatch):
    monkeypatch.setattr(progress, "LOG_SECONDS", 0.0)
    out = _run(monkeypatch, io.StringIO())
    assert "\r" not in out and out.endswith("\n")
    lines = out.splitlines()
    assert len(lines) > 2 and all(line.startswith("work:") for line in lines)
    assert "0/50" in lines[0] and "50/50" in lines[-1] and "100%" in lines[-1]


def test_on_a_log_work_quicker_than_log_seconds_shows_no_bar(monkeypatch):
    """So that a bad input found early still ends in its one `error:` line on a log."""
    assert _run(monkeypatch, io.StringIO(), n=10_000) == ""


def test_a_bar_not_kept_leaves_nothing_on_a_log_but_its_reports(monkeypatch):
    monkeypatch.setattr(progress, "LOG_SECONDS", 0.0)
    out = _run(monkeypatch, io.StringIO(), n=3, leave=False)
    assert "\r" not in out and all(line.startswith("work:") for line in out.splitlines())


def test_on_a_terminal_tqdm_redraws_in_place(monkeypatch):
    out = _run(monkeypatch, _Terminal(), n=5)
    assert "\r" in out and "100%" in out


def test_disabled_writes_nothing(monkeypatch):
    assert _run(monkeypatch, io.StringIO(), disable=True) == ""


def test_a_redirected_convert_writes_lines(tmp_path):
    """The command as a user runs it under nohup or with 2> log: stderr is a pipe here."""
    from kimi_k2_neuron.tiny.checkpoint import make_tiny

    src = make_tiny(tmp_path / "src", quant="fp8", shards=2, seed=0)
    r = subprocess.run([sys.executable, "-m", "kimi_k2_neuron.cli", "convert", str(src), str(tmp_path / "dst"),
                        "--experts", "fp8-blockwise"], capture_output=True, text=True, env=dict(os.environ),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "converting:" not in r.stderr  # seconds long: under LOG_SECONDS
    assert "converted fp8 -> fp8-blockwise" in r.stdout + r.stderr
