"""The converter's resume protocol as the other commands see it: a folder an interrupted `kimi-k2-neuron convert`
left (its manifest and finished shards, no config.json yet) is recognised, with the command that resumes it. The
entry points ask here when a checkpoint's config.json is missing (arguments.fail, for config.MissingConfig).
Stdlib only."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

# The converter's record of a run, the first file it writes into DST (converter.py owns its contents).
MANIFEST = "conversion_manifest.json"



def unfinished_conversion(folder: str | Path) -> str | None:
    """For a folder an interrupted `kimi-k2-neuron convert` left (its manifest, finished shards, maybe .partial
    files, but no config.json yet): one line saying so, with the command that resumes it. None for any other
    folder."""
    state = _conversion_state(folder)
    if state is None:
        return None
    done, command = state
    if command is None:
        return (f"{folder}: an unfinished conversion (no config.json, an unreadable {MANIFEST}); delete it and "
                f"convert again")
    return f"{folder}: an unfinished conversion ({done} files done, no config.json yet); resume it with: {command}"


def resume_hint(folder: str | Path, verify: bool = False) -> str:
    """What an interrupted conversion into `folder` kept and how to resume it ("" when there is nothing to say).
    `verify`: the run re-hashed a finished conversion (--verify), which a stop leaves finished."""
    state = _conversion_state(folder)
    if state is None and verify and (Path(folder) / "config.json").is_file():
        return ("the conversion there is finished as it was; the re-hash stopped: run convert --verify again to "
                "finish it")
    if state is None or state[1] is None:
        return ""
    done, command = state
    return f"{done} files finished and kept; resume with: {command}"


def _conversion_state(folder: str | Path) -> tuple[str, str | None] | None:
    """("k of n", resume command) of an unfinished conversion in `folder`, (.., None) if its manifest is unreadable,
    None if it is no unfinished conversion."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file() or (folder / "config.json").exists():
        return None
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return "?", None
    if not isinstance(m, dict):
        return "?", None
    files = m.get("files") if isinstance(m.get("files"), dict) else {}
    total = m.get("files_total")
    return (f"{len(files)} of {total}" if isinstance(total, int) else f"{len(files)}"), resume_command(m, folder)


def resume_command(manifest: dict, dst: str | Path) -> str:
    """The convert command that continues the conversion `manifest` records (SRC where it does not say)."""
    src = manifest.get("source_dir")
    experts = manifest.get("experts")
    words = ["kimi-k2-neuron", "convert", shlex.quote(str(src)) if isinstance(src, str) else "SRC",
             shlex.quote(str(Path(dst).absolute())), "--experts", str(experts) if isinstance(experts, str) else "E"]
    workers = manifest.get("workers")
    if isinstance(workers, int) and workers > 1:
        words += ["--workers", str(workers)]
    return " ".join(words)
