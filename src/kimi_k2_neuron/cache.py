"""Where the package keeps what it makes for the user: $KIMI_K2_NEURON_CACHE, else ~/.cache/kimi-k2-neuron. The demo's
tiny checkpoint lives there, and every raw checkpoint a command converts on its own (`converted/`, one folder per
source path and expert scheme), so that one conversion serves every tool. Stdlib only."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "KIMI_K2_NEURON_CACHE"


def cache_dir() -> Path:
    """$KIMI_K2_NEURON_CACHE (a leading ~ expanded, as a shell would not inside quotes; made absolute, so that every
    message names one place), else ~/.cache/kimi-k2-neuron; blank counts as unset."""
    value = os.environ.get(ENV, "").strip()
    return Path(value).expanduser().absolute() if value else Path.home() / ".cache" / "kimi-k2-neuron"


def converted_root() -> Path:
    """Where raw checkpoints are converted once (convert/once.py)."""
    return cache_dir() / "converted"
