"""Run specs and configs the shell's unit tests share (test_rules, test_contract, test_vllm_request, test_loader):
Kimi-K2's real config, the tiny one, a converted fp8-per-channel run."""

from __future__ import annotations

from pathlib import Path

from kimi_k2_neuron.config import KimiK2Config
from kimi_k2_neuron.formats.scheme import ExpertScheme
from kimi_k2_neuron.neuron.spec import RunSpec
from kimi_k2_neuron.placement import Layout
from kimi_k2_neuron.tiny.checkpoint import tiny_config_dict

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "test/data/configs"
PER_CHANNEL = ExpertScheme("fp8-per-channel", None)


def tiny_cfg(**over) -> KimiK2Config:
    return KimiK2Config.from_dict({**tiny_config_dict("bf16"), **over})


def kimi_cfg() -> KimiK2Config:
    return KimiK2Config.from_file(CONFIGS / "kimi-k2-instruct-0905.json")


def group(g: int) -> Layout:
    return Layout(kv_group=g)


def chunk(n: int) -> Layout:
    return Layout(prefill_chunk=n)


def per_channel(**opts) -> RunSpec:
    """A run of a converted fp8-per-channel checkpoint."""
    return RunSpec(**{"scheme": PER_CHANNEL, "checkpoint": "/c", **opts})


def doc_table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table at `heading` in a doc's text, cells stripped, header and rule aside."""
    lines = []
    for line in text[text.index(heading):].splitlines():
        if line.startswith("|"):
            lines.append([c.strip() for c in line.strip("|").split("|")])
        elif lines:
            break
    return lines[2:]
