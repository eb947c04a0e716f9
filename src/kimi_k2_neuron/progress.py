"""Progress bars on stderr: tqdm's redraws on a terminal; on a log (stderr redirected, nohup, a CI job), one whole line
every LOG_SECONDS instead, since ten carriage-return redraws a second make a 35-minute conversion's log one
unreadable line of ~20,000 frames. Work shorter than LOG_SECONDS leaves no bar in a log at all, so that a bad input
there still ends in its one `error:` line."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

LOG_SECONDS = 30.0


class _Lines:
    """The file tqdm writes to when stderr is not a terminal: each redraw becomes one line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        text = s.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(iterable=None, *, disable: bool = False, **kw) -> tqdm:
    """tqdm(iterable, **kw) on stderr; where stderr is not a terminal, the first line after LOG_SECONDS, then at
    most one per LOG_SECONDS (and the last state when the bar closes, if it is kept and was shown)."""
    stream = sys.stderr
    if disable:
        return tqdm(iterable, disable=True, **kw)
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced by something without isatty
        terminal = False
    if terminal:
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        if columns:
            return tqdm(iterable, file=stream, dynamic_ncols=True, **kw)
        # a terminal of no size (`script`, some CI runners): tqdm would draw nothing at 0 columns or rows
        return tqdm(iterable, file=stream, ncols=100, nrows=24, **kw)
    return tqdm(iterable, file=_Lines(stream), delay=LOG_SECONDS, mininterval=LOG_SECONDS,
                maxinterval=max(LOG_SECONDS, 10.0), ncols=100, **kw)
