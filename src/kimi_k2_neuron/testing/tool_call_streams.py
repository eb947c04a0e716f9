"""Golden assistant outputs with Kimi's tool calls, as token streams of the tiny tokenizer, for the parser tests.

Each output is what the chat template writes for an assistant message (content, then the tool-call section with
each call's id and arguments), so the message itself is the expected parse; Thinking outputs put
<think>REASONING</think> first, as Kimi-K2-Thinking writes it. The tiny tokenizer keeps Kimi's special tokens at
their real offsets (tiny.tokenizer_files.tiny_special_id), so every marker is one token, as with the real tokenizer.
`TokenStream.deltas` cuts a token stream into chunks of n tokens and decodes each chunk as a streaming detokenizer does:
UTF-8 bytes split across chunks wait for the rest of their character.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path

from ..runtime.tokenizer import KimiTokenizer
from ..tiny.tokenizer_files import write_tiny_tokenizer

ASSISTANT_HEADER = "<|im_assistant|>assistant<|im_middle|>"
TURN_END = "<|im_end|>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


@dataclass(frozen=True)
class Golden:
    """An assistant message and what a parser must read from its output: (id, name, arguments) per call."""
    content: str
    calls: tuple[tuple[str, str, str], ...] = ()
    reasoning: str = ""
    tools: tuple[dict, ...] = (WEATHER,)

    def message(self) -> dict:
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in self.calls]
        return {"role": "assistant", "content": self.content, **({"tool_calls": calls} if calls else {})}


def _big_arguments() -> str:
    """Over 8 KB of JSON arguments (vLLM 0.13's streaming parser gives up on a tool section past 8192 characters),
    with escapes and non-ASCII text."""
    lines = [f"line {i}: naïve café, \"quoted\" and \\backslash\\ — 東京 {i * i}" for i in range(150)]
    return json.dumps({"path": "notes/big.txt", "content": "\n".join(lines)}, ensure_ascii=False)


GOLDENS = {
    "one_call": Golden("", (("functions.get_weather:0", "get_weather", '{"city": "Zürich"}'),)),
    "two_calls": Golden("Let me check both cities.", (
        ("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ("functions.get_weather:1", "get_weather", '{"city": "東京"}'))),
    "dotted_name": Golden("", (("functions.mcp.server.tool:3", "mcp.server.tool", '{"q": "a<b && c>d"}'),)),
    "no_prefix": Golden("", (("get_weather:0", "get_weather", "{}"),)),
    "big_arguments": Golden("Writing the file.", (("functions.write_file:0", "write_file", _big_arguments()),)),
    "content_only": Golden("No tool needed: 2 < 3 and <|im_end is not a marker."),
    "thinking_call": Golden("", (("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),),
                            reasoning="The user wants the weather; call get_weather."),
    "thinking_content": Golden("It is sunny.", reasoning="Plain answer, no tool."),
}


def tiny_tokenizer(out_dir: str | Path) -> KimiTokenizer:
    """The tiny byte-level tokenizer (Kimi's special tokens, 256 byte tokens) written to out_dir and loaded."""
    write_tiny_tokenizer(out_dir)
    return KimiTokenizer.from_dir(out_dir)


def assistant_output(tokenizer: KimiTokenizer, golden: Golden) -> str:
    """The text Kimi generates for golden's message: the chat template's assistant turn, without its header and
    <|im_end|>, after <think>REASONING</think> if it has reasoning."""
    chat = [{"role": "user", "content": "Hi"}, golden.message()]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tools=list(golden.tools))
    turn = text.rsplit(ASSISTANT_HEADER, 1)[1]
    assert turn.endswith(TURN_END), turn
    thought = f"<think>{golden.reasoning}</think>" if golden.reasoning else ""
    return thought + turn[: -len(TURN_END)]


class TokenStream:
    """A text's token ids, to be cut into chunks of n tokens each decoded as a streaming detokenizer decodes them."""

    def __init__(self, tokenizer: KimiTokenizer, text: str):
        self.ids = tokenizer.encode(text)
        pieces = [tokenizer.encoding.decode_single_token_bytes(i) for i in self.ids]
        self._offsets = [0]
        for piece in pieces:
            self._offsets.append(self._offsets[-1] + len(piece))
        self._data = b"".join(pieces)

    def deltas(self, size: int) -> list[tuple[str, list[int]]]:
        """(text, token ids) of each chunk of `size` tokens, decoded incrementally as UTF-8."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, end = [], len(self.ids)
        for start in range(0, end, size):
            stop = min(start + size, end)
            text = decoder.decode(self._data[self._offsets[start]:self._offsets[stop]], final=stop == end)
            out.append((text, self.ids[start:stop]))
        return out


def text_chunks(text: str, size: int) -> list[str]:
    """text cut every `size` characters: pieces that split markers, as a text-level stream may."""
    return [text[i:i + size] for i in range(0, len(text), size)]
