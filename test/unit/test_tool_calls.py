"""Kimi's output grammar (runtime.tool_calls) on golden token streams of the tiny tokenizer.

The oracle is the assistant message each golden output was rendered from by the chat template (testing.
tool_call_streams): its content, reasoning and calls (id, name, arguments) are what a parse must give back, at once
and streamed in every chunking, by tokens (1 per chunk up to all of them) and by characters (markers split).
"""

from __future__ import annotations

import json
import random
import re

import pytest

from kimi_k2_neuron.runtime.tool_calls import (CALL_BEGIN, CALL_END, TOOL_MARKERS, Call, Content, Dropped,
                                               OutputStream, Parsed, Reasoning, ToolCall, collect, infer_name, parse,
                                               split_reasoning, tool_name)
from kimi_k2_neuron.tiny.tokenizer_files import KIMI_SPECIAL_TOKENS, tiny_special_id
from kimi_k2_neuron.testing.tool_call_streams import (ASSISTANT_HEADER, GOLDENS, TURN_END, assistant_output,
                                                      TokenStream, text_chunks, tiny_tokenizer)

REAL_IDS = {content: real for real, content, _ in KIMI_SPECIAL_TOKENS}
MARKERS = (*TOOL_MARKERS, "<think>", "</think>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def expected(golden) -> Parsed:
    return Parsed(golden.content, golden.reasoning, tuple(ToolCall(*call) for call in golden.calls))


def streamed(deltas, thinking: bool, tools=None, finish: bool = True):
    stream = OutputStream(thinking=thinking, tools=tools)
    events = [e for d in deltas for e in stream.feed(d)] + (stream.finish() if finish else [])
    return events, collect(events)


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_outputs_parse_to_their_message_at_once_and_in_every_token_chunking(tok, name):
    golden = GOLDENS[name]
    text = assistant_output(tok, golden)
    tokens = TokenStream(tok, text)
    ids = tokens.ids
    want = expected(golden)
    assert parse(text, thinking=bool(golden.reasoning)) == want
    # every marker is one token with Kimi's special id (at the tiny vocabulary's offset)
    for marker in MARKERS:
        if marker in text:
            marker_ids = tok.encode(marker)
            assert marker_ids == [tiny_special_id(REAL_IDS[marker], tok.num_base_tokens)] and marker_ids[0] in ids
    for size in range(1, len(ids) + 1):
        deltas = [d for d, _ in tokens.deltas(size)]
        assert "".join(deltas) == text
        assert streamed(deltas, bool(golden.reasoning))[1] == want, size


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_outputs_split_inside_markers(tok, name):
    """Text-level streams cut markers anywhere: every character chunking up to the longest marker, and random cuts."""
    golden = GOLDENS[name]
    text = assistant_output(tok, golden)
    want = expected(golden)
    for size in range(1, max(map(len, MARKERS)) + 2):
        assert streamed(text_chunks(text, size), bool(golden.reasoning))[1] == want, size
    rng = random.Random(name)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(pieces, bool(golden.reasoning))[1] == want, cuts


@pytest.mark.parametrize("name", GOLDENS)
def test_streamed_events_come_in_order_and_never_carry_a_marker(tok, name):
    golden = GOLDENS[name]
    text = assistant_output(tok, golden)
    for size in (1, 2, 3, 7, len(text)):
        events, _ = streamed(text_chunks(text, size), bool(golden.reasoning))
        calls = [e for e in events if isinstance(e, Call)]
        assert [c.index for c in calls] == list(range(len(golden.calls)))
        assert not [e for e in events if isinstance(e, Dropped)]
        for e in events:
            for value in vars(e).values():
                assert not (isinstance(value, str) and any(m in value for m in MARKERS)), e


def test_a_call_comes_whole_when_its_end_marker_arrives(tok):
    """Arguments over 8 KB, one token a delta: nothing of the call until the delta holding its end marker, then the
    whole call in one event (vllm_parsers sends it so that vLLM 0.13's last-chunk rewrite never applies)."""
    golden = GOLDENS["big_arguments"]
    text = assistant_output(tok, golden)
    assert len(golden.calls[0][2]) > 8192
    stream, fed, seen = OutputStream(), "", []
    for delta, _ in TokenStream(tok, text).deltas(1):
        fed += delta
        calls = [e for e in stream.feed(delta) if isinstance(e, Call)]
        assert bool(calls) == (delta == CALL_END), delta
        seen += calls
    assert seen == [Call(0, *golden.calls[0])]


def test_output_round_trips_through_the_chat_template(tok):
    """Parse an output, write the message back with the chat template: the same text, ids included (the template
    writes each call's id into the next prompt, so an id that changed would change what the model reads)."""
    for name, golden in GOLDENS.items():
        if golden.reasoning:
            continue
        text = assistant_output(tok, golden)
        parsed = parse(text)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed.calls]
        message = {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}
        again = tok.apply_chat_template([{"role": "user", "content": "Hi"}, message], add_generation_prompt=False)
        assert again.rsplit(ASSISTANT_HEADER, 1)[1] == text + TURN_END, name


