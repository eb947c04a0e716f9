"""Kimi-K2's assistant output read as text: reasoning, content and tool calls, streamed or at once (vllm_parsers
puts vLLM's parser interfaces on top). What Kimi writes (its chat template writes the same back for earlier turns):

    [<think>REASONING</think>]CONTENT<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>  (once per call)
    <|tool_calls_section_end|>

The markers are single special tokens, but a stream may still cut one: a model can write a marker as ordinary text
tokens (`<|tool_call_` then `end|>`), a detokenizer can split it, a text-level stream cuts anywhere. So a delta's
tail that could begin a marker waits for the next delta (at most 27 characters), whoever feeds it; `finish()`
releases it when the output ends.

Markers are never content, reasoning, id or arguments. A call is reported whole (`Call`), once it is closed: by its
end marker, the next call, the section end, or the end of the output if its arguments are then complete JSON. Its
arguments are the text between its argument and end markers with the whitespace around it stripped (a detokenizer
that pads special tokens with spaces adds some). Its id (between its begin and argument markers, stripped) is kept
verbatim, since the chat template writes it back, when it names a function: `functions.NAME:IDX` or `NAME:IDX`, the
name with its dots. An id without `:IDX` (`0`, `call_9`, a UUID: Kimi copies such ids from histories other servers
wrote) names none: the call gets the request's only tool, or else the one tool whose parameters its arguments fit,
and the id `functions.NAME:IDX`; with no such tool it is dropped (`Dropped`), since a call to a wrong function is
worse than none. Text outside tool sections is content; inside one, whitespace between
calls is dropped and other text is content.

Malformed output: a call begin marker outside a section opens one; a call whose id never reaches its argument marker,
or whose arguments the output cut short, is dropped; a marker where it means nothing (a section end outside a
section, say) is dropped. A prefill (`OutputStream.prefill`: the start of the assistant message the prompt already
holds, as for a forced tool call) sets the state the output continues from; its own text is not output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
# The singular spelling some Kimi outputs use for the section markers (vLLM's kimi_k2 parser accepts it too).
SECTION_BEGINS = (SECTION_BEGIN, "<|tool_call_section_begin|>")
SECTION_ENDS = (SECTION_END, "<|tool_call_section_end|>")
TOOL_MARKERS = (*SECTION_BEGINS, *SECTION_ENDS, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
# What ends reasoning: its close marker, or a tool call written without one.
REASONING_ENDS = (THINK_CLOSE, *SECTION_BEGINS, CALL_BEGIN)
FUNCTION_PREFIX = "functions."


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Call:
    """Call `index` (0, 1, ... among the calls reported for this output), whole."""
    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Dropped:
    """A call that is not reported, and why (the caller logs it)."""
    id: str
    arguments: str
    why: str


Event = Content | Reasoning | Call | Dropped


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = field(default_factory=tuple)


def tool_name(call_id: str) -> str | None:
    """The function a Kimi tool-call id names: `functions.mcp.server.tool:3` -> `mcp.server.tool`, `get_weather:0`
    -> `get_weather`; None for an id without the `:IDX` suffix (`0`, `call_9`, a UUID, `functions.f.0`)."""
    head, colon, index = call_id.rpartition(":")
    if not (colon and index.isdigit()):
        return None
    name = head[len(FUNCTION_PREFIX):] if head.startswith(FUNCTION_PREFIX) else head
    return name or None


def tool_schemas(tools: Iterable | None) -> list[tuple[str, dict]]:
    """(name, parameters) of each function tool of a request, as OpenAI's `tools` holds them."""
    out = []
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            out.append((function["name"], parameters if isinstance(parameters, dict) else {}))
    return out


def _fits(arguments: dict, parameters: dict) -> bool:
    """Whether arguments could be a call of a function with these parameters: its required keys all there, and no
    key it does not declare (unless it declares additionalProperties). Names, not types: enough to tell tools
    apart."""
    declared = parameters.get("properties")
    declared = declared if isinstance(declared, dict) else {}
    required = parameters.get("required")
    if isinstance(required, list) and any(key not in arguments for key in required):
        return False
    return bool(parameters.get("additionalProperties")) or all(key in declared for key in arguments)


