"""Replies held to a schema through vLLM on CPU, sampled on the host: vllm-neuron compiles the request itself with no
on-device sampling (`--additional-config '{"override_neuron_config": {"on_device_sampling_config": null}}'`), so
the model returns lm_head's logits every step and vLLM's sampler draws from them; this package's worker
(neuron/vllm_worker.py) applies vLLM's grammar bitmask to a constrained step's logits first. One server for the module
(structured_serving.py), Kimi-K2.6's tiny chat template with thinking off, a slow tokenizer as Kimi's is, the random
tiny model: a reply parses and validates only if the mask works. On-device sampling: test_vllm_structured.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import structured_serving as ss  # noqa: E402
from test_vllm_structured import xgrammar_or_skip  # noqa: E402

from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.fp8_selective_cpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    xgrammar_or_skip()
    root = tmp_path_factory.mktemp("structured-cpu")
    write_tiny_tokenizer(root / "k2.6", chat_template=CHAT_TEMPLATES["k2.6"])
    srv = ss.serve(converted[("fp8", "fp8-blockwise")], root / "k2.6", root,
                   neuron_override={"on_device_sampling_config": None})
    yield srv
    srv.stop()


def test_the_model_samples_on_the_host(server):
    # vllm-neuron's runner logs its sampling placement at load (on_device_sampling_config None: vLLM's sampler)
    assert "CPU sampling enabled" in Path(server.log.name).read_text()


def test_fifty_json_schemas_streamed_and_not(server):
    ss.check_schemas(server, streamed=0)


def test_json_object_regex_and_choice(server):
    ss.check_formats(server)


def test_tool_choice_required_and_named_are_held_to_the_parameters(server):
    ss.check_tool_calls(server)
