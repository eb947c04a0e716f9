"""Kimi-K2's tool calls and reasoning as a vLLM parser plugin (ToolParser and ReasoningParser of vLLM 0.13 and 0.16,
the Neuron SDK 2.28's and 2.29's):

    P=$(python -c 'import kimi_k2_neuron, os; print(os.path.dirname(kimi_k2_neuron.__file__))')/neuron/vllm_parsers.py
    vllm serve MODEL --enable-auto-tool-choice --tool-parser-plugin $P --tool-call-parser kimi_k2_neuron \\
        --reasoning-parser-plugin $P --reasoning-parser kimi_k2_neuron      # the last two for Kimi-K2-Thinking

Importing it registers both under NAME. They only translate: the grammar and streaming are runtime.tool_calls'.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

try:  # vLLM 0.16 (SDK 2.29) split vllm/entrypoints/openai/protocol.py; these are in engine/protocol.py there
    from vllm.entrypoints.openai.engine.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                         ExtractedToolCallInformation, FunctionCall, ToolCall)
except ImportError:  # vLLM 0.13 (SDK 2.28)
    from vllm.entrypoints.openai.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                  ExtractedToolCallInformation, FunctionCall, ToolCall)
from vllm.reasoning import ReasoningParser, ReasoningParserManager
from vllm.tool_parsers import ToolParser, ToolParserManager

from kimi_k2_neuron.runtime import tool_calls as grammar

NAME = "kimi_k2_neuron"
# Tokens that end an assistant turn. vLLM leaves the stop token out of the delta's text but keeps it last in the
# delta's ids, so its arrival tells a parser that the output is over and held-back text can go.
TURN_ENDS = ("<|im_end|>", "[EOS]")
# Every marker a parser reads is one of these single tokens; a prompt ending in one of the last three ends inside a
# tool section (a prefilled, forced call), where reasoning is over.
TOOL_OPENERS = (*grammar.SECTION_BEGINS, grammar.CALL_BEGIN, grammar.ARGUMENT_BEGIN)
logger = logging.getLogger(__name__)


def _turn_end_ids(tokenizer, vocab: dict[str, int]) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {vocab[t] for t in TURN_ENDS if t in vocab} | ({eos} if isinstance(eos, int) else set())


def _arguments_value(text: str):
    """What serving_chat.py keeps of a call's arguments in prev_tool_call_arr: the parsed JSON, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def request_tools(request) -> list[dict]:
    """The request's tools as plain dicts (vLLM holds them as pydantic models)."""
    tools = getattr(request, "tools", None) or []
    return [t.model_dump() if hasattr(t, "model_dump") else t for t in tools]


def request_prefill(request) -> str:
    """The start of the assistant message a request continues (continue_final_message), which the prompt holds."""
    messages = getattr(request, "messages", None) or []
    if not getattr(request, "continue_final_message", False) or not messages:
        return ""
    last = messages[-1]
    last = last if isinstance(last, dict) else getattr(last, "__dict__", {})
    content = last.get("content")
    return content if last.get("role") == "assistant" and isinstance(content, str) else ""


def output_limit(request) -> int | None:
    """The output length the request sets (max_completion_tokens, else max_tokens), when it sets one."""
    fields = vars(request) if hasattr(request, "__dict__") else {}  # vars: max_tokens is deprecated, read warns
    limit = fields.get("max_completion_tokens") or fields.get("max_tokens")
    return limit if isinstance(limit, int) and limit > 0 else None


def no_special_token_spaces(request):
    """vLLM's slow detokenizer (Kimi's tokenizer is a slow one) puts a space on each side of every added token
    (markers, <think>) unless spaces_between_special_tokens is false: ' {"city": "Paris"} ', reasoning ' ok ',
    content ' 1'. Turned off unless the client set it."""
    if "spaces_between_special_tokens" not in getattr(request, "model_fields_set", {"spaces_between_special_tokens"}):
        request.spaces_between_special_tokens = False
    return request


