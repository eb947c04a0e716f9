"""Kimi's chat-completions contract (runtime/chat_api.py) on requests: Kimi-Vendor-Verifier's parameter, tool_choice,
response_format and thinking cases (tests/params, tests/k3_features: their requests and the accept/refuse each
expects), and what the tiny release templates (tiny.tokenizer_files) say about thinking. The same rules through
vLLM's real server: test/nxdi_cpu/test_vllm_contract.py."""

from __future__ import annotations

import json

import pytest

from kimi_k2_neuron.runtime.chat_api import ApiError, ChatFacts, kimi_request, other_request
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer

CONTRACT = ChatFacts(opens_thinking=True, contract=True)
ASK = [{"role": "user", "content": "Say 'OK' and nothing else."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def request(**fields) -> dict:
    return {"model": "kimi", "messages": [dict(m) for m in ASK], **fields}


def thinking_body(thinking: bool, mode: str) -> dict:
    """KVV's _get_thinking_extra_body: the open-source form or Kimi's own."""
    if mode == "opensource":
        return {"chat_template_kwargs": {"thinking": thinking}}
    return {"thinking": {"type": "enabled" if thinking else "disabled"}}


# KVV tests/params/test_params.py IMMUTABLE_PARAMS: (name, default with thinking, without, wrong value)
IMMUTABLE = [("temperature", 0.6, 0.6, 1.1), ("temperature", 0.0, 0.6, 2.0), ("temperature", 1.0, 0.6, -0.1),
             ("top_p", 0.95, 0.95, 0.8), ("presence_penalty", 0, 0, 0.5), ("frequency_penalty", 0, 0, 0.5),
             ("n", 1, 1, 2)]


@pytest.mark.parametrize("mode", ["opensource", "kimi"])
@pytest.mark.parametrize("thinking", [False, True])
def test_kvv_params_defaults_pass_and_wrong_values_are_refused(thinking, mode):
    assert kimi_request(request(**thinking_body(thinking, mode)), CONTRACT)
    for name, think_default, default, wrong in IMMUTABLE:
        kimi_request(request(**thinking_body(thinking, mode), **{name: think_default if thinking else default}),
                     CONTRACT)
        with pytest.raises(ApiError, match=f"^{name}: "):
            kimi_request(request(**thinking_body(thinking, mode), **{name: wrong}), CONTRACT)


def test_what_the_contract_fills_in_and_what_it_leaves_alone():
    on = kimi_request(request(), CONTRACT)
    assert (on["temperature"], on["top_p"]) == (1.0, 0.95)
    off = kimi_request(request(thinking={"type": "disabled"}), CONTRACT)
    assert (off["temperature"], off["top_p"], off["chat_template_kwargs"]) == (0.6, 0.95, {"thinking": False})
    assert kimi_request(request(temperature=0), CONTRACT)["temperature"] == 0
    free = kimi_request(request(temperature=1.7, top_p=0.5, n=3), ChatFacts())  # contract off: as asked
    assert (free["temperature"], free["top_p"], free["n"]) == (1.7, 0.5, 3)
    with pytest.raises(ApiError, match="presence_penalty: only 0: vllm-neuron's sampler"):  # never applied here
        kimi_request(request(presence_penalty=0.5), ChatFacts())
    assert kimi_request(request(), ChatFacts()) == {**request(), "spaces_between_special_tokens": False}
    streamed = kimi_request(request(stream=True), ChatFacts())
    assert streamed["stream_options"] == {"include_usage": True}  # Kimi's API reports a stream's usage
    assert kimi_request(request(stream=True, stream_options={"include_usage": False}), ChatFacts())[
        "stream_options"] == {"include_usage": False}
    assert kimi_request(request(spaces_between_special_tokens=True), ChatFacts())["spaces_between_special_tokens"]


def test_kimis_thinking_field_becomes_the_templates_kwargs():
    got = kimi_request(request(thinking={"type": "enabled", "keep": "all"}), ChatFacts())
    assert "thinking" not in got and got["chat_template_kwargs"] == {"thinking": True, "preserve_thinking": True}
    assert kimi_request(request(thinking={"keep": "all"}, chat_template_kwargs={"thinking": False}), ChatFacts())[
        "chat_template_kwargs"] == {"thinking": False, "preserve_thinking": True}  # the explicit kwarg wins
    for bad, words in (({"type": "maybe"}, "thinking.type: expected 'enabled' or 'disabled'"),
                       ({"keep": "some"}, "thinking.keep: expected 'all' or null")):
        with pytest.raises(ApiError, match=words):
            kimi_request(request(thinking=bad), ChatFacts())
    with pytest.raises(ApiError, match="chat_template_kwargs.thinking: expected true or false"):
        kimi_request(request(chat_template_kwargs={"thinking": "no"}), ChatFacts())


def test_a_thinking_only_checkpoint_refuses_thinking_off():
    k27 = ChatFacts(opens_thinking=True, thinking_only=True, contract=True)
    for off in ({"thinking": {"type": "disabled"}}, {"chat_template_kwargs": {"thinking": False}}):
        with pytest.raises(ApiError, match="thinking: this checkpoint thinks always"):
            kimi_request(request(**off), k27)
    assert kimi_request(request(thinking={"type": "enabled", "keep": "all"}), k27)["temperature"] == 1.0


# KVV tests/k3_features/test_response_format.py: malformed forms are refused whether or not grammars are applied
SERVED = ChatFacts(grammars=None)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
     "response_format.json_schema.name: expected a non-empty string"),
    ({"type": "json_schema", "json_schema": {"name": "weather"}},
     "response_format.json_schema.schema: expected a JSON Schema object"),
    ({"type": "json_schema"}, "response_format.json_schema: expected an object with name and schema"),
    ({"type": "json_schema", "json_schema": {"name": "w", "strict": "yes", "schema": {}}},
     "response_format.json_schema.strict: expected true or false"),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": "x"}},
     "response_format.json_schema.schema: expected a JSON Schema object"),
    ({"type": "bogus"}, "response_format.type: expected 'text', 'json_object' or 'json_schema'"),
])
def test_malformed_response_formats_are_refused(response_format, words):
    for facts in (ChatFacts(), SERVED):
        with pytest.raises(ApiError, match=words):
            kimi_request(request(response_format=response_format), facts)