@pytest.mark.parametrize("call_id, name", [
    ("functions.get_weather:0", "get_weather"),
    ("functions.mcp.server.tool:3", "mcp.server.tool"),
    ("functions.mcp__portal__search-documents:0", "mcp__portal__search-documents"),  # SGLang's hyphenated MCP name
    ("get_weather:12", "get_weather"),
    ("ns:tool:1", "ns:tool"),
    # ids that name no function: Kimi-K2.5's bare counters, client-style ids copied from a history, a typo
    ("0", None), ("3", None), ("call_9", None), ("call00003", None), ("functionsexec5", None),
    ("0f8fad5b-d9cb-469f-a165-70867728950e", None), ("functions.get_weather", None), ("functions.invalid.0", None),
    ("functions.a:b", None), ("functions.:3", None), (":3", None),
])
def test_tool_name(call_id, name):
    assert tool_name(call_id) == name


S, E, B, A, C = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", CALL_BEGIN,
                 "<|tool_call_argument_begin|>", CALL_END)


def call(call_id: str, arguments: str) -> str:
    return f"{B}{call_id}{A}{arguments}{C}"


@pytest.mark.parametrize("text, content, calls", [
    # text after the section, a second section
    (f"Before{S}{call('functions.f:0', '{}')}{E} after", "Before after", [("functions.f:0", "f", "{}")]),
    (f"a{S}{call('f:0', '1')}{E}b{S}{call('g:1', '2')}{E}c", "abc", [("f:0", "f", "1"), ("g:1", "g", "2")]),
    # whitespace around ids and between calls is not content; other text between calls is
    (f"{S}\n {B} functions.f:0 \n{A}{{}}{C}\n\n{call('g:1', '[]')}\n{E}", "", [("functions.f:0", "f", "{}"),
                                                                             ("g:1", "g", "[]")]),
    (f"{S} note {call('f:0', '1')} more\n{E}", " note  more\n", [("f:0", "f", "1")]),
    # arguments keep any '<' inside; the whitespace around them goes (a detokenizer's padding of the markers)
    (S + call("f:0", ' {"a": "<|x|> < "}\n') + E, "", [("f:0", "f", '{"a": "<|x|> < "}')]),
    (f"{S} {B} functions.f:0 {A} {{\"city\": \"Paris\"}} {C} {E}", "", [("functions.f:0", "f", '{"city": "Paris"}')]),
    # the singular section spelling
    (f"x<|tool_call_section_begin|>{call('f:0', '1')}<|tool_call_section_end|>y", "xy", [("f:0", "f", "1")]),
    # a call outside any section; an end marker missing before the next call, before the section end
    (f"x{call('f:0', '1')}y", "xy", [("f:0", "f", "1")]),
    (f"{S}{B}f:0{A}1{B}g:1{A}2{E}z", "z", [("f:0", "f", "1"), ("g:1", "g", "2")]),
    # the output ends after whole arguments: the call; inside them or inside its id: dropped, never content
    (f"ok{S}{B}functions.f:0{A}{{\"a\": 1}}", "ok", [("functions.f:0", "f", '{"a": 1}')]),
    (f"ok{S}{B}functions.f:0{A}{{\"a\": 1", "ok", []),
    (f"ok{S}{B}functions.f", "ok", []),
    (f"ok{S}{B}functions.f{S}{call('g:0', '1')}", "ok", [("g:0", "g", "1")]),
    # a call end without arguments; stray markers; an empty section; a marker cut by the end of the output
    (f"{S}{B}f:0{C}{E}", "", [("f:0", "f", "")]),
    (f"a{E}b{C}c{A}d", "abcd", []),
    (f"a{S}{E}b", "ab", []),
    (f"a{S}   ", "a", []),
    ("text <|tool_call", "text <|tool_call", []),
])
def test_edge_cases_at_once_and_split_anywhere(text, content, calls):
    want = Parsed(content, "", tuple(ToolCall(*c) for c in calls))
    assert parse(text) == want
    for size in range(1, len(text) + 1):
        assert streamed(text_chunks(text, size), False)[1] == want, size