class KimiK2NeuronToolParser(ToolParser):
    """Kimi's tool calls, at once (extract_tool_calls) and streamed (extract_tool_calls_streaming).

    Streamed, each call goes out whole in the delta where the model closes it, as two entries of the same index: its
    id, type and name, then its arguments. vLLM 0.13's serving_chat.py rewrites a last chunk whose first tool-call
    entry carries arguments, replacing the chunk with json.dumps(prev_tool_call_arr[-1]["arguments"]) minus what
    was streamed: `{"city":"Paris"}` sent in pieces comes out `{"city":"Pa{"city": "Paris"}`, and the chunk's other
    calls and content are lost. A first entry without arguments is never rewritten."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self._stream: grammar.OutputStream | None = None
        self._limit: int | None = None
        self._turn_ends = _turn_end_ids(tokenizer, self.vocab)

    def adjust_request(self, request):
        return no_special_token_spaces(super().adjust_request(request))

    def _new_stream(self, request) -> grammar.OutputStream:
        stream = grammar.OutputStream(tools=request_tools(request))
        prefill = request_prefill(request)
        if prefill:
            stream.prefill(prefill)
        return stream

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        stream = self._new_stream(request)
        events = stream.feed(model_output) + stream.finish()
        self._log_dropped(events)
        parsed = grammar.collect(events)
        calls = [ToolCall(id=c.id, type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=parsed.content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request) -> DeltaMessage | None:
        if self._stream is None:
            self._stream, self._limit = self._new_stream(request), output_limit(request)
        events = self._stream.feed(delta_text)
        limit = self._limit
        if (delta_token_ids and delta_token_ids[-1] in self._turn_ends | set(request.stop_token_ids or ())) or (
                limit is not None and len(current_token_ids) >= limit):
            events += self._stream.finish()
        return self._delta(events)

    @staticmethod
    def _log_dropped(events: list[grammar.Event]) -> None:
        for event in events:
            if isinstance(event, grammar.Dropped):
                logger.warning("kimi_k2_neuron: dropped a tool call with id %r and arguments %r: %s", event.id,
                               event.arguments[:200], event.why)

    def _delta(self, events: list[grammar.Event]) -> DeltaMessage | None:
        """One DeltaMessage for a delta's events, keeping the state serving_chat.py reads when the stream ends
        (prev_tool_call_arr: whether calls were made; streamed_args_for_tool)."""
        self._log_dropped(events)
        content, entries = "", []
        for event in events:
            if isinstance(event, grammar.Content):
                content += event.text
            elif isinstance(event, grammar.Call):
                self.current_tool_id, self.current_tool_name_sent = event.index, True
                self.prev_tool_call_arr.append({"name": event.name, "arguments": _arguments_value(event.arguments)})
                self.streamed_args_for_tool.append(event.arguments)
                entries += [DeltaToolCall(index=event.index, id=event.id, type="function",
                                          function=DeltaFunctionCall(name=event.name)),
                            DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.arguments))]
        if not content and not entries:
            return None
        # fields left unset stay out of the chunk's JSON (serving_chat dumps with exclude_unset)
        return DeltaMessage(**({"content": content} if content else {}), **({"tool_calls": entries} if entries else {}))


def _prompt_opens_thinking(tokenizer, chat_template_kwargs: dict | None) -> bool:
    """Whether the chat template ends its generation prompt with <think> (Kimi-K2.5 with thinking on), so that the
    output starts inside the reasoning; Kimi-K2-Thinking's template does not (the model writes <think>)."""
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "."}], tokenize=False,
                                               add_generation_prompt=True, **(chat_template_kwargs or {}))
    except Exception:  # a template that cannot render this probe: the output is read as it comes
        return False
    return isinstance(prompt, str) and prompt.rstrip().endswith(grammar.THINK_OPEN)


class KimiK2NeuronReasoningParser(ReasoningParser):
    """<think>...</think> when the output (or the prompt) opens it, else none. vLLM asks is_reasoning_end() of the
    prompt's ids, then of each delta's after extract_reasoning_streaming() read it: true once the reasoning is over,
    at once for an output that never opens it, or for a prompt that ends after </think> or inside a tool section (a
    prefilled, forced call); then the rest goes to the tool parser."""

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        vocab = self.vocab
        self._open, self._close = vocab.get(grammar.THINK_OPEN), vocab.get(grammar.THINK_CLOSE)
        self._tool_begins = {vocab[m] for m in (*grammar.SECTION_BEGINS, grammar.CALL_BEGIN) if m in vocab}
        self._prompt_ends = {vocab[m] for m in (grammar.THINK_CLOSE, *TOOL_OPENERS) if m in vocab}
        self._turn_ends = _turn_end_ids(tokenizer, vocab)
        self._opened = _prompt_opens_thinking(tokenizer, kwargs.get("chat_template_kwargs"))
        self._splitter = grammar.ReasoningSplitter(self._opened)
        self._streaming = False

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        if self._streaming:
            return self._splitter.done
        return bool(input_ids) and input_ids[-1] in self._prompt_ends

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Sequence[int]) -> bool:
        return any(i == self._close or i in self._tool_begins for i in delta_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        for at, i in enumerate(input_ids):
            if i == self._close:
                return input_ids[at + 1:]
            if i in self._tool_begins:
                return input_ids[at:]
        return [] if self._open in input_ids else input_ids

    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        # a continued assistant message (a prefill) is past the template's generation prompt and its <think>
        opened = self._opened and not request_prefill(request)
        reasoning, rest = grammar.split_reasoning(model_output, opened)
        return reasoning or None, rest or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        self._streaming = True
        parts = self._splitter.feed(delta_text)
        if delta_token_ids and delta_token_ids[-1] in self._turn_ends:
            parts += self._splitter.finish()
        reasoning = "".join(p.text for p in parts if isinstance(p, grammar.Reasoning))
        content = "".join(p.text for p in parts if isinstance(p, grammar.Content))
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)


ToolParserManager.register_module(NAME, module=KimiK2NeuronToolParser)
ReasoningParserManager.register_module(NAME, module=KimiK2NeuronReasoningParser)