def infer_name(arguments: str, tools: Iterable | None) -> str | None:
    """The request's only tool; else the one tool whose parameters the arguments (a JSON object) fit; else None."""
    schemas = tool_schemas(tools)
    if len(schemas) == 1:  # the only function the model could call
        return schemas[0][0]
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    names = [name for name, parameters in schemas if _fits(value, parameters)]
    return names[0] if len(names) == 1 else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest marker in text and where it starts; (len(text), None) if none occurs."""
    best, found = len(text), None
    for marker in markers:
        at = text.find(marker, 0, best + len(marker))
        if 0 <= at < best:
            best, found = at, marker
    return best, found


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of text's tail that could be the start of a marker (every marker opens with its only '<')."""
    longest = max(map(len, markers))
    at = text.rfind("<", max(0, len(text) - longest + 1))
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(len(tail) < len(m) and m.startswith(tail) for m in markers) else 0


class ReasoningSplitter:
    """Splits an output into its reasoning and the rest (as Content events, markers of the rest untouched).
    Reasoning is there only when the output opens with <think> or `opened` (the prompt ended with it); it ends at
    </think> (dropped) or at a tool section or call begin marker (kept, for the tool parser)."""

    def __init__(self, opened: bool = False):
        self._state = "reasoning" if opened else "start"
        self._buf = ""

    @property
    def done(self) -> bool:
        """True once the reasoning is over (or turned out never to begin): the rest is content."""
        return self._state == "rest"

    def feed(self, text: str) -> list[Reasoning | Content]:
        self._buf += text
        out: list[Reasoning | Content] = []
        if self._state == "start":
            body = self._buf.lstrip()
            if body.startswith(THINK_OPEN):
                self._state, self._buf = "reasoning", body[len(THINK_OPEN):]
            elif not body or THINK_OPEN.startswith(body):
                return out  # whitespace, or a prefix of <think>: undecided
            else:
                self._state = "rest"
        if self._state == "reasoning":
            at, marker = _first(self._buf, REASONING_ENDS)
            if marker is None:
                at = len(self._buf) - _held(self._buf, REASONING_ENDS)
            if at:
                out.append(Reasoning(self._buf[:at]))
            if marker is None:
                self._buf = self._buf[at:]
                return out
            self._state = "rest"
            self._buf = self._buf[at + len(THINK_CLOSE):] if marker == THINK_CLOSE else self._buf[at:]
        if self._buf:
            out.append(Content(self._buf))
            self._buf = ""
        return out

    def finish(self) -> list[Reasoning | Content]:
        """The output ended: what was held back (whitespace, part of a marker) is released as it stands."""
        text, self._buf = self._buf, ""
        if not text:
            return []
        return [Reasoning(text)] if self._state == "reasoning" else [Content(text)]


