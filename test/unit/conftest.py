"""Fixtures of the unit tests: the tiny checkpoints, writable copies of them, and the one check every bad-input test
makes (checkpoint_edits.py holds the helpers that break a copy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.tiny.checkpoint import make_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """One tiny checkpoint per storage format, made once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {q: make_tiny(root / q, quant=q, shards=3, seed=0) for q in ("fp8", "int4", "bf16")}


class Converted(dict):
    """(source format, expert scheme) -> (the converted folder, the converter's Result), each converted the first
    time a test asks for it, once a session."""

    def __init__(self, tiny: dict, root: Path):
        super().__init__()
        self.tiny, self.root = tiny, root

    def __missing__(self, key):
        from kimi_k2_neuron.convert import convert

        source, scheme = key
        dst = self.root / f"{source}-{scheme}"
        self[key] = (dst, convert(self.tiny[source], dst, scheme, progress=False))
        return self[key]


@pytest.fixture(scope="session")
def converted(tiny, tmp_path_factory) -> Converted:
    return Converted(tiny, tmp_path_factory.mktemp("converted"))


@pytest.fixture
def ckpt(tiny, tmp_path):
    """ckpt("fp8") -> a fresh, writable copy of the tiny checkpoint of that format, to break one thing in."""

    def copy(quant: str = "fp8") -> Path:
        return Path(shutil.copytree(tiny[quant], tmp_path / quant))

    return copy


class OneLineError:
    """Bad input ends with one line that names what was wrong: a KimiInputError, or a command's `error:` line and
    exit code 2. Each check returns the line."""

    def __call__(self, call, *needles: str) -> str:
        """call() raises KimiInputError with a one-line message holding every needle."""
        with pytest.raises(KimiInputError) as info:
            call()
        return self.message(str(info.value), *needles)

    @staticmethod
    def message(message: str, *needles: str) -> str:
        assert "\n" not in message, message
        for needle in needles:
            assert needle in message, (needle, message)
        return message

    def exit(self, code: int, stderr: str, *needles: str) -> str:
        """A command ended with exit code 2 and stderr one `error: ` line holding every needle, no traceback."""
        assert code == 2, stderr
        assert "Traceback" not in stderr
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr
        return self.message(lines[0], *needles)


@pytest.fixture
def one_line_error() -> OneLineError:
    return OneLineError()