SPLIT_OUTPUT = "Listing." + S + call("functions.bash:0", '{"command": "ls"}') + E + "Done."
SPLIT_MARKERS = {"end": C, "begin": B, "section-end": E, "argument-begin": A, "section-begin": S}


@pytest.mark.parametrize("marker", SPLIT_MARKERS)
def test_a_marker_split_across_two_deltas_is_held_back(marker):
    """Issue 41's regression: `<|tool_call_end|>` reaching the stream as `<|tool_call_` then `end|>` (a model writing
    the marker as ordinary text tokens, a detokenizer splitting it) leaked into the arguments, `{"command": "ls"}<|
    tool_call_end|>`, whose JSON then failed. Every split point of each marker, the rest in whole-token deltas, gives
    the at-once parse, and no event carries a piece of a marker."""
    want = Parsed("Listing.Done.", "", (ToolCall("functions.bash:0", "bash", '{"command": "ls"}'),))
    assert parse(SPLIT_OUTPUT) == want
    text = SPLIT_MARKERS[marker]
    head, tail = SPLIT_OUTPUT.split(text, 1)
    for cut in range(1, len(text)):
        deltas = [*TOKENS.findall(head), text[:cut], text[cut:], *TOKENS.findall(tail)]
        assert "".join(deltas) == SPLIT_OUTPUT
        for finish in (True, False):  # nothing waits for the end once the marker is whole
            events, got = streamed(deltas, False, finish=finish)
            assert got == want, (marker, cut, finish, got)
            assert not [e for e in events if isinstance(e, Dropped)]
            for e in events:
                assert "<|" not in str(getattr(e, "arguments", "")) + str(getattr(e, "text", "")), e


TOKENS = re.compile(r"<\|[a-z_]+\|>|[^<]+|<")  # whole markers, the text between them


# vLLM's test_kimi_k2_tool_parser.py (tests/tool_parsers, 2026) and SGLang's test_kimi_k2_detector cases: their
# outputs and expected content, names and arguments, through our parser. Differences, on purpose: arguments come
# stripped (theirs keep the padding); a call whose id names no function gets the id functions.NAME:IDX (theirs keeps
# "0", which the chat template then writes back into the next prompt: the history Kimi copies bare counters from).
def _tool(tool_id: str, args: str) -> str:
    return f"{B}{tool_id} {A}{args}{C}"


def _wrap(*tools: str) -> str:
    return S + "".join(tools) + E


def _fn(name: str, properties: dict, required: list | None = None) -> dict:
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


STRING = {"type": "string"}
WEATHER = _fn("get_weather", {"city": STRING, "unit": STRING})
READ_FILE = _fn("read_file", {"path": STRING})
BOOK_FLIGHT = _fn("book_flight", {"city": STRING})

