"""Replies held to a schema through vLLM on CPU, sampled on the host: scripts/compile_and_save.py --for-vllm
--no-on-device-sampling compiles the model to return lm_head's logits every step (NEFFs aside, as
test_vllm_serving.py does), and `vllm serve` loads the folder with the --additional-config the script prints
(on_device_sampling_config null: vLLM's sampler draws every token); this package's worker (neuron/vllm_worker.py)
applies vLLM's grammar bitmask to a constrained step's logits first. One server for the module (structured_serving.py),
Kimi-K2.6's tiny chat template with thinking off, a slow tokenizer as Kimi's is, the random tiny model: a reply parses
and validates only if the mask works. On-device sampling: test_vllm_structured.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import structured_serving as ss  # noqa: E402
from test_vllm_structured import xgrammar_or_skip  # noqa: E402

from kimi_k2_neuron.neuron.vllm_request import COMPILED_ARTIFACTS_ENV  # noqa: E402
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.fp8_selective_cpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def compiled(converted, tmp_path_factory):
    """compile_and_save --for-vllm --no-on-device-sampling: (its folder, the flags it prints, the checkpoint)."""
    xgrammar_or_skip()
    model = converted[("fp8", "fp8-blockwise")]
    out, flags = ss.compile_for_vllm(model, tmp_path_factory.mktemp("structured-cpu"), "--no-on-device-sampling")
    return out, flags, model


@pytest.fixture(scope="module")
def server(compiled, tmp_path_factory):
    out, flags, model = compiled
    root = tmp_path_factory.mktemp("serve-cpu")
    write_tiny_tokenizer(root / "k2.6", chat_template=CHAT_TEMPLATES["k2.6"])
    override = json.loads(flags[flags.index("--additional-config") + 1])["override_neuron_config"]
    srv = ss.serve(model, root / "k2.6", root, env={COMPILED_ARTIFACTS_ENV: out}, neuron_override=override)
    yield srv
    srv.stop()


def test_the_folder_returns_logits_and_the_command_serves_it_so(compiled, server):
    out, flags, _ = compiled
    nc = json.loads((out / "neuron_config.json").read_text())["neuron_config"]
    assert nc["on_device_sampling_config"] is None and not nc["output_logits"]  # lm_head's logits are the output
    assert json.loads(flags[flags.index("--additional-config") + 1]) == {
        "override_neuron_config": {"on_device_sampling_config": None}}
    # vllm-neuron's runner logs its sampling placement at load (on_device_sampling_config None: vLLM's sampler)
    assert "CPU sampling enabled" in Path(server.log.name).read_text()


def test_fifty_json_schemas_streamed_and_not(server):
    ss.check_schemas(server, streamed=0)


def test_json_object_regex_and_choice(server):
    ss.check_formats(server)


def test_tool_choice_required_and_named_are_held_to_the_parameters(server):
    ss.check_tool_calls(server)
