"""neuron/vllm_plugin.py, vLLM's entry point, without NxDI: declared in setup.cfg, and a no-op that says why at debug
level. What it registers, in vLLM's own processes and with NxDI's transformers 4.57, is
test/nxdi_cpu/test_vllm_serving.py's."""

from __future__ import annotations

import configparser
import logging
from pathlib import Path

import pytest

from kimi_k2_neuron.neuron import sdk, vllm_plugin

REPO = Path(__file__).resolve().parents[2]


def test_setup_cfg_declares_the_entry_point_vllm_loads():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [line.strip() for line in cfg["options.entry_points"]["vllm.general_plugins"].strip().splitlines()]
    assert lines == ["kimi_k2_neuron = kimi_k2_neuron.neuron.vllm_plugin:register"]


def test_without_nxdi_it_registers_nothing_and_says_why_at_debug_level(caplog):
    if not sdk.missing_neuron_packages():
        pytest.skip("NxDI is importable here")
    with caplog.at_level(logging.DEBUG, logger=vllm_plugin.__name__):
        assert vllm_plugin.register() is None
    [record] = caplog.records
    assert record.levelno == logging.DEBUG and "not registered with vllm-neuron" in record.getMessage()
    assert "No module named" in record.getMessage()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert "kimi_k2" not in CONFIG_MAPPING  # nothing of transformers touched either


def test_the_docs_say_where_vllm_and_vllm_neuron_come_from_on_a_neuron_image():
    """The entry point works only in a venv that has vLLM and vllm-neuron: docs/vllm.md names the ways to one (the
    install command into the NxD Inference venv, the DLAMI's own vLLM venv, the DLC), each with the Neuron page it
    rests on, and the plugin that cannot serve this model."""
    text = (REPO / "docs" / "vllm.md").read_text()
    section = text.split("**Where vLLM and vllm-neuron come from on a Neuron image**", 1)[1].split("\n\n`", 1)[0]
    assert "git clone https://github.com/vllm-project/vllm-neuron.git" in section
    assert "pip install --extra-index-url=https://pip.repos.neuron.amazonaws.com -e ." in section
    assert "pip show vllm vllm-neuron" in section and "ls /opt | grep -i vllm" in section
    for page in ("quickstart-vllm-offline-serving.html", "vllm-user-guide-v1.html", "environments/dlami.html",
                 "vllm-neuron/docs/getting-started/setup-guide.html"):
        assert "https://awsdocs-neuron.readthedocs-hosted.com/en/" in section and page in section, page
