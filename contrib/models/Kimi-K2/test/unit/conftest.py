# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the contrib's CPU tests: Kimi-K2's real config.json files, tiny checkpoints in Kimi-K2's storage
formats converted to the recommended layout, and the Neuron shell's SDK-free modules."""

import types
from pathlib import Path

import pytest

from kimi_k2_neuron.tiny.checkpoint import make_tiny
from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.convert import convert
from kimi_k2_neuron.formats import DEFAULT_SCHEME

DATA = Path(__file__).parent / "data"  # kimi-k2-instruct.json, kimi-k2-instruct-0905.json, kimi-k2-thinking.json


@pytest.fixture(scope="session")
def configs() -> Path:
    """The folder of Kimi-K2's config.json files, NAME.json."""
    return DATA


@pytest.fixture(scope="session")
def kimi() -> KimiK2Config:
    """Kimi-K2-Instruct-0905's config.json."""
    return KimiK2Config.from_file(DATA / "kimi-k2-instruct-0905.json")


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> dict:
    """source format -> (raw tiny checkpoint, converted folder, the converter's Result): a tiny random Kimi-K2 stored
    as Kimi-K2-Instruct is (FP8 in 128x128 blocks) and as Kimi-K2-Thinking is (INT4 groups of 32), each converted to
    the recommended expert layout."""
    root = tmp_path_factory.mktemp("kimi-k2")
    out = {}
    for quant in ("fp8", "int4"):
        raw = make_tiny(root / quant, quant=quant)
        dst = root / f"{quant}-neuron"
        out[quant] = raw, dst, convert(raw, dst, DEFAULT_SCHEME, progress=False)
    return out


@pytest.fixture(scope="session")
def shell() -> types.SimpleNamespace:
    """kimi_k2_neuron.neuron's modules that need no Neuron SDK: spec (one run's settings), rules (what NxD cannot
    compile), contract (the NeuronConfig Kimi sets), loader (the converted checkpoint in NxD's names, memory-mapped),
    fit (the planner) and sdk (is the Neuron SDK here)."""
    from kimi_k2_neuron.neuron import contract, fit, loader, rules, sdk, spec

    return types.SimpleNamespace(spec=spec, rules=rules, contract=contract, loader=loader, fit=fit, sdk=sdk)
