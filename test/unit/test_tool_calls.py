"""Kimi's output grammar (runtime.tool_calls) on golden token streams of the tiny tokenizer.

The oracle is the assistant message each golden output was rendered from by the chat template (testing.
tool_call_streams): its content, reasoning and calls (id, name, arguments) are what a parse must give back, at once
and streamed in every chunking, by tokens (1 per chunk up to all of them) and by characters (markers split).
"""

from __future__ import annotations

import random

import pytest

from kimi_k2_neuron.runtime.tool_calls import (CALL_BEGIN, CALL_END, TOOL_MARKERS, CallArguments, CallEnd, CallStart,
                                               Content, OutputStream, Parsed, Reasoning, ToolCall, collect, parse,
                                               split_reasoning, tool_name)
from kimi_k2_neuron.testing.tiny_tokenizer import KIMI_SPECIAL_TOKENS, tiny_special_id
from kimi_k2_neuron.testing.tool_call_streams import (ASSISTANT_HEADER, GOLDENS, TURN_END, assistant_output,
                                                      TokenStream, text_chunks, tiny_tokenizer)

REAL_IDS = {content: real for real, content, _ in KIMI_SPECIAL_TOKENS}
MARKERS = (*TOOL_MARKERS, "<think>", "</think>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def expected(golden) -> Parsed:
    return Parsed(golden.content, golden.reasoning, tuple(ToolCall(*call) for call in golden.calls))


def streamed(deltas, thinking: bool) -> tuple[list, Parsed]:
    stream = OutputStream(thinking=thinking)
    events = [e for d in deltas for e in stream.feed(d)] + stream.finish()
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
        started, ended = [], []
        for e in events:
            if isinstance(e, CallStart):
                assert e.index == len(started) and e.index == len(ended)
                started.append(e.index)
            elif isinstance(e, CallArguments):
                assert started and e.index == started[-1] and e.index not in ended
            elif isinstance(e, CallEnd):
                assert e.index == started[-1]
                ended.append(e.index)
            for value in vars(e).values():
                assert not (isinstance(value, str) and any(m in value for m in MARKERS)), e
        assert ended == list(range(len(golden.calls)))


def test_big_arguments_stream_as_they_come(tok):
    """Arguments over 8 KB are streamed piece by piece, each token's text out at once unless it may begin a marker."""
    golden = GOLDENS["big_arguments"]
    text = assistant_output(tok, golden)
    arguments = golden.calls[0][2]
    assert len(arguments) > 8192
    stream, sent, fed = OutputStream(), "", ""
    for delta, _ in TokenStream(tok, text).deltas(1):
        fed += delta
        sent += "".join(e.text for e in stream.feed(delta) if isinstance(e, CallArguments))
        if "<|tool_call_argument_begin|>" in fed and CALL_END not in fed:
            written = fed.split("<|tool_call_argument_begin|>", 1)[1]
            assert written.startswith(sent) and len(written) - len(sent) < len(CALL_END)
    assert sent == arguments


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
    ("get_weather:12", "get_weather"),
    ("functions.get_weather", "get_weather"),
    ("ns:tool:1", "ns:tool"),
    ("functions.a:b", "a:b"),
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
    # arguments keep their whitespace and any '<'
    (S + call("f:0", ' {"a": "<|x|> < "}\n') + E, "", [("f:0", "f", ' {"a": "<|x|> < "}\n')]),
    # the singular section spelling
    (f"x<|tool_call_section_begin|>{call('f:0', '1')}<|tool_call_section_end|>y", "xy", [("f:0", "f", "1")]),
    # a call outside any section; an end marker missing before the next call, before the section end
    (f"x{call('f:0', '1')}y", "xy", [("f:0", "f", "1")]),
    (f"{S}{B}f:0{A}1{B}g:1{A}2{E}z", "z", [("f:0", "f", "1"), ("g:1", "g", "2")]),
    # the output ends inside a call's arguments: the call with what it has; inside its id: the id text is content
    (f"ok{S}{B}functions.f:0{A}{{\"a\": 1", "ok", [("functions.f:0", "f", '{"a": 1')]),
    (f"ok{S}{B}functions.f", "okfunctions.f", []),
    (f"ok{S}{B}functions.f{S}{call('g:0', '1')}", "okfunctions.f", [("g:0", "g", "1")]),
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
    assert stream.feed("<|tool_call_argument_begin|>{") == [CallStart(0, "functions.f:0", "f"), CallArguments(0, "{")]
    assert stream.feed("}<|tool_call_e") == [CallArguments(0, "}")]
    assert stream.feed("nd|><|tool_calls_section_end|> <") == [CallEnd(0), Content(" ")]
    assert stream.finish() == [Content("<")]


def test_calls_closed_by_what_follows_them_end_and_a_call_cut_by_the_output_does_not():
    stream = OutputStream()
    events = stream.feed(f"{S}{B}f:0{A}1{B}g:1{A}2{E}{B}h:2{A}3") + stream.finish()
    assert [e.index for e in events if isinstance(e, CallEnd)] == [0, 1]
    assert [e.id for e in events if isinstance(e, CallStart)] == ["f:0", "g:1", "h:2"]
