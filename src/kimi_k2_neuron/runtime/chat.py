"""What generation shares on CPU and trn2: the chat --prompt and --system make, --stop strings (on decoded text, so
one rule serves the CPU runner and transformers' loop), how rows print."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from kimi_k2_neuron.errors import KimiInputError, broken_link, special_file

GENERATION_CONFIG = "generation_config.json"


def chat_messages(prompt: str, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [{"role": "user", "content": prompt}]


def prompt_ids(tokenizer, prompts: Sequence[str], chat: bool = True, system: str | None = None) -> list[list[int]]:
    """Token ids of text prompts, through the checkpoint's chat template unless chat=False (a KimiTokenizer)."""
    texts = [tokenizer.apply_chat_template(chat_messages(p, system)) if chat else p for p in prompts]
    return [tokenizer.encode(t) for t in texts]


def reply_text(tokenizer, ids: Sequence[int]) -> str:
    """As users and --stop strings see it: special tokens dropped, those marked special=false (<think>) kept."""
    return tokenizer.decode(ids, skip_special=True)


def reply_texts(tokenizer, rows: Sequence[Sequence[int]], stops: Iterable[str]) -> list[str]:
    """Each row's reply_text, cut at the earliest of `stops` (--stop strings are never shown)."""
    stops = list(stops)
    return [cut_at_stop(reply_text(tokenizer, ids), stops) for ids in rows]


def cut_at_stop(text: str, stops: Iterable[str]) -> str:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(hits)] if hits else text