class ToolCallStream:
    """Content and tool calls of an output (after its reasoning), as events, from successive text deltas. `tools`:
    the request's, for calls whose id names no function."""

    def __init__(self, tools: Iterable | None = None):
        self._tools = list(tools or ())
        self._state = "content"  # content | section | id | arguments
        self._buf = ""
        self._id = ""
        self._args = ""
        self._gap = ""  # whitespace between calls in a section, dropped unless other text follows before a marker
        self._gap_shown = False
        self.calls = 0  # calls reported so far

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            at, marker = _first(self._buf, TOOL_MARKERS)
            if marker is None:
                at = len(self._buf) - _held(self._buf, TOOL_MARKERS)
            self._text(self._buf[:at], out)
            if marker is None:
                self._buf = self._buf[at:]
                return out
            self._buf = self._buf[at + len(marker):]
            self._marker(marker, out)

    def finish(self) -> list[Event]:
        """The output ended: held text is released; an open call is reported if its arguments are whole JSON."""
        out: list[Event] = []
        self._text(self._buf, out)
        self._buf = ""
        if self._state == "arguments" and not _is_json(self._args.strip()):
            out.append(Dropped(self._id.strip(), self._args.strip(), "the output ended inside its arguments"))
            self._state, self._id, self._args = "content", "", ""
        self._close(out)
        self._state = "content"
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._state == "content":
            out.append(Content(text))
        elif self._state == "arguments":
            self._args += text
        elif self._state == "id":
            self._id += text
        elif self._gap_shown:
            out.append(Content(text))
        else:
            self._gap += text
            if not self._gap.isspace():
                out.append(Content(self._gap))
                self._gap, self._gap_shown = "", True

    def _marker(self, marker: str, out: list[Event]) -> None:
        state = self._state
        if state == "section":
            self._gap, self._gap_shown = "", False
        if marker == ARGUMENT_BEGIN:
            if state == "id":
                self._state, self._args = "arguments", ""
        elif marker == CALL_BEGIN:
            self._close(out)
            self._state, self._id = "id", ""
        elif marker == CALL_END:
            if state in ("id", "arguments"):
                self._close(out, ended=True)
                self._state = "section"
        elif marker in SECTION_BEGINS:
            if state != "arguments":
                self._close(out)
                self._state = "section"
        else:  # a section end
            if state != "content":
                self._close(out)
                self._state = "content"

    def _close(self, out: list[Event], ended: bool = False) -> None:
        """The open call (if any) is over (`ended`: by its own end marker): reported, or dropped if it never reached
        its argument marker (unless its end marker closed it) or names no function its arguments fit."""
        state, call_id, arguments = self._state, self._id.strip(), self._args.strip()
        self._id = self._args = ""
        if state not in ("id", "arguments"):
            return
        if state == "id" and not ended:
            out.append(Dropped(call_id, "", "it never reached its argument marker"))
            return
        name = tool_name(call_id)
        if name is None:
            name = infer_name(arguments, self._tools)
            if name is None:
                out.append(Dropped(call_id, arguments, "its id names no function and its arguments fit no one tool "
                                                      "of the request"))
                return
            digits = re.search(r"(\d+)$", call_id)
            call_id = f"{FUNCTION_PREFIX}{name}:{int(digits.group(1)) if digits else self.calls}"
        out.append(Call(self.calls, call_id, name, arguments))
        self.calls += 1


class OutputStream:
    """Reasoning (when `thinking`), content and tool calls of an output from successive text deltas."""

    def __init__(self, thinking: bool = False, opened: bool = False, tools: Iterable | None = None):
        self._reasoning = ReasoningSplitter(opened) if thinking else None
        self._tools = ToolCallStream(tools)

    def prefill(self, text: str) -> None:
        """The start of the assistant message, already in the prompt: it sets the state, its text is not output."""
        self.feed(text)

    def feed(self, text: str) -> list[Event]:
        if self._reasoning is None:
            return self._tools.feed(text)
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[Event]:
        out = self._route(self._reasoning.finish()) if self._reasoning is not None else []
        return out + self._tools.finish()

    def _route(self, parts: list[Reasoning | Content]) -> list[Event]:
        out: list[Event] = []
        for part in parts:
            out += [part] if isinstance(part, Reasoning) else self._tools.feed(part.text)
        return out


def collect(events: list[Event]) -> Parsed:
    """The whole message the events describe."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = tuple(ToolCall(e.id, e.name, e.arguments) for e in events if isinstance(e, Call))
    return Parsed(content, reasoning, calls)


def parse(text: str, thinking: bool = False, opened: bool = False, tools: Iterable | None = None,
          prefill: str = "") -> Parsed:
    """A whole output at once: the same result as streaming it in any pieces."""
    stream = OutputStream(thinking, opened, tools)
    if prefill:
        stream.prefill(prefill)
    return collect(stream.feed(text) + stream.finish())


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, the rest with its markers) of a whole output."""
    splitter = ReasoningSplitter(opened)
    parts = splitter.feed(text) + splitter.finish()
    return ("".join(p.text for p in parts if isinstance(p, Reasoning)),
            "".join(p.text for p in parts if isinstance(p, Content)))