PORTED = {
    "single_tool_call": ("I'll check. " + _wrap(_tool("functions.get_weather:0", '{"city": "Beijing"}')), None,
                         "I'll check. ", [("functions.get_weather:0", "get_weather", {"city": "Beijing"})]),
    "parallel_tool_calls": (
        "Compare weather. " + _wrap(_tool("functions.get_weather:0", '{"city": "Beijing"}'),
                                    _tool("functions.get_weather:1", '{"city": "Shanghai"}')), None,
        "Compare weather. ", [("functions.get_weather:0", "get_weather", {"city": "Beijing"}),
                              ("functions.get_weather:1", "get_weather", {"city": "Shanghai"})]),
    "three_tool_calls": (
        "Multiple tasks. " + _wrap(
            _tool("functions.get_weather:0", '{"city": "New York"}'),
            _tool("functions.get_news:1", '{"topic": "technology"}'),
            _tool("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')), None,
        "Multiple tasks. ", [("functions.get_weather:0", "get_weather", {"city": "New York"}),
                             ("functions.get_news:1", "get_news", {"topic": "technology"}),
                             ("functions.send_email:2", "send_email",
                              {"to": "user@example.com", "subject": "Daily Update"})]),
    "angle_brackets_in_json": (
        "Process HTML. " + _wrap(_tool("functions.process_html:0", '{"html": "<div>content</div>"}')), None,
        "Process HTML. ", [("functions.process_html:0", "process_html", {"html": "<div>content</div>"})]),
    "multiline_json": (
        "Formatted. " + _wrap(_tool("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')), None,
        "Formatted. ", [("functions.process_data:0", "process_data", {"name": "test", "value": 123})]),
    "no_functions_prefix": ("No prefix. " + _wrap(_tool("get_weather:0", '{"city": "Tokyo"}')), None, "No prefix. ",
                            [("get_weather:0", "get_weather", {"city": "Tokyo"})]),
    "empty_arguments": ("Empty args. " + _wrap(_tool("functions.test:0", "{}")), None, "Empty args. ",
                        [("functions.test:0", "test", {})]),
    "mixed_spacing": (
        f"Mixed spacing test. {S} {B} functions.test:0 {A} {{}} {C}{B}functions.test2:1{A}{{}}{C} {E}", None,
        "Mixed spacing test. ", [("functions.test:0", "test", {}), ("functions.test2:1", "test2", {})]),
    "invalid_funcall_id_skipped": (
        "Help. " + S + _tool("functions.invalid.0", '{"city": "Beijing"}')
        + _tool("functions.valid:1", '{"city": "Shanghai"}') + E, None, "Help. ",
        [("functions.valid:1", "valid", {"city": "Shanghai"})]),
    "bare_counter": ("Let me check. " + _wrap(_tool("0", '{"city": "Tokyo", "unit": "celsius"}')), [WEATHER],
                     "Let me check. ", [("functions.get_weather:0", "get_weather", {"city": "Tokyo",
                                                                                     "unit": "celsius"})]),
    "bare_counter_multiple_tools_infers_by_args": (
        "Let me check. " + _wrap(_tool("0", '{"city": "Tokyo", "unit": "celsius"}')), [READ_FILE, WEATHER],
        "Let me check. ", [("functions.get_weather:0", "get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    "bare_counter_ambiguous": ("Let me check. " + _wrap(_tool("0", '{"city": "Tokyo"}')), [WEATHER, BOOK_FLIGHT],
                               "Let me check. ", []),
    "bare_counter_malformed_json": ("Let me check. " + _wrap(_tool("0", '{"city": "Tokyo"')),
                                    [WEATHER, BOOK_FLIGHT], "Let me check. ", []),
    "hyphenated_name": (_wrap(_tool("functions.mcp__portal__search-documents:0", '{"path": "/docs"}')), None, "",
                        [("functions.mcp__portal__search-documents:0", "mcp__portal__search-documents",
                          {"path": "/docs"})]),
    "stray_markers_stripped": ("normal text" + E + "more" + A + "end", None, "normal textmoreend", []),
}


@pytest.mark.parametrize("name", PORTED)
def test_ported_cases_at_once_and_split_anywhere(name):
    text, tools, content, calls = PORTED[name]
    want_calls = [(i, n, a) for i, n, a in calls]

    def check(parsed):
        assert parsed.content == content
        assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.calls] == want_calls

    check(parse(text, tools=tools))
    for size in (1, 2, 3, 5, 8, len(text)):
        check(streamed(text_chunks(text, size), False, tools)[1])


def test_the_bare_counter_with_one_tool_and_malformed_arguments_is_that_tool():
    """vLLM's case: with one tool declared, the model can call only that one, whatever its arguments."""
    parsed = parse("Let me check. " + _wrap(_tool("0", '{"city": "Tokyo"')), tools=[WEATHER])
    assert parsed.calls == (ToolCall("functions.get_weather:0", "get_weather", '{"city": "Tokyo"'),)


@pytest.mark.parametrize("call_id", ["0", "3", "call_9", "call00003", "functionsexec5",
                                     "0f8fad5b-d9cb-469f-a165-70867728950e"])
def test_an_id_naming_no_function_never_becomes_the_name(call_id):
    """The defect of issue 30: such ids were returned as calls to a function named after the id."""
    text = _wrap(_tool(call_id, '{"path": "a.txt"}'))
    got = parse(text, tools=[WEATHER, READ_FILE])
    index = int(call_id[len(call_id.rstrip("0123456789")):] or 0)  # the id's trailing number, else the call's index
    assert got.calls == (ToolCall(f"functions.read_file:{index}", "read_file", '{"path": "a.txt"}'),)
    assert parse(text).calls == ()  # no tools declared: nothing to infer from, dropped
    events = OutputStream().feed(text)
    assert [e.why for e in events if isinstance(e, Dropped)] == [
        "its id names no function and its arguments fit no one tool of the request"]


@pytest.mark.parametrize("arguments, tools, name", [
    ('{"city": "Paris"}', [WEATHER, READ_FILE], "get_weather"),
    ('{"city": "Paris"}', [WEATHER, BOOK_FLIGHT], None),  # both fit
    ('{"city": "Paris", "unit": "C"}', [WEATHER, BOOK_FLIGHT], "get_weather"),
    ('{"q": 1}', [WEATHER, READ_FILE], None),  # none fits
    ('{"path": "x"}', [_fn("a", {"path": STRING}, ["path"]), _fn("b", {"path": STRING, "n": STRING}, ["n"])], "a"),
    ('{"x": 1}', [_fn("open", {}) | {}, {"type": "function", "function": {
        "name": "any", "parameters": {"type": "object", "additionalProperties": True}}}], "any"),
    ("[1]", [WEATHER, READ_FILE], None),
    ("not json", [WEATHER, READ_FILE], None),
    ("{}", [], None),
])
def test_infer_name(arguments, tools, name):
    assert infer_name(arguments, tools) == name


def test_held_text_waits_for_the_next_delta_or_the_end():
    """A tail that could begin a marker waits: for the next delta, which completes the marker or shows it was text,
    or for finish() (vllm_parsers calls it at the stop token and at max_tokens: issue 30's 'Compare 1 <' is whole)."""
    for thinking, prefix, field, tails in ((False, "", "content", ("<", "<|", "<|tool_calls_sec")),
                                           (True, "<think>", "reasoning",
                                            ("<", "<|", "</", "<|tool_calls_sec", "</thi"))):
        for tail in tails:
            pieces = ([prefix] if prefix else []) + text_chunks("Compare 1 " + tail, 1)
            assert getattr(streamed(pieces, thinking, finish=False)[1], field) == "Compare 1 "
            assert getattr(streamed(pieces, thinking)[1], field) == "Compare 1 " + tail
            assert getattr(streamed(pieces + [" 2"], thinking, finish=False)[1], field) == "Compare 1 " + tail + " 2"


def test_a_prefill_sets_where_the_output_continues():
    """A forced call: the prompt ends inside the section (or inside a call's id); the prefill's text is no output."""
    stream = OutputStream(tools=[WEATHER])
    stream.prefill("Sure." + S)
    events = stream.feed(call("functions.get_weather:0", '{"city": "Paris"}') + E) + stream.finish()
    assert collect(events) == Parsed("", "", (ToolCall("functions.get_weather:0", "get_weather",
                                                        '{"city": "Paris"}'),))
    assert parse('{"city": "Oslo"}' + C + E, prefill=S + B + "functions.get_weather:3" + A) == Parsed(
        "", "", (ToolCall("functions.get_weather:3", "get_weather", '{"city": "Oslo"}'),))
    thinking = OutputStream(thinking=True, opened=True)
    thinking.prefill("</think>" + S)
    assert collect(thinking.feed(call("f:0", "{}") + E)).calls == (ToolCall("f:0", "f", "{}"),)


@pytest.mark.parametrize("text, opened, reasoning, rest", [
    ("Hello <think>not reasoning</think>", False, "", "Hello <think>not reasoning</think>"),
    ("\n<think>deep</think>answer", False, "deep", "answer"),
    ("<think>cut off", False, "cut off", ""),
    ("<think>r" + S + call("f:0", "1") + E, False, "r", S + call("f:0", "1") + E),
    ("<think>r" + call("f:0", "1"), False, "r", call("f:0", "1")),
    ("r</think>answer", True, "r", "answer"),
    ("r</think>answer", False, "", "r</think>answer"),
    ("   ", False, "", "   "),
    ("<thin", False, "", "<thin"),
    ("</think>", True, "", ""),
    # SGLang's case: a tool call inside <think> without </think>
    ("<think>Let me read this file..." + _wrap(_tool("functions.ReadFile:0", '{"path": "/test.py"}')), False,
     "Let me read this file...", _wrap(_tool("functions.ReadFile:0", '{"path": "/test.py"}'))),
])
def test_reasoning_only_when_the_output_or_the_prompt_opens_it(text, opened, reasoning, rest):
    assert split_reasoning(text, opened) == (reasoning, rest)
    for size in range(1, len(text) + 1):
        stream = OutputStream(thinking=True, opened=opened)
        events = [e for piece in text_chunks(text, size) for e in stream.feed(piece)] + stream.finish()
        assert "".join(e.text for e in events if isinstance(e, Reasoning)) == reasoning
        assert collect(events) == Parsed(parse(rest).content, reasoning, parse(rest).calls), size


def test_a_marker_split_across_deltas_is_held_then_released():
    stream = OutputStream()
    assert stream.feed("Hi <|tool_ca") == [Content("Hi ")]
    assert stream.feed("lls_section_begin|><|tool_call_begin|>functions.f:0") == []
    assert stream.feed("<|tool_call_argument_begin|>{") == []
    assert stream.feed("}<|tool_call_e") == []
    assert stream.feed("nd|><|tool_calls_section_end|> <") == [Call(0, "functions.f:0", "f", "{}"), Content(" ")]
    assert stream.finish() == [Content("<")]


def test_calls_closed_by_what_follows_them_and_one_cut_by_the_output():
    stream = OutputStream()
    events = stream.feed(f"{S}{B}f:0{A}1{B}g:1{A}2{E}{B}h:2{A}3") + stream.finish()
    assert [e.id for e in events if isinstance(e, Call)] == ["f:0", "g:1", "h:2"]  # "3" is whole JSON
    stream = OutputStream()
    events = stream.feed(f"{S}{B}f:0{A}1{B}g:1{A}[2") + stream.finish()
    assert [e.id for e in events if isinstance(e, Call)] == ["f:0"]
    assert [(e.id, e.why) for e in events if isinstance(e, Dropped)] == [("g:1", "the output ended inside its "
                                                                                 "arguments")]
