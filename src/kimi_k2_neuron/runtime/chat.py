"""What generation shares on CPU and trn2: the chat --prompt and --system make, --stop strings (on decoded text, so
one rule serves the CPU runner and transformers' loop), how rows print."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from kimi_k2_neuron.errors import KimiInputError

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
    0.95): {"temperature": T, "top_p": P, "top_k": K} with the keys it sets; {} when it asks for none."""
    path = Path(checkpoint) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KimiInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("do_sample") is not True:
        return {}
    out = {}
    for key, lo, hi in (("temperature", 0.0, math.inf), ("top_p", 0.0, 1.0), ("top_k", 0, math.inf)):
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi or (
                key == "top_p" and value == 0) or (key == "top_k" and not isinstance(value, int)):
            raise KimiInputError(f"{path}: field {key}={value!r}, expected a number in [{lo}, {hi}]")
        out[key] = value
    return out


def print_rows(prompts: Sequence[str], texts: Sequence[str]) -> None:
    """One row: its text alone. Several: each under a `### prompt` line, so the rows stay apart."""
    if len(texts) == 1:
        print(texts[0])
        return
    for prompt, text in zip(prompts, texts):
        print(f"### {prompt}\n{text}\n")
