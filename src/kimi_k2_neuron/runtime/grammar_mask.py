"""vLLM's structured-output token mask on the host's logits, with Kimi's special tokens kept structural (the vLLM
worker, neuron/vllm_worker.py, applies it; docs/vllm.md, "Structured outputs").

vLLM's grammar backend (xgrammar) matches text: it allows every token whose bytes continue the grammar's text, and
its one end token is the tokenizer's eos. To it Kimi's special tokens are text too: `<|im_end|>` or a tool-call
marker is valid content of a JSON string. Applied as it is, a reply could stop at `<|im_end|>` inside a string, or
hold a marker inside tool arguments, which the parsers then read as structure; and where the grammar itself writes a
marker, the model could spell it in bytes, which a stream's parser never sees as one. So on a constrained row:

- the end: where the grammar accepts it (its eos allowed), every stop token of the request is allowed (Kimi ends a
  turn with `<|im_end|>`, not the tokenizer's eos); nowhere else;
- special tokens are not text: dropped, except where the grammar is writing one (each ordinary token it allows only
  begins that special's text), where its token alone writes it.

A row the grammar leaves open (every bit set: still reasoning, or the grammar is over) is left as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

BITS = 32  # vLLM's bitmask: int32 words, token t at bit t % 32 of word t // 32 (xgrammar's layout)


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool: which tokens each row allows."""
    shifts = torch.arange(BITS, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    out = bits.reshape(bitmask.shape[0], -1).bool()
    if out.shape[1] < vocab:  # a bitmask narrower than the logits (a padded vocabulary): the rest is not allowed
        out = torch.cat([out, out.new_zeros(out.shape[0], vocab - out.shape[1])], dim=1)
    return out[:, :vocab]


@dataclass(frozen=True, eq=False)
class SpecialTokens:
    """A vocabulary's special tokens (ids num_base and up) and, for each, the ordinary tokens whose bytes are a proper
    prefix of its text (what spells it)."""

    vocab: int
    special: torch.Tensor  # [vocab] bool
    eos: int  # the grammar's end token (xgrammar's stop token: the tokenizer's eos)
    spellers: dict[int, torch.Tensor]  # special id -> [vocab] bool

    @functools.cached_property
    def any_speller(self) -> torch.Tensor:
        """[vocab] bool: the ordinary tokens that spell the start of some special token."""
        out = torch.zeros(self.vocab, dtype=torch.bool)
        for spelling in self.spellers.values():
            out |= spelling
        return out

    @classmethod
    def of(cls, token_bytes: Callable[[int], bytes], num_base: int, num_tokens: int, vocab: int,
           eos: int) -> "SpecialTokens":
        """token_bytes(id) for ids below num_tokens (the tokenizer's); ids from num_base on are special, and so is
        any id of a wider vocabulary (padding the grammar never allows)."""
        special = torch.zeros(vocab, dtype=torch.bool)
        special[num_base:] = True
        texts = {i: token_bytes(i) for i in range(num_base, min(num_tokens, vocab))}
        by_first: dict[int, list[int]] = {}
        for i, text in texts.items():
            if text:
                by_first.setdefault(text[0], []).append(i)
        spellers = {i: torch.zeros(vocab, dtype=torch.bool) for i in texts}
        for t in range(min(num_base, vocab)):
            piece = token_bytes(t)
            for i in by_first.get(piece[0], ()) if piece else ():
                if len(piece) < len(texts[i]) and texts[i].startswith(piece):
                    spellers[i][t] = True
        return cls(vocab, special, eos, spellers)

    @classmethod
    def of_kimi(cls, tokenizer, vocab: int) -> "SpecialTokens":
        """From a runtime.tokenizer.KimiTokenizer (tiktoken ranks, then the special slots)."""
        return cls.of(tokenizer.encoding.decode_single_token_bytes, tokenizer.num_base_tokens, tokenizer.vocab_size,
                      vocab, tokenizer.eos_id)


def allowed(row: torch.Tensor, tokens: SpecialTokens, stops: Iterable[int]) -> torch.Tensor | None:
    """What a constrained row may sample, from the grammar's [vocab] bool mask and the request's stop tokens; None
    where the grammar leaves the row open."""
    if bool(row.all()):
        return None
    stop = torch.zeros_like(row)
    stop[[s for s in {*stops, tokens.eos} if 0 <= s < tokens.vocab]] = True
    ordinary = row & ~tokens.special
    marks = row & tokens.special & ~stop
    out = ordinary
    # (text that spells no special token's start is the common case, decided without the per-token loop)
    if marks.any() and not (ordinary & ~tokens.any_speller).any():
        spelling = torch.zeros_like(row)
        for i in marks.nonzero().flatten().tolist():
            if i in tokens.spellers:
                spelling |= tokens.spellers[i]
        if not (ordinary & ~spelling).any():  # the grammar is writing a special token's text: its token writes it
            out = marks
    if row[tokens.eos]:
        out = out | stop
    return out if out.any() else row  # never an empty row (not reachable from a grammar vLLM accepted)


def apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, stops: list[Iterable[int]],
          tokens: SpecialTokens) -> list[int]:
    """Masks logits[rows[k]] in place by bitmask row k (vLLM's GrammarOutput, rows in its order) and the request's
    stop tokens stops[k]: what a row may not sample gets -inf. Returns the rows masked (not those left open)."""
    masks = unpack(bitmask, logits.shape[-1])
    masked = []
    for k, r in enumerate(rows):
        keep = allowed(masks[k], tokens, stops[k])
        if keep is not None:
            logits[r].masked_fill_(~keep.to(logits.device), float("-inf"))
            masked.append(r)
    return masked