class StopStrings:
    """`done(tokens)` serves the CPU runner; called with input_ids [B, T] it is transformers' (and NxDI's adapter's)
    StoppingCriteria, new tokens starting at column `start`."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], start: int = 0):
        self.decode, self.stops, self.start = decode, [s for s in stops if s], start

    def done(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(s in text for s in self.stops)

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        rows = [self.done(row[self.start:]) for row in input_ids.tolist()]
        return torch.tensor(rows, dtype=torch.bool, device=input_ids.device)


def generation_defaults(checkpoint) -> dict:
    """The sampling generation_config.json asks for when it sets do_sample (Kimi-K2.7-Code: temperature 1.0, top_p
    0.95): {"temperature": T, "top_p": P, "top_k": K} with the keys it sets; {} when it asks for none. Every field
    read is honoured or refused in one line: a file that is no JSON object, a do_sample that is no boolean (the
    string "true" too), a setting out of its range."""
    path = Path(checkpoint) / GENERATION_CONFIG
    broken = broken_link(path)
    if broken or (path.exists() and not path.is_file()):
        what = broken or ("a folder" if path.is_dir() else special_file(path) or "not a file")
        raise KimiInputError(f"{path}: is {what}; expected a JSON file (or no file: greedy decoding)")
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KimiInputError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise KimiInputError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise KimiInputError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise KimiInputError(f"{path}: field do_sample={do_sample!r}, expected true or false")
    if not do_sample:
        return {}
    out = {}
    for key, expected in (("temperature", "a finite number >= 0"), ("top_p", "a number > 0 and <= 1"),
                          ("top_k", "an integer >= 0")):
        value = raw.get(key)
        if value is None:
            continue
        number = not isinstance(value, bool) and isinstance(value, int if key == "top_k" else (int, float))
        if not number or not (0 < value <= 1 if key == "top_p" else 0 <= value < math.inf):
            raise KimiInputError(f"{path}: field {key}={value!r}, expected {expected}")
        out[key] = value
    return out


def print_rows(prompts: Sequence[str], texts: Sequence[str]) -> None:
    """One row: its text alone. Several: each under a `### prompt` line, so the rows stay apart. As a person reads
    them (display_text)."""
    if len(texts) == 1:
        print(display_text(texts[0]))
        return
    for prompt, text in zip(prompts, texts):
        print(f"### {prompt}\n{display_text(text)}\n")


# -- a reply as a person reads it ------------------------------------------------------------------------------------

THINKING, THOUGHT, CALL = "[thinking] ", " [/thinking]\n", "[tool call {index}: {name}] "
DROPPED = "[tool call {id!r}, naming no function] "  # an id without NAME:IDX and no tools to infer it from


class ReplyPrinter:
    """Kimi's reply written as it grows, its markers in words: the special=false tokens reply_text keeps for parsers
    (<think>, </think>, the tool-call tokens) would otherwise print as raw `<|tool_call_begin|>` text. Reasoning shows
    between `[thinking] ` and ` [/thinking]`, each tool call on a line of its own, `[tool call N: NAME] ARGUMENTS`.
    update() takes the whole reply text so far: a character still incomplete (U+FFFD at the end, its bytes not all
    decoded yet) and a tail that could still become a --stop string wait for the next update; nothing from a stop
    string on is ever written. `opened`: the prompt ended with <think>, so the reply starts inside reasoning."""

    def __init__(self, write: Callable[[str], None], stops: Sequence[str] = (), opened: bool = False):
        from .tool_calls import OutputStream

        self.write, self.stops = write, [s for s in stops if s]
        self._stream = OutputStream(thinking=True, opened=opened)
        self._fed, self._reasoning, self._last, self._stopped = 0, False, "\n", False

    def update(self, text: str, final: bool = False) -> None:
        if self._stopped:
            return
        cut = cut_at_stop(text, self.stops)
        end = len(cut)
        if cut == text and not final:  # no stop string yet: hold back what could still begin one, and a half char
            end = max(len(text.rstrip("\ufffd")) - max((len(s) - 1 for s in self.stops), default=0), 0)
        self._stopped = cut != text
        if end > self._fed:
            self._emit(self._stream.feed(cut[self._fed:end]))
            self._fed = end
        if final or self._stopped:
            self._emit(self._stream.finish())
            self._put(THOUGHT.rstrip("\n") if self._reasoning else "")
            self._reasoning = False

    def _emit(self, events) -> None:
        from .tool_calls import Call, Content, Dropped, Reasoning

        for e in events:
            if isinstance(e, Reasoning):
                self._put(("" if self._reasoning else THINKING) + e.text)
                self._reasoning = True
                continue
            if self._reasoning:
                self._put(THOUGHT)
                self._reasoning = False
            if isinstance(e, Content):
                self._put(e.text)
            elif isinstance(e, (Call, Dropped)):  # a call is reported whole, once closed (tool_calls.py)
                head = CALL.format(index=e.index, name=e.name) if isinstance(e, Call) else DROPPED.format(id=e.id)
                self._put(("" if self._last == "\n" else "\n") + head + e.arguments + "\n")

    def _put(self, text: str) -> None:
        if text:
            self.write(text)
            self._last = text[-1]


def display_text(text: str, opened: bool = False) -> str:
    """A whole reply as ReplyPrinter writes it."""
    parts: list[str] = []
    ReplyPrinter(parts.append, opened=opened).update(text, final=True)
    return "".join(parts)


def opens_reasoning(tokenizer, prompt: Sequence[int]) -> bool:
    """The prompt ends with <think> (a thinking model's chat template may open the reasoning for it)."""
    return bool(prompt) and tokenizer.decode(list(prompt[-1:])) == "<think>"


class GenerationOutput:
    """What `generate` shows of its rows, as they are made and at the end, or when it is interrupted.

    One row streams: its text (or, with --input-ids, its ids) is written as each token comes. Several rows print
    when all are done, each under its `### prompt` line: they finish at different times, and interleaved on one
    terminal they could not be read; the runner's progress bar on stderr shows the decode meanwhile. --json prints
    one object at the end. Interrupted (Ctrl-C, SIGTERM), it prints what was generated so far the same way (an
    `"interrupted": true` object with --json), and the interrupt's own line follows on stderr."""

    def __init__(self, tokenizer, prompts: list[list[int]], texts: Sequence[str] | None, stops: Sequence[str],
                 as_json: bool, write: Callable[[str], None] | None = None):
        import sys

        self.tokenizer, self.texts, self.stops, self.as_json = tokenizer, texts, list(stops), as_json
        self.write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.opened = [tokenizer is not None and texts is not None and opens_reasoning(tokenizer, p) for p in prompts]
        self.streams = len(prompts) == 1 and not as_json
        self._printer = ReplyPrinter(self.write, self.stops, self.opened[0]) if self.streams and texts else None
        self._shown_ids, self._streamed_text = 0, ""

    def token(self, row: int, token: int) -> None:
        """The runner's callback: `token` is row's next new token."""
        self.tokens[row].append(token)
        if not self.streams:
            return
        if self._printer is not None:
            self._printer.update(reply_text(self.tokenizer, self.tokens[0]))
        else:
            self.write(("," if self._shown_ids else "") + str(token))
            self._shown_ids += 1

    def text(self, delta: str) -> None:
        """A backend's stream of row 0's reply text (NxDI's adapter in NxD's CPU mode), piece by piece."""
        self._streamed_text += delta
        if self._printer is not None:
            self._printer.update(self._streamed_text)

    def done(self, tokens: list[list[int]] | None = None, timing: dict | None = None, backend: str = "") -> None:
        """All rows ended (`tokens`: the runner's, which may differ from what was streamed only if none was)."""
        self._finish(self.tokens if tokens is None else tokens, timing or {}, backend, interrupted=False)

    def interrupted(self, backend: str = "") -> None:
        self._finish(self.tokens, {}, backend, interrupted=True)

    def _finish(self, tokens, timing: dict, backend: str, interrupted: bool) -> None:
        import json

        texts = reply_texts(self.tokenizer, tokens, self.stops) if self.texts else None
        if self.as_json:
            extra = {"interrupted": True} if interrupted else {}
            self.write(json.dumps({"tokens": tokens, "text": texts, "backend": backend, **timing, **extra}) + "\n")
        elif self.streams:
            if self._printer is not None:  # (a backend that streamed text gave no tokens before its end)
                self._printer.update(reply_text(self.tokenizer, tokens[0]) if tokens[0] else self._streamed_text,
                                     final=True)
            elif not self._shown_ids:  # the tokens came all at once (a backend that does not call token())
                self.write(",".join(map(str, tokens[0])))
            self.write("\n")
        elif texts:
            for prompt, text, opened in zip(self.texts, texts, self.opened):
                self.write(f"### {prompt}\n{display_text(text, opened)}\n\n")
        else:
            self.write("".join(",".join(map(str, t)) + "\n" for t in tokens))