@pytest.mark.parametrize("fields, served", [
    ({"response_format": {"type": "json_object"}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": SCHEMA}}},
     None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": False, "schema": SCHEMA}}},
     {"response_format": {"type": "json_object"}}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, None), ({"structured_outputs": {"choice": ["yes", "no"]}}, None)])
def test_structured_outputs_pass_where_grammars_are_applied_and_are_refused_with_why_elsewhere(fields, served):
    """json_schema strict false: a JSON object, its structure not enforced (Kimi's API words), which is vLLM's
    json_object (any object: test/nxdi_cpu/test_grammar.py). The rest passes as it is: vLLM applies it."""
    got = kimi_request(request(**fields), SERVED)
    assert {k: got[k] for k in ("response_format", "structured_outputs") if k in got} == (served or fields)
    why = ChatFacts(grammars="vllm-neuron's own worker applies no grammar; serve with --worker-cls X")
    with pytest.raises(ApiError, match=r"not served here: vllm-neuron's own worker applies no grammar; serve with "
                                       r"--worker-cls X; refused rather than ignored"):
        kimi_request(request(**fields), why)
    with pytest.raises(ApiError, match="no vLLM configuration was read"):
        kimi_request(request(**fields), ChatFacts())


def test_text_is_served_and_what_vllm_would_ignore_is_refused():
    assert "response_format" not in kimi_request(request(response_format={"type": "text"}), ChatFacts())
    for facts in (ChatFacts(), SERVED):
        with pytest.raises(ApiError, match="guided_json: not read by vLLM 0.13, which would ignore it; use "
                                           "structured_outputs"):
            kimi_request(request(guided_json={"type": "object"}), facts)
    with pytest.raises(ApiError, match="structured_outputs: expected an object"):
        kimi_request(request(structured_outputs="x"), SERVED)


def test_other_endpoints_get_the_same_structured_output_checks():
    other_request({"prompt": "x", "structured_outputs": {"regex": "a"}}, SERVED)
    with pytest.raises(ApiError, match="structured_outputs: not served here"):
        other_request({"prompt": "x", "structured_outputs": {"regex": "a"}}, ChatFacts())


# KVV tests/k3_features/test_tool_choice.py
def test_tool_choice():
    for choice in ("auto", "none"):  # without tools: a plain chat (vLLM itself refuses auto without tools)
        got = kimi_request(request(tool_choice=choice), ChatFacts())
        assert "tool_choice" not in got and "tools" not in got
    for tools in ({}, {"tools": []}):
        with pytest.raises(ApiError, match="tool_choice required: needs a non-empty tools list"):
            kimi_request(request(tool_choice="required", **tools), ChatFacts())
    assert kimi_request(request(tools=[WEATHER], tool_choice="none"), ChatFacts())["tool_choice"] == "none"
    assert kimi_request(request(tools=[WEATHER], tool_choice="bogus"), ChatFacts())["tool_choice"] == "bogus"  # vLLM
    forced = kimi_request(request(tools=[WEATHER], tool_choice="required"), ChatFacts())
    assert forced["tool_choice"] == "auto" and forced["continue_final_message"] and not forced["add_generation_prompt"]
    assert forced["messages"][-1] == {"role": "assistant", "content": "<|tool_calls_section_begin|>"}
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "again"}]
    named = kimi_request({"messages": history, "tools": [WEATHER],
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, ChatFacts())
    assert named["messages"][-1]["content"] == ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
                                                "<|tool_call_argument_begin|>")
    with pytest.raises(ApiError, match="tool_choice.function.name: expected one of the request's tools"):
        kimi_request(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                     ChatFacts())
    assert "structured_outputs" not in forced and "structured_outputs" not in named  # no grammar applied here


