"""Replies held to a schema through vLLM on CPU, the model compiled with on-device sampling: scripts/compile_and_save.py
--for-vllm (NEFFs aside, as test_vllm_serving.py does) compiles the application with the logits returned beside the
device's tokens (output_logits), and `vllm serve` loads the folder with the command it prints: this package's worker
(neuron/vllm_worker.py) samples a step that schedules a constrained request on the host, vLLM's grammar bitmask
applied; other steps keep the device's tokens. One server for the module (structured_serving.py), Kimi-K2.6's tiny
chat template, a slow tokenizer as Kimi's is.

The tiny model is random: it writes JSON, a regex's text or a tool call only because the mask leaves it nothing
else, so every reply parses and validates here only if the mask works. Its head is one row off random: the row of
</think> is 1.5 times the row of the token greedy decoding writes third after the thinking prompt, so that a greedy
reply closes its reasoning after a few tokens (a random model never does); then the reasoning is seen unconstrained
(the same tokens with and without a grammar) and the answer after it constrained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/build_nxdi_cpu_tier.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (scripts/build_nxdi_cpu_tier.sh)")

import structured_cases as cases  # noqa: E402
import structured_serving as ss  # noqa: E402

from kimi_k2_neuron.neuron.vllm_request import COMPILED_ARTIFACTS_ENV, XGRAMMAR_MIN  # noqa: E402
from kimi_k2_neuron.runtime import tool_calls as grammar  # noqa: E402
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer  # noqa: E402
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.fp8_selective_cpu, pytest.mark.slow]

THINK_ASK = [{"role": "user", "content": "Think, then answer in JSON."}]
THINK_SCHEMA = cases.obj({"answer": cases.WORD, "n": cases.COUNT})
FACTOR = 1.5


def xgrammar_or_skip() -> None:
    import importlib.metadata

    version = importlib.metadata.version("xgrammar")
    if tuple(int(p) for p in version.split(".")[:3]) < XGRAMMAR_MIN:
        pytest.skip(f"xgrammar {version} reads Kimi's tokenizer as raw text; rebuild the tier "
                    f"(scripts/build_nxdi_cpu_tier.sh installs 0.1.29)")


def thinking_head(converted: Path, out: Path, prompt: list[int], close: int) -> Path:
    """A copy of the converted checkpoint whose lm_head row `close` (</think>) is FACTOR x the row of the token the
    torch CPU runner's greedy decoding writes third after `prompt`: wherever that token wins, </think> wins instead."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kimi_k2_neuron.runtime.runner import CpuRunner

    shutil.copytree(converted, out)
    third = CpuRunner(out, dtype=torch.bfloat16).generate([prompt], 3).tokens[0][2]
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    with safe_open(shard, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    head = tensors["lm_head.weight"]
    head[close] = (head[third].float() * FACTOR).to(head.dtype)
    save_file(tensors, shard, metadata=metadata)
    return out


@pytest.fixture(scope="module")
def k26(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k2.6")
    write_tiny_tokenizer(folder, chat_template=CHAT_TEMPLATES["k2.6"])
    return folder


@pytest.fixture(scope="module")
def compiled(converted, k26, tmp_path_factory):
    """compile_and_save --for-vllm of the designed-head checkpoint: (its folder, the flags it prints, the
    checkpoint)."""
    xgrammar_or_skip()
    root = tmp_path_factory.mktemp("structured")
    kimi = KimiTokenizer.from_dir(k26)
    prompt = kimi.encode(kimi.apply_chat_template(THINK_ASK, thinking=True))
    model = thinking_head(converted[("fp8", "fp8-blockwise")], root / "model", prompt,
                          kimi.token_to_id(grammar.THINK_CLOSE))
    out, flags = ss.compile_for_vllm(model, root)
    return out, flags, model


@pytest.fixture(scope="module")
def server(compiled, k26, tmp_path_factory):
    out, _, model = compiled
    srv = ss.serve(model, k26, tmp_path_factory.mktemp("serve"), env={COMPILED_ARTIFACTS_ENV: out})
    yield srv
    srv.stop()


def test_compile_for_vllm_returns_the_logits_and_prints_the_worker(compiled):
    out, flags, _ = compiled
    nc = json.loads((out / "neuron_config.json").read_text())["neuron_config"]
    assert nc["on_device_sampling_config"]["dynamic"] is True and nc["output_logits"] is True
    assert "--additional-config" not in flags  # vllm-neuron's default: on-device sampling
    assert flags[flags.index("--worker-cls") + 1] == "kimi_k2_neuron.neuron.vllm_worker.KimiNeuronWorker"
    assert json.loads(flags[flags.index("--structured-outputs-config") + 1]) == {
        "backend": "xgrammar", "disable_any_whitespace": True}


def test_fifty_json_schemas_streamed_and_not(server):
    ss.check_schemas(server, streamed=1)


def test_json_object_regex_and_choice(server):
    ss.check_formats(server)


def test_tool_choice_required_and_named_are_held_to_the_parameters(server):
    ss.check_tool_calls(server)


def test_the_reasoning_is_free_and_the_answer_held(server, k26):
    """K2.6 with thinking on (the prompt ends <think>), greedy: with a grammar and without, the same tokens up to and
    including </think> (vLLM's structured output manager leaves the row open until the reasoning parser says the
    reasoning is over); after it, the answer validates, where the unconstrained reply's does not."""
    kimi = KimiTokenizer.from_dir(k26)
    close = kimi.token_to_id(grammar.THINK_CLOSE)
    base = ss.chat(THINK_ASK, temperature=0.0, max_tokens=cases.BUDGET, return_token_ids=True,
                   chat_template_kwargs={"thinking": True})
    held_body = {**base, **cases.schema_request(THINK_SCHEMA), "max_tokens": cases.BUDGET}  # the reasoning too
    free = server.post("/v1/chat/completions", {**base, "max_tokens": 24})["choices"][0]
    held = server.post("/v1/chat/completions", held_body)["choices"][0]
    assert close in free["token_ids"], "the designed head did not close the reasoning"
    at = free["token_ids"].index(close)
    assert at >= 1, "the reasoning is empty: nothing to see unconstrained"
    assert held["token_ids"][:at + 1] == free["token_ids"][:at + 1]
    assert held["message"]["reasoning_content"] == kimi.decode(free["token_ids"][:at])
    cases.check(held["message"]["content"], THINK_SCHEMA)
    with pytest.raises(ValueError):  # what the model writes unconstrained after </think> is no such JSON
        cases.check(kimi.decode(free["token_ids"][at + 1:], skip_special=True), THINK_SCHEMA)
    streamed, finish = ss.reply(server, held_body, stream=True)
    assert streamed["reasoning_content"] == held["message"]["reasoning_content"]
    cases.check(streamed["content"], THINK_SCHEMA)
    assert finish == "stop"


def test_a_plain_reply_batched_with_a_constrained_one_keeps_its_tokens(server):
    """A greedy reply alone and the same beside a constrained request (whose row alone is then sampled on the host, the
    plain row keeping the device's token from the same call): the same tokens."""
    from concurrent.futures import ThreadPoolExecutor

    plain = ss.chat(temperature=0.0, max_tokens=24, ignore_eos=True, return_token_ids=True, **ss.NO_THINKING)
    alone = server.post("/v1/chat/completions", plain)["choices"][0]["token_ids"]
    held = ss.chat(**cases.schema_request(cases.SCHEMAS[30][1]), **ss.NO_THINKING)
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(server.post, "/v1/chat/completions", plain)
        pool.submit(server.post, "/v1/chat/completions", held).result()
        assert beside.result()["choices"][0]["token_ids"] == alone


def test_a_greedy_reply_beside_a_sampled_one_keeps_its_tokens(server):
    """vllm-neuron hands the device's sampler each row's parameters by the order its runner holds the requests, not by
    the step's rows (NXDI_CONTRACT.md: vllm-ods-params); the worker hands them by row, so a greedy reply beside one
    sampled at temperature 1.0, no grammar in either, gives the tokens it gives alone, whichever arrives first."""
    from concurrent.futures import ThreadPoolExecutor

    greedy = ss.chat(temperature=0.0, max_tokens=24, ignore_eos=True, return_token_ids=True, **ss.NO_THINKING)
    alone = server.post("/v1/chat/completions", greedy)["choices"][0]["token_ids"]
    sampled = {**greedy, "temperature": 1.0}
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(server.post, "/v1/chat/completions", sampled)
        beside = pool.submit(server.post, "/v1/chat/completions", greedy)
        other.result()
        assert beside.result()["choices"][0]["token_ids"] == alone
