"""Kimi-K2's assistant output read as text: reasoning, content and tool calls, streamed or at once (vllm_parsers
puts vLLM's parser interfaces on top). What Kimi writes (its chat template writes the same back for earlier turns):

    [<think>REASONING</think>]CONTENT<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>  (once per call)
    <|tool_calls_section_end|>

The markers are single special tokens, but these parsers work on text: a delta's tail that could begin a marker is
held back until the next delta decides it (at most 27 characters); `finish()` releases it when the output ends.

Markers are never content, reasoning, id or arguments. A call's id (between its begin and argument markers, stripped)
is kept verbatim, since the chat template writes it back; its name is the id without `functions.` and `:IDX` (dots
stay). Arguments are the text up to the call's end marker, streamed as they come. Text outside tool sections is
content; inside one, whitespace between calls is dropped and other text is content.

Malformed output: a call begin marker outside a section opens one; a call without its end marker ends at the next
call, the section end or the output; a call whose id never reaches its argument marker is content, since its name is
unknown; a marker where it means nothing (a section end outside a section, say) is dropped.
"""

from __future__ import annotations

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
class CallStart:
    """Call `index` (0, 1, ... within this output) begins; its id and name are whole."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of call `index`'s arguments."""
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """Call `index` was closed (by its end marker, or by what followed it); not sent for a call the output cut."""
    index: int


Event = Content | Reasoning | CallStart | CallArguments | CallEnd


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


def tool_name(call_id: str) -> str:
    """The function name in a Kimi tool-call id: `functions.mcp.server.tool:3` -> `mcp.server.tool`; ids without the
    `functions.` prefix or the `:IDX` suffix keep what they have."""
    name = call_id[len(FUNCTION_PREFIX):] if call_id.startswith(FUNCTION_PREFIX) else call_id
    head, colon, index = name.rpartition(":")
    return head if colon and index.isdigit() else name


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
            elif THINK_OPEN.startswith(body):
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
    """Content and tool calls of an output (after its reasoning), as events, from successive text deltas."""

    def __init__(self):
        self._state = "content"  # content | section | id | arguments
        self._buf = ""
        self._id = ""
        self._gap = ""  # whitespace between calls in a section, dropped unless other text follows before a marker
        self._gap_shown = False
        self.calls = 0  # calls started so far

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
        """The output ended: held text is released; a call cut before its argument marker becomes content."""
        out: list[Event] = []
        self._text(self._buf, out)
        self._buf = ""
        if self._state == "id":
            self._abandon_id(out)
        self._state = "content"
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._state == "content":
            out.append(Content(text))
        elif self._state == "arguments":
            out.append(CallArguments(self.calls - 1, text))
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
                self._start_call(out)
                self._state = "arguments"
        elif marker == CALL_BEGIN:
            self._close(out)
            self._state, self._id = "id", ""
        elif marker == CALL_END:
            if state == "id":
                self._start_call(out)
            if state in ("id", "arguments"):
                out.append(CallEnd(self.calls - 1))
                self._state = "section"
        elif marker in SECTION_BEGINS:
            if state != "arguments":
                self._close(out)
                self._state = "section"
        else:  # a section end
            if state != "content":
                self._close(out)
                self._state = "content"

    def _start_call(self, out: list[Event]) -> None:
        call_id = self._id.strip()
        out.append(CallStart(self.calls, call_id, tool_name(call_id)))
        self.calls += 1

    def _close(self, out: list[Event]) -> None:
        """A marker ended whatever call was open without its end marker."""
        if self._state == "arguments":
            out.append(CallEnd(self.calls - 1))
        elif self._state == "id":
            self._abandon_id(out)

    def _abandon_id(self, out: list[Event]) -> None:
        if self._id:
            out.append(Content(self._id))
        self._id = ""


class OutputStream:
    """Reasoning (when `thinking`), content and tool calls of an output from successive text deltas."""

    def __init__(self, thinking: bool = False, opened: bool = False):
        self._reasoning = ReasoningSplitter(opened) if thinking else None
        self._tools = ToolCallStream()

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
    content, reasoning, ids, names, arguments = [], [], [], [], []
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, Reasoning):
            reasoning.append(event.text)
        elif isinstance(event, CallStart):
            ids.append(event.id)
            names.append(event.name)
            arguments.append([])
        elif isinstance(event, CallArguments):
            arguments[event.index].append(event.text)
    calls = tuple(ToolCall(i, n, "".join(a)) for i, n, a in zip(ids, names, arguments))
    return Parsed("".join(content), "".join(reasoning), calls)


def parse(text: str, thinking: bool = False, opened: bool = False) -> Parsed:
    """A whole output at once: the same result as streaming it in any pieces."""
    stream = OutputStream(thinking, opened)
    return collect(stream.feed(text) + stream.finish())


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, the rest with its markers) of a whole output."""
    splitter = ReasoningSplitter(opened)
    parts = splitter.feed(text) + splitter.finish()
    return ("".join(p.text for p in parts if isinstance(p, Reasoning)),
            "".join(p.text for p in parts if isinstance(p, Content)))