SEARCH = {"type": "function", "function": {"name": "search", "parameters": {}}}


def test_forced_tool_calls_are_held_to_the_tools_parameters_where_grammars_are_applied():
    """Named: the prompt ends at the call's argument marker, the rest is the function's parameters. Required: the
    prompt ends at the section's begin marker, the rest whole calls (IDX counting the conversation's calls) and the
    section's end, as an xgrammar structural tag (its compilation and what it accepts: test/nxdi_cpu/
    test_grammar.py). The tool choice's grammar replaces a response_format, as vLLM's does."""
    named = kimi_request(request(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, response_format={"type": "json_object"}), SERVED)
    assert named["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    assert "response_format" not in named and named["tool_choice"] == "auto"
    empty = kimi_request(request(tools=[SEARCH], tool_choice={"type": "function", "function": {"name": "search"}}),
                         SERVED)
    assert empty["structured_outputs"] == {"json": {"type": "object"}}  # arguments are an object
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "-"}, {"role": "user", "content": "more"}]
    for parallel, calls in ((None, 4), (False, 1)):
        fields = {} if parallel is None else {"parallel_tool_calls": parallel}
        required = kimi_request({"messages": history, "tools": [WEATHER, SEARCH], "tool_choice": "required", **fields},
                                SERVED)
        grammar = json.loads(required["structured_outputs"]["structural_tag"])
        assert grammar["type"] == "structural_tag"
        begins, level = [], grammar["format"]
        while level is not None:  # sequence[or(tags), or(end, next level) | end]
            tags, tail = level["elements"]
            begins.append([t["begin"] for t in tags["elements"]])
            assert all(t["end"] == "<|tool_call_end|>" for t in tags["elements"])
            level = tail["elements"][1] if tail["type"] == "or" else None
            assert (tail["elements"][0] if tail["type"] == "or" else tail) == {
                "type": "const_string", "value": "<|tool_calls_section_end|>"}
        assert begins == [[f"<|tool_call_begin|>functions.{name}:{1 + k}<|tool_call_argument_begin|>"
                           for name in ("get_weather", "search")] for k in range(calls)]


def test_history_tool_call_ids_become_kimis():
    """K2-Vendor-Verifier's advice and Moonshot's API: ids renamed functions.NAME:IDX, IDX counting the calls of the
    conversation, and each tool result follows its call (a bare counter reused in a later turn included)."""
    def turn(*ids):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": "{}"}} for i, n in ids]}

    messages = [*ASK, turn(("0", "search"), ("call_9", "get_weather")),
                {"role": "tool", "tool_call_id": "0", "content": "a"},
                {"role": "tool", "tool_call_id": "call_9", "content": "b"},
                {"role": "user", "content": "more"}, turn(("0", "search")),
                {"role": "tool", "tool_call_id": "0", "content": "c"}]
    got = kimi_request({"messages": messages}, ChatFacts())["messages"]
    assert [c["id"] for c in got[1]["tool_calls"]] == ["functions.search:0", "functions.get_weather:1"]
    assert [m["tool_call_id"] for m in got if m["role"] == "tool"] == ["functions.search:0", "functions.get_weather:1",
                                                                      "functions.search:2"]
    assert messages[1]["tool_calls"][0]["id"] == "0"  # the caller's request is not changed
    # KVV test_tool_role_without_tool_call_id_rejected
    with pytest.raises(ApiError, match=r"messages\[0\].tool_call_id: a tool message needs the id of the call"):
        kimi_request({"messages": [{"role": "tool", "content": "some tool result"},
                                   {"role": "user", "content": "hello"}]}, ChatFacts())


@pytest.mark.parametrize("release, facts", [
    ("k2", ChatFacts()), ("k2-thinking", ChatFacts()), ("k2.5", ChatFacts(True, False, True)),
    ("k2.6", ChatFacts(True, False, True)), ("k2.7", ChatFacts(True, True, True))])
def test_chat_facts_read_from_the_release_templates(tmp_path, release, facts):
    write_tiny_tokenizer(tmp_path, chat_template=CHAT_TEMPLATES[release])
    tok = KimiTokenizer.from_dir(tmp_path)
    assert ChatFacts.of(tok) == facts
    assert ChatFacts.of(tok, contract=False).contract is False


def test_prompt_cache_key_is_accepted_and_taken_out_and_cache_salt_passes():
    """Kimi's session key: the engine's hits come from the prompt's own block hashes; vLLM's cache_salt is vLLM's."""
    got = kimi_request(request(prompt_cache_key="session-7", cache_salt="tenant-a"), ChatFacts())
    assert "prompt_cache_key" not in got and got["cache_salt"] == "tenant-a"
    with pytest.raises(ApiError, match="prompt_cache_key: expected a string"):
        kimi_request(request(prompt_cache_key=7), ChatFacts())
