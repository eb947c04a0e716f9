"""Kimi's API contract through vLLM's real OpenAI server on CPU: vLLM 0.13 -> vllm-neuron 0.2.0 -> the NxDI model in
NxD's CPU mode (as test_vllm_serving.py), with this package's parsers, its `--middleware` (neuron/vllm_api.py) and a
slow tokenizer as Kimi's is (kimi_slow_tokenizer.py: vLLM's slow detokenizer, which pads special tokens with spaces
unless told not to). One server for the module; every request below goes to it.

The checks are Kimi-Vendor-Verifier's pre-flight contract tests (tests/params, tests/prompt_tokens,
tests/k3_features/test_tool_choice.py and test_response_format.py, the thinking toggle and preserved thinking), on
what does not depend on the model's quality: a random tiny model writes bytes, so whether it calls a tool when asked
to is not a test here, but what the server accepts, refuses, renders and counts is. The oracle of prompt_tokens is
our tokenizer's count of the prompt the chat template renders (KimiTokenizer, independent of transformers' tokenizer
that vLLM runs). docs/vllm.md records the verifiers' own runs against such a server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash ../shared/nxdi-cpu/vllm/setup.sh VENV adds it)")
pytest.importorskip("vllm_neuron", reason="vllm-neuron is not installed here (../shared/nxdi-cpu/vllm/setup.sh)")

import vllm_support as vs  # noqa: E402
from kimi_slow_tokenizer import write_slow_tokenizer  # noqa: E402

from kimi_k2_neuron.runtime import tool_calls as grammar  # noqa: E402
from kimi_k2_neuron.runtime.tokenizer import KimiTokenizer  # noqa: E402
from kimi_k2_neuron.tiny.tokenizer_files import CHAT_TEMPLATES, write_tiny_tokenizer  # noqa: E402

SERVE_LEN = 768  # byte-level tiny tokenizer: a chat with tools and a history is ~600 tokens
BATCH = 2
ASK = [{"role": "user", "content": "Say 'OK' and nothing else."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}

pytestmark = pytest.mark.fp8_selective_cpu


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """release -> a KimiTokenizer with that release's chat template (the oracle's renderer)."""
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for release in ("k2-thinking", "k2.6", "k2.7"):
        write_tiny_tokenizer(root / release, chat_template=CHAT_TEMPLATES[release])
        out[release] = KimiTokenizer.from_dir(root / release)
    return out


@pytest.fixture(scope="module")
def server(converted, templates, tmp_path_factory):
    """`vllm serve` of the tiny FP8 checkpoint with Kimi-K2.6's chat template (thinking on by default, so the
    fixed sampling parameters apply), the Kimi middleware, both parsers, --stream-interval 3 (deltas of several
    tokens, as speculative decoding gives) and request-level chat templates allowed (K2-Thinking's, K2.7's)."""
    root = tmp_path_factory.mktemp("contract")
    dists = vs.write_dists(root / "dists")
    tokenizer = write_slow_tokenizer(Path(templates["k2.6"]._source), root / "tokenizer")
    parsers = str(vs.REPO / "src/kimi_k2_neuron/neuron/vllm_parsers.py")
    extra = ("--middleware", "kimi_k2_neuron.neuron.vllm_api.KimiApi", "--chat-template-content-format", "string",
             "--reasoning-parser-plugin", parsers,
             "--reasoning-parser", "kimi_k2_neuron", "--trust-remote-code", "--trust-request-chat-template",
             "--stream-interval", "3")
    srv = vs.Server(converted[("fp8", "fp8-blockwise")], tokenizer, vs.child_env(dists), root / "serve.log",
                    SERVE_LEN, BATCH, extra)
    try:
        srv.wait_ready(600)
        yield srv
    finally:
        srv.stop()


def chat(messages=None, **fields) -> dict:
    return {"model": "kimi", "messages": messages or [dict(m) for m in ASK], "max_tokens": 2,
            "return_token_ids": True, **fields}


def ok(server, body, stream=False):
    status, reply = server.call(body, stream)
    assert status == 200, (body, reply)
    return reply


def refused(server, body, words: str) -> str:
    status, reply = server.call(body)
    assert status == 400, (body, reply)
    message = reply["error"]["message"]
    assert words in message, message
    return message


def streamed_message(chunks) -> tuple[dict, dict | None, str | None]:
    """A stream put back together as a client does (KVV's _StreamAccumulator): message, usage, finish_reason."""
    message, calls, usage, finish = {"content": "", "reasoning_content": ""}, {}, None, None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                slot["id"] = slot["id"] or call.get("id")
                function = call.get("function") or {}
                slot["name"] = slot["name"] or function.get("name")
                slot["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, usage, finish


# -- tests/params: the fixed sampling parameters -----------------------------------------------------------------------

IMMUTABLE = [("temperature", 0.6, 0.6, 1.1), ("temperature", 0.0, 0.6, 2.0), ("temperature", 1.0, 0.6, -0.1),
             ("top_p", 0.95, 0.95, 0.8), ("presence_penalty", 0, 0, 0.5), ("frequency_penalty", 0, 0, 0.5),
             ("n", 1, 1, 2)]


def test_kvv_params_defaults_succeed_and_wrong_values_are_refused(server):
    """KVV tests/params, both thinking modes in both of its --think-mode forms (opensource: chat_template_kwargs;
    kimi: Kimi's thinking field): a request without the parameters, and one with every default (KVV sends them one
    at a time; together they cost one generation), succeed; each wrong value is answered 400 before the model
    runs (a refusal costs no generation, so each is sent alone)."""
    for form in ("opensource", "kimi"):
        for thinking in (False, True):
            toggle = ({"chat_template_kwargs": {"thinking": thinking}} if form == "opensource"
                      else {"thinking": {"type": "enabled" if thinking else "disabled"}})
            ok(server, chat(**toggle, max_tokens=1))
            defaults = {name: (think_default if thinking else default)
                        for name, think_default, default, _ in IMMUTABLE if name != "temperature"}
            ok(server, chat(**toggle, max_tokens=1, temperature=1.0 if thinking else 0.6, **defaults))
            for name, _, _, wrong in IMMUTABLE:
                refused(server, chat(**toggle, **{name: wrong}), name)
    ok(server, chat(temperature=0.0, max_tokens=1))  # KVV's other thinking defaults, 0.0 and 0.6: in [0, 1]
    ok(server, chat(temperature=0.6, max_tokens=1))


# -- tests/prompt_tokens: usage.prompt_tokens against our tokenizer's count ---------------------------------------------

def prompt_cases(templates) -> list[tuple[str, dict, str, list, dict]]:
    """(name, request fields, template release, the messages the template renders, its kwargs): the rendered
    messages are written out by hand (ids renamed as Moonshot's API renames them), not taken from the middleware."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [
                   {"id": "call_9", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_9", "content": '{"celsius": 18}'},
               {"role": "assistant", "content": "18 C.", "reasoning_content": "Answer it."},
               {"role": "user", "content": "And tomorrow?"}]
    renamed = json.loads(json.dumps(history).replace("call_9", "functions.get_weather:0"))
    k27 = templates["k2.7"].chat_template
    thinking = templates["k2-thinking"].chat_template
    return [
        ("plain", {}, "k2.6", ASK, {}),
        ("thinking off", {"chat_template_kwargs": {"thinking": False}}, "k2.6", ASK, {"thinking": False}),
        ("history, tools", {"messages": history, "tools": [WEATHER]}, "k2.6", renamed, {}),
        ("preserved thinking", {"messages": history, "tools": [WEATHER], "thinking": {"type": "enabled",
                                                                                      "keep": "all"}},
         "k2.6", renamed, {"thinking": True, "preserve_thinking": True}),
        ("k2.7 always preserves", {"messages": history, "tools": [WEATHER], "chat_template": k27}, "k2.7", renamed,
         {}),
        ("k2-thinking", {"messages": history, "tools": [WEATHER], "chat_template": thinking}, "k2-thinking", renamed,
         {}),
    ]


def test_prompt_tokens_are_our_tokenizers_count_of_the_rendered_prompt(server, templates):
    """KVV tests/prompt_tokens: usage.prompt_tokens within +0..+3 of the truth; here exactly our tokenizer's count,
    streamed (the usage chunk the middleware asks for, as Kimi's API sends) and not, with and without preserved
    thinking (the history's reasoning rendered back, and counted)."""
    counts = {}
    for name, fields, release, messages, kwargs in prompt_cases(templates):
        tok = templates[release]
        tools = fields.get("tools")
        want = tok.encode(tok.apply_chat_template(messages, tools=tools, **kwargs))
        body = chat(**{"max_tokens": 1, **fields})
        reply = ok(server, body)
        assert reply["prompt_token_ids"] == want, (name, tok.decode(reply["prompt_token_ids"]))
        assert reply["usage"]["prompt_tokens"] == len(want), name
        _, usage, _ = streamed_message(ok(server, body, stream=True))
        assert usage["prompt_tokens"] == len(want), name
        counts[name] = len(want)
    assert counts["preserved thinking"] > counts["history, tools"]  # the earlier turns' reasoning is counted
    assert counts["k2.7 always preserves"] == counts["preserved thinking"]


# -- the thinking toggle -------------------------------------------------------------------------------------------------

def test_the_thinking_toggle_opens_or_closes_think_in_the_prompt(server, templates):
    """chat_template_kwargs.thinking (and Kimi's thinking.type): the prompt ends in <think> or <think></think>; the
    reply's reasoning comes as reasoning_content when thinking, none when not."""
    tok = templates["k2.6"]
    think, close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    for toggle, ends in (({}, [think]), ({"chat_template_kwargs": {"thinking": True}}, [think]),
                         ({"thinking": {"type": "enabled"}}, [think]),
                         ({"chat_template_kwargs": {"thinking": False}}, [think, close]),
                         ({"thinking": {"type": "disabled"}}, [think, close])):
        reply = ok(server, chat(**toggle, temperature=0))
        assert reply["prompt_token_ids"][-len(ends):] == ends, toggle
        message = reply["choices"][0]["message"]
        text = tok.decode(reply["choices"][0]["token_ids"], skip_special=True).rstrip("\ufffd")
        if ends == [think]:  # the output starts inside the reasoning
            reasoning, rest = grammar.split_reasoning(text, opened=True)
            assert (message.get("reasoning_content") or "") == reasoning and (message["content"] or "") == rest
        else:
            assert not message.get("reasoning_content")


# -- tests/k3_features/test_tool_choice.py -------------------------------------------------------------------------------

def test_tool_choice(server, templates):
    """auto and none, with and without tools, succeed; none gives no tool call; required needs tools; required and a
    named function are forced by the prompt (its end opens the tool section, or the call): whatever the random
    model writes then is read as a call, streamed and not alike; an unknown choice is refused."""
    tok = templates["k2.6"]
    section, argument = tok.token_to_id(grammar.SECTION_BEGIN), tok.token_to_id(grammar.ARGUMENT_BEGIN)
    for fields in ({"tool_choice": "auto"}, {"tool_choice": "none"}, {"tools": [WEATHER], "tool_choice": "auto"}):
        ok(server, chat(**fields))
    none = ok(server, chat(tools=[WEATHER], tool_choice="none", max_tokens=4))["choices"][0]
    assert not none["message"].get("tool_calls") and none["finish_reason"] in ("stop", "length")
    refused(server, chat(tool_choice="required"), "tool_choice required: needs a non-empty tools list")
    refused(server, chat(tools=[], tool_choice="required"), "tool_choice required: needs a non-empty tools list")
    refused(server, chat(tools=[WEATHER], tool_choice="bogus"), "tool_choice")
    for choice, last in (("required", section), ({"type": "function", "function": {"name": "get_weather"}},
                                                 argument)):
        body = chat(tools=[WEATHER], tool_choice=choice, max_tokens=6, temperature=0)
        reply = ok(server, body)
        assert reply["prompt_token_ids"][-1] == last
        message = reply["choices"][0]["message"]
        streamed, _, finish = streamed_message(ok(server, body, stream=True))
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in message.get("tool_calls") or ()]
        assert [c["name"] for c in streamed["tool_calls"]] == [c["name"] for c in calls]
        assert [c["arguments"] for c in streamed["tool_calls"]] == [c["arguments"] for c in calls]
        assert finish == reply["choices"][0]["finish_reason"]


# -- tests/k3_features/test_response_format.py ---------------------------------------------------------------------------

def test_response_format(server):
    """text is served; json_object and json_schema are refused with the reason where the server runs vllm-neuron's
    own worker, which applies no grammar (as this module's does; with this package's worker they are served:
    test_vllm_structured*.py), and so is every malformed form KVV sends."""
    ok(server, chat(response_format={"type": "text"}))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for response_format in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "weather", "strict": True,
                                                                    "schema": schema}},
                            {"type": "json_schema", "json_schema": {"name": "weather", "strict": False,
                                                                    "schema": schema}},
                            {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                            {"type": "json_schema", "json_schema": {"name": "weather"}},
                            {"type": "json_schema"},
                            {"type": "json_schema", "json_schema": {"name": "w", "strict": "yes", "schema": {}}},
                            {"type": "json_schema", "json_schema": {"name": "w", "schema": "x"}}):
        refused(server, chat(response_format=response_format), "response_format")
    refused(server, chat(response_format={"type": "bogus"}), "response_format.type")


# -- what a client reads: streamed and not, no padding -------------------------------------------------------------------

def test_streamed_and_not_give_one_message_without_padding(server, templates):
    """The same greedy request streamed (deltas of 3 tokens) and not: one message; its text is what our tokenizer
    decodes from the reply's token ids, read by our grammar: no space the slow detokenizer would put around <think>,
    </think> or a tool marker."""
    tok = templates["k2.6"]
    for fields in ({"chat_template_kwargs": {"thinking": False}}, {}, {"tools": [WEATHER]}):
        body = chat(**fields, max_tokens=12, temperature=0)
        reply = ok(server, body)
        choice = reply["choices"][0]
        message = choice["message"]
        streamed, _, finish = streamed_message(ok(server, body, stream=True))
        assert streamed["content"] == (message["content"] or "")
        assert streamed["reasoning_content"] == (message.get("reasoning_content") or "")
        assert finish == choice["finish_reason"]
        # vLLM's detokenizer holds back a character whose bytes are not all there, and the output's end never
        # completes it: the random model's bytes are often not UTF-8
        text = tok.decode(choice["token_ids"], skip_special=True).rstrip("\ufffd")
        opened = reply["prompt_token_ids"][-1] == tok.token_to_id("<think>")
        if fields.get("tools"):  # the tool parser reads what follows the reasoning
            parsed = grammar.parse(text, thinking=True, opened=opened, tools=fields["tools"])
            want = (parsed.content, parsed.reasoning)
        else:
            reasoning, rest = grammar.split_reasoning(text, opened)
            want = (rest, reasoning)
        assert (message["content"] or "", message.get("reasoning_content") or "") == want
