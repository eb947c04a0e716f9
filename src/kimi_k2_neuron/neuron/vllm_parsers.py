"""Kimi-K2's tool calls and reasoning as a vLLM parser plugin (ToolParser and ReasoningParser of vLLM 0.13 and 0.16,
the Neuron SDK 2.28's and 2.29's):

    P=$(python -c 'import kimi_k2_neuron, os; print(os.path.dirname(kimi_k2_neuron.__file__))')/neuron/vllm_parsers.py
    vllm serve MODEL --enable-auto-tool-choice --tool-parser-plugin $P --tool-call-parser kimi_k2_neuron \\
        --reasoning-parser-plugin $P --reasoning-parser kimi_k2_neuron      # the last two for Kimi-K2-Thinking

Importing it registers both under NAME. They only translate: the grammar and streaming are runtime.tool_calls'.
"""

from __future__ import annotations

import json
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


def _turn_end_ids(tokenizer, vocab: dict[str, int]) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {vocab[t] for t in TURN_ENDS if t in vocab} | ({eos} if isinstance(eos, int) else set())


def _arguments_value(text: str):
    """What serving_chat.py json.dumps() from prev_tool_call_arr when the last chunk carries arguments: the parsed
    arguments (so that it writes the same text again when the model wrote canonical JSON), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class KimiK2NeuronToolParser(ToolParser):
    """Kimi's tool calls, at once (extract_tool_calls) and streamed (extract_tool_calls_streaming)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self._stream = grammar.ToolCallStream()
        self._turn_ends = _turn_end_ids(tokenizer, self.vocab)

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        parsed = grammar.parse(model_output)
        calls = [ToolCall(id=c.id, type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=parsed.content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request) -> DeltaMessage | None:
        events = self._stream.feed(delta_text)
        if delta_token_ids and delta_token_ids[-1] in self._turn_ends | set(request.stop_token_ids or ()):
            events += self._stream.finish()
        return self._delta(events)

    def _delta(self, events: list[grammar.Event]) -> DeltaMessage | None:
        """One DeltaMessage for a delta's events (several markers may arrive in one delta), keeping the state
        serving_chat.py reads when the stream ends (prev_tool_call_arr, streamed_args_for_tool)."""
        content, calls = "", {}
        for event in events:
            if isinstance(event, grammar.Content):
                content += event.text
            elif isinstance(event, grammar.CallStart):
                self.current_tool_id, self.current_tool_name_sent = event.index, True
                self.prev_tool_call_arr.append({"name": event.name, "arguments": ""})
                self.streamed_args_for_tool.append("")
                calls[event.index] = {"id": event.id, "type": "function", "name": event.name}
            elif isinstance(event, grammar.CallArguments):
                self.streamed_args_for_tool[event.index] += event.text
                call = calls.setdefault(event.index, {})
                call["arguments"] = call.get("arguments", "") + event.text
            elif isinstance(event, grammar.CallEnd):
                self.prev_tool_call_arr[event.index]["arguments"] = _arguments_value(
                    self.streamed_args_for_tool[event.index])
        if not content and not calls:
            return None
        delta = {"content": content} if content else {}
        if calls:  # fields left unset stay out of the chunk's JSON (serving_chat dumps with exclude_unset)
            delta["tool_calls"] = [
                DeltaToolCall(index=i, **{k: c[k] for k in ("id", "type") if k in c},
                              function=DeltaFunctionCall(**{k: c[k] for k in ("name", "arguments") if k in c}))
                for i, c in calls.items()]
        return DeltaMessage(**delta)


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
    at once for an output that never opens it; then the rest goes to the tool parser."""

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        vocab = self.vocab
        self._open, self._close = vocab.get(grammar.THINK_OPEN), vocab.get(grammar.THINK_CLOSE)
        self._tool_begins = {vocab[m] for m in (*grammar.SECTION_BEGINS, grammar.CALL_BEGIN) if m in vocab}
        self._turn_ends = _turn_end_ids(tokenizer, vocab)
        self._opened = _prompt_opens_thinking(tokenizer, kwargs.get("chat_template_kwargs"))
        self._splitter = grammar.ReasoningSplitter(self._opened)
        self._streaming = False

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        if self._streaming:
            return self._splitter.done
        return bool(input_ids) and input_ids[-1] == self._close

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
        reasoning, rest = grammar.split_reasoning(model_output, self._opened)
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
